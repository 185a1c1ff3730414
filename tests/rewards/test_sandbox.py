"""Behaviour of the sandbox's public API: statuses, stdin/stdout, languages, limits."""

from __future__ import annotations

import threading

import pytest

from rlax_tasks.rewards.sandbox import (
    ExecResult,
    Program,
    SandboxError,
    cxx_available,
    run,
    sandbox_info,
)

pytestmark = pytest.mark.usefixtures("no_leftovers")

needs_cxx = pytest.mark.skipif(not cxx_available(), reason="g++ is not installed")


def test_python_ok_with_stdin():
    result = run("import sys\nprint(sys.stdin.read().strip()[::-1])", stdin="hello\n")
    assert isinstance(result, ExecResult)
    assert (result.status, result.stdout, result.exit_code) == ("ok", "olleh\n", 0)
    assert 0 < result.wall_s < 5


def test_runtime_error_keeps_exit_code_and_stderr():
    result = run("import sys\nprint('partial')\nsys.stderr.write('boom')\nsys.exit(3)")
    assert (result.status, result.exit_code, result.stdout) == ("runtime_error", 3, "partial\n")
    assert "boom" in result.stderr
    result = run("raise ValueError('bad input')")
    assert result.status == "runtime_error" and "ValueError: bad input" in result.stderr


def test_python_syntax_error_is_compile_error():
    result = run("def f(:\n    pass\n")
    assert result.status == "compile_error"
    assert "SyntaxError" in result.stderr


def test_timeout_and_memory_statuses():
    slow = run("while True:\n    pass", timeout_s=1.0)
    assert slow.status == "timeout" and slow.wall_s < 3
    sleepy = run("import time\ntime.sleep(30)", timeout_s=0.5)  # wall clock, no CPU used
    assert sleepy.status == "timeout" and sleepy.wall_s < 3
    big = run("x = bytearray(400 * 1024 * 1024)\nprint(len(x))", memory_mb=128)
    assert big.status == "memory"
    fits = run("x = bytearray(50 * 1024 * 1024)\nprint(len(x))", memory_mb=256)
    assert fits.status == "ok" and fits.stdout.strip() == str(50 * 1024 * 1024)


def test_sandbox_view_of_the_system():
    probe = (
        "import os, socket\n"
        "print(os.getcwd(), os.environ.get('HOME'))\n"
        "open('/tmp/scratch', 'w').write('x')\n"
        "print(sorted(os.listdir('/')))\n"
        "print(open('/proc/self/status').read().split('NoNewPrivs:')[1].split()[0])\n"
        "print(len([p for p in os.listdir('/proc') if p.isdigit()]) < 10, os.getpid() < 10)\n"
        "print([n for _, n in socket.if_nameindex()])\n"
    )
    result = run(probe)
    assert result.status == "ok", result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "/tmp /tmp"
    top = eval(lines[1])  # noqa: S307 - our own probe output
    assert "root" not in top and "home" not in top and "work" not in top
    assert lines[2] == "1"  # no_new_privs: setuid binaries cannot elevate
    assert lines[3] == "True True"  # own PID namespace
    assert eval(lines[4]) == ["lo"]  # noqa: S307 - own network namespace, loopback only


def test_args_and_files_are_visible_read_only():
    src = (
        "import sys\nprint(sys.argv[1:], open('/sandbox/data.txt').read())\n"
        "open('/sandbox/data.txt', 'w')"
    )
    result = run(src, args=["a", "b"], files={"data.txt": "payload"})
    assert result.stdout == "['a', 'b'] payload\n"
    assert result.status == "runtime_error" and "Read-only file system" in result.stderr


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="'cobol'"):
        run("x", language="cobol")
    with pytest.raises(ValueError, match="timeout_s"):
        run("print(1)", timeout_s=0)
    with pytest.raises(ValueError, match="memory_mb"):
        run("print(1)", memory_mb=-1)
    with pytest.raises(TypeError):
        run(b"print(1)")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="file name"):
        run("print(1)", files={"../escape": "x"})


def test_concurrent_runs_are_independent():
    results: list[ExecResult] = [None] * 6  # type: ignore[list-item]

    def worker(i: int) -> None:
        results[i] = run(f"print({i} * {i})")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.stdout for r in results] == [f"{i * i}\n" for i in range(6)]


def test_missing_bwrap_is_an_error_not_a_zero():
    from rlax_tasks.rewards.sandbox import SandboxConfig

    with pytest.raises(SandboxError, match="bubblewrap"):
        run("print(1)", config=SandboxConfig(bwrap="/nonexistent/bwrap"))


def test_sandbox_info():
    info = sandbox_info()
    assert info["bwrap"] and "python" in info["languages"]


@needs_cxx
def test_cpp_compiles_once_and_runs_many_times():
    src = "#include <iostream>\nint main(){long a,b; std::cin>>a>>b; std::cout<<a+b<<'\\n';}"
    with Program(src, "cpp") as program:
        assert program.compile_result is not None and program.compile_result.status == "ok"
        outs = [program.run(f"{i} {i}").stdout for i in range(3)]
    assert outs == ["0\n", "2\n", "4\n"]
    assert run(src, "c++", "2 40").stdout == "42\n"


@needs_cxx
def test_cpp_compile_error_and_crash():
    bad = run("int main() { return undefined_name; }", "cpp")
    assert bad.status == "compile_error" and "undefined_name" in bad.stderr
    crash = run("#include <vector>\nint main(){std::vector<int> v; v.reserve(1L<<40);}", "cpp")
    assert crash.status == "memory"
