"""Where the controller's time goes: seconds per phase, per cycle (one ``train_step`` call to
the next) and over the run. A cycle's figures travel with the batch sent at its end as
``Batch.timings`` (``time_<phase>_s``, ``time_other_s`` for time in no phase, ``time_cycle_s``),
so the train, lineage and rollouts times in step s's metrics row are those of step s - 1."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

# the timed phases, in the order of a cycle; wait = time outside ``Controller.iterate()``
PHASES = (
    "wait",
    "dispatch",
    "collect",
    "score",
    "batch",
    "snapshot",
    "train",
    "lineage",
    "rollouts",
)


class PhaseClock:
    """Adds clock time to phases; ``end_cycle()`` hands out the cycle's figures."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.totals: dict[str, float] = dict.fromkeys(PHASES, 0.0)  # over the whole run
        self._phases: dict[str, float] = dict.fromkeys(PHASES, 0.0)  # since the last step
        self.cycle_start: float | None = None  # clock when the last step was sent

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Adds the clock time of the ``with`` block to ``phase``."""
        t0 = self.clock()
        try:
            yield
        finally:
            self.add(phase, self.clock() - t0)

    def add(self, phase: str, seconds: float) -> None:
        seconds = max(0.0, seconds)
        self._phases[phase] += seconds
        self.totals[phase] += seconds

    def end_cycle(self) -> dict[str, float]:
        """The seconds per phase since the previous step was sent, as ``time_<phase>_s``
        metrics plus ``time_other_s`` (in no phase) and ``time_cycle_s`` (all); starts the
        next cycle now."""
        now = self.clock()
        cycle = 0.0 if self.cycle_start is None else max(0.0, now - self.cycle_start)
        out = {f"time_{p}_s": s for p, s in self._phases.items()}
        out["time_other_s"] = max(0.0, cycle - sum(self._phases.values()))
        out["time_cycle_s"] = cycle
        self._phases = dict.fromkeys(PHASES, 0.0)
        self.cycle_start = now
        return out
