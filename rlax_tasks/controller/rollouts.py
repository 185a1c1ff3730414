"""``rollouts/step-<step>.parquet``: one row per completion a training step used (docs/design.md
§7).

Each row holds the prompt and group, the generating version, tokens, behaviour log-probs, the
verifier's score and verdict and the shaped reward. Written whole after the trainer applied the
step; a replayed step rewrites the same file, so a crash leaves no partial or duplicate file."""

from __future__ import annotations

import functools
import io
import json
from collections.abc import Mapping
from importlib import metadata
from typing import Any

from rlax_tasks.controller.buffer import (
    Batch,
    ScoredGroup,
    support_lists,
    support_tuples,
    version_tuple,
)
from rlax_tasks.rollout.routes import RoutedExperts
from rlax_tasks.rundir import storage
from rlax_tasks.rundir.paths import run_paths


def rollouts_dir(run_dir: str) -> str:
    """run_dir/rollouts."""
    return run_paths(run_dir).rollouts


def step_path(run_dir: str, step: int) -> str:
    """Where the rollouts of training step ``step`` live."""
    return storage.join(rollouts_dir(run_dir), f"step-{step:08d}.parquet")


@functools.cache
def verifier_version() -> str:
    """The version of the scoring code (the installed rlax-tasks distribution)."""
    try:
        return metadata.version("rlax-tasks")
    except metadata.PackageNotFoundError:
        return "unknown"


@functools.cache
def schema() -> Any:
    """The pyarrow schema of a rollouts file: its columns, in order, with their types."""
    import pyarrow as pa  # (pyarrow loads on first use, not at start-up)

    return pa.schema(
        [
            ("step", pa.int64()),
            ("prompt_id", pa.string()),
            ("dataset", pa.string()),
            ("group_id", pa.int32()),
            ("sample", pa.int32()),
            ("seq", pa.int64()),
            ("weight_version", pa.int64()),
            ("prompt_tokens", pa.list_(pa.int32())),
            ("tokens", pa.list_(pa.int32())),
            ("behavior_logprobs", pa.list_(pa.float32())),
            ("finish_reason", pa.string()),
            ("score", pa.float32()),
            ("verdict", pa.string()),
            ("reward", pa.float32()),
            ("verifier", pa.string()),
            ("verifier_version", pa.string()),
            # per token, the ids the sampler's top-k/top-p kept (null: not recorded)
            ("support", pa.list_(pa.list_(pa.int32()))),
            # per token, the weight version it was sampled with (null: not recorded);
            # weight_version is the oldest of the group's
            ("token_versions", pa.list_(pa.int64())),
            # how many of its first tokens were resumed from a partial rollout (a snapshot's,
            # a failed worker's last report) rather than generated again
            ("resumed_tokens", pa.int32()),
            # a mixture-of-experts sampler's experts per token and layer: int16 bytes of
            # [tokens, layers, k] (docs/design.md §14), and its [layers, k] (null: not recorded)
            ("routed_experts", pa.binary()),
            ("routed_experts_shape", pa.list_(pa.int32())),
            # an episode's (docs/design.md §15): 1 where a token trains (the model's), 0 for
            # observations (null: every token trains); its counters as JSON
            ("loss_mask", pa.list_(pa.int8())),
            ("episode", pa.string()),
        ]
    )


def rollout_rows(step: int, batch: Batch, verifiers: Mapping[str, str]) -> dict[str, list]:
    """Columns of the step's rows; ``verifiers`` maps a dataset name to its verifier kind."""
    cols: dict[str, list] = {name: [] for name in schema().names}
    for gid, g in enumerate(batch.groups):
        dataset = g.prompt_id.split("/", 1)[0]
        for i in range(g.group_size):
            cols["step"].append(step)
            cols["prompt_id"].append(g.prompt_id)
            cols["dataset"].append(dataset)
            cols["group_id"].append(gid)
            cols["sample"].append(i)
            cols["seq"].append(g.seq)
            cols["weight_version"].append(g.version)
            cols["prompt_tokens"].append(list(g.prompt_tokens))
            cols["tokens"].append(list(g.completions[i]))
            cols["behavior_logprobs"].append(list(g.logprobs[i]))
            cols["finish_reason"].append(g.finish_reasons[i])
            cols["score"].append(g.scores[i])
            cols["verdict"].append(g.verdicts[i] if g.verdicts else None)
            cols["reward"].append(g.rewards[i])
            cols["verifier"].append(verifiers.get(dataset, "unknown"))
            cols["verifier_version"].append(verifier_version())
            cols["support"].append(support_lists(g.support[i]) if g.support else None)
            versions = g.token_versions[i] if g.token_versions else None
            cols["token_versions"].append(None if versions is None else list(versions))
            cols["resumed_tokens"].append(g.resumed[i] if g.resumed else 0)
            routes = g.routed_experts[i] if g.routed_experts else None
            cols["routed_experts"].append(None if routes is None else routes.data)
            cols["routed_experts_shape"].append(None if routes is None else list(routes.shape[1:]))
            loss_mask = g.loss_masks[i] if g.loss_masks else None
            cols["loss_mask"].append(None if loss_mask is None else list(loss_mask))
            episode = g.episodes[i] if g.episodes else None
            cols["episode"].append(None if episode is None else json.dumps(dict(episode)))
    return cols


def write_step(run_dir: str, step: int, batch: Batch, verifiers: Mapping[str, str]) -> str:
    """Writes (or rewrites) ``rollouts/step-<step>.parquet``; returns its path."""
    import pyarrow as pa  # (pyarrow loads on first use, not at start-up)
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.table(rollout_rows(step, batch, verifiers), schema=schema()), buf)
    path = step_path(run_dir, step)
    storage.write_bytes(path, buf.getvalue())
    return path


def read_step_batch(run_dir: str, step: int) -> Batch:
    """The batch training step ``step`` trained on, rebuilt from its rollouts file.

    Its ``arrays()`` equal those the trainer received (tokens, float32 log-probs and rewards).
    """
    import pyarrow.parquet as pq  # (pyarrow loads on first use, not at start-up)

    path = step_path(run_dir, step)
    if not storage.exists(path):
        raise FileNotFoundError(
            f"cannot give the trainer step {step} again: {path} is missing (the trainer's "
            "checkpoints are older than the rollouts this run kept)"
        )
    cols = pq.read_table(io.BytesIO(storage.read_bytes(path))).to_pydict()
    rows: dict[int, list[int]] = {}
    for i, gid in enumerate(cols["group_id"]):
        rows.setdefault(gid, []).append(i)
    groups = []
    for gid in sorted(rows):
        idx = sorted(rows[gid], key=lambda i: cols["sample"][i])
        first = idx[0]
        groups.append(
            ScoredGroup(
                prompt_id=cols["prompt_id"][first],
                seq=cols["seq"][first],
                version=cols["weight_version"][first],
                prompt_tokens=tuple(cols["prompt_tokens"][first]),
                completions=tuple(tuple(cols["tokens"][i]) for i in idx),
                logprobs=tuple(tuple(cols["behavior_logprobs"][i]) for i in idx),
                finish_reasons=tuple(cols["finish_reason"][i] for i in idx),
                scores=tuple(cols["score"][i] for i in idx),
                rewards=tuple(cols["reward"][i] for i in idx),
                verdicts=tuple(cols["verdict"][i] or "" for i in idx)
                if "verdict" in cols and any(cols["verdict"][i] for i in idx)
                else (),
                support=tuple(support_tuples(cols["support"][i]) for i in idx)
                if "support" in cols and any(cols["support"][i] is not None for i in idx)
                else (),
                token_versions=tuple(version_tuple(cols["token_versions"][i]) for i in idx)
                if "token_versions" in cols
                and any(cols["token_versions"][i] is not None for i in idx)
                else (),
                resumed=tuple(cols["resumed_tokens"][i] for i in idx)
                if "resumed_tokens" in cols and any(cols["resumed_tokens"][i] for i in idx)
                else (),
                routed_experts=tuple(_routes(cols, i) for i in idx)
                if "routed_experts" in cols
                and any(cols["routed_experts"][i] is not None for i in idx)
                else (),
                loss_masks=tuple(
                    None if cols["loss_mask"][i] is None else tuple(cols["loss_mask"][i])
                    for i in idx
                )
                if "loss_mask" in cols and any(cols["loss_mask"][i] is not None for i in idx)
                else (),
                episodes=tuple(
                    None if cols["episode"][i] is None else json.loads(cols["episode"][i])
                    for i in idx
                )
                if "episode" in cols and any(cols["episode"][i] is not None for i in idx)
                else (),
            )
        )
    return Batch(step, tuple(groups))


def _routes(cols: dict[str, list], i: int) -> RoutedExperts | None:
    """Row ``i``'s recorded experts from their bytes and [layers, k] (None: not recorded)."""
    data = cols["routed_experts"][i]
    if data is None:
        return None
    layers, k = cols["routed_experts_shape"][i]
    return RoutedExperts((len(cols["tokens"][i]), layers, k), data)


def read_rollouts(run_dir: str) -> Any:
    """Every step's rollouts as one pandas DataFrame, in step order (empty when none)."""
    import pandas as pd  # (pandas and pyarrow load on first use, not at start-up)
    import pyarrow.parquet as pq

    paths = [  # step-<step>.parquet sorts by step; a writer's temp file starts with ".tmp-"
        p
        for p in storage.list_prefix(rollouts_dir(run_dir))
        if p.rsplit("/", 1)[-1].startswith("step-") and p.endswith(".parquet")
    ]
    frames = [pq.read_table(io.BytesIO(storage.read_bytes(p))).to_pandas() for p in paths]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
