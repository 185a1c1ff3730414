"""The benchmarks' own checks and reports: the TRL benchmarks say what to install before they
start, not minutes in (a fresh machine set up with ``scripts/setup.sh --test`` has neither TRL
nor ``datasets``); rollout.py prints the machine's load and marks contended figures; the
TRL comparison holds our run still for its whole evaluation, as TRL's clock pauses for its own."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
import types

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import rl_throughput, vs_trl  # noqa: E402


@pytest.mark.parametrize(
    ("main", "argv"),
    [
        (vs_trl.main, ["--model-size", "30m"]),
        (vs_trl.main, []),
        (rl_throughput.main, []),
    ],
)
def test_a_missing_trl_side_package_stops_the_benchmark_at_once(monkeypatch, capsys, main, argv):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "datasets" else find_spec(name, *a),
    )
    monkeypatch.setattr(rl_throughput, "run", lambda *a, **k: pytest.fail("the benchmark ran"))
    monkeypatch.setattr(vs_trl, "base_model_dir", lambda: pytest.fail("the benchmark ran"))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "datasets not installed" in err and "scripts/setup.sh --bench" in err


def test_only_ours_needs_no_trl(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    ran = []
    monkeypatch.setattr(rl_throughput, "run", lambda *a, **k: ran.append(a) or {})
    assert vs_trl.main(["--model-size", "30m", "--only", "ours"]) == 0
    assert ran


def test_30m_rounds_alternate_the_sides_and_report_the_median(monkeypatch, capsys, tmp_path):
    """--model-size 30m --rounds N: ours first, then TRL first, ...; each round's steps/s ratio
    and their median."""
    import json

    rates = {"ours-colocated": [0.10, 0.09, 0.11], "trl": [0.05, 0.06, 0.04]}
    calls: list[str] = []

    def side(label: str) -> dict:
        rate = rates[label][calls.count(label)]
        calls.append(label)
        return {"label": label, "steps": 6, "first_step_s": 3.0, "steps_per_s": rate}

    monkeypatch.setattr(rl_throughput, "trl_missing", lambda: None)
    _quiet_machine(monkeypatch)
    monkeypatch.setattr(rl_throughput, "build_model", lambda path, tokenizer_dir: 30_000_000)
    monkeypatch.setattr("benchmarks.async_vs_sync.base_model_dir", lambda: str(tmp_path))
    monkeypatch.setattr(rl_throughput, "run_ours", lambda layout, *a: side(f"ours-{layout}"))
    monkeypatch.setattr(rl_throughput, "run_trl", lambda *a: side("trl"))
    out_json = tmp_path / "out.json"
    argv = ["--model-size", "30m", "--layouts", "colocated", "--rounds", "3",
            "--json-out", str(out_json)]  # fmt: skip
    assert vs_trl.main(argv) == 0
    assert calls == ["ours-colocated", "trl", "trl", "ours-colocated", "ours-colocated", "trl"]
    out = capsys.readouterr().out
    # rounds: 0.10/0.05 = 2.0, 0.09/0.06 = 1.5, 0.11/0.04 = 2.75: median 2.0
    assert "round 2 of 3 (in this order: trl, ours-colocated):" in out
    assert "median over 3 rounds:\n  ours-colocated / TRL = 2.00x" in out
    saved = json.loads(out_json.read_text())
    assert saved["ratios"] == {"ours-colocated": pytest.approx(2.0)}
    assert [r["ratios"]["ours-colocated"] for r in saved["rounds"]] == [
        pytest.approx(2.0), pytest.approx(1.5), pytest.approx(2.75)
    ]  # fmt: skip
    assert saved["rounds"][1]["order"] == ["trl", "ours-colocated"]


@pytest.mark.parametrize("main", [vs_trl.main, rl_throughput.main])
def test_a_round_count_below_one_is_refused(monkeypatch, capsys, main):
    monkeypatch.setattr(rl_throughput, "run", lambda *a, **k: pytest.fail("the benchmark ran"))
    monkeypatch.setattr(vs_trl, "base_model_dir", lambda: pytest.fail("the benchmark ran"))
    with pytest.raises(SystemExit) as info:
        main(["--rounds", "0"])
    assert info.value.code == 2
    assert "--rounds: give a positive number of rounds, got 0" in capsys.readouterr().err


def test_rollout_figures_come_with_the_machine_load_and_a_contended_mark(capsys):
    from benchmarks import rollout

    quiet = {"when": "before", "load_1m": 0.1, "busy_cores": 0.0, "cpu_count": 2}
    after = {**quiet, "when": "after", "load_1m": 1.9}
    figures = ["[generate] ours 900 tok/s", "[swap] 20 ms"]
    rollout.print_figures(figures, {**quiet, "contended": False}, {**after, "contended": False})
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("rollout benchmark, machine load before: load 0.10 (1 min)")
    assert out[1:] == figures
    busy = {**after, "busy_cores": 1.2, "contended": True}  # another process held a core
    rollout.print_figures(figures, {**quiet, "contended": False}, busy)
    out = capsys.readouterr().out.splitlines()
    assert all(line.endswith("[CONTENDED: load 0.1, busy 1.2 cores]") for line in out[1:])


def test_figures_name_the_cpu_and_its_widest_vector_instructions(tmp_path):
    """The machine line names the CPU: torch's and XLA's kernels differ by more than a run's
    noise between an AVX2 and an AVX-512 machine, so figures compare only on the same kind."""
    from benchmarks import _timing

    def cpuinfo(flags: str) -> str:
        path = tmp_path / f"cpuinfo-{len(flags)}"
        core = f"processor\t: {{}}\nmodel name\t: Intel(R) Xeon(R) Processor\nflags\t\t: {flags}\n"
        path.write_text(core.format(0) + "\n" + core.format(1))
        return str(path)

    assert _timing.cpu_model(cpuinfo("fpu sse avx2 avx512f avx512bw")) == (
        "Intel(R) Xeon(R) Processor, AVX-512"
    )
    assert _timing.cpu_model(cpuinfo("fpu avx avx2 fma")).endswith(", AVX2")
    assert _timing.cpu_model(cpuinfo("fpu avx2 avx512f amx_tile")).endswith(", AMX")
    assert _timing.cpu_model(cpuinfo("fpu sse4_2")).endswith(", no AVX2")
    assert _timing.cpu_model(str(tmp_path / "missing")) is None
    load = {"load_1m": 0.1, "busy_cores": 0.0, "cpu_count": 2, "cpu": "Xeon, AVX-512"}
    assert _timing.describe_load(load) == (
        "load 0.10 (1 min), 0.00 of 2 cores busy with other work (Xeon, AVX-512)"
    )
    assert _timing.describe_load({**load, "cpu": None}).endswith("busy with other work")


def test_rollout_times_the_sides_in_turn():
    """Each round runs every side once: a drift of the machine's speed reaches both sides."""
    from benchmarks import rollout

    calls = []
    sides = [lambda: calls.append("ours") or 1, lambda: calls.append("theirs") or 2]
    timings = rollout.timed_side_by_side(sides, repeats=3)
    assert calls == ["ours", "theirs"] * 4  # a warm-up round, then three timed ones
    assert [result for _, result in timings] == [1, 2]
    assert all(seconds >= 0 for seconds, _ in timings)


@pytest.mark.parametrize("tied", [True, False])
def test_the_matmul_floor_runs_every_product_of_the_rollout_on_the_policys_weights(tied):
    """rollout.py's floor must not be lower than the products it stands for: every layer's seven
    projections and the output projection, for the prefill and each decode step, all kept by XLA
    (a product whose result went unused would be dropped and the floor read too fast)."""
    import re

    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from benchmarks._matmul_floor import floor_program
    from rlax_tasks.models import Policy
    from tests.tiny_model import tiny_model_config

    config = tiny_model_config(tie_word_embeddings=tied)
    policy = Policy.init(config, seed=0)
    fn, (prompt, mats, head) = floor_program(policy, batch=3, prompt_len=5, new_tokens=4)
    assert prompt.shape == (3 * 5, config.hidden_size)
    layers = policy.params["layers"]
    for i, m in enumerate(mats):
        gate = np.asarray(layers["mlp"]["gate_proj"]["kernel"][...][i])
        o = np.asarray(layers["self_attn"]["o_proj"]["kernel"][...][i])
        np.testing.assert_array_equal(m["gate_proj"], gate)
        np.testing.assert_array_equal(m["o_proj"], o.reshape(-1, config.hidden_size))
    unembedding = np.asarray(nnx.merge(policy.graphdef, policy.params).unembedding())
    np.testing.assert_array_equal(head, unembedding)
    compiled = fn.lower(prompt, mats, head).compile().as_text()
    dots = re.findall(r"\bdot\(", compiled)
    # the prefill's products and one decode step's (the loop body), each 7 per layer + the head
    assert len(dots) == 2 * (7 * config.num_hidden_layers + 1)
    assert jnp.isfinite(fn(prompt, mats, head)).all()


def test_the_cache_floor_attends_over_no_more_entries_than_each_decode_step_holds():
    """The attention floor's windows: the N - 1 decode steps, in order, each stretch over the
    entries its first step holds (P + t + 1 at step t), never more than any of its steps."""
    from benchmarks._matmul_floor import ATTENTION_STRETCHES, stretches

    for prompt_len, new_tokens in [(64, 128), (5, 4), (7, 2), (3, 1), (16, 1000)]:
        plan = stretches(prompt_len, new_tokens)
        assert sum(steps for steps, _ in plan) == new_tokens - 1
        assert len(plan) <= ATTENTION_STRETCHES
        first = 0
        for steps, window in plan:
            assert steps > 0
            assert window == prompt_len + first + 1  # what the stretch's first step holds
            first += steps
    assert stretches(64, 128)[-1] == (16, 64 + 111 + 1)


@pytest.mark.parametrize("tied", [True, False])
def test_the_cache_floor_adds_attentions_two_products_per_layer_over_the_windows(tied):
    """With attention=True every decode stretch runs the same products plus, per layer, the
    queries x keys and scores x values products over its window, all kept by XLA."""
    import re

    import jax.numpy as jnp

    from benchmarks._matmul_floor import floor_program, stretches
    from rlax_tasks.models import Policy
    from tests.tiny_model import tiny_model_config

    config = tiny_model_config(tie_word_embeddings=tied)
    policy = Policy.init(config, seed=0)
    fn, (prompt, mats, head, windows) = floor_program(
        policy, batch=3, prompt_len=5, new_tokens=4, attention=True
    )
    plan = stretches(5, 4)
    kv, hd, layers = config.num_key_value_heads, config.head_dim, config.num_hidden_layers
    assert len(windows) == len(plan) == 3
    for (keys, values), (_, w) in zip(windows, plan, strict=True):
        assert [k.shape for k in keys] == [(3, kv, hd, w)] * layers
        assert [v.shape for v in values] == [(3, kv, w, hd)] * layers
    compiled = fn.lower(prompt, mats, head, windows).compile().as_text()
    dots = re.findall(r"\bdot\(", compiled)
    # the prefill's products, then each stretch's loop body: 7 per layer + the head, and the
    # two attention products per layer
    assert len(dots) == (7 * layers + 1) + len(plan) * (9 * layers + 1)
    assert jnp.isfinite(fn(prompt, mats, head, windows)).all()


def _stopped(pid: int, want: bool) -> bool:
    """Whether process ``pid`` is stopped ('T' in /proc/<pid>/stat) as ``want``, within 2 s."""
    deadline = time.monotonic() + 2.0
    while True:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        if (state == "T") == want or time.monotonic() > deadline:
            return state == "T"
        time.sleep(0.01)


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc")
def test_eval_pauses_hold_the_training_jobs_while_the_heldout_job_evaluates(tmp_path):
    """vs_trl's clock excludes evaluation as TRL's does: from the held-out job's mark of a run
    version's evaluation until its result, the run's other jobs are held still (the held-out job
    is not) and the pause is taken off the clock; the starting weights' evaluation (before the
    run) and one already over when the hook first sees it hold nothing."""
    import json

    from benchmarks.async_vs_sync import EvalPauses
    from rlax_tasks.rundir.paths import run_paths

    def job():
        return subprocess.Popen(
            [sys.executable, "-c", "import time\nwhile True: time.sleep(0.01)"],
            start_new_session=True,  # leads its own process group, as the supervisor's jobs do
        )

    trainer, heldout = job(), job()
    sup = types.SimpleNamespace(components={
        "trainer": types.SimpleNamespace(proc=trainer),
        "heldout": types.SimpleNamespace(proc=heldout),
    })  # fmt: skip
    scores = run_paths(str(tmp_path)).heldout_scores
    os.makedirs(os.path.dirname(scores))

    def write(*rows):
        with open(scores, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)

    pauses = EvalPauses(str(tmp_path))
    try:
        write({"evaluating": 0, "time": 1.0})  # the starting weights: the run has not started
        pauses.follow(sup)
        held_for_base = _stopped(trainer.pid, True)
        write({"version": 0, "pass@1": 0.1})
        write({"evaluating": 10, "time": 2.0})
        pauses.follow(sup)
        held = _stopped(trainer.pid, True), _stopped(heldout.pid, True)
        write({"version": 10, "pass@1": 0.2})
        pauses.follow(sup)
        released = not _stopped(trainer.pid, False)
        write({"evaluating": 20, "time": 3.0}, {"version": 20, "pass@1": 0.3})  # over already
        pauses.follow(sup)
        held_after_done = _stopped(trainer.pid, True)
    finally:
        for p in (trainer, heldout):
            p.kill()
            p.wait()
    assert not held_for_base
    assert held == (True, False)
    assert released and not held_after_done
    assert len(pauses.pauses) == 1
    start, end = pauses.pauses[0]
    assert pauses.paused_before(end + 1) == pytest.approx(end - start)


_PARENT_ONLY: list[str] = []  # set in the test's process; a fresh interpreter starts without it


def _fresh_process_report(value: int, *, launched: float) -> dict:
    """Run by run_in_fresh_process: what the child saw of its start."""
    if value < 0:
        raise ValueError(f"negative value {value}")
    return {
        "pid": os.getpid(),
        "value": value,
        "since_launch": time.monotonic() - launched,
        "parent_state": list(_PARENT_ONLY),
    }


def test_a_fresh_process_clock_counts_its_start_and_a_failure_is_raised_not_hung():
    """TRL's side runs in a fresh interpreter whose clock starts before it is launched: its own
    imports count as ours' processes' do."""
    from benchmarks import _timing

    _PARENT_ONLY[:] = ["set in the parent"]
    t0 = time.monotonic()
    seen = _timing.run_in_fresh_process(_fresh_process_report, 7)
    assert seen["pid"] != os.getpid() and seen["value"] == 7
    assert seen["parent_state"] == []  # a fresh interpreter, not a fork of this one
    # the clock began before the child existed: its interpreter start is on it
    assert 0.0 < seen["since_launch"] <= time.monotonic() - t0
    with pytest.raises(RuntimeError, match="negative value -1"):
        _timing.run_in_fresh_process(_fresh_process_report, -1)


def _quiet_machine(monkeypatch) -> None:
    """The benchmarks' load readings, stubbed: a real one waits up to 150 s for a load left by
    the previous test to settle."""
    from benchmarks import _timing

    def load(log=None, when="before", **_):
        return {"when": when, "load_1m": 0.1, "load_5m": 0.1, "load_15m": 0.1,
                "busy_cores": 0.0, "cpu_count": 2, "contended": False}  # fmt: skip

    monkeypatch.setattr(_timing, "machine_load", load)


def test_vs_trl_rounds_alternate_the_sides_and_report_the_median(monkeypatch, capsys, tmp_path):
    """--rounds N runs every side N times, ours first, then TRL first, ...: a slow spell of the
    machine reaches both sides; the ratios are each round's and their median."""
    import json

    seconds = {"ours-colocated": [10.0, 12.0], "trl": [30.0, 20.0]}  # time to target per call
    calls: list[str] = []

    def result(label: str) -> dict:
        t = seconds[label][calls.count(label)]
        calls.append(label)
        curve = [
            {"version": 0, "pass@1": 0.1, "seconds": 0.0},
            {"version": 10, "pass@1": 0.5, "seconds": t},
        ]
        return {"curve": curve, "steps": 10, "stopped": "target", "train_seconds": t,
                "first_step_seconds": 2.0, "step_interval_median": 0.1,
                "step_interval_mean": 0.1, "reward_last10": 0.3}  # fmt: skip

    class Evaluator:
        def __init__(self, cfg):
            pass

        def evaluate(self):
            return {"pass@1": 0.1}

    monkeypatch.setattr(vs_trl, "run_ours", lambda label, *a, **k: result(label))
    monkeypatch.setattr(vs_trl, "run_trl_fresh", lambda *a, **k: result("trl"))
    monkeypatch.setattr(vs_trl, "base_model_dir", lambda: str(tmp_path))
    monkeypatch.setattr(vs_trl, "base_checks", lambda cfg, d: {"torch_sampled": 0.1, "exact": 0.1})
    monkeypatch.setattr(rl_throughput, "trl_missing", lambda: None)
    monkeypatch.setattr("rlax_tasks.run.report.HeldOutEvaluator", Evaluator)
    _quiet_machine(monkeypatch)
    out_json = tmp_path / "out.json"
    argv = ["--layouts", "colocated", "--rounds", "2", "--json-out", str(out_json)]
    assert vs_trl.main(argv) == 0
    assert calls == ["ours-colocated", "trl", "trl", "ours-colocated"]
    out = capsys.readouterr().out
    # end to end: 30/10 = 3.0 and 20/12 = 1.67; from the first step: 28/8 = 3.5 and 18/10 = 1.8
    assert "round 2 of 2 (in this order: trl, ours-colocated)" in out
    assert "ours-colocated: TRL / ours = 2.33x end to end, 2.65x from each side's first" in out
    saved = json.loads(out_json.read_text())
    assert saved["ratios_trl_over_ours"]["ours-colocated"] == {
        "end_to_end": pytest.approx(7 / 3),
        "from_first_step": pytest.approx(2.65),
    }
    assert [r["ratios_trl_over_ours"]["ours-colocated"]["end_to_end"] for r in saved["rounds"]] == [
        pytest.approx(3.0),
        pytest.approx(20 / 12),
    ]


def test_core_pins_put_each_job_on_its_cores():
    """async_vs_sync --pin: every process of a worker job on the workers' cores, the others'
    on theirs (here a job that starts a child, as the job runner does)."""
    from benchmarks.async_vs_sync import CorePins, parse_pin

    assert parse_pin("1:0") == ({1}, {0}) and parse_pin("2-3:0,1") == ({2, 3}, {0, 1})
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores")  # (CI and every user's first machine have two)
    cmd = [
        sys.executable,
        "-c",
        "import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); time.sleep(30)",
    ]
    procs = {name: subprocess.Popen(cmd, start_new_session=True) for name in ("worker-0", "ps")}
    try:
        time.sleep(1.0)  # the children started
        sup = types.SimpleNamespace(
            components={n: types.SimpleNamespace(proc=p) for n, p in procs.items()}
        )
        CorePins({cores[1]}, {cores[0]}).apply(sup)
        for name, proc in procs.items():
            want = {cores[1]} if name.startswith("worker") else {cores[0]}
            group = [
                int(pid)
                for pid in os.listdir("/proc")
                if pid.isdigit() and _pgrp(int(pid)) == proc.pid
            ]
            assert len(group) == 2, group  # the job and its child
            assert all(os.sched_getaffinity(pid) == want for pid in group), name
    finally:
        for proc in procs.values():
            os.killpg(proc.pid, 9)
            proc.wait()


def _pgrp(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[2])
    except (OSError, ValueError):
        return None


def test_the_train_sweep_keeps_the_fastest_setting_and_records_one_that_fails(monkeypatch):
    """A setting that fails (out of memory) is a row with its error, not the end of the sweep;
    the train figures are the fastest setting's, and its ``--set`` flags are printed."""
    import argparse

    from benchmarks import accelerator

    speed = {"full": 1.0, "dots": 3.0, "none": None}  # remat none runs out of memory

    def fake_figures(policy, batch, seq_len, setting, repeats):
        row = {"batch": batch, "seq_len": seq_len, "remat": setting.remat,
               "micro_batch": setting.micro_batch, "attention": setting.attention}  # fmt: skip
        if speed[setting.remat] is None:
            return {**row, "error": "XlaRuntimeError: RESOURCE_EXHAUSTED"}
        rate = speed[setting.remat] * (2 if setting.micro_batch == batch else 1)
        return {**row, "tokens_per_s": rate, "model_flops_per_s": rate * 10}

    monkeypatch.setattr(accelerator, "train_figures", fake_figures)
    args = argparse.Namespace(train_batch=8, train_seq_len=16, micro_batch=2, repeats=1,
                              train_sweep=True, train_budget_s=60.0, json_out=None)  # fmt: skip
    results: dict = {}
    accelerator.train_sweep(None, args, "gpu", (100.0, 1.0), results)
    rows = results["train_sweep"]
    assert [(r["remat"], r["micro_batch"], r["attention"]) for r in rows] == [
        ("full", 2, None), ("dots", 2, None), ("none", 2, None), ("dots", 8, None),
        ("dots", 2, "xla"),
    ]  # fmt: skip
    assert "RESOURCE_EXHAUSTED" in rows[2]["error"] and "mfu" not in rows[2]
    assert results["train"]["remat"] == "dots" and results["train"]["micro_batch"] == 8
    assert results["train"]["mfu"] == 6 * 10 / 100.0
    assert results["train_best_settings"] == [
        "trainer.remat=dots", "trainer.micro_batch_size=8"
    ]  # fmt: skip
    # without --train-sweep: the run's default alone
    assert accelerator.train_settings(8, 2, "gpu", sweep=False) == [
        accelerator.TrainSetting("full", 2)
    ]


def test_rollout_figures_count_model_tokens_and_episodes_across_versions(monkeypatch):
    """async_vs_sync: observation tokens (loss mask 0) are not rollout tokens trained on, and a
    sequence whose model tokens carry two weight versions had an update land mid-episode."""
    import pandas as pd

    from benchmarks.async_vs_sync import rollout_figures

    rows = pd.DataFrame(
        {
            "tokens": [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10]],
            "loss_mask": [[1, 1, 0, 0, 1], [1, 1, 1], [1, 0]],
            "token_versions": [[3, 3, -1, -1, 4], [5, 5, 5], [2, -1]],
        }
    )
    monkeypatch.setattr("rlax_tasks.controller.read_rollouts", lambda run_dir: rows)
    figures = rollout_figures("unused")
    assert figures == {"rollout_tokens": 7, "sequences": 3, "multi_version_sequences": 1}


def test_ps_http_stack_serves_the_same_version_through_both_stacks_at_its_smallest(tmp_path):
    """benchmarks/ps_http_stack.py --quick: both stacks serve a version with the same digest
    (else it stops), every pull returns the whole stream, and each figure is printed."""
    out_json = tmp_path / "ps_http.json"
    script = os.path.join(
        os.path.dirname(os.path.dirname(__file__)), "benchmarks", "ps_http_stack.py"
    )
    proc = subprocess.run(
        [sys.executable, script, "--quick", "--json-out", str(out_json)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("ps http.server", "fastapi StreamingResponse", "fastapi memoryview Response",
                 "memcpy ceiling", "GET /v1/latest under"):  # fmt: skip
        assert name in proc.stdout, proc.stdout
    import json

    (size,) = json.loads(out_json.read_text())["sizes"]
    for stack in ("ps", "fastapi_stream", "fastapi_memoryview"):
        assert size[stack]["bytes"] == size["stream_bytes"] > 4 * 2**20
        assert size[stack]["gb_per_s"] > 0
    assert size["ps_control"]["requests"] > 0 and size["fastapi_control"]["requests"] > 0
