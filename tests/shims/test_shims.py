"""Positive controls of the test shims: each reports what it exists to report when the thing
happens (a JAX backend started; tokens drawn, a resumed request's too), so a test that finds
the report empty proves something. Each runs in a fresh interpreter, as the shims act there."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import REPO

SHIMS = os.path.join(REPO, "tests", "shims")


def _run(argv: list[str], shims: list[str], **env: str) -> None:
    """Runs ``python argv...`` in a fresh interpreter with ``shims`` first on PYTHONPATH."""
    path = os.pathsep.join([*(os.path.join(SHIMS, s) for s in shims), REPO])
    full = {**os.environ, "PYTHONPATH": path, "JAX_PLATFORMS": "cpu", **env}
    out = subprocess.run([sys.executable, *argv], env=full, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]


def _lines(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def test_report_backends_reports_a_backend_that_started(tmp_path):
    report = str(tmp_path / "backends.jsonl")
    _run(["-c", "import jax; jax.devices()"], ["report_backends"], RLAX_TEST_BACKENDS_FILE=report)
    _run(["-c", "import jax"], ["report_backends"], RLAX_TEST_BACKENDS_FILE=report)  # no backend
    assert [r["backends"] for r in _lines(report)] == [["cpu"], []]


SAMPLE = """
import json, sys
from rlax_tasks.models import Policy
from rlax_tasks.rollout import Request, Sampler, SamplingParams
from tests.tiny_model import tiny_model_config

policy = Policy.init(tiny_model_config("small", eos_token_id=2), seed=3)
sampler = Sampler(policy, max_slots=2, max_len=64, decode_chunk=4)
params = SamplingParams(max_new_tokens=20, temperature=1.0, seed=7, ignore_eos=True)
for sample in range(2):
    sampler.add_request(Request.make([5, 6, 7], params, sample, request_id=["p", sample]))
sampler.step()
held = sampler.in_progress()  # interrupted part-way: resumed from these tokens
sampler.interrupt()
done = []
while sampler.has_unfinished:
    done += sampler.step()
result = {"held": {p.request.sample_index: len(p.tokens) for p in held},
          "tokens": {c.request.sample_index: c.tokens for c in done}}
open(sys.argv[1], "w").write(json.dumps(result))
"""


def test_record_tokens_records_every_drawn_token_once_across_a_resume(tmp_path):
    """Every token of each completion is recorded once, at its position, with its value, the
    tokens before an interrupt included and those a resume prefilled not again; the shim runs
    the next sitecustomize on the path too (report_backends here)."""
    tokens, backends = str(tmp_path / "tokens.jsonl"), str(tmp_path / "backends.jsonl")
    script = tmp_path / "sample.py"
    script.write_text(SAMPLE)
    _run(
        [str(script), str(tmp_path / "result.json")], ["record_tokens", "report_backends"],
        RLAX_TEST_TOKENS_FILE=tokens, RLAX_TEST_BACKENDS_FILE=backends,
    )  # fmt: skip
    result = json.loads((tmp_path / "result.json").read_text())
    assert all(n > 0 for n in result["held"].values()), result  # resumed part-way
    drawn: dict[tuple[int, int], list[int]] = {}
    for r in _lines(tokens):
        assert r["request"][0] == "p"
        drawn.setdefault((r["request"][1], r["position"]), []).append(r["token"])
    for sample, completion in result["tokens"].items():
        assert len(completion) == 20
        for position, token in enumerate(completion):
            assert drawn.pop((int(sample), position)) == [token], (sample, position)
    assert not drawn, f"recorded tokens no completion holds: {sorted(drawn)}"
    assert [r["backends"] for r in _lines(backends)] == [["cpu"]]  # the next shim ran too
