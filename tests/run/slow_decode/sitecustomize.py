"""Test shim, put on PYTHONPATH by tests/run/test_local_run.py, acting in worker jobs only:
- while the file named by RLAX_TEST_SLOW_DECODE exists, each decode chunk is followed by a
  pause, so generation, not training, is what every step waits for and each snapshot of the
  run finds the workers' groups part-generated, however loaded the machine is;
- while the file named by RLAX_TEST_FREEZE_FILE exists, the worker RLAX_TEST_FREEZE_WORKER
  stops decoding once it has reported part-generated groups to a snapshot (it still answers),
  so what that snapshot holds of its groups is what they hold when it is killed."""

import os

PAUSE_S = 0.25

_job = os.environ.get("RLAX_JOB_NAME", "")
_slow = os.environ.get("RLAX_TEST_SLOW_DECODE")
_freeze = os.environ.get("RLAX_TEST_FREEZE_FILE")
if _job != os.environ.get("RLAX_TEST_FREEZE_WORKER"):
    _freeze = None

if (_slow or _freeze) and _job.startswith("worker-"):
    import time

    from rlax_tasks.rollout.sampler import Sampler
    from rlax_tasks.rollout.worker import InferenceWorker

    _step, _answer = Sampler.step, InferenceWorker._answer_progress
    _frozen = False

    def _test_answer(self):  # type: ignore[no-untyped-def]
        global _frozen
        asked = bool(self._progress_calls)
        holds = any(p.tokens for p in self.sampler.in_progress())
        _answer(self)
        if _freeze and asked and holds and os.path.exists(_freeze):
            _frozen = True

    def _test_step(self):  # type: ignore[no-untyped-def]
        if _frozen and os.path.exists(_freeze):
            time.sleep(0.01)
            return []
        finished = _step(self)
        if _slow and os.path.exists(_slow):
            time.sleep(PAUSE_S)
        return finished

    Sampler.step = _test_step
    InferenceWorker._answer_progress = _test_answer
