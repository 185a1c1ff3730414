"""Qwen3-MoE against transformers' Qwen3MoeForCausalLM on tiny random models: logits, greedy
generation, the loss's gradient, the checkpoint round trip; the grouped products against the
dense reference; and configs this model cannot compute refused naming the field."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from rlax_tasks.models import ModelConfig, hf_io, load_pretrained
from rlax_tasks.models.config import ModelConfigError
from rlax_tasks.models.moe import GROUPED_MATMUL_ENV, expert_outputs, grouped_matmul
from rlax_tasks.rollout import Sampler
from tests.models.hf_models import hf_logits, left_padded_batch, tiny_hf_model


@pytest.fixture(scope="module", params=[True, False], ids=["norm-topk", "raw-topk"])
def moe(request, tmp_path_factory):
    # no end-of-sequence token: both sides generate all 32 tokens
    model = tiny_hf_model("qwen3_moe", seed=3, norm_topk_prob=request.param, pad_token_id=0)
    path = str(tmp_path_factory.mktemp("qwen3-moe"))
    model.save_pretrained(path)
    return model, path


def test_logits_match_transformers_within_1e4(moe):
    hf, path = moe
    policy = load_pretrained(path)
    assert policy.config.is_moe and policy.config.num_experts == 6
    ids, mask = left_padded_batch(np.random.default_rng(0), 97, [40, 23, 7])
    ours = np.asarray(policy.logits(ids, mask))
    ref = hf_logits(hf, ids, mask)
    real = mask.astype(bool)
    np.testing.assert_allclose(ours[real], ref[real], atol=1e-4, rtol=0)


def test_greedy_tokens_equal_transformers_generate_for_32_tokens(moe):
    hf, path = moe
    policy = load_pretrained(path)
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(3, 97, n)] for n in (4, 11, 7, 16)]
    outs = Sampler(policy, max_slots=4, max_len=64).generate(
        prompts, max_new_tokens=32, ignore_eos=True
    )
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            gen = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                              dtype=torch.long), max_new_tokens=32,
                              do_sample=False, use_cache=True, pad_token_id=0)  # fmt: skip
        assert out.tokens == gen[0, len(prompt) :].tolist()


def test_the_losss_gradient_equals_pytorchs_within_1e5(moe):
    """d mean log p(token) / d weights, router and experts included, against autograd."""
    hf, path = moe
    policy = load_pretrained(path)
    ids, mask = left_padded_batch(np.random.default_rng(2), 97, [24, 17])
    positions = np.maximum(np.cumsum(mask, 1) - 1, 0)
    completion = (mask[:, 1:] * mask[:, :-1]).astype(np.float32)  # predicted from a real token

    hf.zero_grad()
    out = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
             position_ids=torch.tensor(positions))  # fmt: skip
    lp = torch.log_softmax(out.logits[:, :-1].float(), -1)
    picked = lp.gather(-1, torch.tensor(ids[:, 1:, None])).squeeze(-1)
    (-(picked * torch.tensor(completion)).sum() / completion.sum()).backward()
    ref = {n: p.grad.numpy() for n, p in hf.named_parameters()}

    def loss(params):  # noqa: ANN001, ANN202
        lps = policy.with_params(params).token_logprobs(ids, mask)
        return -(lps[:, 1:] * completion).sum() / completion.sum()

    grads = jax.grad(loss)(policy.params)
    ours = dict(hf_io.hf_tensors(grads, "float32"))  # HF names and layouts
    router = np.asarray(ours["model.layers.1.mlp.gate.weight"])
    np.testing.assert_allclose(router, ref["model.layers.1.mlp.gate.weight"], atol=1e-5)
    gate_up = ref["model.layers.0.mlp.experts.gate_up_proj"]  # transformers' fused [E, 2F, D]
    f = gate_up.shape[1] // 2
    for e in range(6):
        ours_gate = np.asarray(ours[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"])
        np.testing.assert_allclose(ours_gate, gate_up[e, :f], atol=1e-5)
        ours_down = np.asarray(ours[f"model.layers.0.mlp.experts.{e}.down_proj.weight"])
        np.testing.assert_allclose(ours_down, ref["model.layers.0.mlp.experts.down_proj"][e],
                                   atol=1e-5)  # fmt: skip
    assert np.abs(router).max() > 1e-4  # the router does learn


def test_save_then_transformers_load_gives_the_same_logits(moe, tmp_path):
    hf, path = moe
    policy = load_pretrained(path)
    policy.save_pretrained(str(tmp_path))
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == ["Qwen3MoeForCausalLM"] and saved["num_experts"] == 6
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
    ids, mask = left_padded_batch(np.random.default_rng(4), 97, [12, 9])
    real = mask.astype(bool)  # (padding rows depend on the attention kernel)
    np.testing.assert_allclose(hf_logits(back, ids, mask)[real], hf_logits(hf, ids, mask)[real],
                               atol=1e-5)  # fmt: skip


@pytest.mark.parametrize("impl", ["tiled", "ragged", "dense"])
def test_each_grouped_product_equals_the_per_group_reference(impl, monkeypatch):
    """Groups of 0, 1 and many rows, rows past the groups' total zero; and the experts' sum over
    a device's share of them (``first_expert``) is that share of the whole."""
    monkeypatch.setenv(GROUPED_MATMUL_ENV, impl)
    rng = np.random.default_rng(0)
    sizes = np.array([0, 5, 1, 19, 0, 3], np.int32)
    x = rng.normal(size=(30, 8)).astype(np.float32)
    w = rng.normal(size=(6, 8, 4)).astype(np.float32)
    out = np.asarray(jax.jit(lambda *a: grouped_matmul(*a))(x, w, sizes))  # traced per choice
    ref = np.zeros((30, 4), np.float32)
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    for g in range(6):
        ref[bounds[g] : bounds[g + 1]] = x[bounds[g] : bounds[g + 1]] @ w[g]
    np.testing.assert_allclose(out, ref, atol=1e-5)

    tokens = rng.normal(size=(10, 8)).astype(np.float32)
    experts = rng.integers(0, 6, (10, 2)).astype(np.int32)
    weights = rng.uniform(size=(10, 2)).astype(np.float32)
    gate, up = rng.normal(size=(2, 6, 8, 5)).astype(np.float32)
    down = rng.normal(size=(6, 5, 8)).astype(np.float32)
    whole = expert_outputs(tokens, experts, weights, gate, up, down)
    halves = sum(expert_outputs(tokens, experts, weights, gate[s], up[s], down[s], s.start)
                 for s in (slice(0, 3), slice(3, 6)))  # fmt: skip
    np.testing.assert_allclose(np.asarray(halves), np.asarray(whole), atol=1e-4)
    by_hand = sum(
        weights[:, j, None] * np.stack([
            (jax.nn.silu(tokens[n] @ gate[experts[n, j]]) * (tokens[n] @ up[experts[n, j]]))
            @ down[experts[n, j]] for n in range(10)
        ]) for j in range(2)
    )  # fmt: skip
    np.testing.assert_allclose(np.asarray(whole), by_hand, atol=1e-4)


def test_the_tiled_product_does_not_multiply_every_row_by_every_expert():
    """Its FLOPs (XLA's cost analysis) stay within 2x of the rows' own, where the dense
    reference's grow with the expert count."""
    import os

    x = jnp.zeros((256, 64), jnp.float32)
    w = jnp.zeros((32, 64, 64), jnp.float32)
    sizes = jnp.full((32,), 8, jnp.int32)
    flops = {}
    for impl in ("tiled", "dense"):
        os.environ[GROUPED_MATMUL_ENV] = impl
        try:
            traced = jax.jit(lambda *a: grouped_matmul(*a))  # a trace of its own per choice
            compiled = traced.lower(x, w, sizes).compile()
        finally:
            del os.environ[GROUPED_MATMUL_ENV]
        flops[impl] = compiled.cost_analysis()["flops"]
    rows_own = 2 * 256 * 64 * 64
    assert flops["tiled"] < 2.5 * rows_own, flops
    assert flops["dense"] > 30 * rows_own, flops


@pytest.mark.parametrize(
    "field, value",
    [("scoring_func", "sigmoid"), ("n_shared_experts", 1), ("decoder_sparse_step", 2),
     ("mlp_only_layers", [0]), ("topk_method", "noaux_tc")],
)  # fmt: skip
def test_a_router_or_layout_it_cannot_compute_is_one_line_naming_the_field(field, value):
    cfg = tiny_hf_model("qwen3_moe").config.to_dict()
    cfg[field] = value
    with pytest.raises(ModelConfigError) as err:
        ModelConfig.from_hf_dict(cfg)
    assert str(err.value).startswith(f"{field}=") and "\n" not in str(err.value)


def test_active_parameters_count_k_of_the_experts():
    cfg = ModelConfig.from_hf_dict(tiny_hf_model("qwen3_moe").config.to_dict())
    hf = tiny_hf_model("qwen3_moe")
    assert cfg.num_parameters() == sum(p.numel() for p in hf.parameters())
    expert = 3 * 64 * 32
    assert cfg.num_parameters() - cfg.num_active_parameters() == 2 * (6 - 2) * expert
