"""Fleet simulation: hundreds to a thousand simulated inference workers speaking the real worker
protocol to the real controller, pulling real weight versions from real parameter-server
replicas, with a fake trainer pushing random weights; no model compute, a few processes on one
machine. Each replica's link is a token bucket (``--egress``); workers are preempted and join
(``--churn-per-minute``), some are slow, and one replica is killed mid-run.

It prints, per replica count (1 and 4 by default, one after the other), how long a version
takes to reach every worker against the bound version bytes × workers / (replicas × egress),
the controller's calls per second with p50/p99 latency, snapshot size and commit time with the
fleet in flight, the processes' peak memory, and the fate of every group generated (which must
balance: none silently lost). docs/design.md §16.

``.venv/bin/python benchmarks/fleet.py [--workers 1024] [--replicas 1,4] [--seconds 150]
[--version-bytes 256KiB] [--egress 16MiB] [--churn-per-minute 0.1] [--topology star,chain,root]
[--quick] [--out FILE]``"""

from __future__ import annotations

import argparse
import json
import logging
import math
import multiprocessing
import os
import secrets
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _setup  # noqa: E402,F401  (the repository on sys.path, JAX on the CPU)
import _timing  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks._fleet import figures  # noqa: E402
from benchmarks._fleet.controller_host import ControllerHostSettings, controller_main  # noqa: E402
from benchmarks._fleet.processes import START_TIMEOUT_S, Child, Churn, Fleet, wait_for  # noqa: E402
from benchmarks._fleet.services import (  # noqa: E402
    ReplicaSettings,
    TrainerSettings,
    replica_main,
    trainer_main,
)
from benchmarks._fleet.workers import WorkerSettings, host_main  # noqa: E402
from rlax_tasks.paramserver.assignment import assign_replica, failover_order  # noqa: E402
from rlax_tasks.utils.byte_sizes import parse_bytes  # noqa: E402

log = logging.getLogger("benchmarks.fleet")

WORKERS_PER_HOST = 256  # simulated workers per host process
LEAVE_DELAY_S = 5.0  # a preempted worker leaves the workers file this long after it died
STATUS_EVERY_S = 5.0
TOPOLOGIES = ("star", "chain", "root")
# --quick: small enough for a test on two cores
QUICK = dict(workers=32, replicas="1,2", seconds=12.0, version_bytes="128KiB", egress="4MiB",
             gen_median_s=0.5, churn_per_minute=1.0)  # fmt: skip


# the command line, as data: (flag, argparse keywords)
OPTIONS: list[tuple[str, dict[str, Any]]] = [
    ("--workers", dict(type=int, default=1024, help="simulated inference workers")),
    ("--replicas", dict(default="1,4", help="replica counts to run, one after another")),
    ("--topology", dict(default="star", help="comma-separated, for runs of more than one "
        "replica: replicas r>0 relay from replica 0 (star) or from r-1 (chain); root: a star "
        "whose replica 0 serves only the other replicas, the workers being spread over those")),
    ("--seconds", dict(type=float, default=150.0, help="controller time per run")),
    ("--minutes", dict(type=float, default=None, help="the same in minutes")),
    ("--version-bytes", dict(default="256KiB", help="bytes of one weight version")),
    ("--egress", dict(default="16MiB", help="bytes/s each replica's link sends (keep replicas "
        "x egress well below what the machine moves over loopback, or the figures measure the "
        "CPU, not the links)")),
    ("--churn-per-minute", dict(type=float, default=0.10,
        help="fraction of the fleet preempted (and replaced) per minute")),
    ("--slow-fraction", dict(type=float, default=0.05,
        help="fraction of workers whose groups take --slow-factor times as long")),
    ("--slow-factor", dict(type=float, default=5.0)),
    ("--no-replica-kill", dict(action="store_true",
        help="keep every replica alive (else the last one dies mid-run)")),
    ("--gen-median-s", dict(type=float, default=1.0, help="a group's median time")),
    ("--group-size", dict(type=int, default=8)),
    ("--tokens", dict(default="64,448", help="a completion's length range MIN,MAX")),
    ("--prompts-per-step", dict(type=int, default=None, help="default: --workers")),
    ("--reload-every", dict(type=int, default=1, help="j (docs/design.md §3)")),
    ("--max-staleness", dict(type=int, default=1, help="k (docs/design.md §3)")),
    ("--seed", dict(type=int, default=0)),
    ("--quick", dict(action="store_true",
        help="a small CPU-friendly setting: 32 workers, replicas 1,2, 12 s each")),
    ("--out", dict(default=None, help="write the figures as JSON here")),
    ("--profile-controller", dict(default=None, help=argparse.SUPPRESS)),
    ("--child-log-level", dict(default="ERROR",
        help="log level of the simulated services (WARNING: every worker failure)")),
]  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for flag, keywords in OPTIONS:
        p.add_argument(flag, **keywords)
    args = p.parse_args(argv)
    if args.quick:  # (options given on the command line keep their values)
        for name, value in QUICK.items():
            if getattr(args, name) == p.get_default(name):
                setattr(args, name, value)
    if args.minutes is not None:
        args.seconds = 60.0 * args.minutes
    args.replica_counts = [int(x) for x in str(args.replicas).split(",") if x.strip()]
    args.version_nbytes = parse_bytes(args.version_bytes)
    args.egress_bytes = parse_bytes(args.egress)
    args.tokens_min, args.tokens_max = (int(x) for x in args.tokens.split(","))
    args.topologies = [t.strip() for t in args.topology.split(",") if t.strip()]
    if not args.topologies or set(args.topologies) - set(TOPOLOGIES):
        p.error(f"--topology: give some of {', '.join(TOPOLOGIES)}, got {args.topology!r}")
    if args.workers < 1 or any(r < 1 for r in args.replica_counts):
        p.error("--workers and --replicas must be >= 1")
    return args


# --------------------------------------------------------------------------- one run
class Simulation:
    """One run with ``replicas`` replicas: services, workers, the controller for
    ``args.seconds`` under churn (and a replica killed half-way), then everything's report."""

    def __init__(self, args: argparse.Namespace, replicas: int, topology: str) -> None:
        self.args, self.replicas, self.topology = args, replicas, topology
        self.ctx = multiprocessing.get_context("spawn")
        self.token = secrets.token_hex(16)
        self.run_dir = tempfile.mkdtemp(prefix=f"fleet-r{replicas}-")
        self.rng = np.random.default_rng(args.seed)
        self.label = f"{replicas} replica{'s' if replicas > 1 else ''}"
        if replicas > 1:
            self.label += f" ({topology})"
        self.children: list[Child] = []
        self.dead_replicas: dict[int, float] = {}  # replica -> when it was killed
        self.bound0 = figures.link_bound_s(
            args.version_nbytes, args.workers, replicas, args.egress_bytes
        )

    def run(self) -> dict[str, Any]:
        try:
            self._start_services()
            self._start_workers()
            self._drive()
            return self._stop()
        finally:
            for c in self.children:
                c.end()

    def _child(self, name: str, target: Any, settings: Any) -> Child:
        child = Child(self.ctx, name, target, settings)
        self.children.append(child)
        return child

    def _replica_order(self, i: int) -> tuple[int, ...]:
        """The replicas the i-th worker tries, its home first: homes spread evenly (root: over
        replicas 1..R-1), then the others in the order `rlax run` gives a worker
        (``failover_order``: a dead replica's workers spread over the rest)."""
        if self.topology == "root" and self.replicas > 1:
            home = 1 + assign_replica(i, self.replicas - 1)
        else:
            home = assign_replica(i, self.replicas)
        return tuple(failover_order(home, self.replicas, i))

    def _slow(self) -> bool:
        return bool(self.rng.random() < self.args.slow_fraction)

    def _start_services(self) -> None:
        """Replica 0 takes the trainer's pushes; replica r relays from 0 (star, root) or from
        r-1 then 0 (chain); the fake trainer pushes version 0 as it starts."""
        a = self.args
        self.ps: list[Child] = []
        self.urls: list[str] = []
        for r in range(self.replicas):
            up: tuple[str, ...] = ()
            if r > 0:
                chain = self.topology == "chain"
                up = (self.urls[r - 1], self.urls[0]) if chain else (self.urls[0],)
            settings = ReplicaSettings(self.token, r, a.egress_bytes, up)
            self.ps.append(self._child(f"ps-{r}", replica_main, settings))
            self.urls.append(self.ps[-1].recv(START_TIMEOUT_S))
        settings = TrainerSettings(self.token, self.urls[0], self.run_dir, a.version_nbytes)
        self.trainer = self._child("trainer", trainer_main, settings)
        self.trainer_url = self.trainer.recv(START_TIMEOUT_S)

    def _start_workers(self) -> None:
        """The worker hosts and the fleet, every worker holding version 0 (the first
        broadcast: every worker pulls at once)."""
        a = self.args
        settings = WorkerSettings(
            self.token, tuple(self.urls), a.reload_every, a.gen_median_s, 0.5, a.slow_factor,
            a.tokens_min, a.tokens_max, a.seed,
        )  # fmt: skip
        n_hosts = max(1, math.ceil(a.workers / WORKERS_PER_HOST))
        hosts = [self._child(f"workers-{h}", host_main, settings) for h in range(n_hosts)]
        for h in hosts:
            assert h.recv(START_TIMEOUT_S) == "ready"
        self.fleet = Fleet(os.path.join(self.run_dir, "workers.json"), hosts)
        per_host = math.ceil(a.workers / n_hosts)
        for h in range(n_hosts):
            count = min(per_host, a.workers - h * per_host)
            self.fleet.spawn(h, count, self._replica_order, self._slow, pull=False)
        self.fleet.write()
        self.initial = list(self.fleet.live)
        self.started = time.monotonic()  # every worker pulls from now on
        for h in hosts:
            h.call("pull")
        seconds = wait_for(
            lambda: self.fleet.stats()["held"].get("0", 0) == a.workers, 4 * self.bound0 + 60
        )
        if seconds is None:
            raise TimeoutError(f"{self.label}: the workers never all held version 0")
        log.info("%s: %d workers hold version 0 after %.1fs (bound %.1fs)",
                 self.label, a.workers, seconds, self.bound0)  # fmt: skip

    def _drive(self) -> None:
        """The controller for ``args.seconds``: workers preempted and replaced, one replica
        killed half-way (with more than one), a status line every few seconds."""
        a = self.args
        self.controller = self._child("controller", controller_main, ControllerHostSettings(
            self.token, self.trainer_url, self.fleet.path, self.run_dir,
            prompts_per_step=a.prompts_per_step or a.workers,
            max_outstanding_groups=a.workers, group_size=a.group_size,
            max_new_tokens=a.tokens_max, reload_every=a.reload_every,
            max_staleness=a.max_staleness, seed=a.seed, profile=a.profile_controller,
        ))  # fmt: skip
        self.churn = Churn(a, self.rng)
        status: dict[str, Any] = {}
        probe_at: float | None = None  # when to ask for a snapshot with the fleet busy
        probed = False
        next_probe_check = 0.0
        leaving: list[tuple[float, str]] = []
        t0 = time.monotonic()
        next_status = t0 + STATUS_EVERY_S
        kill_at = t0 + a.seconds / 2 if self.replicas > 1 and not a.no_replica_kill else None
        while time.monotonic() - t0 < a.seconds:
            time.sleep(0.2)
            now = time.monotonic()
            changed = False
            for _ in range(self.churn.due(now)):
                victim = self.fleet.live[int(self.rng.integers(len(self.fleet.live)))]
                self.fleet.kill(victim)
                leaving.append((now + LEAVE_DELAY_S, victim))
                self.fleet.spawn(self.fleet.host_of[victim], 1, self._replica_order, self._slow)
                changed = True
            while leaving and leaving[0][0] <= now:  # the launcher notices and rewrites
                self.fleet.urls.pop(leaving.pop(0)[1], None)
                changed = True
            if changed:
                self.fleet.write()
            if kill_at is not None and now >= kill_at:
                self.ps[-1].proc.kill()
                self.dead_replicas[self.replicas - 1] = now
                kill_at = None
                log.warning("%s: replica %d killed", self.label, self.replicas - 1)
            while self.controller.conn.poll():
                _, status = self.controller.conn.recv()
            busy = status.get("step", 0) >= 1 and status.get("in_flight", 0) >= 0.9 * a.workers
            if busy and not probed and probe_at is None and now >= next_probe_check:
                next_probe_check = now + 0.5
                if self._fleet_generating(status):
                    probe_at = now + a.gen_median_s / 2  # half-way through their groups
            if probe_at is not None and now >= probe_at:
                self.controller.conn.send("snapshot")  # one with the fleet in flight
                probe_at, probed = None, True
            if now >= next_status:
                next_status = now + STATUS_EVERY_S
                for c in self.children:
                    c.sample()
                self._log_status(now - t0, status)

    def _fleet_generating(self, status: dict[str, Any]) -> bool:
        """Whether nine in ten workers hold the version the controller's groups need (so,
        with as many groups in flight, they are generating them)."""
        held = self.fleet.stats()["held"].get(str(status["version"]), 0)
        return held >= 0.9 * self.args.workers

    def _log_status(self, t: float, status: dict[str, Any]) -> None:
        s = self.fleet.stats()
        held = sorted(((int(k), v) for k, v in s["held"].items() if k != "None"), reverse=True)
        log.info(
            "%s t=%3.0fs | step %s v%s | %d workers live, holding %s | in flight %s, buffered "
            "%s, received %s, stale %s | %d preempted | %d replica(s) dead",
            self.label, t, status.get("step"), status.get("version"), s["live"],
            ", ".join(f"v{v}: {n}" for v, n in held[:3]), status.get("in_flight"),
            status.get("buffered"), status.get("received"), status.get("dropped_stale"),
            self.churn.events, len(self.dead_replicas),
        )  # fmt: skip

    def _stop(self) -> dict[str, Any]:
        """Stops the controller, waits for its last version to reach every live worker, then
        collects every process's report; the run's figures."""
        self.controller.conn.send("stop")
        final = None
        while final is None:
            kind, message = self.controller.recv(120)
            if kind == "closing":  # its pool waits for its polls: answered at once from now
                for h in self.fleet.hosts:
                    h.call("release")
            elif kind == "final":
                final = message
        stuck = [e["prompt_id"] for e in final["oldest_in_flight"]]
        found: dict[str, Any] = {}
        for h in self.fleet.hosts:
            found.update(h.call("find", stuck))
        for e in final["oldest_in_flight"]:
            e["at_workers"] = found.get(e["prompt_id"])
            e["history"] = found.get(f"{e['prompt_id']} history")
        latest = max(0, final["status"]["version"])
        waited = wait_for(
            lambda: all(k != "None" and int(k) >= latest for k in self.fleet.stats()["held"]),
            4 * self.bound0 + 60,
        )
        for c in self.children:
            c.sample()
        hosts = [h.call("stop", timeout_s=120) for h in self.fleet.hosts]
        self.trainer.conn.send(("stop", ()))
        trainer = self.trainer.recv(60)
        replicas = [c.call("stop") if c.proc.is_alive() else None for c in self.ps]
        return self._figures(final, hosts, trainer, replicas, waited)

    def _figures(
        self,
        final: dict[str, Any],
        host_reports: list[dict[str, Any]],
        trainer: dict[str, Any],
        replica_reports: list[dict[str, Any] | None],
        waited: float | None,
    ) -> dict[str, Any]:
        a = self.args
        workers: dict[str, dict[str, Any]] = {}
        for h in host_reports:
            workers.update(h["workers"])

        def alive_at(t: float) -> int:
            return self.replicas - sum(1 for when in self.dead_replicas.values() if when <= t)

        commits = {v: end for v, _, end in trainer["pushes"] if v > 0}
        versions = figures.reach(workers, commits, a.version_nbytes, a.egress_bytes, alive_at)
        first = figures.initial_broadcast(
            workers, self.initial, self.started, a.version_nbytes, a.egress_bytes, self.replicas
        )
        ratios = [v["ratio"] for v in versions if v["ratio"] is not None]
        trained = sum(t["groups"] for t in trainer["trained"])
        books = figures.accounting(
            host_reports, final, trained, figures.trained_prompt_ids(self.run_dir)
        )
        ps_rss = [
            max(c.peak_rss, (r or {}).get("maxrss", 0))
            for c, r in zip(self.ps, replica_reports, strict=True)
        ]
        host_rss = [
            max(c.peak_rss, r["maxrss"])
            for c, r in zip(self.fleet.hosts, host_reports, strict=True)
        ]
        return {
            "label": self.label,
            "replicas": self.replicas,
            "topology": self.topology,
            "workers": a.workers,
            "version_bytes": a.version_nbytes,
            "egress_bytes_per_s": a.egress_bytes,
            "seconds": final["seconds"],
            "steps": final["status"]["step"],
            "preempted": self.churn.events,
            "replica_killed": bool(self.dead_replicas),
            "first_version": first,
            "versions": versions,
            "reach_ratio_p50": figures.percentile(ratios, 50),
            "reach_ratio_max": max(ratios) if ratios else None,
            "every_worker_reached_every_version": waited is not None
            and all(v["missing"] == 0 for v in versions),
            "final_version_wait_s": waited,
            "calls": figures.call_figures(final["calls"], final["seconds"]),
            "at_workers": figures.worker_side(host_reports, final["seconds"]),
            "failed_calls": final["failed_calls"],
            "snapshots": figures.snapshot_figures(final["snapshots"]),
            "phases_s": final["phases"],
            "rss_bytes": {
                "ps_replica_max": max(ps_rss),
                "ps_replica_0": ps_rss[0],
                "controller": max(self.controller.peak_rss, final["maxrss"]),
                "trainer": max(self.trainer.peak_rss, trainer["maxrss"]),
                "worker_host_max": max(host_rss),
            },
            "cpu_s": {
                "controller": self.controller.cpu_s,
                "ps_replicas": sum(c.cpu_s for c in self.ps),
                "worker_hosts": sum(c.cpu_s for c in self.fleet.hosts),
                "trainer": self.trainer.cpu_s,
                "wall_s": time.monotonic() - self.started,
            },
            "accounting": books,
            "oldest_in_flight": final["oldest_in_flight"],
            "controller_error": final["error"],
        }


# --------------------------------------------------------------------------- the report
def _fmt(x: Any, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def report_lines(results: list[dict[str, Any]]) -> list[str]:
    """The figures of every run as a few tables."""
    mib = 1 << 20
    lines = ["", "## Version to every worker (bound: bytes x workers / (replicas x egress))"]
    lines.append(
        "| run | first version s / bound s (x) | later versions: reach p50 x, max x "
        "| versions | every worker reached |"
    )
    lines.append("| --- | --- | --- | --- | --- |")
    for r in results:
        f = r["first_version"]
        lines.append(
            f"| {r['label']} | {_fmt(f['reach_s'], 1)} / {_fmt(f['bound_s'], 1)} "
            f"({_fmt(f['ratio'])}) | {_fmt(r['reach_ratio_p50'])}, {_fmt(r['reach_ratio_max'])} "
            f"| {len(r['versions'])} | {r['every_worker_reached_every_version']} |"
        )
    lines += ["", "## The controller's calls (p50 / p99 ms, per second)"]
    lines.append(
        "| run | requests to workers | submit | reset | progress | results (no request) "
        "| a finished group's wait at its worker | requests the workers answered |"
    )
    lines.append("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        cells = []
        for kind in ("requests", "submit", "reset", "progress", "results"):
            c = r["calls"].get(kind)
            cells.append(
                "-"
                if not c or not c["count"]
                else f"{_fmt(c['p50_ms'], 1)} / {_fmt(c['p99_ms'], 1)}, {_fmt(c['per_s'], 0)}/s"
            )
        w = r["at_workers"]
        cells.append(
            f"{_fmt(w['wait_ms_p50'], 1)} / {_fmt(w['wait_ms_p99'], 1)} (before a poll came: "
            f"{_fmt(w['wait_for_poll_ms_p50'], 1)} / {_fmt(w['wait_for_poll_ms_p99'], 1)})"
        )
        cells.append(", ".join(f"{k} {v:.0f}/s" for k, v in w["requests_per_s"].items()))
        lines.append(f"| {r['label']} | " + " | ".join(cells) + " |")
    lines += ["", "## Snapshots, memory, steps"]
    lines.append(
        "| run | steps | snapshots with the fleet in flight: count, fewest groups, s p50 / max "
        "(asking max + writing max), fewest answered in time | write-ahead snapshots (the "
        "buffer): max s, MiB | peak RSS MiB: PS replica, controller, trainer | CPU s: "
        "controller, PS replicas, worker hosts; wall s |"
    )
    lines.append("| --- | --- | --- | --- | --- | --- |")
    for r in results:
        s, m, c = r["snapshots"], r["rss_bytes"], r["cpu_s"]
        f, a = s.get("fleet_in_flight") or {}, s.get("write_ahead") or {}
        answered = f.get("answered_min")
        lines.append(
            f"| {r['label']} | {r['steps']} | {f.get('count')}, {f.get('groups_min')}, "
            f"{_fmt(f.get('total_s_p50'))} / {_fmt(f.get('total_s_max'))} "
            f"({_fmt(f.get('gather_s_max'))} + {_fmt(f.get('write_s_max'))}), "
            f"{'-' if answered is None else f'{100 * answered:.0f}%'} | "
            f"{_fmt(a.get('total_s_max'))}, {_fmt((a.get('bytes_max') or 0) / mib, 1)} | "
            f"{m['ps_replica_max'] / mib:.0f}, {m['controller'] / mib:.0f}, "
            f"{m['trainer'] / mib:.0f} | {c['controller']:.0f}, {c['ps_replicas']:.0f}, "
            f"{c['worker_hosts']:.0f}; {c['wall_s']:.0f} |"
        )
    lines += ["", "## Every group generated, accounted for"]
    for r in results:
        a = r["accounting"]
        w = a["workers"]
        lines.append(
            f"- {r['label']}: generated {w['generated']}: handed over {w['popped']}, dropped by "
            f"resets {w['reset_results']}, lost with {r['preempted']} preempted workers "
            f"{w['preempted_results']}, held at the end {w['held_at_end']}; of those handed "
            f"over, {a['dropped_by_pool']} dropped by the controller's pool at resets and "
            f"{a['held_by_pool']} held by it at the end; received {a['received']} = "
            + " + ".join(f"{v} {k}" for k, v in a["outcome"].items())
            + f"; unfinished work lost and re-issued: {w['reset_unfinished']} at resets, "
            f"{w['preempted_unfinished']} with preempted workers. "
            + ("BALANCED" if a["balanced"] else "NOT BALANCED: " + json.dumps(a["checks"]))
        )
    return lines


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every configuration the arguments ask for; the figures with the machine's load."""
    before = _timing.machine_load(log, "before", settle_s=0)
    t0 = time.monotonic()
    results = []
    for replicas in args.replica_counts:
        for topology in args.topologies if replicas > 1 else ["star"]:
            results.append(Simulation(args, replicas, topology).run())
    after = _timing.machine_load(log, "after")
    return {
        "args": vars(args),
        "runs": results,
        "machine_load": [before, after],
        "wall_s": time.monotonic() - t0,
        "peak_rss_bytes": _timing.peak_rss_bytes(),
    }


def main(argv: list[str] | None = None) -> int:
    _timing.setup_logging()
    args = parse_args(argv)
    Child.log_level = logging.getLevelName(args.child_log_level.upper())
    out = run(args)
    lines = report_lines(out["runs"])
    mark = _timing.contended_mark(*out["machine_load"])
    lines.append("")
    lines.append(
        f"machine load: {_timing.describe_load(out['machine_load'][0])} before, "
        f"{_timing.describe_load(out['machine_load'][1])} after {mark}"
    )
    _timing.print_report(lines, out)
    _timing.write_json(args.out, out, log)
    ok = all(
        r["accounting"]["balanced"]
        and r["every_worker_reached_every_version"]
        and r["controller_error"] is None
        for r in out["runs"]
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
