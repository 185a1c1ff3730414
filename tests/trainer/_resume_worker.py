"""Subprocess of the checkpoint tests (run as a script; ``python _resume_worker.py MODE ...``).

resume RUN_DIR OUT.npz   -- new Trainer, restore_latest, 2 more steps, write params + cursor
die-mid-save DIR         -- one complete save, then SIGKILL itself while the next save is writing
"""

from __future__ import annotations

import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from rlax_tasks.algorithms import make_objective  # noqa: E402
from rlax_tasks.trainer import Checkpointer, Trainer, TrainerConfig  # noqa: E402
from tests.trainer.helpers import random_batch, tiny_policy  # noqa: E402

RESUME_CONFIG = dict(learning_rate=1e-3, warmup_steps=1, total_steps=10, mesh_shape=(1, 2, 2))


def resume(run_dir: str, out: str) -> None:
    trainer = Trainer(
        tiny_policy(), make_objective("grpo"), TrainerConfig(**RESUME_CONFIG), run_dir
    )
    restored = trainer.restore_latest()
    assert restored is not None
    for step in range(restored.step, restored.step + 2):
        trainer.step(random_batch(step))
    leaves = jax.tree_util.tree_leaves_with_path(trainer.params)
    arrays = {jax.tree_util.keystr(k): np.asarray(v) for k, v in leaves}
    arrays["__rng__"] = np.asarray(jax.random.key_data(trainer.rng))
    np.savez(out, **arrays)
    with open(out + ".json", "w") as fh:
        json.dump({"step": restored.step, "cursor": restored.data_cursor}, fh)
    trainer.close()


def die_mid_save(directory: str) -> None:
    ckpt = Checkpointer(directory, max_to_keep=5, async_save=True)
    rng = np.random.default_rng(0)
    small = {"w": jax.numpy.asarray(rng.standard_normal((64,), np.float32))}
    ckpt.save(1, small, {"step": 1})
    ckpt.wait()
    # large enough that the background write is still running when we die
    big = {"w": jax.numpy.asarray(rng.standard_normal((64 * 2**20,), np.float32))}
    ckpt.save(2, big, {"step": 2})
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "resume":
        resume(sys.argv[2], sys.argv[3])
    elif mode == "die-mid-save":
        die_mid_save(sys.argv[2])
    else:
        raise SystemExit(f"unknown mode {mode}")
