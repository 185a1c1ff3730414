"""Adversarial programs: each must end with a non-ok status and leave the host untouched
(no surviving process, no file outside the sandbox, no secret leaked)."""

from __future__ import annotations

import os
import socket
import uuid

import pytest
from conftest import assert_no_sandbox_processes

from rlax_tasks.rewards.sandbox import run

pytestmark = pytest.mark.usefixtures("bwrap_required")


@pytest.fixture
def marker():
    """A unique string passed in the program's argv: it shows in every descendant's cmdline."""
    tag = f"rlax-adv-{uuid.uuid4().hex[:12]}"
    yield tag
    assert_no_sandbox_processes(tag)


def _run(src: str, marker: str, **kw):
    result = run(src, args=[marker], **kw)
    assert result.status != "ok", (result.status, result.stdout[:300], result.stderr[-300:])
    return result


def test_infinite_loop(marker):
    result = _run("while True:\n    pass", marker, timeout_s=1.0)
    assert result.status == "timeout" and result.wall_s < 4


@pytest.mark.slow
def test_fork_bomb(marker):
    src = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    result = _run(src, marker, timeout_s=1.0)
    assert result.status == "timeout" and result.wall_s < 6
    assert run("print('still fine')").stdout == "still fine\n"


def test_allocate_10_gb(marker):
    # a generous wall limit: the memory limit, not the clock, must end both programs, even on
    # a loaded machine where the interpreter alone takes seconds to start
    result = _run("x = bytearray(10 * 1024 ** 3)\nprint(len(x))", marker, timeout_s=30.0)
    assert result.status == "memory", (result.status, result.wall_s)
    grow_src = "chunks = []\nwhile True:\n    chunks.append(b'x' * 10 ** 7)"
    grow = _run(grow_src, marker, timeout_s=30.0)
    assert grow.status == "memory", (grow.status, grow.wall_s)


def test_write_to_etc(marker):
    target = f"/etc/{marker}"
    result = _run(f"open({target!r}, 'w').write('pwned')", marker)
    assert result.status == "runtime_error"
    assert not os.path.exists(target)


def test_write_to_home(marker):
    target = os.path.join(os.path.expanduser("~"), marker)
    result = _run(f"import os\nopen({target!r}, 'w').write('pwned')", marker)
    assert result.status == "runtime_error"
    assert not os.path.exists(target)


def test_sandbox_tmp_is_private(marker, tmp_path):
    src = (
        "import os, sys\n"
        f"open('/tmp/{marker}', 'w').write('x')\n"
        f"open(os.path.expanduser('~/{marker}'), 'w').write('x')\n"
        f"open({str(tmp_path / marker)!r}, 'w').write('x')\n"
    )
    result = _run(src, marker)
    assert result.status == "runtime_error"  # the host tmp dir does not exist inside
    assert not os.path.exists(f"/tmp/{marker}")
    assert not (tmp_path / marker).exists()


def test_connect_to_host_loopback_port(marker):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        server.setblocking(False)
        port = server.getsockname()[1]
        src = (
            "import socket\n"
            f"s = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
            "s.sendall(b'exfiltrated')\n"
        )
        result = _run(src, marker)
        assert result.status == "runtime_error"
        assert "ConnectionRefusedError" in result.stderr or "unreachable" in result.stderr
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing ever reached the host's listener


def test_print_one_gigabyte(marker):
    src = (
        "import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(1024):\n    sys.stdout.write(chunk)\n"
    )
    result = _run(src, marker, timeout_s=10.0)
    assert result.status == "output_limit"
    assert len(result.stdout) <= 8 * 1024 * 1024 and result.wall_s < 5


def test_daemonized_child_sleeping_past_timeout(marker):
    src = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        for fd in (0, 1, 2):\n"
        "            os.close(fd)\n"
        "        time.sleep(60)\n"
        "    os._exit(0)\n"
        "print('parent exits at once')\n"
    )
    result = _run(src, marker, timeout_s=1.0)
    assert result.status == "timeout" and result.wall_s < 4
    assert result.stdout == "parent exits at once\n"


def test_reading_parent_environment(marker, monkeypatch):
    secret = f"s3cr3t-{uuid.uuid4().hex}"
    monkeypatch.setenv("RLAX_TEST_SECRET", secret)
    src = (
        "import glob, os\n"
        "print(dict(os.environ))\n"
        "for path in glob.glob('/proc/*/environ'):\n"
        "    try:\n"
        "        print(path, open(path, 'rb').read())\n"
        "    except OSError as exc:\n"
        "        print(path, exc)\n"
        f"print(open('/proc/{os.getpid()}/environ', 'rb').read())\n"
    )
    result = _run(src, marker)
    assert result.status == "runtime_error"
    assert "RLAX_TEST_SECRET" not in result.stdout + result.stderr
    assert secret not in result.stdout + result.stderr
