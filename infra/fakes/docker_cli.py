"""A stand-in for the ``docker`` CLI on a fake TPU VM host (see ``infra/fakes/cloud_tpu.py``).

``pull``, ``run -d``, ``rm -f``, ``inspect``, ``logs``, ``ps`` as ``infra/tpu/startup.sh`` uses
them; the command comes from ``infra/Dockerfile``'s ENTRYPOINT/CMD (never hard-coded), so a script
that would fail on a TPU VM fails here. A "container" is a process tree marked by an env var."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import pathlib
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import psutil

REPO = pathlib.Path(__file__).resolve().parents[2]
BIN = pathlib.Path(__file__).resolve().parent / "bin"
# on the containers' Python path: what the TPU image adds to the runtime one, its libtpu (here
# the fake's, a JAX plugin: infra/fakes/tpu_image/jax_plugins/rlax_fake_libtpu)
TPU_IMAGE_SITE = pathlib.Path(__file__).resolve().parent / "tpu_image"
CONTAINER_VAR = "RLAX_FAKE_CONTAINER"
# names (comma-separated) of the test process's variables every host and container of the fake
# sees: what stands for the world outside a VM (STORAGE_EMULATOR_HOST: the route to GCS) and test
# speed-ups (a JAX compilation cache); nothing else of the test process reaches them
PASS_ENV_VAR = "RLAX_FAKE_PASS_ENV"
# the PATH of the image's base (python:3.11-slim-bookworm) and of a TPU VM's host
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# `docker run` options the stand-in knows: those that take a value, and flags
_VALUE_OPTS = {
    "--name",
    "--restart",
    "--net",
    "--network",
    "--ulimit",
    "--shm-size",
    "-v",
    "--volume",
    "-e",
    "--env",
    "--entrypoint",
}
_FLAG_OPTS = {"-d", "--detach", "--privileged", "--init", "--rm"}


class DockerError(Exception):
    """A docker failure: the message (as docker prints it) and the exit code."""

    def __init__(self, message: str, code: int = 125) -> None:
        super().__init__(message)
        self.code = code


# ---------------------------------------------------------------------- the image
@dataclasses.dataclass
class ImageConfig:
    """What ``docker run`` takes from an image."""

    entrypoint: list[str]
    cmd: list[str]
    env: dict[str, str]


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile: comments dropped, continuations joined."""
    out, pending = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not pending):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        if line:
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _exec_or_shell(rest: str) -> list[str]:
    """ENTRYPOINT/CMD arguments: the JSON (exec) form, else the shell form."""
    if rest.startswith("["):
        try:
            value = json.loads(rest)
        except json.JSONDecodeError:
            value = None
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return value
    return ["/bin/sh", "-c", rest]


def _parse_env(rest: str) -> dict[str, str]:
    words = shlex.split(rest)
    if words and "=" not in words[0]:  # legacy form: ENV KEY value with spaces
        return {words[0]: " ".join(words[1:])}
    return dict(w.split("=", 1) for w in words)


def image_config(dockerfile: str | os.PathLike, stage: str) -> ImageConfig:
    """ENTRYPOINT, CMD and ENV of ``stage`` in ``dockerfile`` (following FROM <earlier stage>)."""
    stages: dict[str, ImageConfig] = {}
    current: ImageConfig | None = None
    name = ""
    for word, rest in _instructions(pathlib.Path(dockerfile).read_text()):
        if word == "FROM":
            parts = rest.split()
            base = parts[0]
            name = parts[2].lower() if len(parts) >= 3 and parts[1].lower() == "as" else ""
            parent = stages.get(base.lower())
            current = (
                ImageConfig(list(parent.entrypoint), list(parent.cmd), dict(parent.env))
                if parent
                else ImageConfig([], [], {})
            )
            if name:
                stages[name] = current
        elif current is None:
            continue  # ARG before the first FROM
        elif word == "ENTRYPOINT":
            current.entrypoint = _exec_or_shell(rest)
            current.cmd = []  # as docker: a new ENTRYPOINT resets the inherited CMD
        elif word == "CMD":
            current.cmd = _exec_or_shell(rest)
        elif word == "ENV":
            current.env.update(_parse_env(rest))
    if stage.lower() not in stages:
        raise DockerError(f"stage {stage!r} not found in {dockerfile}", 1)
    return stages[stage.lower()]


def container_command(image: ImageConfig, entrypoint: str | None, args: list[str]) -> list[str]:
    """The command ``docker run [--entrypoint EP] IMAGE ARGS`` runs, as docker resolves it."""
    if entrypoint is not None:  # --entrypoint replaces ENTRYPOINT and drops the image's CMD
        command = ([entrypoint] if entrypoint else []) + list(args)
    else:
        command = image.entrypoint + (list(args) or image.cmd)
    if not command:
        raise DockerError("docker: Error response from daemon: no command specified.")
    return command


def _dockerfile() -> str:
    return os.environ.get("RLAX_FAKE_DOCKERFILE") or str(REPO / "infra" / "Dockerfile")


def _stage() -> str:
    return os.environ.get("RLAX_FAKE_DOCKER_STAGE") or "runtime"


# ---------------------------------------------------------------------- the registry
def _normalise(image: str) -> str:
    last = image.rsplit("/", 1)[-1]
    return image if ":" in last or "@" in image else image + ":latest"


def known_images() -> set[str]:
    """The images the fake registry holds."""
    images = [i for i in os.environ.get("RLAX_FAKE_DOCKER_IMAGES", "").split(",") if i]
    registry = os.environ.get("RLAX_FAKE_REGISTRY")
    if registry:
        with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
            images += json.loads(pathlib.Path(registry).read_text())
    return {_normalise(i) for i in images}


def _state_dir() -> pathlib.Path:
    path = os.environ.get("RLAX_FAKE_DOCKER_STATE")
    if not path:
        raise DockerError(
            "docker stand-in: RLAX_FAKE_DOCKER_STATE is not set (it is run by the fake Cloud "
            "TPU API, infra/fakes/cloud_tpu.py)",
            1,
        )
    (pathlib.Path(path) / "containers").mkdir(parents=True, exist_ok=True)
    return pathlib.Path(path)


def _pulled_path() -> pathlib.Path:
    return _state_dir() / "images.json"


def _pulled() -> set[str]:
    with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
        return set(json.loads(_pulled_path().read_text()))
    return set()


def pull(image: str) -> None:
    ref = _normalise(image)
    if ref not in known_images():
        raise DockerError(
            f"Error response from daemon: manifest for {ref} not found: manifest unknown: "
            "manifest unknown",
            1,
        )
    _write_json(_pulled_path(), sorted(_pulled() | {ref}))
    print(f"{ref.rsplit(':', 1)[-1]}: Pulling from {ref.rsplit(':', 1)[0]}")
    print(f"Status: Downloaded newer image for {ref}")
    print(ref)


# ---------------------------------------------------------------------- containers
def _write_json(path: pathlib.Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True))
    os.replace(tmp, path)


def _record_path(name: str) -> pathlib.Path:
    return _state_dir() / "containers" / f"{name}.json"


def _load(name: str) -> dict[str, Any] | None:
    with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
        return json.loads(_record_path(name).read_text())
    return None


def alive(pid: int | None) -> bool:
    """Whether ``pid`` is a live process (a zombie is not)."""
    if not pid:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def marked_pids(var: str, values: Iterable[str]) -> list[int]:
    """Live processes whose environment has ``var`` set to one of ``values``."""
    values = set(values)
    out = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(var) in values and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            continue
    return out


def kill_marked(var: str, values: Iterable[str], spare: Iterable[int] = ()) -> list[int]:
    """SIGKILLs every process marked ``var``=one of ``values`` (until none is left; a process
    forking meanwhile is caught by the next round); returns the pids killed."""
    values, spare, killed = set(values), set(spare), []
    for _ in range(50):
        pids = [p for p in marked_pids(var, values) if p not in spare and p != os.getpid()]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        killed += pids
        deadline = time.monotonic() + 2.0
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.01)
    return killed


def _parse_run(argv: list[str]) -> tuple[dict[str, Any], str, list[str]]:
    """(options, IMAGE, ARGS) of ``docker run`` arguments."""
    opts: dict[str, Any] = {"env": [], "detach": False, "entrypoint": None, "restart": "no"}
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        word = argv[i]
        key, eq, value = word.partition("=")
        if key in _FLAG_OPTS and not eq:
            opts["detach"] |= key in ("-d", "--detach")
            i += 1
            continue
        if key not in _VALUE_OPTS:
            raise DockerError(f"unknown flag: {key}\nSee 'docker run --help'.")
        if not eq:
            if i + 1 >= len(argv):
                raise DockerError(f"flag needs an argument: {key}")
            value = argv[i + 1]
            i += 1
        i += 1
        if key in ("-e", "--env"):
            opts["env"].append(value)
        elif key == "--name":
            opts["name"] = value
        elif key == "--restart":
            opts["restart"] = value
        elif key == "--entrypoint":
            opts["entrypoint"] = value
    if i >= len(argv):
        raise DockerError('"docker run" requires at least 1 argument.')
    return opts, argv[i], argv[i + 1 :]


def _restart_policy(value: str) -> tuple[str, int | None]:
    policy, _, count = value.partition(":")
    if policy not in ("no", "on-failure", "always", "unless-stopped"):
        raise DockerError(f"invalid restart policy: {value}")
    if count and (policy != "on-failure" or not count.isdigit()):
        raise DockerError(f"invalid restart policy: {value}")
    return policy, int(count) if count else None


def run(argv: list[str]) -> None:
    opts, image, args = _parse_run(argv)
    if not opts["detach"]:
        raise DockerError("the docker stand-in only runs detached containers (run -d)", 1)
    ref = _normalise(image)
    if ref not in _pulled():
        print(f"Unable to find image '{ref}' locally", file=sys.stderr)
        try:
            pull(image)
        except DockerError as e:
            raise DockerError(f"docker: {e}") from None  # exit code 125, as docker run
    config = image_config(_dockerfile(), _stage())
    command = container_command(config, opts["entrypoint"], args)
    _restart_policy(opts["restart"])
    name = opts.get("name") or f"fake_{uuid.uuid4().hex[:8]}"
    existing = _load(name)
    if existing is not None:
        raise DockerError(
            f'docker: Error response from daemon: Conflict. The container name "/{name}" is '
            f'already in use by container "{existing["Id"]}". You have to remove (or rename) '
            "that container to be able to reuse that name."
        )
    container_id = uuid.uuid4().hex + uuid.uuid4().hex
    env = container_env(config, opts["env"], _state_dir() / "homes" / name)
    env[CONTAINER_VAR] = container_id
    if shutil.which(command[0], path=env.get("PATH")) is None and "/" not in command[0]:
        raise DockerError(
            "docker: Error response from daemon: failed to create task for container: "
            f'exec: "{command[0]}": executable file not found in $PATH: unknown.',
            127,
        )
    record = {
        "Id": container_id,
        "Name": name,
        "Image": ref,
        "Path": command[0],
        "Args": command[1:],
        "Config": {
            "Image": ref,
            "Entrypoint": config.entrypoint if opts["entrypoint"] is None else [opts["entrypoint"]],
            "Cmd": args or (config.cmd if opts["entrypoint"] is None else []),
            "Env": [f"{k}={v}" for k, v in sorted({**config.env, **_dash_e(opts["env"])}.items())],
        },
        "HostConfig": {"RestartPolicy": opts["restart"]},
        "State": {"Running": False, "Pid": 0, "ExitCode": 0, "Status": "created"},
        "RestartCount": 0,
        "SupervisorPid": 0,
    }
    _write_json(_record_path(name), record)
    log = open(_state_dir() / "containers" / f"{name}.log", "ab")  # noqa: SIM115 - child's
    supervisor = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "_supervise", name],
        env=env,
        cwd=str(REPO),
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
        start_new_session=True,  # detached: its own session, as a container is
    )
    record["SupervisorPid"] = supervisor.pid
    # wait until the command has started, so that `docker run` answers with a running container
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline and supervisor.poll() is None:
        state = (_load(name) or {}).get("State", {})
        if state.get("Pid") or state.get("Status") == "exited":
            break
        time.sleep(0.01)
    print(container_id)


def passed_env(environ: Mapping[str, str]) -> dict[str, str]:
    """What a fake host or container keeps of ``environ``: the fake's own variables
    (``RLAX_FAKE_*``) and those PASS_ENV_VAR names."""
    names = {n for n in environ.get(PASS_ENV_VAR, "").split(",") if n}
    return {k: v for k, v in environ.items() if k.startswith("RLAX_FAKE_") or k in names}


def container_env(config: ImageConfig, dash_e: list[str], home: pathlib.Path) -> dict[str, str]:
    """A container's environment as docker builds it: the image's ENV, then ``-e`` (``-e KEY``:
    the client's value), never the host's (only ``passed_env``). Its PATH is the image's, whose
    Python is the fake's virtualenv (RLAX_FAKE_PYTHON) with the TPU image's libtpu
    (TPU_IMAGE_SITE); ``home``: its own file system's."""
    python_bin = os.path.dirname(os.environ.get("RLAX_FAKE_PYTHON") or sys.executable)
    home.mkdir(parents=True, exist_ok=True)
    env = {"PATH": f"{python_bin}{os.pathsep}{BIN}{os.pathsep}{SYSTEM_PATH}", "HOME": str(home)}
    env.update(config.env)
    env.update(_dash_e(dash_e))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TPU_IMAGE_SITE), env.get("PYTHONPATH")]))
    return {**env, **passed_env(os.environ)}


def _dash_e(items: list[str]) -> dict[str, str]:
    """The variables of ``-e`` options: ``KEY=VALUE``, or ``KEY``: the client's value (unset
    there: not set, as docker does)."""
    out = {}
    for item in items:
        key, eq, value = item.partition("=")
        if eq:
            out[key] = value
        elif key in os.environ:
            out[key] = os.environ[key]
    return out


def _update(name: str, **changes: Any) -> dict[str, Any]:
    record = _load(name) or {}
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(record.get(key), dict):
            record[key] = {**record[key], **value}
        else:
            record[key] = value
    _write_json(_record_path(name), record)
    return record


def _become_subreaper() -> None:
    """Orphans of the container's processes are re-parented here (as to a container's init)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def _wait_reaping(pid: int) -> int:
    """Waits for ``pid`` (reaping any other child meanwhile); its return code as subprocess's."""
    while True:
        try:
            done, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return -signal.SIGKILL
        if done == pid:
            return os.waitstatus_to_exitcode(status)


def supervise(name: str) -> int:
    """The container: runs its command, restarting it as its policy says."""
    _become_subreaper()
    record = _load(name)
    policy, max_retries = _restart_policy(record["HostConfig"]["RestartPolicy"])
    command = [record["Path"], *record["Args"]]
    delay, restarts = 0.1, 0
    _update(name, SupervisorPid=os.getpid())
    while True:
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL)
        started = time.monotonic()
        _update(name, State={"Running": True, "Pid": proc.pid, "Status": "running"})
        code = _wait_reaping(proc.pid)
        proc.returncode = code
        # a container's processes end with its main process
        kill_marked(CONTAINER_VAR, [record["Id"]], spare=[os.getpid()])
        exit_code = code if code >= 0 else 128 - code
        _update(name, State={"Running": False, "Pid": 0, "ExitCode": exit_code, "Status": "exited"})
        retry = policy in ("always", "unless-stopped") or (policy == "on-failure" and code != 0)
        if max_retries is not None and restarts >= max_retries:
            retry = False
        if not retry:
            return 0
        if time.monotonic() - started > 10.0:
            delay = 0.1  # as docker: the delay resets after a run of 10 s or more
        time.sleep(delay)
        delay = min(delay * 2, 5.0)
        restarts += 1
        _update(name, RestartCount=restarts, State={"Status": "restarting"})


def remove(argv: list[str]) -> None:
    force = any(a in ("-f", "--force") for a in argv)
    names = [a for a in argv if not a.startswith("-")]
    if not names:
        raise DockerError('"docker rm" requires at least 1 argument.', 1)
    for name in names:
        record = _load(name)
        if record is None:
            if force:
                continue
            raise DockerError(f"Error response from daemon: No such container: {name}", 1)
        if record["State"].get("Running") and not force:
            raise DockerError(
                f'Error response from daemon: cannot remove container "/{name}": container '
                "is running: stop the container before removing or force remove",
                1,
            )
        kill_marked(CONTAINER_VAR, [record["Id"]])
        _record_path(name).unlink(missing_ok=True)
        print(name)


def inspect(argv: list[str]) -> None:
    out = []
    for name in [a for a in argv if not a.startswith("-")]:
        record = _load(name)
        if record is None:
            print("[]")
            raise DockerError(f"Error: No such object: {name}", 1)
        out.append(record)
    print(json.dumps(out, indent=4))


def logs(argv: list[str]) -> None:
    name = next((a for a in argv if not a.startswith("-")), "")
    if _load(name) is None:
        raise DockerError(f"Error response from daemon: No such container: {name}", 1)
    path = _state_dir() / "containers" / f"{name}.log"
    sys.stdout.write(path.read_text(errors="replace") if path.exists() else "")


def ps(_argv: list[str]) -> None:
    print("CONTAINER ID   IMAGE   COMMAND   STATUS   NAMES")
    for path in sorted((_state_dir() / "containers").glob("*.json")):
        record = json.loads(path.read_text())
        if record["State"].get("Running"):
            command = shlex.join([record["Path"], *record["Args"]])
            print(f"{record['Id'][:12]}   {record['Image']}   {command!r}   Up   {record['Name']}")


COMMANDS = {"pull": None, "run": run, "rm": remove, "inspect": inspect, "logs": logs, "ps": ps}


def main(argv: list[str]) -> int:
    if argv[:1] == ["_supervise"]:
        return supervise(argv[1])
    if not argv or argv[0] not in COMMANDS:
        known = ", ".join(COMMANDS)
        print(
            f"docker stand-in: unknown command {argv[:1]} (this stand-in knows {known})",
            file=sys.stderr,
        )
        return 1
    try:
        if argv[0] == "pull":
            if len(argv) != 2:
                raise DockerError('"docker pull" requires exactly 1 argument.', 1)
            pull(argv[1])
        else:
            COMMANDS[argv[0]](argv[1:])
    except DockerError as e:
        print(str(e), file=sys.stderr)
        return e.code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
