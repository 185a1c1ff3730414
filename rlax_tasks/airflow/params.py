"""The DAGs' Params: rlax_train's form (``train_params``), the typed record its plan task reads
them into (``TrainParams``) and the one mapping of that record onto the run configuration
(``config_from_params``, docs/design.md §10); the choices the other DAGs' Params share.

The scheduler imports this module when it parses the DAGs: the run config loads inside
``config_from_params``, which runs in a task."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from airflow.sdk import Param

from rlax_tasks.airflow.settings import default_run_root
from rlax_tasks.plan.slices import RUNTIME_VERSION_PATTERN, PlanError
from rlax_tasks.plan.topology import WorkerSlices
from rlax_tasks.presets import preset_names
from rlax_tasks.utils.validation import did_you_mean

# docs/design.md §4 objective presets (tests/dags checks this against rlax_tasks.algorithms.config)
ALGORITHMS = (
    "grpo",
    "dapo",
    "dr_grpo",
    "rloo",
    "reinforce_seq",
    "reinforce_token",
    "reinforce_pp",
    "cispo",
    "gspo",
    "ppo",
)
# docs/design.md §11 dataset formats (tests/dags checks this against rlax_tasks.data.formats)
DATA_FORMATS = ("rlax", "gsm8k", "math", "dapo", "messages", "code", "columns")
# run ids double as Cloud label values (rlax-run-id) and directory names
RUN_ID_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,62}$"
PRESET = "preset"  # TrainParams.max_staleness: keep the preset's (the Param was not given)


def dag_run_run_id(dag_run_id: str) -> str:
    """An RLAX run id derived from an Airflow DAG run id (e.g. "manual__2025-...")."""
    text = re.sub(r"[^a-z0-9_-]+", "-", dag_run_id.lower()).strip("-_")
    return (text or "run")[:63]


@dataclasses.dataclass(frozen=True)
class TrainParams:
    """rlax_train's Params as its plan task reads them (a missing one: its default here).

    Args:
        preset: the run configuration preset.
        model_path: the base model; None: the preset's.
        algorithm: the objective preset; None: the preset's.
        reload_every: staleness j (workers reload when the PS is >= j versions ahead).
        max_staleness: staleness k (None: any; ``PRESET``: the preset's).
        accelerator_type: the trainer slice's type.
        runtime_version: its image; None: the family's default.
        capacity: spot, on-demand or reserved.
        service_account: the identity the TPU VMs run as; None: the default.
        network: the VPC network; None: the default.
        subnetwork: its subnetwork; None: the default.
        worker_accelerator_type: the workers' own slices' type; None: on the trainer slice.
        worker_slices: how many worker slices.
        num_workers: None: the preset's (or one per host of the worker slices).
        ps_replicas: parameter-server replicas (paramserver.replicas); None: the preset's.
        steps: training steps in total; None: the preset's trainer.total_steps.
        run_root: local directory or gs://; None: RLAX_RUN_ROOT.
        run_id: same id = resume that run; None: derived from the DAG run id.
        overrides: the run config's fields by dotted key (the user's own, applied first).
        allow_config_change: a resume may change training settings.
    """

    preset: str = "tiny-arith"
    model_path: str | None = None
    algorithm: str | None = None
    reload_every: int | None = None
    max_staleness: int | str | None = PRESET
    accelerator_type: str | None = "cpu"
    runtime_version: str | None = None
    capacity: str | None = "spot"
    service_account: str | None = None
    network: str | None = None
    subnetwork: str | None = None
    worker_accelerator_type: str | None = None
    worker_slices: int | None = 1
    num_workers: int | None = None
    ps_replicas: int | None = None
    steps: int | None = None
    run_root: str | None = None
    run_id: str | None = None
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    allow_config_change: bool = False

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> TrainParams:
        """The record of a DAG run's Params; PlanError names an unknown Param or bad overrides.

        Returns:
            The Params, each absent one at its default.
        """
        names = [f.name for f in dataclasses.fields(cls)]
        for key in params:
            if key not in names:
                raise PlanError(f"{key}: not a Param of rlax_train{did_you_mean(key, names)}")
        overrides = params.get("overrides") or {}
        if not isinstance(overrides, Mapping):
            raise PlanError(f"overrides: must be an object of dotted keys, got {overrides!r}")
        return cls(**{**params, "overrides": dict(overrides)})


def config_from_params(
    params: TrainParams,
    *,
    run_root: str,
    run_id: str,
    dataset: str = "",
    verifier: str = "math",
    workers: WorkerSlices | None = None,
) -> Any:
    """The run configuration ``params`` ask for: the preset with the ``overrides`` Param, then
    every other Param on its field (``dataset``: a curated file replacing the preset's datasets;
    ``workers``: the worker slices, one worker per host).

    Returns:
        The validated ``RunConfig``.

    Raises:
        PlanError: naming the Param whose value the configuration refuses ("run config: ..."
        for a field the ``overrides`` Param or the preset set).
    """
    from rlax_tasks.config import ConfigError, load_config  # in the task, never at parse time

    fields: dict[str, Any] = {"run_root": run_root, "run_id": run_id}
    by_param = {"run_root": "run_root", "run_id": "run_id", "preset": "preset"}

    def put(param: str, field: str, value: Any) -> None:
        fields[field] = value
        by_param[field] = param

    if params.model_path:
        put("model_path", "model.path", params.model_path)
        put("model_path", "model.warmup_if_missing", False)  # a given model is used as is
        put("model_path", "model.import_if_missing", None)
    if params.algorithm:
        put("algorithm", "algorithm.preset", params.algorithm)
    if params.reload_every is not None:
        put("reload_every", "staleness.reload_every", params.reload_every)
    if params.max_staleness != PRESET:
        put("max_staleness", "staleness.max_staleness", params.max_staleness)
    if workers is not None:
        count = workers.count * workers.hosts
        if params.num_workers not in (None, count):
            raise PlanError(
                f"num_workers: {params.num_workers} workers, but {workers.count} "
                f"worker_slices of {params.worker_accelerator_type} ({workers.hosts} host(s) "
                f"each) run {count}, one per host: leave num_workers empty or change "
                "worker_slices"
            )
        put("worker_slices", "workers.count", count)
        # each worker on every device of a host of its own slice, none of the trainer's
        put("worker_accelerator_type", "placement.separate_worker_hosts", True)
    elif params.num_workers:
        put("num_workers", "workers.count", params.num_workers)
    if params.ps_replicas is not None:
        put("ps_replicas", "paramserver.replicas", params.ps_replicas)
    if dataset:
        source = {"path": dataset, "verifier": verifier}  # the curated Asset's, not a Param
        fields["datasets"] = [{"name": "curated", "weight": 1.0, "source": source}]
    try:
        return load_config(params.preset, {**params.overrides, **fields})
    except ConfigError as e:
        param = by_param.get(e.field) or by_param.get(e.field.split("[")[0])
        if param is None:
            raise PlanError(f"run config: {e}") from None
        raise PlanError(str(e) if param == e.field else f"{param}: {e}") from None


def accelerator_type_param() -> Param:
    """The ``accelerator_type`` Param of a DAG whose job runs on one 1-host slice
    (``single_host_slice`` resolves it)."""
    return Param(
        "cpu", type="string", minLength=1,
        description="the job's slice: cpu on the local backend, a 1-host Cloud TPU type "
        "(e.g. v5litepod-1) on cloud_tpu (booting its family's default runtime)",
    )  # fmt: skip


def silence_param(default: int, unit: str) -> Param:
    """The Param that says which runs are active: a run whose status is older than this many
    ``unit`` (minutes, hours) is not (the janitor's grace, the nightly evaluation's window)."""
    return Param(
        default, type="integer", minimum=1,
        description=f"a run silent for this many {unit} is not active",
    )  # fmt: skip


def train_params() -> dict[str, Param]:
    """rlax_train's Params form: one Param per ``TrainParams`` field (tests/dags checks both)."""
    return {
        "preset": Param(
            "tiny-arith", type="string", enum=preset_names(),
            description="run configuration preset (rlax_tasks/presets)",
        ),
        "model_path": Param(
            None, type=["null", "string"],
            description="base model (HF directory, local or gs://); empty = the preset's",
        ),
        "algorithm": Param(
            None, type=["null", "string"], enum=[None, *ALGORITHMS],
            description="objective preset (docs/design.md §4); empty = the preset's",
        ),
        "reload_every": Param(
            1, type="integer", minimum=1, title="staleness j",
            description="workers reload when the PS is >= j versions ahead",
        ),
        "max_staleness": Param(
            1, type=["null", "integer"], minimum=1, title="staleness k",
            description="a rollout of version u trains version v only if v - u <= k (null: any)",
        ),
        "accelerator_type": Param(
            "cpu", type="string", minLength=1,
            description="slice accelerator: a Cloud TPU type on cloud_tpu (e.g. v5litepod-8), a "
            "Ray slice type on ray (cpu, gpu-8, 2xgpu-8: hosts x GPUs), cpu for the local backend",
        ),
        "runtime_version": Param(
            None, type=["null", "string"], pattern=RUNTIME_VERSION_PATTERN,
            description="TPU VM runtime version; empty = the accelerator family's default "
            "(cpu needs none)",
        ),
        "capacity": Param(
            "spot", type="string", enum=["spot", "on-demand", "reserved"],
            description="how the slices are bought: spot (reclaimable: the run resumes from "
            "its checkpoint), on-demand, or the project's reservation",
        ),
        "service_account": Param(
            None, type=["null", "string"],
            description="the service account the TPU VMs run as (email); empty = the default",
        ),
        "network": Param(
            None, type=["null", "string"], description="the VPC network; empty = the default"
        ),
        "subnetwork": Param(
            None, type=["null", "string"], description="its subnetwork; empty = the default"
        ),
        "worker_accelerator_type": Param(
            None, type=["null", "string"], minLength=1,
            description="workers on slices of their own, one worker per host (e.g. v5litepod-4, "
            "or gpu-4 on ray); empty = the workers run on the trainer slice",
        ),
        "worker_slices": Param(
            1, type="integer", minimum=1, maximum=64,
            description="how many worker slices (with worker_accelerator_type)",
        ),
        "num_workers": Param(
            None, type=["null", "integer"], minimum=1, maximum=256,
            description="empty = the preset's (or one per host of the worker slices)",
        ),
        "ps_replicas": Param(
            None, type=["null", "integer"], minimum=1, maximum=64,
            description="parameter-server replicas, workers spread over them (empty = the "
            "preset's, 1)",
        ),
        "steps": Param(20, type="integer", minimum=1, description="training steps in total"),
        "run_root": Param(
            default_run_root(), type="string", minLength=1,
            description="local directory or gs://bucket/prefix",
        ),
        "run_id": Param(
            None, type=["null", "string"], pattern=r"^([a-z0-9][a-z0-9_-]{0,62})?$",
            description="same id = resume that run; empty = derived from the DAG run id",
        ),
        "overrides": Param(
            {}, type="object",
            description='run-config overrides by dotted key, e.g. {"rollout.group_size": 4}',
        ),
        "allow_config_change": Param(
            False, type="boolean",
            description="resume this run_id with settings that change training (recorded in "
            "config_changes.jsonl); off: such a resume fails the plan, listing the fields",
        ),
    }  # fmt: skip
