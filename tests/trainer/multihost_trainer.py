"""One process of a simulated multi-host trainer (run as a script by test_multihost.py).

``python multihost_trainer.py RUN_DIR OUT.npz`` with RLAX_COORDINATOR_ADDRESS, RLAX_NUM_PROCESSES
and RLAX_PROCESS_ID set (or unset: a single process), JAX_PLATFORMS=cpu and forced host devices.
Trains 3 steps (checkpoint every 2), restores a fresh Trainer from the last checkpoint, trains a
4th step, and (process 0) writes the gathered parameters. The batches are mostly padding (32 rows
of 32, ~560 tokens), so the trainer packs them (``trainer.pack_sequences``): 24 rows.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from rlax_tasks.trainer.process_group import CommandChannel, ProcessGroup  # noqa: E402


def main(run_dir: str, out: str) -> None:
    group = ProcessGroup.from_env(int(os.environ.get("RLAX_NUM_PROCESSES") or 1))
    if group is not None:
        group.initialize()
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    from rlax_tasks.algorithms import make_objective
    from rlax_tasks.trainer import Trainer, TrainerConfig
    from tests.trainer.helpers import random_batch, tiny_policy

    def batch(step: int) -> dict:
        return random_batch(step, batch=32, seq_len=32, group_size=4)

    config = TrainerConfig(
        learning_rate=1e-3, warmup_steps=0, mesh_shape=(1, -1, 1), checkpoint_every=2
    )
    trainer = Trainer(tiny_policy(), make_objective("grpo"), config, run_dir)
    for step in range(3):
        trainer.step(batch(step))
    trainer.close()
    if group is not None:  # the command channel carries bytes in order to every host
        channel = CommandChannel(poll_s=5)
        for i in range(3):
            if group.is_leader:
                seq = channel.send({"op": "echo", "i": i}, bytes([i]) * (i * 1000))
            else:
                seq, command, payload = channel.receive()
                assert command == {"op": "echo", "i": i} and payload == bytes([i]) * (i * 1000)
            channel.done(seq)
    resumed = Trainer(tiny_policy(), make_objective("grpo"), config, run_dir)
    restored = resumed.restore_latest()
    assert restored is not None and restored.step == 2, restored
    resumed.step(batch(2))
    gathered = multihost_utils.process_allgather(resumed.params, tiled=True)
    leaves = jax.tree_util.tree_leaves_with_path(gathered)
    if jax.process_index() == 0:
        np.savez(out, **{jax.tree_util.keystr(k): np.asarray(v) for k, v in leaves})
    resumed.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
