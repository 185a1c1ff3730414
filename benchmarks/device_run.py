"""A device run: every accelerator figure under one deadline, the most valuable first, its
summary rewritten after every part, so a run that fails, times out or is killed still returns
what it measured. ``scripts/device_check.sh OUT_DIR`` is its one command (it installs the carried
wheels and picks the interpreter); this runs the parts.

OUT_DIR ends up holding at most four files: summary.json (each part's status and headline
figures, the profile's table), figures.json (every part's own JSON), logs.tar.gz (each part's log
and the profiles' traces), and nothing else. ``--plan FILE`` replaces the parts (a JSON list of
{"name", "cap_s", "argv"}) to rehearse the deadline and the summary."""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rlax_tasks.process.parent_death import dies_with_parent  # noqa: E402  (a part dies with this run)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_DEADLINE_S = 480
# kept back from the deadline for the last summary and the archive
RESERVE_S = 10
# a part is not started with less time than this left
MIN_PART_S = 15
# a part's log lines kept in the summary when it did not pass
TAIL_LINES = 15
# the archive's largest member (a profile trace beyond it is left out, and said so)
MAX_MEMBER_BYTES = 24 << 20
SUMMARY, FIGURES, ARCHIVE = "summary.json", "figures.json", "logs.tar.gz"


@dataclasses.dataclass
class Part:
    """One part of the run: ``argv`` with {python}, {json} (where it writes its figures),
    {work} (its scratch folder) filled in, and the most seconds it may take."""

    name: str
    cap_s: float
    argv: list[str]
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    # a junit XML file it writes ({work} filled in): its counts and failed tests are its figures
    junit: str | None = None
    # a run's metrics.jsonl: each step's time, train time, tokens/s, loss and reward
    metrics: str | None = None


def platform_parts(platform: str) -> tuple[list[Part], list[str]]:
    """(the parts in the order of their value, what the CPU form leaves out) for a platform.
    Each command is written as one line; {python}, {json} and {work} are filled in per part."""
    if platform in ("gpu", "tpu"):
        decode, profile = "--slots 256,64", "--shape qwen2.5-1.5b"
        train = "--train-sweep --train-budget-s 90"
        # Qwen2.5-7B's layer widths: 8 of its 28 layers fit one device with float32 Adam
        train_7b = ("--shape qwen2.5-7b --layers 8 --train-batch 8 --train-seq-len 1024 "
                    "--micro-batch 2 --train-sweep --train-budget-s 60")  # fmt: skip
    else:  # the CPU form: the same code on small shapes
        decode = "--shape small --slots 8,4 --prompt-len 16 --new-tokens 8 --repeats 1"
        train = ("--shape small --train-batch 4 --train-seq-len 32 --micro-batch 2 --repeats 1 "
                 "--train-sweep --train-budget-s 10")  # fmt: skip
        train_7b = None
        profile = "--shape small"
    # (--settle-s: a device host's own load is not ours to wait out)
    bench = "{python} benchmarks/accelerator.py --settle-s 5 --json-out {json}"
    tests = ("{python} -m pytest -o addopts=-ra -p no:cacheprovider -q -m accelerator "
             "--junitxml {work}/accelerator-tests.xml tests/accelerator")  # fmt: skip
    parts = [
        Part("decode", 170, f"{bench} --only decode {decode}".split()),
        Part("train", 170, f"{bench} --only train {train}".split()),
        Part("profile", 120, f"{{python}} benchmarks/profile_steps.py {profile} "
                             "--trace-dir {work}/profile --json-out {json}".split()),  # fmt: skip
        Part("accelerator-tests", 100, tests.split(), junit="{work}/accelerator-tests.xml"),
        Part("doctor", 60, "{python} -m rlax_tasks.cli doctor".split()),
    ]
    if train_7b is not None:  # after the tests: a figure, where the tests are a verdict
        parts.insert(4, Part("train-7b", 130, f"{bench} --only train {train_7b}".split()))
    skipped = []
    if platform == "gpu":
        # the tiny preset end to end on GPU 0, its base model built first (a part of its own):
        # trainer and worker as two processes sharing the GPU, then colocated with the held-out
        # evaluation before and after as a job of its own
        run = ("{python} -m rlax_tasks.cli run --run-root {work}/runs --steps 4 "
               "--set placement.platform=gpu --set placement.trainer=[0]")  # fmt: skip
        shared = "--no-eval --set placement.mode=disaggregated --set placement.workers=[[0]]"
        warm_up = "{python} -m rlax_tasks.warmup.base_model runs/base-models tiny-arith"
        parts += [
            Part("base-model", 90, warm_up.split()),
            Part("e2e-shared-gpu", 120, f"{run} --run-id e2e-shared-gpu {shared}".split(),
                 metrics="{work}/runs/e2e-shared-gpu/metrics.jsonl"),  # fmt: skip
            Part("e2e-colocated", 120, f"{run} --run-id e2e-colocated".split(),
                 metrics="{work}/runs/e2e-colocated/metrics.jsonl"),  # fmt: skip
        ]
    else:
        skipped.append(f"the accelerator tests run but skip themselves on {platform}")
        skipped.append(f"Qwen2.5-1.5B shapes: the benchmarks run their small shape on {platform}")
        skipped.append(f"tiny-arith end to end on one GPU (the suite runs it on {platform})")
    return parts, skipped


def load_plan(path: str) -> list[Part]:
    """Parts from a JSON plan file (--plan): a list of {"name", "cap_s", "argv"[, "env"]}."""
    with open(path) as f:
        rows = json.load(f)
    if not isinstance(rows, list) or not rows:
        raise SystemExit(f"--plan {path}: expected a non-empty JSON list of parts")
    parts = []
    for i, row in enumerate(rows):
        missing = [k for k in ("name", "cap_s", "argv") if k not in row]
        if missing:
            raise SystemExit(f"--plan {path}: part {i} has no {', '.join(missing)}")
        parts.append(
            Part(
                str(row["name"]),
                float(row["cap_s"]),
                [str(a) for a in row["argv"]],
                {str(k): str(v) for k, v in row.get("env", {}).items()},
            )
        )
    return parts


class DeviceRun:
    """Runs parts one after the other under one deadline; after each, rewrites OUT_DIR's
    summary, figures and archive (also on an exception or a signal)."""

    def __init__(
        self,
        out_dir: str,
        deadline_s: float,
        python: str,
        platform: str,
        versions: str,
        skipped: list[str],
    ) -> None:
        self.out_dir, self.deadline_s, self.python = out_dir, deadline_s, python
        self.start = time.monotonic()
        self.work = tempfile.mkdtemp(prefix="rlax_device_run_")
        self.summary: dict[str, Any] = {
            "platform": platform,
            "versions": versions,
            "deadline_s": deadline_s,
            "seconds": 0,
            "parts": [],
            "figures": {},
            "skipped": skipped,
            "complete": False,
        }
        self.figures: dict[str, Any] = {}
        self.child: subprocess.Popen | None = None
        os.makedirs(out_dir, exist_ok=True)

    def left_s(self) -> float:
        return self.deadline_s - RESERVE_S - (time.monotonic() - self.start)

    def run(self, parts: list[Part], reduce: Callable[[str, Any], Any]) -> int:
        """Runs ``parts``; ``reduce(name, figures)`` picks a part's headline figures."""
        previous = {
            s: signal.signal(s, self._on_signal)
            for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
        }
        try:
            for part in parts:
                row = self._run_part(part)
                figures = self._read_figures(part)
                if figures is not None:
                    self.figures[part.name] = figures
                    headline = reduce(part.name, figures)
                    if headline is not None:
                        self.summary["figures"][part.name] = headline
                self.summary["parts"].append(row)
                self._print(row)
                self.write()
            self.summary["complete"] = True
        except Exception:  # the summary says what broke; what was measured stays
            self.summary["error"] = traceback.format_exc(limit=5)
            print(f"[device_run] error:\n{self.summary['error']}", flush=True)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            self.write()
            shutil.rmtree(self.work, ignore_errors=True)
        failed = [p["name"] for p in self.summary["parts"] if p["status"] != "passed"]
        print(
            f"[device_run] {'not passed: ' + ', '.join(failed) if failed else 'every part passed'}"
            f"; {self.summary['seconds']:.0f} s of {self.deadline_s:.0f}; "
            f"{os.path.join(self.out_dir, SUMMARY)}",
            flush=True,
        )
        return 1 if failed or "error" in self.summary else 0

    def _argv(self, part: Part) -> list[str]:
        fill = {"{python}": self.python, "{json}": self._json_path(part), "{work}": self.work}
        out = []
        for arg in part.argv:
            for key, value in fill.items():
                arg = arg.replace(key, value)
            out.append(arg)
        return out

    def _json_path(self, part: Part) -> str:
        return os.path.join(self.work, f"{part.name}.json")

    def _run_part(self, part: Part) -> dict[str, Any]:
        limit = min(part.cap_s, self.left_s())
        row: dict[str, Any] = {"name": part.name, "limit_s": round(max(limit, 0), 1)}
        if limit < MIN_PART_S and limit < part.cap_s:
            return {
                **row,
                "status": "skipped",
                "why": f"{max(limit, 0):.0f} s left of the deadline",
            }
        log_path = os.path.join(self.work, f"{part.name}.log")
        t0 = time.monotonic()
        with open(log_path, "wb") as log:
            self.child = subprocess.Popen(
                dies_with_parent(self._argv(part)),
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **part.env},
                start_new_session=True,
            )
            try:
                code = self.child.wait(timeout=limit)
                status = "passed" if code == 0 else "failed"
            except subprocess.TimeoutExpired:
                self._kill_child()
                code, status = None, "timed out"
            finally:
                self.child = None
        row.update(status=status, exit=code, seconds=round(time.monotonic() - t0, 1))
        if status != "passed":
            row["log_tail"] = _tail(log_path, TAIL_LINES)
        return row

    def _read_figures(self, part: Part) -> Any:
        """The part's JSON (also what a part killed midway wrote), its junit counts, or None."""
        if part.junit is not None:
            return _junit_counts(part.junit.replace("{work}", self.work))
        if part.metrics is not None:
            return _step_metrics(part.metrics.replace("{work}", self.work))
        try:
            with open(self._json_path(part)) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def _kill_child(self) -> None:
        """SIGTERM to the part's process group, SIGKILL after 5 s."""
        child = self.child
        if child is None or child.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(child.pid, sig)
            except ProcessLookupError:
                return
            try:
                child.wait(wait_s)
                return
            except subprocess.TimeoutExpired:
                continue

    def _on_signal(self, signum: int, _frame: Any) -> None:
        name = signal.Signals(signum).name
        print(f"[device_run] {name}: stopping the part under way, writing the summary", flush=True)
        self._kill_child()
        self.summary["interrupted"] = name
        self.write()
        shutil.rmtree(self.work, ignore_errors=True)
        os._exit(128 + signum)

    def write(self) -> None:
        """summary.json, figures.json and logs.tar.gz, each replaced whole."""
        self.summary["seconds"] = round(time.monotonic() - self.start, 1)
        _replace_json(os.path.join(self.out_dir, SUMMARY), self.summary)
        _replace_json(os.path.join(self.out_dir, FIGURES), self.figures)
        left_out = _archive(self.work, os.path.join(self.out_dir, ARCHIVE))
        if left_out and self.summary.get("left_out_of_archive") != left_out:
            self.summary["left_out_of_archive"] = left_out
            _replace_json(os.path.join(self.out_dir, SUMMARY), self.summary)

    def _print(self, row: dict[str, Any]) -> None:
        took = f" after {row['seconds']:.0f} s" if "seconds" in row else ""
        print(
            f"[device_run] {row['name']}: {row['status']}{took} (limit {row['limit_s']:.0f} s)",
            flush=True,
        )
        headline = self.summary["figures"].get(row["name"])
        if headline is not None:
            print(f"[device_run]   {json.dumps(headline)[:400]}", flush=True)


def _replace_json(path: str, data: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, default=str)
    os.replace(tmp, path)


def _archive(work: str, path: str) -> list[str]:
    """Writes every file under ``work`` into the gzipped tar at ``path``; returns what it left
    out (members over MAX_MEMBER_BYTES)."""
    left_out = []
    tmp = path + ".tmp"
    with tarfile.open(tmp, "w:gz") as tar:
        for root, _, files in os.walk(work):
            for name in sorted(files):
                full = os.path.join(root, name)
                rel = os.path.relpath(full, work)
                try:
                    size = os.path.getsize(full)
                except OSError:
                    continue
                if size > MAX_MEMBER_BYTES:
                    left_out.append(f"{rel} ({size} bytes)")
                    continue
                with open(full, "rb") as f:
                    data = f.read()
                info = tarfile.TarInfo(rel)
                info.size, info.mtime = len(data), int(time.time())
                tar.addfile(info, io.BytesIO(data))
    os.replace(tmp, path)
    return left_out


def _step_metrics(path: str) -> list[dict[str, Any]] | None:
    """Each step's seconds, training seconds, tokens/s, loss and reward of a metrics.jsonl."""
    keys = ("step", "step_time_s", "time_train_s", "tokens_per_s", "loss", "reward_mean")
    try:
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return None
    return [{k: r.get(k) for k in keys} for r in rows]


def _junit_counts(path: str) -> dict[str, Any] | None:
    """A junit XML report's test counts and the tests that failed (None: no report)."""
    import xml.etree.ElementTree as ET

    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return None
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    failed = [
        f"{case.get('classname')}::{case.get('name')}"
        for case in suite.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    return {**counts, "failed": failed}


def _tail(path: str, lines: int) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - 16384))
            return f.read().decode(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


def headline(name: str, figures: Any) -> Any:
    """The figures of a part that go into summary.json (the rest stays in figures.json)."""
    if not isinstance(figures, dict):
        return figures if isinstance(figures, list) else None
    if name == "decode" and "decode" in figures:
        keys = (
            "slots",
            "tokens_per_s",
            "fraction_of_roofline",
            "decode_step_s",
            "decode_step_fraction_of_roofline",
            "prefill_s",
        )
        return [{k: r.get(k) for k in keys} for r in figures.get("decode", [])]
    if name.startswith("train") and "train" in figures:
        t = figures["train"]
        return {
            "batch": t.get("batch"),
            "seq_len": t.get("seq_len"),
            "step_s": t.get("timing", {}).get("median_s"),
            "tokens_per_s": t.get("tokens_per_s"),
            "mfu": t.get("mfu"),
            "settings": figures.get("train_best_settings"),
            "measured": [
                {k: r.get(k) for k in ("remat", "micro_batch", "attention", "mfu", "error")}
                for r in figures.get("train_sweep", [])
            ],
        }
    if name == "profile" and "programs" in figures:
        return figures["programs"]
    return figures


def detect(python: str) -> tuple[str, str]:
    """(JAX's platform as gpu/tpu/cpu or "none", the versions) by ``python``, in a process of its
    own that takes no accelerator memory."""
    code = (
        "import sys, jax\nfrom importlib.metadata import version\n"
        "names = ('jax', 'jaxlib', 'flax', 'optax', 'orbax-checkpoint', 'transformers')\n"
        "print(jax.default_backend())\n"
        "print(', '.join([f'python {sys.version.split()[0]}'] + "
        "[f'{n} {version(n)}' for n in names]))\n"
    )
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    try:
        out = subprocess.run(
            [python, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=REPO
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return "none", f"{python}: {e}"
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or len(lines) < 2:
        return "none", (out.stderr.strip().splitlines() or ["no output"])[-1]
    platform = {"cuda": "gpu", "rocm": "gpu"}.get(lines[0], lines[0])
    return platform, lines[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir")
    p.add_argument(
        "--deadline-s",
        type=float,
        default=DEFAULT_DEADLINE_S,
        help=f"the whole run's seconds (default {DEFAULT_DEADLINE_S})",
    )
    p.add_argument("--python", default=sys.executable, help="the interpreter of the parts")
    p.add_argument("--parts", default=None, help="only these parts (comma-separated names)")
    p.add_argument("--plan", default=None, help="a JSON list of parts instead of the platform's")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    platform, versions = detect(args.python)
    print(
        f"[device_run] JAX platform: {platform} ({versions}); deadline {args.deadline_s:.0f} s;"
        f" figures under {args.out_dir}",
        flush=True,
    )
    if args.plan:
        parts, skipped = load_plan(args.plan), []
    else:
        parts, skipped = platform_parts(platform)
    if args.parts:
        wanted = args.parts.split(",")
        unknown = sorted(set(wanted) - {p.name for p in parts})
        if unknown:
            raise SystemExit(
                f"--parts: no part named {', '.join(unknown)} "
                f"(parts: {', '.join(p.name for p in parts)})"
            )
        parts = [p for p in parts if p.name in wanted]
    run = DeviceRun(args.out_dir, args.deadline_s, args.python, platform, versions, skipped)
    for line in skipped:
        print(f"[device_run] left out: {line}", flush=True)
    return run.run(parts, headline)


if __name__ == "__main__":
    sys.exit(main())
