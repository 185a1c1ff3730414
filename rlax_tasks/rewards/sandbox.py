"""Sandboxed execution of untrusted programs (docs/design.md §9): ``run`` once, or a ``Program``
compiled once and run many times, each run a fresh bubblewrap sandbox (``bubblewrap``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence

from rlax_tasks.rewards.bubblewrap import (
    SANDBOX_DIR,
    Job,
    cxx_available,
    execute,
    find_bwrap,
    sandbox_python,
    set_max_concurrency,
)
from rlax_tasks.rewards.sandbox_types import (
    DEFAULT_CONFIG,
    LANGUAGES,
    STATUSES,
    ExecResult,
    SandboxConfig,
    SandboxError,
    normalize_language,
)

# the sandbox's public names, whichever module defines them (callers import them from here)
__all__ = [
    "LANGUAGES",
    "STATUSES",
    "ExecResult",
    "Program",
    "SandboxConfig",
    "SandboxError",
    "cxx_available",
    "normalize_language",
    "run",
    "sandbox_info",
    "set_max_concurrency",
]


class Program:
    """A program ready to run many times (C++ compiled once); use as a context manager."""

    def __init__(
        self, source: str, language: str = "python", *, config: SandboxConfig | None = None
    ) -> None:
        if not isinstance(source, str):
            raise TypeError(f"source must be str, got {type(source).__name__}")
        self.language = normalize_language(language)
        self.config = config or DEFAULT_CONFIG
        self.compile_result: ExecResult | None = None
        self._dir = tempfile.mkdtemp(prefix="rlax-sbx-")
        os.chmod(self._dir, 0o755)
        try:
            self._prepare(source)
        except BaseException:
            self.close()
            raise

    def _prepare(self, source: str) -> None:
        if self.language == "python":
            self._src = self._write("main.py", source)
            return
        if not cxx_available(self.config):
            raise SandboxError(f"language 'cpp' needs {self.config.cxx!r}, which is not installed")
        cxx = os.path.realpath(shutil.which(self.config.cxx) or self.config.cxx)
        src = self._write("main.cpp", source)
        build = os.path.join(self._dir, "build")
        os.mkdir(build, 0o700)
        job = Job(
            argv=[
                cxx,
                "-O2",
                "-std=c++17",
                "-pipe",
                "-o",
                f"{SANDBOX_DIR}/build/main",
                f"{SANDBOX_DIR}/main.cpp",
            ],
            stdin_path=None,
            ro_files={f"{SANDBOX_DIR}/main.cpp": src},
            rw_dirs={f"{SANDBOX_DIR}/build": build},
            timeout_s=self.config.compile_timeout_s,
            memory_mb=self.config.compile_memory_mb,
        )
        result = execute(job, self.config)
        binary = os.path.join(build, "main")
        if result.status != "ok" or not os.path.isfile(binary):
            result.status = "compile_error"
        self.compile_result = result
        self._binary = binary

    def _write(self, name: str, data: str | bytes) -> str:
        path = os.path.join(self._dir, name)
        with open(path, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.chmod(path, 0o644)
        return path

    def run(
        self,
        stdin: str | bytes = "",
        timeout_s: float = 2.0,
        memory_mb: int = 256,
        *,
        args: Sequence[str] = (),
        files: Mapping[str, str | bytes] | None = None,
    ) -> ExecResult:
        """Run once; `files` (name -> content) appear read-only under /sandbox/."""
        if self.compile_result is not None and self.compile_result.status != "ok":
            return self.compile_result
        if not isinstance(stdin, str | bytes):
            raise TypeError(f"stdin must be str or bytes, got {type(stdin).__name__}")
        run_dir = tempfile.mkdtemp(prefix="run-", dir=self._dir)
        os.chmod(run_dir, 0o755)
        try:
            stdin_path = os.path.join(run_dir, "stdin")
            with open(stdin_path, "wb") as f:
                f.write(stdin.encode("utf-8") if isinstance(stdin, str) else stdin)
            ro_files = {}
            for name, content in (files or {}).items():
                if "/" in name or name in ("", ".", "..", "main", "main.py", "main.cpp"):
                    raise ValueError(f"invalid sandbox file name {name!r}")
                path = os.path.join(run_dir, name)
                with open(path, "wb") as f:
                    f.write(content.encode("utf-8") if isinstance(content, str) else content)
                os.chmod(path, 0o644)
                ro_files[f"{SANDBOX_DIR}/{name}"] = path
            if self.language == "python":
                target = f"{SANDBOX_DIR}/main.py"
                ro_files[target] = self._src
                argv = [sandbox_python(self.config), "-I", target, *map(str, args)]
                syntax_check = target
            else:
                target = f"{SANDBOX_DIR}/main"
                ro_files[target] = self._binary
                argv = [target, *map(str, args)]
                syntax_check = None
            job = Job(
                argv=argv,
                stdin_path=stdin_path,
                ro_files=ro_files,
                rw_dirs={},
                timeout_s=float(timeout_s),
                memory_mb=int(memory_mb),
                syntax_check=syntax_check,
            )
            return execute(job, self.config)
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)

    def close(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> Program:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run(
    source: str,
    language: str = "python",
    stdin: str | bytes = "",
    timeout_s: float = 2.0,
    memory_mb: int = 256,
    *,
    args: Sequence[str] = (),
    files: Mapping[str, str | bytes] | None = None,
    config: SandboxConfig | None = None,
) -> ExecResult:
    """Compile (if needed) and run `source` once in the sandbox (docs/design.md §9)."""
    with Program(source, language, config=config) as program:
        return program.run(stdin, timeout_s, memory_mb, args=args, files=files)


def sandbox_info(config: SandboxConfig | None = None) -> dict:
    """What the sandbox will use here: bwrap path/version, mode, interpreter, languages."""
    config = config or DEFAULT_CONFIG
    bwrap = find_bwrap(config)
    version = subprocess.run(
        [bwrap, "--version"], capture_output=True, text=True, check=False
    ).stdout.strip()
    return {
        "bwrap": bwrap,
        "version": version,
        "mode": "root (privileged bwrap, per-run uid)"
        if os.geteuid() == 0
        else "unprivileged (user namespace)",
        "python": sandbox_python(config),
        "languages": [lang for lang in LANGUAGES if lang != "cpp" or cxx_available(config)],
    }
