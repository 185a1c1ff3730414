"""The memory plan of a run: bytes per device of every job, from the config and the model's shapes.

``memory_plan(cfg)`` is what ``rlax run --dry-run`` prints and what both launchers check before
anything starts (``rlax run`` and the rlax_train DAG's ``plan`` refuse a plan that does not fit
the accelerator named in ``placement.accelerator``). ``ps_retention`` is the parameter server's
``--keep-versions`` / ``--keep-bytes`` for both launchers.

``slice_memory_plan(cfg, accelerator_type, worker_accelerator_type)`` is the same plan with the
jobs on Cloud TPU slices, whatever ``placement`` says (the trainer over every chip of the
``accelerator_type`` slice, each worker on one host of a ``worker_accelerator_type`` slice, each
job against its family's HBM per chip): a model that cannot fit the slices is refused before
they are provisioned. ``slice_fit_error(plan)`` says why in one line, led by the Param to change.

Notation: P parameters; L layers, h hidden, f intermediate, a heads, kv key/value heads, d head
dim, V vocabulary; bp, bc bytes of model.param_dtype (master weights) and model.dtype (compute,
what workers and the PS hold); a job's mesh (data, fsdp, tensor) over its devices. An axis that
does not divide a dimension replicates it (rlax_tasks.models.sharding.fit_spec): t_a, t_kv, t_f,
t_V are tensor if it divides a, kv, f, V, else 1.

Trainer, per device (shards = fsdp × tensor):
  params P·bp/shards; reference (a KL term, held in the compute dtype) P·bc/shards; Adam
  moments 2·P·bp/shards;
  gradients P·4/shards (float32), twice when micro-batches accumulate (the running sum and the
  micro-batch's own); activations of one micro-batch: s sequences per device (micro_batch_size,
  else the batch, over data × fsdp; all of it when that does not divide) of T = workers.max_len:
    one layer, everything kept:  A = bc·T·(4h + 2a·d/t_a + 2kv·d/t_kv + 4f/t_f)
                                     + (a/t_a)·S·(4 + bc)   (causal scores f32 + probs,
                                       S = min(T², T·(T+128)/2): 128-query blocks)
    remat none: s·L·A;  dots (matmul outputs kept): s·(L·bc·T·(3h + a·d/t_a + 2kv·d/t_kv
    + 2f/t_f) + A);  full (layer inputs kept): s·(L·bc·T·h + A)   (+A: the layer recomputed)
  logits: s·c·(V/t_V)·4·3 (c = min(trainer.logprob_chunk_size, T): f32 logits, softmax, grad),
  plus s·T·(V/t_V)·4 when the micro-batch's logits (micro·T·V·4) fit trainer.keep_logits_mb
  (kept from the forward for the backward; unset: 1 GiB on a CPU, none on accelerators).
  Packed sequences (trainer.pack_sequences) hold at most the padded batch's tokens, in rows T
  wide (32 when T < 32): the same bound.
Worker, per device:
  weights P·bc/(fsdp·tensor), plus one array while a new version is swapped in (reload: the swap
  frees each old array before placing its replacement; the largest array is the embedding or
  a stacked MLP kernel, max(V·h, L·h·f)·bc/(fsdp·tensor));
  KV cache slots·max_len·L·2·kv·d·bc / (data·fsdp (slots, when it divides them) · t_kv);
  logits (slots/(data·fsdp))·(V/t_V)·4·2 (float32 logits and sampling probabilities).
Parameter server, host RAM: a version is P·bc; keep_bytes = PS_RAM_FRACTION of the host's RAM
(placement.host_memory, else this machine's); keep_versions = max(2, min(k + 2, keep_bytes //
version − 1)): keep_bytes also counts the push in flight, hence the − 1; k =
staleness.max_staleness (reload_every when unbounded). The PS needs keep_bytes ≥ 2 versions
(the newest and a push): below that the plan does not fit.
Usable per device: gpu = XLA_PYTHON_CLIENT_MEM_FRACTION × memory; tpu = the chip's HBM; cpu =
the host's RAM for every job together (not refused, only flagged). XLA's temporaries and the
prefill of the samplers are not counted: keep some headroom.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

from rlax_tasks.compute.devices import GiB
from rlax_tasks.run.placement import (
    ACCELERATORS,
    COLOCATED,
    CPU_JOBS,
    describe,
    describe_devices,
    format_bytes,
    gpu_memory_fraction,
    host_memory,
    is_colocated,
    job_devices,
    job_mesh,
    job_names,
    resolve_mesh,
)
from rlax_tasks.rundir import storage
from rlax_tasks.trainer.config import keep_logits_mb

# share of a host's RAM the parameter server may keep versions in
PS_RAM_FRACTION = 0.25
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
ATTENTION_BLOCK = 128  # rlax_tasks.models.attention.ATTENTION_BLOCK (no JAX import here)

# Shapes of well-known models (their public config.json), for a model.path that cannot be read
# here (gs:// without network): keyed by the path's last component, lower case.
KNOWN_MODELS: dict[str, dict[str, Any]] = {
    "qwen2.5-math-1.5b": {
        "model_type": "qwen2", "hidden_size": 1536, "intermediate_size": 8960,
        "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
        "vocab_size": 151936, "tie_word_embeddings": True, "max_position_embeddings": 4096,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
    },
    "qwq-32b": {
        "model_type": "qwen2", "hidden_size": 5120, "intermediate_size": 27648,
        "num_hidden_layers": 64, "num_attention_heads": 40, "num_key_value_heads": 8,
        "vocab_size": 152064, "tie_word_embeddings": False, "max_position_embeddings": 40960,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-5,
    },
}  # fmt: skip
TRAINER_KINDS = ("params", "reference", "adam", "grads", "activations")
WORKER_KINDS = ("weights", "reload", "kv_cache")
KINDS = (*TRAINER_KINDS, *WORKER_KINDS, "logits")


class PlanDoesNotFit(ValueError):
    """The run's memory plan does not fit its devices; the message says which job, how much it
    needs and has, and what to change."""


# --------------------------------------------------------------------------- the model
def resolve_model(
    cfg: Any, model_config: str | None = None, offline: bool = True
) -> tuple[Any, str]:
    """(ModelConfig, where its shapes came from) for ``cfg.model.path``.

    In order: ``model_config`` (a config.json or an HF directory), the local model directory,
    the warm-up recipe (``model.warmup_if_missing`` and not built yet), the shapes of a
    well-known model named by the path's last component, and (``offline=False``) the
    config.json of a gs:// model. ValueError naming model.path when none applies.
    """
    from rlax_tasks.models.config import ModelConfig, ModelConfigError
    from rlax_tasks.models.hf_io import CheckpointError, read_hf_config

    def build(raw: dict[str, Any], source: str) -> tuple[Any, str]:
        try:
            return ModelConfig.from_hf_dict(raw), source
        except ModelConfigError as e:
            raise ValueError(f"{source}: {e}") from None

    if model_config:
        if os.path.isdir(model_config):
            return build(read_hf_config(model_config), f"config.json in {model_config}")
        with open(model_config, encoding="utf-8") as f:
            return build(json.load(f), model_config)
    path = cfg.model.path
    if not storage.is_gcs(path) and os.path.exists(os.path.join(path, "config.json")):
        try:
            return build(read_hf_config(path), f"config.json in {path}")
        except CheckpointError as e:
            raise ValueError(f"model.path: {e}") from None
    if cfg.model.warmup_if_missing and not storage.is_gcs(path):
        from rlax_tasks.warmup import WarmupRecipe

        return WarmupRecipe().model_config(), "the warm-up recipe (the model is not built yet)"
    name = path.rstrip("/").rsplit("/", 1)[-1]
    if name.lower() in KNOWN_MODELS:
        return build(
            KNOWN_MODELS[name.lower()],
            f"the known shapes of {name} (config.json at {path} not read)",
        )
    if storage.is_gcs(path) and not offline:
        try:
            raw = json.loads(storage.read_bytes(storage.join(path, "config.json")))
        except (FileNotFoundError, ValueError) as e:
            raise ValueError(f"model.path: cannot read {path}/config.json: {e}") from None
        return build(raw, f"config.json in {path}")
    where = "cannot be read here (no network)" if storage.is_gcs(path) else "does not exist"
    raise ValueError(
        f"model.path: {path}/config.json {where}, and the memory plan needs the model's shapes: "
        f"give its config.json (rlax run --dry-run --model-config PATH), or name a known model "
        f"directory ({', '.join(sorted(KNOWN_MODELS))})"
    )


# --------------------------------------------------------------------------- parameter server
@dataclasses.dataclass(frozen=True)
class PsRetention:
    """What the parameter server keeps: ``--keep-versions`` and ``--keep-bytes``."""

    version_bytes: int
    wanted: int  # k + 2
    keep_versions: int
    keep_bytes: int
    host_memory: int
    host_source: str

    @property
    def fits(self) -> bool:
        """keep_bytes holds the newest version and a push (the PS refuses less)."""
        return 2 * self.version_bytes <= self.keep_bytes

    @property
    def roomy(self) -> bool:
        """keep_versions and a push in flight fit together: a push never waits for room."""
        return (self.keep_versions + 1) * self.version_bytes <= self.keep_bytes

    def argv(self) -> list[str]:
        return ["--keep-versions", str(self.keep_versions), "--keep-bytes", str(self.keep_bytes)]


def ps_retention(cfg: Any, model: Any) -> PsRetention:
    """keep_bytes = the budget, a stated share (PS_RAM_FRACTION) of the host's RAM
    (placement.host_memory, else this machine's); keep_versions = max(2, min(k + 2, versions
    that fit beside a push in flight))."""
    version = model.num_parameters() * DTYPE_BYTES[cfg.model.dtype]
    host = cfg.placement.host_memory
    source = "placement.host_memory"
    if host is None:
        host, source = host_memory(), "this machine's RAM"
    budget = int(host * PS_RAM_FRACTION)
    s = cfg.staleness
    wanted = (s.max_staleness if s.max_staleness is not None else s.reload_every) + 2
    keep = max(2, min(wanted, budget // max(version, 1) - 1))
    return PsRetention(version, wanted, keep, budget, host, source)


# --------------------------------------------------------------------------- per job
def _split(n: int, axis: int) -> int:
    """The mesh axis size that shards a dimension of n (fit_spec: 1 when it does not divide)."""
    return axis if n % axis == 0 else 1


def _mesh_or_single(cfg: Any, job: str) -> tuple[tuple[int, int, int], bool]:
    """The job's resolved mesh, or its mesh with -1 as 1 when its device count is unknown."""
    mesh = job_mesh(cfg, job)
    if mesh is not None:
        return mesh, True
    shape = cfg.trainer.mesh_shape if job in ("trainer", COLOCATED) else cfg.workers.mesh_shape
    d, f, t = (1 if s == -1 else s for s in shape)
    return (d, f, t), False


def layer_activations(m: Any, tokens: int, bc: int, tensor: int) -> int:
    """Bytes one sequence of ``tokens`` keeps for one layer without remat (A above)."""
    h, f, a, kv, d = (
        m.hidden_size, m.intermediate_size, m.num_attention_heads, m.num_key_value_heads,
        m.head_dim,
    )  # fmt: skip
    t_a, t_kv, t_f = _split(a, tensor), _split(kv, tensor), _split(f, tensor)
    per_token = bc * (4 * h + 2 * a * d // t_a + 2 * kv * d // t_kv + 4 * f // t_f)
    scores = min(tokens * tokens, tokens * (tokens + ATTENTION_BLOCK) // 2)
    return tokens * per_token + (a // t_a) * scores * (4 + bc)


def trainer_bytes(cfg: Any, m: Any) -> tuple[dict[str, int], str]:
    """Bytes per trainer device by kind, and a note on the activation terms."""
    (data, fsdp, tensor), _ = _mesh_or_single(cfg, "trainer")
    shards = fsdp * tensor
    n_params = m.num_parameters()
    bp, bc = DTYPE_BYTES[cfg.model.param_dtype], DTYPE_BYTES[cfg.model.dtype]
    t = cfg.trainer
    batch = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    micro = t.micro_batch_size or batch
    seqs = micro // (data * fsdp) if micro % (data * fsdp) == 0 else micro
    tokens = cfg.workers.max_len
    a_layer = layer_activations(m, tokens, bc, tensor)
    h, f, a, kv, d, layers = (
        m.hidden_size, m.intermediate_size, m.num_attention_heads, m.num_key_value_heads,
        m.head_dim, m.num_hidden_layers,
    )  # fmt: skip
    if t.remat == "none":
        per_seq = layers * a_layer
    elif t.remat == "dots":
        kept = 3 * h + a * d // _split(a, tensor) + 2 * kv * d // _split(kv, tensor)
        kept += 2 * f // _split(f, tensor)
        per_seq = layers * bc * tokens * kept + a_layer
    else:
        per_seq = layers * bc * tokens * h + a_layer
    chunk = min(t.logprob_chunk_size, tokens)
    vocab = m.vocab_size // _split(m.vocab_size, tensor)
    budget = keep_logits_mb(t.keep_logits_mb, cfg.placement.platform) << 20
    kept = seqs * tokens * vocab * 4 if micro * tokens * m.vocab_size * 4 <= budget else 0
    parts = {
        "params": n_params * bp // shards,
        "reference": n_params * bc // shards if cfg.objective_config().needs_reference else 0,
        "adam": 2 * n_params * bp // shards,
        "grads": n_params * 4 // shards * (2 if micro < batch else 1),
        "activations": seqs * per_seq,
        "logits": seqs * chunk * vocab * 4 * 3 + kept,
    }
    note = (
        f"trainer: {seqs} sequence(s) × {tokens} tokens per device (micro-batch {micro} over "
        f"data×fsdp {data * fsdp}), remat {t.remat}"
    )
    return parts, note


def worker_bytes(cfg: Any, m: Any, job: str) -> tuple[dict[str, int], str]:
    """Bytes per device of one worker by kind, and a note on its KV-cache split."""
    if job == COLOCATED:  # the sampler: workers.mesh_shape over the trainer's devices
        devices = job_devices(cfg, job)
        if devices is not None:
            data, fsdp, tensor = resolve_mesh(cfg.workers.mesh_shape, len(devices))
        else:
            data, fsdp, tensor = (1 if s == -1 else s for s in cfg.workers.mesh_shape)
    else:
        (data, fsdp, tensor), _ = _mesh_or_single(cfg, job)
    w = cfg.workers
    bc = DTYPE_BYTES[cfg.model.dtype]
    batch_shards = _split(w.slots, data * fsdp)
    kv_shards = _split(m.num_key_value_heads, tensor)
    weights = m.num_parameters() * bc // (fsdp * tensor)
    layers_mlp = m.num_hidden_layers * m.hidden_size * m.intermediate_size
    cache = w.slots * w.max_len * m.num_hidden_layers * 2 * m.num_key_value_heads * m.head_dim
    vocab = m.vocab_size // _split(m.vocab_size, tensor)
    parts = {
        "weights": weights,
        "reload": max(m.vocab_size * m.hidden_size, layers_mlp) * bc // (fsdp * tensor),
        "kv_cache": cache * bc // (batch_shards * kv_shards),
        "logits": (w.slots // batch_shards) * vocab * 4 * 2,
    }
    note = (
        f"{job}: {w.slots} slots × {w.max_len} tokens; KV cache split {batch_shards} way(s) "
        f"over slots (data×fsdp) and {kv_shards} over KV heads (tensor)"
    )
    return parts, note


def _job_bytes(cfg: Any, m: Any, job: str) -> tuple[dict[str, int], str]:
    """Bytes per device of ``job`` by kind, and its note (a colocated job: the trainer's and
    its sampler's, on the same devices)."""
    if job == "trainer":
        return trainer_bytes(cfg, m)
    if job != COLOCATED:
        return worker_bytes(cfg, m, job)
    parts, note = trainer_bytes(cfg, m)
    sampler, sampler_note = worker_bytes(cfg, m, job)
    # the sampler's weights, reload and KV cache beside the trainer's state; both may hold
    # logits at once (generation runs beside a training step)
    logits = parts.pop("logits") + sampler.pop("logits")
    return {**parts, **sampler, "logits": logits}, (
        f"{note}; {sampler_note.replace(job, 'sampler', 1)}"
    )


@dataclasses.dataclass(frozen=True)
class JobMemory:
    """One accelerator job: its devices and bytes per device by kind."""

    job: str
    devices: str
    count: int  # devices of the job (1 when the platform default)
    parts: dict[str, int]
    usable: int | None  # bytes per device the job may use; None = not checked

    @property
    def total(self) -> int:
        return sum(self.parts.values())


@dataclasses.dataclass(frozen=True)
class SliceJob:
    """A job of a slice plan (slice_memory_plan): the Param that chose its slice, the Cloud TPU
    type, its chip, and what the plan says of the job. A worker on the devices the config gives
    it (no worker_accelerator_type) is led by the trainer's accelerator_type, whose chips it is
    checked against."""

    param: str  # "accelerator_type" or "worker_accelerator_type"
    accelerator_type: str
    accelerator: Any  # placement.Accelerator: the family and its HBM per chip
    devices: str  # the job's chips in words
    how: str  # where its usable memory comes from
    advice: str  # what to change when it does not fit


def _usable(cfg: Any, job: str) -> tuple[int | None, str]:
    """Bytes per device ``job`` may use, and how that was derived (None: not checked)."""
    p = cfg.placement
    acc = ACCELERATORS.get(p.accelerator or "")
    if acc is None:
        return None, ""
    if p.platform == "gpu":
        frac = gpu_memory_fraction(cfg, job)
        return int(acc.memory * frac), f"{frac} of {acc.name}'s {format_bytes(acc.memory)}"
    return acc.memory, f"{acc.name}'s {format_bytes(acc.memory)}"


# --------------------------------------------------------------------------- the plan
@dataclasses.dataclass
class MemoryPlan:
    """Every accelerator job's bytes per device, the parameter server's retention, a verdict."""

    cfg: Any
    model: Any
    model_source: str
    jobs: list[JobMemory]
    notes: list[str]
    ps: PsRetention
    problems: list[str]  # each: which job, needs, has, what to change
    warnings: list[str]
    # the jobs on Cloud TPU slices (slice_memory_plan): job → its slice; empty otherwise
    slices: dict[str, SliceJob] = dataclasses.field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return not self.problems

    def message(self) -> str:
        return "the memory plan does not fit:\n" + "\n".join(f"- {p}" for p in self.problems)

    def check(self) -> None:
        """Raises PlanDoesNotFit with ``message()`` unless the plan fits."""
        if not self.fits:
            raise PlanDoesNotFit(self.message())

    def format(self, problems: bool = True) -> str:
        """The memory table (GiB per device by kind), the notes and the verdict (with the
        problems unless ``problems`` is False: a caller that raises ``message()`` after)."""
        m = self.model
        out = [
            f"model: {m.model_type}, {_count(m.num_parameters())} parameters "
            f"({m.num_hidden_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} "
            f"heads / {m.num_key_value_heads} KV), from {self.model_source}",
            f"memory per device (GiB; param_dtype {self.cfg.model.param_dtype}, dtype "
            f"{self.cfg.model.dtype}):",
        ]
        kinds = [k for k in KINDS if any(k in j.parts for j in self.jobs)]
        rows = [("job", "devices", *kinds, "total", "usable", "fits")]
        for j in self.jobs:
            verdict = "?" if j.usable is None else "yes" if j.total <= j.usable else "NO"
            rows.append(
                (
                    j.job,
                    j.devices,
                    *(_gib(j.parts[k]) if k in j.parts else "-" for k in kinds),
                    _gib(j.total),
                    "-" if j.usable is None else _gib(j.usable),
                    verdict,
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for r in rows:
            cells = [
                c.ljust(w) if i < 2 else c.rjust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            ]
            out.append("  " + "  ".join(cells).rstrip())
        ps = self.ps
        out += [f"  {n}" for n in self.notes]
        out.append(
            f"parameter server (host RAM): a version is {format_bytes(ps.version_bytes)} "
            f"({self.cfg.model.dtype}); keeps {ps.keep_versions} versions (k+2 = {ps.wanted}) "
            f"+ a push = {format_bytes((ps.keep_versions + 1) * ps.version_bytes)} of --keep-bytes "
            f"{format_bytes(ps.keep_bytes)} ({PS_RAM_FRACTION:.0%} of "
            f"{format_bytes(ps.host_memory)}, {ps.host_source})"
        )
        out += [f"warning: {w}" for w in self.warnings]
        acc, platform = self.cfg.placement.accelerator, self.cfg.placement.platform
        if self.fits and self.slices:
            types = dict.fromkeys(f"{j.param} {j.accelerator_type}" for j in self.slices.values())
            out.append(f"verdict: fits {' and '.join(types)}")
        elif self.fits and acc:
            out.append(f"verdict: fits {acc}")
        elif self.fits and platform == "cpu":
            out.append(
                "verdict: may not fit this host's RAM (see the warning)"
                if self.warnings
                else "verdict: fits this host's RAM"
            )
        elif self.fits:
            out.append("verdict: devices not checked (set placement.accelerator to check them)")
        else:
            out.append("verdict: DOES NOT FIT" + ("" if problems else " (what to change: below)"))
            out += [f"  - {p}" for p in self.problems] if problems else []
        return "\n".join(out)


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return str(n)


def _gib(n: int) -> str:
    return "-" if n == 0 else "<0.01" if n < GiB / 100 else f"{n / GiB:.2f}"


def _advice(cfg: Any, job: str, devices: str | None = None) -> str:
    """What to change when ``job`` does not fit; ``devices`` replaces the advice on its devices
    (a slice plan: the Param that sizes the slice)."""
    if job == "trainer":
        remat = "" if cfg.trainer.remat == "full" else "trainer.remat: full, "
        kept = keep_logits_mb(cfg.trainer.keep_logits_mb, cfg.placement.platform)
        keep = "trainer.keep_logits_mb: 0, " if kept else ""
        devices = devices or "give it more devices (placement.trainer, trainer.hosts)"
        return (
            f"{devices} or shards (trainer.mesh_shape fsdp/tensor), a smaller "
            f"trainer.micro_batch_size, {remat}{keep}or a smaller workers.max_len"
        )
    if job == COLOCATED:
        return (
            "give the run more devices (placement.trainer) or shards (trainer.mesh_shape), fewer "
            "workers.slots, a smaller trainer.micro_batch_size, or placement.mode: "
            "disaggregated (the sampler on devices of its own)"
        )
    devices = devices or "give each worker more devices (placement.workers)"
    return (
        f"{devices} with tensor/fsdp shards (workers.mesh_shape), fewer workers.slots, or a "
        "smaller workers.max_len"
    )


def memory_plan(cfg: Any, model_config: str | None = None, offline: bool = True) -> MemoryPlan:
    """The memory plan of ``cfg`` (see the module docstring for every formula)."""
    model, source = resolve_model(cfg, model_config, offline=offline)
    return _plan(cfg, model, source)


def _plan(
    cfg: Any, model: Any, source: str, slices: dict[str, SliceJob] | None = None
) -> MemoryPlan:
    """The plan of ``cfg`` for ``model``; ``slices`` gives jobs on Cloud TPU slices their chip
    memory, device words and advice (slice_memory_plan), the others take them from placement."""
    slices = slices or {}
    jobs, notes, problems, warnings = [], [], [], []
    for job in job_names(cfg):
        if job in CPU_JOBS:
            continue
        parts, note = _job_bytes(cfg, model, job)
        devices = job_devices(cfg, job)
        count = len(devices) if devices is not None else 1
        if job in ("trainer", COLOCATED):
            count *= cfg.trainer.hosts
        on = slices.get(job)
        if on is None:
            usable, how = _usable(cfg, job)
            entry = JobMemory(job, describe_devices(cfg, job), count, parts, usable)
            advice = _advice(cfg, job)
        else:
            usable, how, advice = on.accelerator.memory, on.how, on.advice
            entry = JobMemory(job, on.devices, count, parts, usable)
        jobs.append(entry)
        if job in ("trainer", "worker-0", COLOCATED):
            notes.append(note)
        if usable is not None and entry.total > usable:
            same = [j for j in jobs[:-1] if (j.parts, j.usable) == (parts, usable)]
            if not same:  # the workers that need the same as an earlier one are said once
                problems.append(
                    f"{job} needs {format_bytes(entry.total)} per device ("
                    + ", ".join(f"{k} {format_bytes(v)}" for k, v in parts.items() if v)
                    + f") but has {format_bytes(usable)} ({how}): {advice}"
                )
            elif not problems[-1].startswith("the other workers"):
                problems.append("the other workers need as much as the one above")
    ps = ps_retention(cfg, model)
    if not ps.fits:
        problems.append(
            f"ps needs {format_bytes(2 * ps.version_bytes)} of host RAM for the newest version "
            f"and a push ({format_bytes(ps.version_bytes)} each) but --keep-bytes is "
            f"{format_bytes(ps.keep_bytes)} ({PS_RAM_FRACTION:.0%} of {ps.host_source}, "
            f"{format_bytes(ps.host_memory)}): set placement.host_memory to the RAM of the run's "
            f"hosts, or use hosts with more RAM"
        )
    elif not ps.roomy:
        warnings.append(
            f"--keep-bytes {format_bytes(ps.keep_bytes)} holds fewer than keep_versions "
            f"{ps.keep_versions} + a push: a push waits for the workers' acks before the oldest "
            f"version goes"
        )
    if cfg.placement.platform == "cpu":
        host = cfg.placement.host_memory or host_memory()
        need = sum(j.total * j.count for j in jobs) + ps.keep_versions * ps.version_bytes
        notes.append(
            f"cpu: the jobs together need about {format_bytes(need)} of the host's "
            f"{format_bytes(host)} RAM"
        )
        if need > host:
            warnings.append(
                f"the jobs together need about {format_bytes(need)} of this host's "
                f"{format_bytes(host)} RAM"
            )
    return MemoryPlan(cfg, model, source, jobs, notes, ps, problems, warnings, slices)


# --------------------------------------------------------------------------- Cloud TPU slices
# the largest slice a refusal suggests instead (every family has 256-chip slices)
SUGGEST_MAX_CHIPS = 256


def _slice_type(param: str, accelerator_type: str) -> Any:
    """tpu_type(accelerator_type), its errors naming ``param``; its family's ACCELERATORS entry
    must exist (the families are named alike)."""
    from rlax_tasks.compute.tpu_types import UnknownAcceleratorError, tpu_type

    try:
        t = tpu_type(accelerator_type)
    except UnknownAcceleratorError as e:
        raise UnknownAcceleratorError(f"{param}: {e}") from None
    if t.family not in ACCELERATORS:  # a family tpu_types knows and this table does not
        raise ValueError(f"{param}: {accelerator_type}: no chip memory known for {t.family}")
    return t


def _worker_chips(cfg: Any, worker_type: Any) -> list[int]:
    """Chips of each worker: every chip of one host of ``worker_type``, else the config's device
    list of the worker (none: the mesh's fixed sizes, -1 as 1, as memory_plan counts it)."""
    if is_colocated(cfg):  # the sampler shares the trainer's chips
        return []
    if worker_type is not None:
        return [worker_type.chips_per_host] * cfg.workers.count
    default = math.prod(1 if s == -1 else s for s in cfg.workers.mesh_shape)
    out = []
    for i in range(cfg.workers.count):
        devices = job_devices(cfg, f"worker-{i}")
        out.append(default if devices is None else len(devices))
    return out


def _slice_config(cfg: Any, trainer_type: Any, worker_chips: list[int]) -> Any:
    """``cfg`` as it runs on Cloud TPU slices, built and validated by the config module
    (RunConfig.from_dict of ``cfg.to_dict()`` with overrides: ``cfg`` itself is not touched).

    placement: platform tpu, accelerator the trainer's family, hosts 1; the trainer every chip of
    a host of ``trainer_type`` on each of its hosts (trainer.hosts = the slice's hosts). The
    workers run on slices of their own: their chip indices are numbered after the trainer's, one
    aligned block each, only so that the config's check of chips shared on one host (which does
    not apply between slices) passes; the plan uses their counts. Not for launching anything.
    ConfigError when the config cannot run so (e.g. a trainer.mesh_shape the chips do not split).
    """
    from rlax_tasks.config import RunConfig, merge_overrides

    blocks, end = [], trainer_type.chips_per_host
    for n in worker_chips:
        start = -(-end // n) * n  # aligned: a TPU process's chips are a block of its size
        blocks.append(list(range(start, start + n)))
        end = start + n
    overrides = {
        "trainer.hosts": trainer_type.hosts,
        "placement": {
            "platform": "tpu",
            "accelerator": trainer_type.family,
            "hosts": 1,
            "trainer": list(range(trainer_type.chips_per_host)),
            "workers": blocks or None,  # (none: a colocated sampler on the trainer's chips)
            "memory_fraction": None,
        },
    }
    return RunConfig.from_dict(merge_overrides(cfg.to_dict(), overrides))


def _family_types(accelerator_type: str) -> list[Any]:
    """The slices of ``accelerator_type``'s family with a power of two of chips up to
    SUGGEST_MAX_CHIPS, fewest chips first."""
    from rlax_tasks.compute.tpu_types import UnknownAcceleratorError, tpu_type

    t = tpu_type(accelerator_type)
    prefix, n = accelerator_type.rsplit("-", 1)
    per_chip = int(n) // t.chips  # TensorCores a chip where the name counts them
    out, chips = [], 1
    while chips <= SUGGEST_MAX_CHIPS:
        try:
            out.append(tpu_type(f"{prefix}-{chips * per_chip}"))
        except UnknownAcceleratorError:
            pass
        chips *= 2
    return out


def _fitting_trainer_type(cfg: Any, model: Any, trainer_type: Any, worker_chips: list[int]):
    """The smallest larger slice of the family whose trainer fits (None: none up to the cap)."""
    from rlax_tasks.config import ConfigError

    memory = ACCELERATORS[trainer_type.family].memory
    for t in _family_types(trainer_type.name):
        if t.chips <= trainer_type.chips:
            continue
        try:
            derived = _slice_config(cfg, t, worker_chips)
        except ConfigError:  # e.g. a fixed trainer.mesh_shape these chips do not split
            continue
        job = COLOCATED if is_colocated(derived) else "trainer"
        if sum(_job_bytes(derived, model, job)[0].values()) <= memory:
            return t
    return None


def _fitting_worker_type(cfg: Any, model: Any, trainer_type: Any, worker_type: Any):
    """The smallest slice of the workers' family with more chips a host whose worker fits."""
    from rlax_tasks.config import ConfigError

    memory = ACCELERATORS[worker_type.family].memory
    for t in _family_types(worker_type.name):
        if t.chips_per_host <= worker_type.chips_per_host:
            continue
        try:
            derived = _slice_config(cfg, trainer_type, _worker_chips(cfg, t))
        except ConfigError:
            continue
        if sum(worker_bytes(derived, model, "worker-0")[0].values()) <= memory:
            return t
    return None


def _chips(n: int) -> str:
    return f"{n} chip" if n == 1 else f"{n} chips"


def slice_memory_plan(
    cfg: Any,
    accelerator_type: str,
    worker_accelerator_type: str | None = None,
    model_config: str | None = None,
    offline: bool = False,
) -> MemoryPlan:
    """The memory plan of ``cfg`` as it would run on Cloud TPU slices, whatever its placement
    says: what the rlax_train DAG checks before it provisions anything.

    - the trainer spans every chip of the ``accelerator_type`` slice: trainer.hosts = its hosts,
      each host's chips_per_host chips (rlax_tasks.compute.tpu_types), trainer.mesh_shape over
      them all;
    - each worker runs on one host of a ``worker_accelerator_type`` slice, on all its chips;
      None: each worker keeps the devices the config gives it (placement.workers; none given:
      the workers.mesh_shape sizes, -1 as 1), on chips of the trainer's family;
    - every job is checked against the HBM of its slice's chip (ACCELERATORS: v4, v5e, v5p,
      v6e), the parameter server against the host RAM as in ``memory_plan``.

    The plan's config (``plan.cfg``) is ``cfg`` rebuilt through the config module with
    placement.platform tpu and placement.accelerator the trainer's family (``_slice_config``);
    ``cfg`` is not modified. ``plan.slices`` says which slice each job is on, and a problem's
    advice names the Param to change (a larger ``accelerator_type``: the smallest of the family
    up to SUGGEST_MAX_CHIPS chips that fits the trainer, when there is one). ``slice_fit_error``
    turns a plan that does not fit into one line.

    ValueError (UnknownAcceleratorError) for a type that is not a Cloud TPU type; ValueError
    naming placement.accelerator when it is set to another family than a slice's; ValueError
    naming the Param and the field when the config cannot run on the slice (e.g. a
    trainer.mesh_shape its chips do not split, a worker device list of 3 chips); ValueError
    naming model.path when the model's shapes cannot be found (``resolve_model``).
    """
    from rlax_tasks.config import ConfigError

    trainer_type = _slice_type("accelerator_type", accelerator_type)
    worker_type = (
        None
        if worker_accelerator_type is None
        else _slice_type("worker_accelerator_type", worker_accelerator_type)
    )
    named = cfg.placement.accelerator
    for param, t in (("accelerator_type", trainer_type), ("worker_accelerator_type", worker_type)):
        if t is not None and named is not None and named != t.family:
            other = f", or pick a {named} {param}" if ACCELERATORS[named].platform == "tpu" else ""
            raise ValueError(
                f"placement.accelerator: is {named!r} but {param} {t.name} is a {t.family} "
                f"slice: set placement.accelerator to {t.family!r} or leave it out (null){other}"
            )
    worker_chips = _worker_chips(cfg, worker_type)
    try:
        derived = _slice_config(cfg, trainer_type, worker_chips)
    except ConfigError as e:
        on_workers = e.field.startswith(("workers", "placement.workers"))
        param, t = (
            ("worker_accelerator_type", worker_type)
            if on_workers and worker_type is not None
            else ("accelerator_type", trainer_type)
        )
        hosts = f"{t.hosts} hosts × {_chips(t.chips_per_host)}" if t.hosts > 1 else "1 host"
        raise ValueError(
            f"{param}: {t.name} ({_chips(t.chips)}, {hosts}): the config cannot run on it: {e}"
        ) from None
    model, source = resolve_model(derived, model_config, offline=offline)

    trainer_acc = ACCELERATORS[trainer_type.family]
    hosts = f" × {trainer_type.hosts} hosts" if trainer_type.hosts > 1 else ""
    trainer = SliceJob(
        "accelerator_type", trainer_type.name, trainer_acc,
        f"{trainer_type.name}: {_chips(trainer_type.chips_per_host)}{hosts}",
        f"a {trainer_acc.name} chip of {trainer_type.name}",
        _advice(derived, "trainer", "use a larger accelerator_type"),
    )  # fmt: skip

    def worker(n: int) -> SliceJob:
        if worker_type is None:
            return SliceJob(
                "accelerator_type", trainer_type.name, trainer_acc,
                f"{_chips(n)} of {trainer_acc.name} (as configured)",
                f"a {trainer_acc.name} chip, the family of accelerator_type {trainer_type.name}",
                _advice(
                    derived, "worker-0",
                    "run the workers on slices of their own (worker_accelerator_type), or give "
                    "each worker more chips (placement.workers)",
                ),
            )  # fmt: skip
        acc = ACCELERATORS[worker_type.family]
        return SliceJob(
            "worker_accelerator_type", worker_type.name, acc,
            f"{worker_type.name}: {_chips(n)}{' of a host' if worker_type.hosts > 1 else ''}",
            f"a {acc.name} chip of {worker_type.name}",
            _advice(
                derived, "worker-0",
                "use a worker_accelerator_type with more chips a host (each worker runs on one "
                "host of it)",
            ),
        )  # fmt: skip

    lead = COLOCATED if is_colocated(derived) else "trainer"  # the job on the trainer slice
    slices = {lead: trainer}
    slices.update({f"worker-{i}": worker(n) for i, n in enumerate(worker_chips)})
    plan = _plan(derived, model, source, slices)

    # a larger slice that fits, computed, where the advice can name one
    failing = {j.job for j in plan.jobs if j.usable is not None and j.total > j.usable}
    if lead in failing:
        bigger = _fitting_trainer_type(cfg, model, trainer_type, worker_chips)
        fix = (
            f"use a larger accelerator_type ({bigger.name} fits the trainer)"
            if bigger
            else f"use a larger accelerator_type (no {trainer_type.family} slice of up to "
            f"{SUGGEST_MAX_CHIPS} chips fits the trainer as configured)"
        )
        slices[lead] = dataclasses.replace(trainer, advice=_advice(derived, lead, fix))
    if worker_type is not None and failing - {lead}:
        bigger = _fitting_worker_type(cfg, model, trainer_type, worker_type)
        fix = (
            f"use a worker_accelerator_type with more chips a host ({bigger.name}: "
            f"{_chips(bigger.chips_per_host)} a host fits a worker)"
            if bigger
            else f"use a worker_accelerator_type with more chips a host (none of the "
            f"{worker_type.family} slices of up to {SUGGEST_MAX_CHIPS} chips fits a worker)"
        )
        for job in failing - {lead}:
            slices[job] = dataclasses.replace(slices[job], advice=_advice(derived, job, fix))
    if failing:
        plan = _plan(derived, model, source, slices)
    return plan


def slice_fit_error(plan: MemoryPlan, accelerator_type: str | None = None) -> str | None:
    """Why ``plan`` does not fit, in one line; None when it fits.

    One clause per job at fault (workers that need the same once), each led by the Param that
    chose its chips, e.g. ``accelerator_type: v5litepod-8: trainer needs 41.2 GiB per chip
    (params 7.1 GiB, ...) but a v5e chip has 16.0 GiB: use a larger accelerator_type
    (v5litepod-32 fits the trainer) or shards (trainer.mesh_shape fsdp/tensor), ...``; a
    parameter server short of host RAM says so and names placement.host_memory. Clauses are
    joined by "; ". For a plan of ``slice_memory_plan`` the Params come from ``plan.slices``;
    for another plan the jobs are led by ``accelerator_type`` when given, else by
    placement.accelerator.
    """
    if plan.fits:
        return None
    failing = [j for j in plan.jobs if j.usable is not None and j.total > j.usable]
    clauses, seen = [], []
    for j in failing:
        key = (j.parts, j.usable)
        if key in seen:
            continue
        seen.append(key)
        same = sum((k.parts, k.usable) == key for k in failing) - 1
        who = j.job if not same else f"{j.job} (and {same} other worker{'s' * (same > 1)})"
        on = plan.slices.get(j.job)
        if on is not None:
            lead, unit, advice = f"{on.param}: {on.accelerator_type}", "chip", on.advice
            has = f"a {on.accelerator.name} chip has {format_bytes(on.accelerator.memory)}"
        else:
            lead = (
                f"accelerator_type: {accelerator_type}"
                if accelerator_type
                else f"placement.accelerator: {plan.cfg.placement.accelerator}"
            )
            unit, advice = "device", _advice(plan.cfg, j.job)
            has = f"it has {format_bytes(j.usable)}"
        parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in j.parts.items() if v)
        clauses.append(
            f"{lead}: {who} needs {format_bytes(j.total)} per {unit} ({parts}) but {has}: {advice}"
        )
    clauses += [p for p in plan.problems if p.startswith("ps needs")]
    return "; ".join(clauses) or "; ".join(plan.problems)


def dry_run_text(cfg: Any, plan: MemoryPlan) -> str:
    """What ``rlax run --dry-run`` prints: the placement, then the memory plan (the problems of
    a plan that does not fit follow as its error message)."""
    return f"{describe(cfg)}\n{plan.format(problems=False)}"


__all__ = [
    "KNOWN_MODELS",
    "PS_RAM_FRACTION",
    "JobMemory",
    "MemoryPlan",
    "PlanDoesNotFit",
    "PsRetention",
    "SUGGEST_MAX_CHIPS",
    "SliceJob",
    "dry_run_text",
    "layer_activations",
    "memory_plan",
    "ps_retention",
    "resolve_model",
    "slice_fit_error",
    "slice_memory_plan",
    "trainer_bytes",
    "worker_bytes",
]
