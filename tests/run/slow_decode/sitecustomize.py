"""Test shim, put on PYTHONPATH by tests/run/test_local_run.py: in a worker job, each decode
chunk is followed by a pause while the file named by RLAX_TEST_SLOW_DECODE exists, so that
generation, not training, is what every step waits for and each snapshot of the run finds the
workers' groups part-generated, however loaded the machine is."""

import os

_FLAG = os.environ.get("RLAX_TEST_SLOW_DECODE")
PAUSE_S = 0.25

if _FLAG and os.environ.get("RLAX_JOB_NAME", "").startswith("worker-"):
    import time

    from rlax_tasks.rollout.sampler import Sampler

    _step = Sampler.step

    def _slow_step(self):  # type: ignore[no-untyped-def]
        finished = _step(self)
        if os.path.exists(_FLAG):
            time.sleep(PAUSE_S)
        return finished

    Sampler.step = _slow_step
