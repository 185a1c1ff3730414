"""The train step's gradient, micro-batching and sharding against direct computations."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rlax_tasks.algorithms import make_objective
from rlax_tasks.models import LogProbOptions, forward
from rlax_tasks.trainer import StepSettings, Trainer, TrainerConfig, make_train_step
from rlax_tasks.trainer.train_step import init_value_head, policy_outputs
from tests.trainer.helpers import random_batch, tiny_policy

BASE = dict(learning_rate=1e-3, warmup_steps=0, max_grad_norm=1.0, weight_decay=0.01, seed=0)


def _flat(params) -> dict[str, np.ndarray]:
    leaves = jax.tree_util.tree_leaves_with_path(params)
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in leaves}


def _one_step(tmp_path, name: str, objective, **config) -> tuple[dict, dict]:
    trainer = Trainer(
        tiny_policy(), objective, TrainerConfig(**{**BASE, **config}), str(tmp_path / name)
    )
    metrics = trainer.step(random_batch(0))
    return _flat(trainer.params), metrics


@pytest.mark.parametrize("micro", [2, None], ids=["micro-batches", "one-forward-pass"])
@pytest.mark.parametrize("name", ["grpo", "ppo"])
def test_step_gradient_is_the_gradient_of_the_full_batch_loss(name, micro):
    """SGD(lr=1) step == minus the direct jax.grad of the objective: with 2 micro-batches (a
    prefill, then forward and backward per micro-batch) and with one (one forward pass)."""
    policy = tiny_policy()
    objective = make_objective(name)
    batch = {k: jnp.asarray(v) for k, v in random_batch(3).items()}
    if objective.needs_reference:
        ref = tiny_policy(seed=1)
        batch["ref_logprobs"] = forward.token_logprobs(
            ref.graphdef, ref.params, batch["input_ids"], batch["attention_mask"]
        )
    params = {"model": policy.params}
    if objective.needs_values:  # non-zero head so the value gradient reaches the model too
        head = init_value_head(policy.config.hidden_size)
        params["value_head"] = {"kernel": head["kernel"] + 0.3, "bias": head["bias"] + 0.1}
    coef = 0.5
    settings = StepSettings(micro, LogProbOptions(chunk_size=4), value_loss_coef=coef)
    step = jax.jit(make_train_step(policy.graphdef, objective, optax.sgd(1.0), settings))
    new_params, _, metrics = step(params, optax.sgd(1.0).init(params), batch)
    got = jax.tree.map(lambda a, b: a - b, params, new_params)

    def direct_loss(p):
        ids, attn = batch["input_ids"], batch["attention_mask"]
        logp, _, values, _ = policy_outputs(policy.graphdef, p, ids, attn)
        obj_batch = {
            "old_logprobs": jax.lax.stop_gradient(logp),
            "mask": (batch["completion_mask"] * attn).astype(jnp.float32),
            "rewards": batch["rewards"],
            "group_ids": batch["group_ids"],
            "behavior_logprobs": batch["behavior_logprobs"],
        }
        if "ref_logprobs" in batch:
            obj_batch["ref_logprobs"] = batch["ref_logprobs"]
        if values is not None:
            obj_batch["values"] = jax.lax.stop_gradient(values)
        loss, _ = objective.loss(logp, obj_batch)
        if values is not None:
            loss = loss + coef * objective.value_loss(values, obj_batch)[0]
        return loss

    loss, want = jax.jit(jax.value_and_grad(direct_loss))(params)
    np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=1e-5, atol=1e-7)
    # the sampler-vs-trainer KL: k3 of old − beh over completion tokens, the old log-probs the
    # trainer's own (before the update)
    old = np.asarray(
        policy_outputs(policy.graphdef, params, batch["input_ids"], batch["attention_mask"])[0],
        np.float64,
    )
    on = np.asarray(batch["completion_mask"] * batch["attention_mask"]) > 0
    d = old[on] - np.asarray(batch["behavior_logprobs"], np.float64)[on]
    assert np.abs(d).max() > 0.1  # the sampler's log-probs differ from the trainer's
    np.testing.assert_allclose(
        float(metrics["logprob_mismatch_kl"]), np.mean(np.exp(d) - d - 1), rtol=1e-4
    )
    got_flat, want_flat = _flat(got), _flat(want)
    assert got_flat.keys() == want_flat.keys()
    scale = max(np.abs(v).max() for v in want_flat.values())
    assert scale > 1e-4  # the gradient is not trivially zero
    for k in want_flat:
        np.testing.assert_allclose(got_flat[k], want_flat[k], atol=1e-5 * scale, err_msg=k)


def test_micro_batching_equals_one_full_batch(tmp_path):
    objective = make_objective("dapo")
    full, m_full = _one_step(tmp_path, "full", objective, mesh_shape=(1, 1, 1))
    micro, m_micro = _one_step(
        tmp_path, "micro", objective, mesh_shape=(1, 1, 1), micro_batch_size=2
    )
    np.testing.assert_allclose(m_micro["loss"], m_full["loss"], rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(m_micro["grad_norm"], m_full["grad_norm"], rtol=1e-5)
    # Adam's first update is ~lr * sign(g): float noise on tiny gradient entries shows at ~lr/1e3
    for k in full:
        np.testing.assert_allclose(micro[k], full[k], atol=1e-5, err_msg=k)


@pytest.fixture(scope="module")
def single_device_step(tmp_path_factory):
    objective = make_objective("grpo")  # with the k3 KL: the reference prefill is sharded too
    return _one_step(tmp_path_factory.mktemp("single"), "single", objective, mesh_shape=(1, 1, 1))


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (forced host) devices")
@pytest.mark.parametrize("mesh_shape", [(2, 2, 2), (1, 8, 1)])
def test_sharded_step_matches_single_device(tmp_path, single_device_step, mesh_shape):
    want_params, want_metrics = single_device_step
    got_params, got_metrics = _one_step(
        tmp_path, "sharded", make_objective("grpo"), mesh_shape=mesh_shape, micro_batch_size=4
    )
    for key in ("loss", "grad_norm", "entropy", "logprob_mismatch_p95", "kl"):
        np.testing.assert_allclose(got_metrics[key], want_metrics[key], atol=1e-5, err_msg=key)
    for k in want_params:
        np.testing.assert_allclose(got_params[k], want_params[k], atol=1e-5, err_msg=k)


def test_bucketed_width():
    from rlax_tasks.trainer.trainer import bucketed_width

    assert [bucketed_width(t, 128) for t in (1, 2, 3, 9, 15, 16, 17, 100)] == [
        1,
        2,
        4,
        16,
        16,
        16,
        32,
        128,
    ]
    long = (128, 129, 134, 160, 161, 300, 1100, 2000)
    assert [bucketed_width(t, 128) for t in long] == [128, 144, 144, 160, 176, 320, 1152, 2048]
    assert bucketed_width(17, 8) == 18  # an eighth of 16 past a bucket of 8
    # past the bucket, at most an eighth of the width is padding; 8 shapes per doubling
    widths = [bucketed_width(t, 128) for t in range(129, 4097)]
    assert all(w >= t and w - t < t / 8 for t, w in zip(range(129, 4097), widths, strict=True))
    assert len(set(widths)) == 40


@pytest.mark.parametrize("name", ["grpo", "dr_grpo"])
def test_bucket_padding_changes_nothing_but_the_compile_count(tmp_path, name):
    """Batches of widths 11 and 13 share one compiled step (padded to 16) and train exactly like
    unpadded batches; Dr. GRPO gets a fixed max_length so its normaliser does not move.
    (Unpacked: packing would give both runs rows 32 wide; test_packing covers it.)"""
    objective = make_objective(name, **({"max_length": 8} if name == "dr_grpo" else {}))
    widths = (11, 13)
    runs = {}
    for bucket in (0, 128):
        trainer = Trainer(
            tiny_policy(),
            objective,
            # adam_eps well above float32 noise: Adam's first update lr * g / (|g| + eps) turns a
            # gradient at rounding level (where padded and unpadded sums differ in order: seen
            # on an AVX-512/AMX Xeon, embedding rows off by 2e-4) into +-lr
            TrainerConfig(
                **BASE,
                adam_eps=1e-6,
                mesh_shape=(1, 1, 1),
                length_bucket=bucket,
                pack_sequences=False,
            ),
            str(tmp_path / f"b{bucket}"),
        )
        metrics = [trainer.step(random_batch(i, seq_len=w)) for i, w in enumerate(widths)]
        runs[bucket] = (_flat(trainer.params), metrics, trainer._train_step._cache_size())
    (exact, m_exact, n_exact), (padded, m_padded, n_padded) = runs[0], runs[128]
    assert (n_exact, n_padded) == (2, 1)
    for a, b in zip(m_exact, m_padded, strict=True):
        for key in ("loss", "grad_norm", "tokens", "completion_tokens"):
            np.testing.assert_allclose(b[key], a[key], rtol=1e-5, atol=1e-7, err_msg=key)
    for k in exact:  # 2.3e-6 seen on that Xeon (an update of lr = 1e-3 is 1000x that)
        np.testing.assert_allclose(padded[k], exact[k], atol=5e-6, err_msg=k)


def test_dr_grpo_without_max_length_is_not_padded(tmp_path, caplog):
    """Its normaliser is the array width: padding would silently rescale the loss."""
    trainer = Trainer(
        tiny_policy(),
        make_objective("dr_grpo"),
        TrainerConfig(**BASE, mesh_shape=(1, 1, 1)),
        str(tmp_path / "d"),
    )
    assert "compiles the step again" in caplog.text
    for i, w in enumerate((11, 13)):
        trainer.step(random_batch(i, seq_len=w))
    assert trainer._train_step._cache_size() == 2


def _sampled_batch(
    policy, temperature: float, top_k: int = 0, new_tokens: int = 8
) -> dict[str, np.ndarray]:
    """Completions drawn by the Sampler at ``temperature`` (and ``top_k``, recording the ids it
    kept), laid out by the controller's ``Batch.arrays`` as the trainer service receives them:
    the sampler's log-probs as behaviour log-probs, its kept ids as ``support_ids``."""
    from rlax_tasks.controller.buffer import Batch, ScoredGroup
    from rlax_tasks.rollout import Sampler

    rng = np.random.default_rng(7)
    prompts = [[int(t) for t in rng.integers(3, 64, n)] for n in (5, 8, 3, 6)]
    sampler = Sampler(policy, max_slots=4, max_len=32, support_capacity=top_k)
    outs = sampler.generate(
        prompts, max_new_tokens=new_tokens, temperature=temperature, top_k=top_k, seed=1, n=2,
        ignore_eos=True,
    )  # fmt: skip
    groups = []
    for k, prompt in enumerate(prompts):
        pair = outs[2 * k : 2 * k + 2]
        groups.append(
            ScoredGroup(
                f"p{k}", k, 0, tuple(prompt),
                tuple(tuple(o.tokens) for o in pair), tuple(tuple(o.logprobs) for o in pair),
                ("length",) * 2, (0.0, 1.0), (0.0, 1.0),
                support=tuple(tuple(map(tuple, o.support)) for o in pair) if top_k else (),
            )
        )  # fmt: skip
    arrays = Batch(1, tuple(groups)).arrays()
    arrays["completion_mask"] = arrays.pop("mask")  # as the trainer service renames it
    return arrays


def test_old_logprobs_are_taken_at_the_sampling_temperature(tmp_path):
    """The trainer's recomputed log-probs are those of the distribution the sampler drew from
    (softmax(logits / T)): at T 0.7 they match the sampler's; taken at T 1 they would not."""
    policy = tiny_policy()
    batch = _sampled_batch(policy, temperature=0.7)
    mismatch = {}
    for t in (0.7, 1.0):
        trainer = Trainer(
            policy,
            make_objective("grpo", kl_beta=0.0),
            TrainerConfig(**BASE, mesh_shape=(1, 1, 1)),
            str(tmp_path / f"t{t}"),
            sampling_temperature=t,
        )
        mismatch[t] = trainer.step(batch)["logprob_mismatch_p95"]
    assert mismatch[0.7] < 1e-4 and mismatch[1.0] > 0.05, mismatch


@pytest.mark.parametrize(
    ("config", "new_tokens"),
    [(dict(mesh_shape=(1, 1, 1)), 3), (dict(micro_batch_size=2, pack_sequences=False), 8)],
    ids=["packed-one-pass", "micro-batches"],
)
def test_old_logprobs_are_taken_over_the_samplers_kept_tokens(tmp_path, config, new_tokens):
    """Sampling-mask replay: a top-k sampler records each token's kept ids; the trainer's
    recomputed log-probs, renormalised over them, equal the sampler's (packed rows in one pass,
    or micro-batches with a separate prefill); without the support they would not. The
    reference policy's log-probs (the KL term) are taken over the same ids: at the first step,
    policy = reference, the KL is 0."""
    policy = tiny_policy()
    batch = _sampled_batch(policy, temperature=0.7, top_k=4, new_tokens=new_tokens)
    assert batch["support_ids"].max() >= 0
    got = {}
    for name, b in (("replayed", batch), ("whole vocabulary", {**batch, "support_ids": None})):
        trainer = Trainer(
            policy,
            make_objective("grpo"),  # with its k3 KL to the reference
            TrainerConfig(**{**BASE, **config}),
            str(tmp_path / name.replace(" ", "-")),
            sampling_temperature=0.7,
        )
        got[name] = trainer.step(b)
    rows = got["replayed"]["train_rows"]
    assert rows < len(batch["rewards"]) if config.get("mesh_shape") else rows == 8  # packed?
    assert got["replayed"]["logprob_mismatch_p95"] < 1e-4, got["replayed"]
    assert got["whole vocabulary"]["logprob_mismatch_p95"] > 0.05
    assert got["replayed"]["support_replayed_frac"] == 1.0
    assert "support_replayed_frac" not in got["whole vocabulary"]
    assert got["replayed"]["kl"] < 1e-6 and got["whole vocabulary"]["kl"] < 1e-6
