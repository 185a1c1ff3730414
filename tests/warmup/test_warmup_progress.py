"""The supervised warm-up logs steps done / total, rate, ETA and the loss while it trains."""

from __future__ import annotations

import logging
import re

from rlax_tasks.warmup import train_base_policy
from tests.warmup.test_base_model import SMALL  # its compiled step is kept: no second compile


def test_warmup_logs_every_step_with_its_loss(caplog):
    with caplog.at_level(logging.INFO, logger="rlax_tasks.warmup"):
        _, stats = train_base_policy(SMALL, log_every_s=0)
    n = SMALL.steps
    lines = [r.getMessage() for r in caplog.records]
    lines = [x for x in lines if re.match(r"warm-up: \d+/", x)]
    pattern = rf"warm-up: (\d+)/{n} steps \(\d+%\) \S+/s eta \S+ loss (\S+)$"
    steps = [re.match(pattern, x) for x in lines[:-1]]
    assert [int(m.group(1)) for m in steps] == list(range(1, n + 1))  # a line per step
    assert all(float(m.group(2)) > 0 for m in steps)
    final = re.match(rf"warm-up: {n}/{n} steps done in \S+ \(\S+/s\) loss (\S+)$", lines[-1])
    assert final and float(final.group(1)) == float(f"{stats.final_loss:.4g}")
