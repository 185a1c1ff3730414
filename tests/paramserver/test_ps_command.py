"""`rlax ps serve`: its module is light (the server loads when the command runs), and every flag
reaches the server's config."""

from __future__ import annotations

import subprocess
import sys

from rlax_tasks.cli import main
from rlax_tasks.paramserver import cli as ps_cli


def test_the_command_module_loads_neither_numpy_nor_the_server():
    code = (
        "import sys, rlax_tasks.paramserver.cli\n"
        "print(sorted(m for m in ('numpy', 'rlax_tasks.paramserver.server') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-2000:]


def test_every_flag_reaches_the_server_config(monkeypatch):
    monkeypatch.setenv("RLAX_PS_TOKEN", "secret")
    served = []
    monkeypatch.setattr(
        ps_cli, "serve_forever", lambda cfg, publish_to: served.append((cfg, publish_to)) or 0
    )
    argv = ["ps", "serve", "--port", "8123", "--run-root", "/tmp/rr", "--keep-versions", "5",
            "--keep-bytes", "3MiB", "--mirror-every", "2", "--mirror-keep", "4",
            "--worker-timeout", "7", "--io-timeout", "9", "--no-verify-push",
            "--no-shared-memory", "--assembly-timeout", "11"]  # fmt: skip
    assert main(argv) == 0
    ((config, publish_to),) = served
    assert publish_to is None
    assert (config.token, config.port, config.run_root) == ("secret", 8123, "/tmp/rr")
    assert (config.keep_versions, config.keep_bytes) == (5, 3 * 2**20)
    assert (config.mirror_every, config.mirror_keep) == (2, 4)
    assert (config.worker_timeout_s, config.io_timeout_s, config.assembly_timeout_s) == (7, 9, 11)
    assert config.verify_push is False and config.shared_memory is False
