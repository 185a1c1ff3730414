"""The fleet simulation's figures, from what its processes reported: how long each version took
to reach every worker against the link bound, the controller's calls per second and their
latency, snapshot size and time, memory, and the accounting of every group generated."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterable, Sequence
from typing import Any

from benchmarks._fleet.workers import Counts


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100, nearest rank) of ``values``; None for none."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def link_bound_s(nbytes: int, workers: int, replicas: int, egress: float) -> float:
    """The shortest time a version can reach ``workers`` through ``replicas`` links of
    ``egress`` bytes/s each: every worker's copy leaves some replica's link."""
    return nbytes * workers / (replicas * egress)


def reach(
    workers: dict[str, dict[str, Any]],
    commits: dict[int, float],
    version_bytes: int,
    egress: float,
    replicas_alive: Any,
) -> list[dict[str, Any]]:
    """Per version committed at replica 0 (``commits``: version -> when): the seconds until
    every worker that was up then holds it or a newer one (a worker preempted before it did is
    left out; one that joined later too), its median worker's, those that never did, and the
    bound for that many workers over the replicas alive then (``replicas_alive(t)``)."""
    out = []
    for version, committed in sorted(commits.items()):
        waits, missing, who = [], 0, []
        by_home: dict[int, list[float]] = {}
        for worker_id, w in workers.items():
            if w["joined"] > committed:
                continue
            got = next((t for v, t in w["arrivals"] if v >= version), None)
            if w["killed"] is not None and (got is None or got > w["killed"]):
                continue
            if got is None:
                missing += 1
                who.append(worker_id)
                continue
            waits.append(max(0.0, got - committed))
            by_home.setdefault(w["home"], []).append(waits[-1])
        alive = replicas_alive(committed)
        bound = link_bound_s(version_bytes, len(waits) + missing, alive, egress)
        worst = max(waits) if waits and not missing else None
        out.append(
            {
                "version": version,
                "workers": len(waits) + missing,
                "missing": missing,
                "missing_workers": who[:10],
                "replicas_alive": alive,
                "reach_s": worst,
                "median_s": percentile(waits, 50),
                "bound_s": bound,
                "ratio": None if worst is None else worst / bound,
                # the last worker of each home replica (a failed-over one counts at home)
                "reach_s_by_home": {str(h): max(v) for h, v in sorted(by_home.items())},
            }
        )
    return out


def initial_broadcast(
    workers: dict[str, dict[str, Any]],
    first: Iterable[str],
    started: float,
    version_bytes: int,
    egress: float,
    replicas: int,
) -> dict[str, Any]:
    """The first version to the workers ``first``, started at ``started`` and pulling at once
    (nothing else on the links)."""
    first = list(first)
    arrivals = [workers[w]["arrivals"][0][1] for w in first if workers[w]["arrivals"]]
    worst = max(arrivals) - started if arrivals and len(arrivals) == len(first) else None
    bound = link_bound_s(version_bytes, len(first), replicas, egress)
    by_home: dict[str, float] = {}
    for w in first:
        if workers[w]["arrivals"]:
            home = str(workers[w]["home"])
            wait = workers[w]["arrivals"][0][1] - started
            by_home[home] = max(by_home.get(home, 0.0), wait)
    return {
        "workers": len(first),
        "reach_s": worst,
        "bound_s": bound,
        "ratio": None if worst is None else worst / bound,
        "reach_s_by_home": dict(sorted(by_home.items())),
    }


def call_figures(calls: dict[str, list[float]], seconds: float) -> dict[str, dict[str, Any]]:
    """Per kind of pool call (and the requests to workers together: submit, reset, progress;
    results sends none, and progress_many, a snapshot's questions to every holder at once, is
    one call per snapshot, timed with it): count, per second, p50/p99/max in ms."""
    kinds = dict(calls)
    batches = ("results", "progress_many")
    kinds["requests"] = [x for k, v in calls.items() if k not in batches for x in v]
    out = {}
    for kind, values in kinds.items():
        ms = [1000 * v for v in values]
        out[kind] = {
            "count": len(ms),
            "per_s": len(ms) / seconds if seconds > 0 else None,
            "p50_ms": percentile(ms, 50),
            "p99_ms": percentile(ms, 99),
            "max_ms": max(ms) if ms else None,
        }
    return out


def worker_side(hosts: Iterable[dict[str, Any]], seconds: float) -> dict[str, Any]:
    """What the workers saw: requests per second by path, and how long each finished group
    waited at its worker until it was written to the controller (p50/p99/max in ms), and of
    that, before the controller's poll arrived."""
    hosts = list(hosts)
    requests: dict[str, int] = {}
    for h in hosts:
        for path, n in h["requests"].items():
            requests[path] = requests.get(path, 0) + n
    waits = [1000 * x for h in hosts for x in h["waits"]]
    for_poll = [1000 * x for h in hosts for x in h["waits_for_poll"]]
    return {
        "requests_per_s": {k: v / seconds for k, v in sorted(requests.items())},
        "wait_ms_p50": percentile(waits, 50),
        "wait_ms_p99": percentile(waits, 99),
        "wait_ms_max": max(waits) if waits else None,
        # of that wait, the part before the controller's long poll was there to take it
        "wait_for_poll_ms_p50": percentile(for_poll, 50),
        "wait_for_poll_ms_p99": percentile(for_poll, 99),
    }


def snapshot_figures(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The snapshots taken with the fleet in flight (at least 90% of the most groups any held):
    their count, groups, seconds (p50, max; asking the workers and writing the files, max) and
    the smallest share of workers that answered within the deadline; the write-ahead snapshots
    (the buffer before a step): their slowest seconds and largest bytes; every record."""
    if not records:
        return {"count": 0}
    keys = ("in_flight", "partial_rows", "buffered", "total_s", "gather_s", "write_s", "bytes",
            "asked", "answered")  # fmt: skip

    def pick(r: dict[str, Any]) -> dict[str, Any]:
        return {k: r.get(k) for k in keys}

    most = max(r["in_flight"] for r in records)
    fleet = [r for r in records if most and r["in_flight"] >= 0.9 * most]
    ahead = [r for r in records if r.get("pending")]
    shares = [r["answered"] / r["asked"] for r in fleet if r.get("asked")]
    return {
        "count": len(records),
        "fleet_in_flight": {
            "count": len(fleet),
            "groups_min": min((r["in_flight"] for r in fleet), default=None),
            "total_s_p50": percentile([r["total_s"] for r in fleet], 50),
            "total_s_max": max((r["total_s"] for r in fleet), default=None),
            "gather_s_max": max((r.get("gather_s") or 0.0 for r in fleet), default=None),
            "write_s_max": max((r.get("write_s") or 0.0 for r in fleet), default=None),
            "answered_min": min(shares, default=None),
        },
        "write_ahead": {
            "count": len(ahead),
            "total_s_max": max((r["total_s"] for r in ahead), default=None),
            "bytes_max": max((r.get("bytes") or 0 for r in ahead), default=None),
        },
        "total_s_p50": percentile([r["total_s"] for r in records], 50),
        "total_s_max": max(r["total_s"] for r in records),
        "all": [{**pick(r), "step": r.get("step"), "pending": r.get("pending")} for r in records],
    }


def trained_prompt_ids(run_dir: str) -> list[str]:
    """Every prompt id ``lineage.jsonl`` says was trained on (the controller's record)."""
    path = os.path.join(run_dir, "lineage.jsonl")
    if not os.path.exists(path):
        return []
    ids: list[str] = []
    with open(path) as f:
        for line in f:
            if line.strip():
                ids.extend(json.loads(line)["prompt_ids"])
    return ids


def accounting(
    hosts: Iterable[dict[str, Any]],
    controller: dict[str, Any],
    trained_by_trainer: int,
    lineage_ids: list[str],
) -> dict[str, Any]:
    """Every group the simulated workers generated, followed to where it went; ``balanced``
    when each identity holds (``checks``: name -> (left, right))."""
    keys = [f.name for f in dataclasses.fields(Counts) if f.name not in ("requests", "pulls")]
    sim = dict.fromkeys(keys, 0)
    undelivered = unfinished = 0
    for h in hosts:
        for k in keys:
            sim[k] += h["counts"][k]
        undelivered += h["undelivered"]
        unfinished += h["unfinished"]
    status = controller["status"]
    received, dropped_by_pool = controller["received"], controller["dropped_by_pool"]
    held_by_pool = controller["held_by_pool"]
    outcome = {
        "trained (trainer's count)": trained_by_trainer,
        "dropped stale": status.get("dropped_stale", 0),
        "dropped zero variance": status.get("dropped_zero_variance", 0),
        "ignored (re-issued elsewhere meanwhile)": status.get("ignored_results", 0),
        "buffered at the end": status.get("buffered", 0),
        "being scored at the end": status.get("scoring", 0),
    }
    checks = {
        "generated = handed over + dropped by resets + lost with preempted workers + "
        "held at the end": (
            sim["generated"],
            sim["popped"] + sim["reset_results"] + sim["preempted_results"] + undelivered,
        ),
        "handed over = written out whole + lost on the way": (
            sim["popped"],
            sim["delivered"] + sim["lost_in_transit"],
        ),
        "written out = received by the controller + dropped by its pool at a reset + held "
        "by its pool at the end": (sim["delivered"], received + dropped_by_pool + held_by_pool),
        "received = trained + dropped + ignored + buffered + being scored": (
            received,
            sum(outcome.values()),
        ),
        "trained: trainer's count = controller's count": (
            trained_by_trainer,
            status.get("trained_groups", 0),
        ),
        "trained: lineage's prompt ids, each once": (len(lineage_ids), len(set(lineage_ids))),
    }
    return {
        "workers": {**sim, "held_at_end": undelivered, "unfinished_at_end": unfinished},
        "received": received,
        "dropped_by_pool": dropped_by_pool,
        "held_by_pool": held_by_pool,
        "outcome": outcome,
        "reissued_prompts": status.get("reissued", 0),
        "worker_failures": status.get("worker_failures", 0),
        "checks": {k: list(v) for k, v in checks.items()},
        "balanced": all(a == b for a, b in checks.values()),
    }
