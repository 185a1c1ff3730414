"""One host of a simulated multi-host trainer pushing to a parameter server (run as a script by
test_multihost_push.py).

``python multihost_pusher.py COORDINATOR PROCESS_ID URL OUT_DIR SCENARIO`` with RLAX_PS_TOKEN,
JAX_PLATFORMS=cpu and 4 forced host devices: two such processes join by ``jax.distributed``
(meeting at its coordination-service barriers, no device collective), build the global arrays
of ``expected(version)`` on an 8-device mesh (2 hosts x 4 devices) and push them with
``ParameterServerClient.push``. Scenarios:

- ``push``: both hosts push version 1.
- ``missing``: only host 0 pushes version 1 (host 1 never sends its part): its push must fail
  with PushAssemblyTimeoutError; then both hosts push version 2.

Each process writes ``OUT_DIR/p<PROCESS_ID>.json``: what each push did (seconds or the error).
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

CHUNK_BYTES = 1024  # several blocks per shard


def expected(version: int) -> dict[str, np.ndarray]:
    """The global arrays of ``version`` by name, the same in every process (bit for bit)."""
    rng = np.random.default_rng(version)

    def normal(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32)

    return {
        "embed": normal(32, 512),  # columns over fsdp, replicated across the hosts
        "head": normal(16, 32).astype(ml_dtypes.bfloat16),  # rows over hosts, columns over fsdp
        "layers.w_data": normal(16, 48),  # one half per host, replicated within each host
        "layers.w_rows": normal(64, 256),  # 8 ways over both hosts
        "norm": normal(40),  # replicated on every device
        "step": np.array(version, np.int32),  # a scalar, replicated
    }


def _partition_specs() -> dict:
    from jax.sharding import PartitionSpec as P

    return {
        "embed": P(None, "fsdp"),
        "head": P("data", "fsdp"),
        "layers.w_data": P("data"),
        "layers.w_rows": P(("data", "fsdp")),
        "norm": P(),
        "step": P(),
    }


def global_tree(version: int, mesh) -> dict:
    """``expected(version)`` as global jax.Arrays on ``mesh`` (each process builds only its
    addressable shards), nested as a trainer's parameters are."""
    import jax
    from jax.sharding import NamedSharding

    specs = _partition_specs()
    tree: dict = {}
    for name, value in expected(version).items():
        array = jax.make_array_from_callback(
            value.shape, NamedSharding(mesh, specs[name]), lambda index, v=value: v[index]
        )
        *path, leaf = name.split(".")
        node = tree
        for key in path:
            node = node.setdefault(key, {})
        node[leaf] = array
    return tree


def _push(client, version: int, mesh) -> dict:
    from rlax_tasks.paramserver import ParameterServerError

    t0 = time.perf_counter()
    try:
        client.push(version, global_tree(version, mesh))
    except ParameterServerError as e:
        return {"error": type(e).__name__, "message": str(e), "seconds": time.perf_counter() - t0}
    return {"error": None, "seconds": time.perf_counter() - t0}


def _barrier(name: str) -> None:
    """Waits until both processes get here, through the coordination service: a device
    collective (``multihost_utils.sync_global_devices``) hung about 1 run in 10 on XLA:CPU's gloo
    (the other process finished it and exited while this one was still connecting)."""
    from jax._src import distributed

    distributed.global_state.client.wait_at_barrier(name, 60_000)


def main(coordinator: str, process_id: int, url: str, out_dir: str, scenario: str) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator, num_processes=2, process_id=process_id
    )
    from jax.sharding import Mesh

    from rlax_tasks.paramserver import ParameterServerClient

    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "fsdp"))
    client = ParameterServerClient(url, chunk_bytes=CHUNK_BYTES, timeout_s=30.0)  # $RLAX_PS_TOKEN
    pushes: dict[str, dict] = {}
    if scenario == "push":
        pushes["1"] = _push(client, 1, mesh)
    elif scenario == "missing":
        if process_id == 0:  # host 1 never sends its part of version 1
            pushes["1"] = _push(client, 1, mesh)
        _barrier("version 1 given up")
        pushes["2"] = _push(client, 2, mesh)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    client.close()
    with open(os.path.join(out_dir, f"p{process_id}.json"), "w") as fh:
        json.dump({"process": jax.process_index(), "pushes": pushes}, fh)
    _barrier("done")
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
