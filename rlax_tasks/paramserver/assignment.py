"""Which replica serves which worker (docs/design.md §16): light to import, for the planner
(``plan/topology.py``) and for ``ReplicaClient``."""

from __future__ import annotations


def assign_replica(worker_index: int, replicas: int) -> int:
    """The home replica of the ``worker_index``-th worker of ``replicas``: round robin, so the
    counts differ by at most one.

    Args:
        worker_index: the worker's index in the run (worker-<i>), >= 0.
        replicas: how many replicas the run has, >= 1.

    Returns:
        The replica index in [0, replicas).
    """
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if worker_index < 0:
        raise ValueError(f"worker_index must be >= 0, got {worker_index}")
    return worker_index % replicas


def failover_order(home: int, replicas: int, worker_index: int = 0) -> list[int]:
    """Replica indices in the order a worker at ``home`` tries them: home, then the others
    cyclically, starting ``worker_index // replicas`` places further on, so that the workers
    of a dead replica spread evenly over the others rather than all onto the next one.

    Args:
        home: the worker's home replica (``assign_replica``).
        replicas: how many replicas the run has.
        worker_index: the worker's index in the run (0: plain cyclic order).

    Returns:
        Every replica index once, ``home`` first.
    """
    others = [(home + k) % replicas for k in range(1, replicas)]
    if others:
        turn = (worker_index // replicas) % len(others)
        others = others[turn:] + others[:turn]
    return [home, *others]
