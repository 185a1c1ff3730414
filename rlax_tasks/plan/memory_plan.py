"""The memory plan of a run: bytes per device of every job, from the config and the model's shapes.

``memory_plan(cfg)`` is what ``rlax run --dry-run`` prints and what both launchers check before
anything starts; ``ps_retention`` gives the parameter server's --keep-versions/--keep-bytes.
The formulas are in the comment below; rlax_tasks.plan.slices runs the plan on Cloud TPU slices."""

from __future__ import annotations

import dataclasses
from typing import Any

from rlax_tasks.plan.model_shapes import resolve_model
from rlax_tasks.plan.placement import (
    ACCELERATORS,
    COLOCATED,
    HELDOUT,
    describe,
    describe_devices,
    gpu_memory_fraction,
    host_memory,
    is_cpu_job,
    job_devices,
    job_mesh,
    job_names,
    resolve_mesh,
)
from rlax_tasks.trainer.config import keep_logits_mb
from rlax_tasks.utils.byte_sizes import GiB, format_bytes

# share of a host's RAM the parameter server may keep versions in
PS_RAM_FRACTION = 0.25
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
ATTENTION_BLOCK = 128  # rlax_tasks.models.attention.ATTENTION_BLOCK (no JAX import here)

# Notation: P parameters; L layers, h hidden, f intermediate, a heads, kv key/value heads, d head
# dim, V vocabulary; bp, bc bytes of model.param_dtype (master weights) and model.dtype (compute,
# what workers and the PS hold); a job's mesh (data, fsdp, tensor) over its devices. An axis that
# does not divide a dimension replicates it (rlax_tasks.models.sharding.fit_spec): t_a, t_kv, t_f,
# t_V are tensor if it divides a, kv, f, V, else 1.
#
# Trainer, per device (shards = fsdp × tensor):
#   params P·bp/shards; reference (a KL term, held in the compute dtype) P·bc/shards; Adam
#   moments 2·P·bp/shards;
#   gradients P·4/shards (float32), twice when micro-batches accumulate (the running sum and the
#   micro-batch's own); activations of one micro-batch: s sequences per device (micro_batch_size,
#   else the batch, over data × fsdp; all of it when that does not divide) of T = workers.max_len:
#     one layer, everything kept:  A = bc·T·(4h + 2a·d/t_a + 2kv·d/t_kv + 4f/t_f)
#                                      + (a/t_a)·S·(4 + bc)   (causal scores f32 + probs,
#                                        S = min(T², T·(T+128)/2): 128-query blocks)
#     remat none: s·L·A;  dots (matmul outputs kept): s·(L·bc·T·(3h + a·d/t_a + 2kv·d/t_kv
#     + 2f/t_f) + A);  full (layer inputs kept): s·(L·bc·T·h + A)   (+A: the layer recomputed)
#   logits: s·c·(V/t_V)·4·3 (c = min(trainer.logprob_chunk_size, T): f32 logits, softmax, grad),
#   plus s·T·(V/t_V)·4 when the micro-batch's logits (micro·T·V·4) fit trainer.keep_logits_mb
#   (kept from the forward for the backward; unset: 1 GiB on a CPU, none on accelerators).
#   Packed sequences (trainer.pack_sequences) hold at most the padded batch's tokens, in rows T
#   wide (32 when T < 32): the same bound.
# Mixture of experts (qwen3_moe): the experts' P_e = L·E·3·h·f_e parameters are split over
#   expert × fsdp × tensor (each where it divides E, h, f_e), the rest over fsdp × tensor; the
#   batch over data × fsdp × expert; f in A is k·f_e (the width a token computes); dispatch per
#   layer and sequence: bc·T·(expert·h + 2k·(2h + 3f_e/t_fe)) (the expert group's tokens
#   gathered, each token's k rows sorted and block-padded with their products), every layer's
#   without remat, else one layer's.
# Worker, per device:
#   weights P·bc/(fsdp·tensor), plus one array while a new version is swapped in (reload: the swap
#   frees each old array before placing its replacement; the largest array is the embedding or
#   a stacked MLP kernel, max(V·h, L·h·f)·bc/(fsdp·tensor)); decode_layers: each layer's weights
#   as arrays of their own for decode (rollout/held_weights.py), (P − embeddings)·bc/(fsdp·tensor),
#   none with workers.decode_layer_copies false on an accelerator;
#   KV cache slots·max_len·L·2·kv·d·bc / (data·fsdp (slots, when it divides them) · t_kv);
#   logits (slots/(data·fsdp))·(V/t_V)·4·2 (float32 logits and sampling probabilities).
# Parameter server, host RAM: a version is P·bc; keep_bytes = placement.ps_memory_fraction
# (PS_RAM_FRACTION by default) of the host's RAM
# (placement.host_memory, else this machine's); keep_versions = max(2, min(k + 2, keep_bytes //
# version − 1)): keep_bytes also counts the push in flight, hence the − 1; k =
# staleness.max_staleness (reload_every when unbounded). The PS needs keep_bytes ≥ 2 versions
# (the newest and a push): below that the plan does not fit.
# Usable per device: gpu = XLA_PYTHON_CLIENT_MEM_FRACTION × memory; tpu = the chip's HBM; cpu =
# the host's RAM for every job together (not refused, only flagged). XLA's temporaries and the
# prefill of the samplers are not counted: keep some headroom.

TRAINER_KINDS = ("params", "reference", "adam", "grads", "activations", "dispatch")
WORKER_KINDS = ("weights", "reload", "decode_layers", "kv_cache")
KINDS = (*TRAINER_KINDS, *WORKER_KINDS, "logits")


class PlanDoesNotFit(ValueError):
    """The run's memory plan does not fit its devices; the message says which job, how much it
    needs and has, and what to change."""


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
    """keep_bytes = the budget, a stated share (placement.ps_memory_fraction) of the host's RAM
    (placement.host_memory, else this machine's); keep_versions = max(2, min(k + 2, versions
    that fit beside a push in flight))."""
    version = model.num_parameters() * DTYPE_BYTES[cfg.model.dtype]
    host = cfg.placement.host_memory
    source = "placement.host_memory"
    if host is None:
        host, source = host_memory(), "this machine's RAM"
    budget = int(host * cfg.placement.ps_memory_fraction)
    s = cfg.staleness
    wanted = (s.max_staleness if s.max_staleness is not None else s.reload_every) + 2
    keep = max(2, min(wanted, budget // max(version, 1) - 1))
    return PsRetention(version, wanted, keep, budget, host, source)


# --------------------------------------------------------------------------- per job
def _split(n: int, axis: int) -> int:
    """The mesh axis size that shards a dimension of n (fit_spec: 1 when it does not divide)."""
    return axis if n % axis == 0 else 1


def _four_axes(shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    """(data, fsdp, expert, tensor) of a 3- or 4-entry mesh shape."""
    if len(shape) == 4:
        return shape[0], shape[1], shape[2], shape[3]
    return shape[0], shape[1], 1, shape[2]


def _mesh_or_single(cfg: Any, job: str) -> tuple[tuple[int, int, int, int], bool]:
    """The job's resolved (data, fsdp, expert, tensor) mesh, or its mesh with -1 as 1 when its
    device count is unknown."""
    mesh = job_mesh(cfg, job)
    if mesh is not None:
        return _four_axes(mesh), True
    shape = cfg.trainer.mesh_shape if job in ("trainer", COLOCATED) else cfg.workers.mesh_shape
    return _four_axes(tuple(1 if s == -1 else s for s in shape)), False


def parameters_per_device(m: Any, fsdp: int, expert: int, tensor: int) -> int:
    """Parameters one device holds: the dense ones over fsdp × tensor, the experts' over
    expert × fsdp × tensor (each axis where it divides their dimension)."""
    experts = m.num_expert_parameters()
    if not experts:
        return m.num_parameters() // (fsdp * tensor)
    shards = (_split(m.num_experts, expert) * _split(m.hidden_size, fsdp)
              * _split(m.moe_intermediate_size, tensor))  # fmt: skip
    return (m.num_parameters() - experts) // (fsdp * tensor) + experts // shards


def mlp_width(m: Any) -> int:
    """The MLP width a token computes: the intermediate size, or k experts' for MoE."""
    if m.is_moe:
        return m.num_experts_per_tok * m.moe_intermediate_size
    return m.intermediate_size


def dispatch_bytes(m: Any, tokens: int, bc: int, expert: int, tensor: int) -> int:
    """One MoE layer's dispatch buffers for a sequence of ``tokens``: the expert group's tokens
    gathered (expert × h) and each token's k rows sorted by expert, their block padding (up to
    2×) with their gate, up and hidden outputs (0 for a dense model)."""
    if not m.is_moe:
        return 0
    h, k, fe = m.hidden_size, m.num_experts_per_tok, m.moe_intermediate_size
    return bc * tokens * (expert * h + 2 * k * (2 * h + 3 * fe // _split(fe, tensor)))


def layer_activations(m: Any, tokens: int, bc: int, tensor: int) -> int:
    """Bytes one sequence of ``tokens`` keeps for one layer without remat (A above)."""
    h, f, a, kv, d = (
        m.hidden_size, mlp_width(m), m.num_attention_heads, m.num_key_value_heads, m.head_dim,
    )  # fmt: skip
    t_a, t_kv, t_f = _split(a, tensor), _split(kv, tensor), _split(f, tensor)
    per_token = bc * (4 * h + 2 * a * d // t_a + 2 * kv * d // t_kv + 4 * f // t_f)
    scores = min(tokens * tokens, tokens * (tokens + ATTENTION_BLOCK) // 2)
    return tokens * per_token + (a // t_a) * scores * (4 + bc)


def trainer_bytes(cfg: Any, m: Any) -> tuple[dict[str, int], str]:
    """Bytes per trainer device by kind, and a note on the activation terms."""
    (data, fsdp, expert, tensor), _ = _mesh_or_single(cfg, "trainer")
    held = parameters_per_device(m, fsdp, expert, tensor)
    bp, bc = DTYPE_BYTES[cfg.model.param_dtype], DTYPE_BYTES[cfg.model.dtype]
    t = cfg.trainer
    batch = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    micro = t.micro_batch_size or batch
    replicas = data * fsdp * expert  # the batch is split over every data-parallel axis
    seqs = micro // replicas if micro % replicas == 0 else micro
    tokens = cfg.workers.max_len
    a_layer = layer_activations(m, tokens, bc, tensor)
    h, f, a, kv, d, layers = (
        m.hidden_size, mlp_width(m), m.num_attention_heads, m.num_key_value_heads,
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
        "params": held * bp,
        "reference": held * bc if cfg.objective_config().needs_reference else 0,
        "adam": 2 * held * bp,
        "grads": held * 4 * (2 if micro < batch else 1),
        "activations": seqs * per_seq,
        "logits": seqs * chunk * vocab * 4 * 3 + kept,
    }
    dispatch = dispatch_bytes(m, tokens, bc, expert, tensor)
    if dispatch:  # kept for every layer without remat, else one layer's at a time
        parts["dispatch"] = seqs * dispatch * (layers if t.remat == "none" else 1)
    note = (
        f"trainer: {seqs} sequence(s) × {tokens} tokens per device (micro-batch {micro} over "
        f"data×fsdp{'×expert' if expert > 1 else ''} {replicas}), remat {t.remat}"
    )
    if m.num_expert_parameters():
        note += f"; {m.num_experts} experts split {_split(m.num_experts, expert)} way(s)"
    return parts, note


def worker_bytes(cfg: Any, m: Any, job: str) -> tuple[dict[str, int], str]:
    """Bytes per device of one worker by kind, and a note on its KV-cache split."""
    if job == COLOCATED:  # the sampler: workers.mesh_shape over the trainer's devices
        devices = job_devices(cfg, job)
        if devices is not None:
            shape = resolve_mesh(cfg.workers.mesh_shape, len(devices))
        else:
            shape = tuple(1 if s == -1 else s for s in cfg.workers.mesh_shape)
        data, fsdp, expert, tensor = _four_axes(shape)
    else:
        (data, fsdp, expert, tensor), _ = _mesh_or_single(cfg, job)
    w = cfg.workers
    bc = DTYPE_BYTES[cfg.model.dtype]
    batch_shards = _split(w.slots, data * fsdp * expert)
    kv_shards = _split(m.num_key_value_heads, tensor)
    held = parameters_per_device(m, fsdp, expert, tensor)
    weights = held * bc
    embeddings = m.vocab_size * m.hidden_size * (1 if m.tie_word_embeddings else 2) + m.hidden_size
    layers_mlp = m.num_hidden_layers * m.hidden_size * m.intermediate_size
    if m.num_expert_parameters():  # the largest array: one of the stacked expert weights
        layers_mlp = m.num_expert_parameters() // 3 // _split(m.num_experts, expert)
    cache = w.slots * w.max_len * m.num_hidden_layers * 2 * m.num_key_value_heads * m.head_dim
    vocab = m.vocab_size // _split(m.vocab_size, tensor)
    parts = {
        "weights": weights,
        "reload": max(m.vocab_size * m.hidden_size, layers_mlp) * bc // (fsdp * tensor),
        # (a CPU without a mesh keeps them whatever the setting: rollout/held_weights.py)
        "decode_layers": (held - embeddings // (fsdp * tensor)) * bc
        if w.decode_layer_copies or cfg.placement.platform == "cpu"
        else 0,
        "kv_cache": cache * bc // (batch_shards * kv_shards),
        "logits": (w.slots // batch_shards) * vocab * 4 * 2,
    }
    note = (
        f"{job}: {w.slots} slots × {w.max_len} tokens; KV cache split {batch_shards} way(s) "
        f"over slots (data×fsdp) and {kv_shards} over KV heads (tensor)"
    )
    return parts, note


def job_bytes(cfg: Any, m: Any, job: str) -> tuple[dict[str, int], str]:
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
            f"{format_bytes(ps.keep_bytes)} ({self.cfg.placement.ps_memory_fraction:.0%} of "
            f"{format_bytes(ps.host_memory)}, {ps.host_source})"
        )
        out.append(
            f"workers (host RAM): one on another host than the PS keeps a copy of its version "
            f"({format_bytes(ps.version_bytes)}) to receive the next as a delta"
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


def job_advice(cfg: Any, job: str, devices: str | None = None) -> str:
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
    if job == HELDOUT:
        devices = devices or "give the held-out evaluation more devices (placement.evaluator)"
    devices = devices or "give each worker more devices (placement.workers)"
    copies = "workers.decode_layer_copies: false, " if cfg.workers.decode_layer_copies else ""
    return (
        f"{devices} with tensor/fsdp shards (workers.mesh_shape), fewer workers.slots, "
        f"{copies}or a smaller workers.max_len"
    )


def memory_plan(cfg: Any, model_config: str | None = None, offline: bool = True) -> MemoryPlan:
    """The memory plan of ``cfg`` (see the module docstring for every formula)."""
    model, source = resolve_model(cfg, model_config, offline=offline)
    return plan_for(cfg, model, source)


def plan_for(
    cfg: Any, model: Any, source: str, slices: dict[str, SliceJob] | None = None
) -> MemoryPlan:
    """The plan of ``cfg`` for ``model``; ``slices`` gives jobs on Cloud TPU slices their chip
    memory, device words and advice (slice_memory_plan), the others take them from placement."""
    slices = slices or {}
    jobs, notes, problems, warnings = [], [], [], []
    # the held-out evaluation on devices of its own samples as a worker does
    own_evaluator = [HELDOUT] if cfg.placement.evaluator is not None else []
    for job in [*job_names(cfg), *own_evaluator]:
        if is_cpu_job(job):
            continue
        parts, note = job_bytes(cfg, model, job)
        devices = job_devices(cfg, job)
        count = len(devices) if devices is not None else 1
        if job in ("trainer", COLOCATED):
            count *= cfg.trainer.hosts
        on = slices.get(job)
        if on is None:
            usable, how = _usable(cfg, job)
            entry = JobMemory(job, describe_devices(cfg, job), count, parts, usable)
            advice = job_advice(cfg, job)
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
            f"{format_bytes(ps.keep_bytes)} ({cfg.placement.ps_memory_fraction:.0%} of "
            f"{ps.host_source}, {format_bytes(ps.host_memory)}): set placement.host_memory to "
            "the RAM of the run's hosts, raise placement.ps_memory_fraction, or use hosts with "
            "more RAM"
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


def dry_run_text(cfg: Any, plan: MemoryPlan) -> str:
    """What ``rlax run --dry-run`` prints: the placement, then the memory plan (the problems of
    a plan that does not fit follow as its error message)."""
    return f"{describe(cfg)}\n{plan.format(problems=False)}"


__all__ = [
    "PS_RAM_FRACTION",
    "JobMemory",
    "MemoryPlan",
    "PlanDoesNotFit",
    "PsRetention",
    "SliceJob",
    "job_advice",
    "dry_run_text",
    "job_bytes",
    "layer_activations",
    "memory_plan",
    "plan_for",
    "ps_retention",
    "trainer_bytes",
    "worker_bytes",
]
