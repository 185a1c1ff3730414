"""What a sandboxed run takes and gives: languages, the host-side settings, the outcome.

Kept apart from the bubblewrap machinery (``bubblewrap``) so that clients of the reward service
read these types without it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

STATUSES = ("ok", "timeout", "memory", "runtime_error", "compile_error", "output_limit")
LANGUAGES = ("python", "cpp")
_LANGUAGE_ALIASES = {
    "python": "python",
    "python3": "python",
    "py": "python",
    "cpp": "cpp",
    "c++": "cpp",
    "cxx": "cpp",
}


class SandboxError(RuntimeError):
    """The sandbox itself failed (missing bwrap, broken set-up): not the program's fault."""


@dataclass
class ExecResult:
    """Outcome of one sandboxed execution (docs/design.md §9)."""

    status: str
    stdout: str
    stderr: str
    exit_code: int | None
    wall_s: float

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class SandboxConfig:
    """Host-side settings of the sandbox (paths and limits not part of a single run)."""

    bwrap: str = "bwrap"
    python: str | None = None  # interpreter used inside the sandbox; None = auto-detect
    cxx: str = "g++"
    max_processes: int = 32
    output_limit_bytes: int = 8 * 1024 * 1024
    stderr_keep_bytes: int = 64 * 1024
    tmp_size_mb: int = 64
    max_open_files: int = 256
    compile_timeout_s: float = 20.0
    compile_memory_mb: int = 2048
    extra_ro_binds: tuple[str, ...] = field(default_factory=tuple)


DEFAULT_CONFIG = SandboxConfig()


def normalize_language(language: str) -> str:
    """Canonical language name; unknown names raise ValueError naming them."""
    key = str(language).strip().lower()
    if key not in _LANGUAGE_ALIASES:
        raise ValueError(f"unknown language {language!r}; supported: {', '.join(LANGUAGES)}")
    return _LANGUAGE_ALIASES[key]
