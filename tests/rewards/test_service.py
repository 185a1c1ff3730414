"""`rlax verify serve`: the verifiers over HTTP on loopback, used through the client."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading

import psutil
import pytest

from rlax_tasks.rewards.cli import add_verify_parser
from rlax_tasks.rewards.judge import Submission, TestCase
from rlax_tasks.rewards.service import VerifierClient, VerifierError


def test_add_verify_parser_registers_serve():
    parser = argparse.ArgumentParser(prog="rlax")
    add_verify_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["verify", "serve"])
    assert (args.host, args.port, args.math_timeout) == ("127.0.0.1", 0, 5.0)
    assert callable(args.func)
    args = parser.parse_args(["verify", "serve", "--port", "8123", "--math-workers", "1"])
    assert (args.port, args.math_workers) == (8123, 1)
    with pytest.raises(SystemExit):
        parser.parse_args(["verify"])


@pytest.fixture(scope="module")
def server():
    """A real server process on 127.0.0.1 with a free port; killed with its workers after."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rlax_tasks.rewards.cli",
            "verify",
            "serve",
            "--port",
            "0",
            "--math-workers",
            "1",
            "--max-parallel",
            "2",
            "--log-level",
            "warning",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "RLAX_PS_TOKEN": "tok"},
    )
    first: list[str] = []
    reader = threading.Thread(target=lambda: first.append(proc.stdout.readline()))
    reader.start()
    reader.join(timeout=60)
    try:
        assert first and first[0].startswith("http://127.0.0.1:"), proc.stderr.read()
        url = first[0].strip()
        client = VerifierClient(url, token="tok", timeout_s=120)
        yield client
    finally:
        children = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        _, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, f"service left processes behind: {alive}"


@pytest.mark.slow
def test_service_math_code_and_judge(server):
    health = server.health()
    assert health["status"] == "ok" and "math-verify" in health["math_verifier_version"]
    results = server.check_math(
        [(r"\boxed{\frac{1}{2}}", "0.5"), (r"\boxed{3}", "4"), ("no answer", "1")]
    )
    assert [r.verdict for r in results] == ["correct", "incorrect", "no_answer"]
    assert server.verify_math(r"\boxed{x = 3}", "3") == 1.0
    out = server.run("print(input() * 2)", stdin="ab")
    assert (out.status, out.stdout) == ("ok", "abab\n")
    assert server.run("while True: pass", timeout_s=0.5).status == "timeout"
    judged = server.judge_batch(
        [
            Submission("print(sum(map(int, input().split())))", (TestCase("1 2", "3"),)),
            Submission("print(0)", (TestCase("1 2", "3"),)),
            # call-based: judged on the return value (fn_name travels with the submission)
            Submission("def add(a, b):\n    return a + b\n", (TestCase("[1, 2]", "3"),),
                       fn_name="add"),
        ]
    )  # fmt: skip
    assert [j.reward for j in judged] == [1.0, 0.0, 1.0]
    assert judged[1].tests[0].verdict == "wrong_answer"
    with pytest.raises(VerifierError, match="400.*cobol"):
        server.run("x", language="cobol")
    with pytest.raises(VerifierError, match="422"):
        server.run("x", timeout_s=-1)
