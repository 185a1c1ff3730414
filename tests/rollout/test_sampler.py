"""The KV-cache sampler: exact against reference decodes; log-probs, sampling knobs, batching."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from rlax_tasks.models import Policy, load_pretrained
from rlax_tasks.models.reference_decode import greedy_decode
from rlax_tasks.models.tokenizer import char_tokenizer
from rlax_tasks.rollout import Request, Sampler, SamplingParams
from rlax_tasks.rollout.kernels import fold_in_rows, request_keys
from rlax_tasks.rollout.logprob_gaps import forward_logprob_gaps
from rlax_tasks.rollout.shapes import admission_rows, admission_sizes, decode_window, prompt_bucket
from tests.models.hf_models import tiny_hf_model
from tests.rollout.prefill_rows import record_prefill_rows
from tests.tiny_model import tiny_model_config

CONFIG = tiny_model_config("wide", vocab_size=97, eos_token_id=2)
LENGTHS = [3, 17, 5, 30, 9, 1]


@pytest.fixture(scope="module")
def policy():
    return Policy.init(CONFIG, seed=3)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [[int(t) for t in rng.integers(3, CONFIG.vocab_size, n)] for n in LENGTHS]


@pytest.fixture(scope="module")
def sampler(policy):
    # fewer slots than prompts: slots are reused (continuous batching) within one call
    return Sampler(policy, max_slots=4, max_len=96)


def test_greedy_equals_no_cache_reference_decode(sampler, policy, prompts):
    outs = sampler.generate(prompts, max_new_tokens=24)
    ref = greedy_decode(policy, prompts, 24)
    assert [o.tokens for o in outs] == ref
    for o in outs:
        assert o.finish_reason == ("eos" if o.tokens[-1] == 2 else "length")
        assert len(o.tokens) == len(o.logprobs)


def test_decode_attends_over_a_window_that_grows_with_its_slots(policy):
    """Decode reads only the cache entries its slots have written (a window of MIN_WINDOW times
    1, 1.5, 2, 3, ..., up to a third of max_len, then every entry); completions that cross from
    one window into the next stay exact."""
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(3, CONFIG.vocab_size, n)] for n in (50, 3, 61)]
    sampler = Sampler(policy, max_slots=2, max_len=200, decode_chunk=5)
    outs = sampler.generate(prompts, max_new_tokens=40, ignore_eos=True)
    assert [o.tokens for o in outs] == greedy_decode(policy, prompts, 40, stop_ids=[])
    for prompt, out in zip(prompts, outs, strict=True):  # every step saw every earlier token
        forward = policy.token_logprobs(np.array(prompt + out.tokens)[None])[0, len(prompt) :]
        np.testing.assert_allclose(out.logprobs, np.asarray(forward), atol=1e-5)
    ends = (1, 64, 65, 96, 97, 128, 129, 192, 193, 257, 1024, 1025)
    assert [decode_window(n, 4096) for n in ends] == [
        64, 64, 96, 96, 128, 128, 192, 192, 256, 384, 1024, 4096
    ]  # fmt: skip
    # past a third of max_len, every entry in place moves fewer bytes than a window's copy
    assert [decode_window(n, 200) for n in (1, 64, 65, 200)] == [64, 64, 200, 200]


def test_greedy_equals_transformers_generate(tmp_path):
    hf = tiny_hf_model("qwen2", seed=1, eos_token_id=2, pad_token_id=0)
    hf.save_pretrained(tmp_path)
    policy = load_pretrained(str(tmp_path))
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(3, 97, n)] for n in (4, 11, 7)]
    outs = Sampler(policy, max_slots=2, max_len=64).generate(prompts, max_new_tokens=16)
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            gen = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=16,
                do_sample=False,
                use_cache=True,
                eos_token_id=2,
                pad_token_id=0,
            )
        assert out.tokens == gen[0, len(prompt) :].tolist()


def test_logprobs_match_the_policy_forward_pass(sampler, policy, prompts):
    outs = sampler.generate(prompts, max_new_tokens=20, temperature=1.0, seed=5, n=2)
    assert len(outs) == 2 * len(prompts)
    for k, out in enumerate(outs):
        prompt = prompts[k // 2]  # prompt-major
        ids = np.array(prompt + out.tokens)[None]
        forward = np.asarray(policy.token_logprobs(ids))[0, len(prompt) :]
        np.testing.assert_allclose(out.logprobs, forward, atol=1e-5)


def test_logprobs_are_those_of_the_tempered_and_filtered_distribution(sampler, policy, prompts):
    temperature, top_k = 0.7, 5
    outs = sampler.generate(prompts[:3], max_new_tokens=12, temperature=temperature, top_k=top_k)
    for prompt, out in zip(prompts, outs, strict=False):
        ids = np.array(prompt + out.tokens)[None]
        logits = np.asarray(policy.logits(ids))[0, len(prompt) - 1 : -1] / temperature
        kth = np.sort(logits, axis=-1)[:, -top_k][:, None]
        kept = np.where(logits >= kth, logits, -np.inf)
        expected = jax.nn.log_softmax(jnp.asarray(kept), axis=-1)
        picked = np.take_along_axis(np.asarray(expected), np.array(out.tokens)[:, None], 1)[:, 0]
        assert np.all(np.isfinite(picked)), "a token outside the top-k set was sampled"
        np.testing.assert_allclose(out.logprobs, picked, atol=1e-5)


def test_each_tokens_kept_support_is_recorded_for_the_trainer(policy, prompts):
    """With a support capacity, a filtering request's tokens carry the ids its top-k/top-p kept
    (the trainer's log-probs are then renormalised over them): exactly the tempered top-k set,
    holding the drawn token, whose renormalised log-prob is the recorded one; a nucleus larger
    than the capacity is recorded empty; unfiltered and greedy requests record none."""
    sampler = Sampler(policy, max_slots=4, max_len=96, support_capacity=6)
    temperature, top_k = 0.7, 5
    outs = sampler.generate(prompts[:3], max_new_tokens=12, temperature=temperature, top_k=top_k)
    for prompt, out in zip(prompts, outs, strict=False):
        logits = np.asarray(policy.logits(np.array(prompt + out.tokens)[None]))[0]
        logits = logits[len(prompt) - 1 : -1] / temperature
        assert len(out.support) == len(out.tokens)
        for row, token, kept, logprob in zip(
            logits, out.tokens, out.support, out.logprobs, strict=True
        ):
            assert sorted(kept) == sorted(np.argsort(row)[-top_k:].tolist()) and token in kept
            z = row[kept]
            log_norm = np.log(np.sum(np.exp(z - z.max()))) + z.max()
            np.testing.assert_allclose(logprob, row[token] - log_norm, atol=1e-5)
    # top-p 0.99 over a 97-token vocabulary keeps more than 6 ids: not replayable, recorded empty
    (broad,) = sampler.generate(prompts[:1], max_new_tokens=6, temperature=1.0, top_p=0.99)
    assert broad.support is not None and [] in broad.support
    assert all(len(kept) <= 6 for kept in broad.support)
    (plain,) = sampler.generate(prompts[:1], max_new_tokens=4, temperature=1.0)
    (greedy,) = sampler.generate(prompts[:1], max_new_tokens=4, top_k=5)
    assert plain.support is None and greedy.support is None
    (unrecorded,) = Sampler(policy, max_slots=4, max_len=96).generate(
        prompts[:1], max_new_tokens=4, temperature=0.7, top_k=5
    )
    assert unrecorded.support is None


def test_same_seed_same_output_whatever_shares_the_batch(policy, prompts):
    target = prompts[1]
    alone = Sampler(policy, max_slots=1, max_len=96).generate(
        [target], max_new_tokens=20, temperature=1.0, seed=11, n=3
    )
    crowded = Sampler(policy, max_slots=8, max_len=96).generate(
        [prompts[0], target, prompts[3]], max_new_tokens=20, temperature=1.0, seed=11, n=3
    )[3:6]
    for a, b in zip(alone, crowded, strict=True):
        assert a.tokens == b.tokens
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-6)
    # the n samples of one prompt differ from each other, and another seed changes them
    assert len({tuple(o.tokens) for o in alone}) == 3
    other = Sampler(policy, max_slots=1, max_len=96).generate(
        [target], max_new_tokens=20, temperature=1.0, seed=12
    )
    assert other[0].tokens != alone[0].tokens


def test_a_prompt_shared_by_several_requests_is_prefilled_once(policy, prompts):
    """A group's G samples of one prompt take one prefill row (its cache entries copied to each
    slot), and they complete exactly as each prefilled on its own (one slot at a time)."""
    shared = Sampler(policy, max_slots=16, max_len=96)
    rows = record_prefill_rows(shared)
    kwargs = dict(max_new_tokens=12, temperature=1.0, seed=5, n=4)
    out = shared.generate(prompts[:3], **kwargs)  # 12 rows, 3 prompts
    # 3 distinct prompts of 12 requests: 4 prompt rows (padded) for 16 admission rows
    assert rows == [(4, 16)]
    alone = Sampler(policy, max_slots=1, max_len=96).generate(prompts[:3], **kwargs)
    assert [o.tokens for o in out] == [o.tokens for o in alone]
    for a, b in zip(out, alone, strict=True):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-6)
    # every row its own prompt: no sharing, the prefill computes every row
    rows.clear()
    shared.generate(prompts[:3], max_new_tokens=4, temperature=1.0, seed=5)
    assert rows == [(4, None)]


def test_request_keys_are_fold_in_of_the_seed_key_and_sample_index():
    # one device call per admission must give each request the key it always had
    seeds = [0, 11, 11, 2**31 - 1, 2**31, 2**32 + 5, -3]
    indices = [0, 0, 7, 1, 2, 3, 4]
    expected = [
        np.asarray(jax.random.key_data(jax.random.fold_in(jax.random.PRNGKey(s), i)))
        for s, i in zip(seeds, indices, strict=True)
    ]
    np.testing.assert_array_equal(request_keys(seeds, indices), np.stack(expected))
    assert request_keys([], []).shape == (0, 2)
    # admissions of any size compile once per power of two, not once per size
    before = fold_in_rows._cache_size()
    for n in range(1, 33):
        assert request_keys(list(range(n)), [1] * n).shape == (n, 2)
    assert fold_in_rows._cache_size() - before <= 6


def test_top_k_1_and_tiny_top_p_are_greedy(sampler, prompts):
    greedy = sampler.generate(prompts, max_new_tokens=10)
    top1 = sampler.generate(prompts, max_new_tokens=10, temperature=1.3, top_k=1, seed=4)
    nucleus = sampler.generate(prompts, max_new_tokens=10, temperature=1.3, top_p=1e-6, seed=4)
    assert [o.tokens for o in top1] == [o.tokens for o in greedy]
    assert [o.tokens for o in nucleus] == [o.tokens for o in greedy]
    for o in top1:  # the filtered distribution is a point mass: log-prob 0
        np.testing.assert_allclose(o.logprobs, 0.0, atol=1e-6)


def test_per_request_parameters_in_one_batch(sampler, prompts):
    params = [
        SamplingParams(max_new_tokens=5),
        SamplingParams(max_new_tokens=9, temperature=1.0, seed=1),
        SamplingParams(max_new_tokens=7, temperature=0.8, top_p=0.9, seed=2),
    ]
    outs = sampler.generate(prompts[:3], params=params)
    alone = [sampler.generate([p], params=[sp])[0] for p, sp in zip(prompts, params, strict=False)]
    assert [o.tokens for o in outs] == [o.tokens for o in alone]
    assert [len(o.tokens) for o in outs if o.finish_reason == "length"] == [
        sp.max_new_tokens for sp, o in zip(params, outs, strict=True) if o.finish_reason == "length"
    ]


def test_stop_token_ids_and_stop_strings():
    tok = char_tokenizer()
    config = tiny_model_config(
        "one_layer", model_type="llama", vocab_size=len(tok), qkv_bias=False, eos_token_id=2
    )
    policy = Policy.init(config, seed=0, tokenizer=tok)
    sampler = Sampler(policy, max_slots=2, max_len=64)
    prompt = tok.encode("12+3=")
    kwargs = dict(max_new_tokens=30, temperature=1.0, seed=3, ignore_eos=True)
    free = sampler.generate([prompt], **kwargs)[0]
    assert free.finish_reason == "length" and len(free.tokens) == 30
    text = tok.decode(free.tokens)

    # stop at the first occurrence of a token id: it is kept, reason "stop"
    stop_id = free.tokens[7]
    first = free.tokens.index(stop_id)
    out = sampler.generate([prompt], **kwargs, stop_token_ids=[stop_id])[0]
    assert out.tokens == free.tokens[: first + 1] and out.finish_reason == "stop"

    # a two-character stop string: the completion ends with the token that completes it
    needle = text[10:12]
    out = sampler.generate([prompt], **kwargs, stop_strings=[needle])[0]
    assert out.finish_reason == "stop"
    assert tok.decode(out.tokens).endswith(needle)
    assert needle not in tok.decode(out.tokens[:-1])
    assert out.tokens == free.tokens[: len(out.tokens)]


def test_static_and_continuous_batching_give_the_same_completions(policy, prompts):
    kwargs = dict(max_new_tokens=16, temperature=1.0, seed=9)
    cont = Sampler(policy, max_slots=2, max_len=96).generate(prompts, **kwargs)
    static = Sampler(policy, max_slots=2, max_len=96, batching="static").generate(prompts, **kwargs)
    assert [o.tokens for o in cont] == [o.tokens for o in static]


def test_weight_swap_without_recompilation(policy, prompts):
    sampler = Sampler(policy, max_slots=4, max_len=96)
    sampler.generate(prompts, max_new_tokens=8)
    compiled = (sampler._prefill_fn._cache_size(), sampler._decode_fn._cache_size())
    other = Policy.init(CONFIG, seed=99)
    seconds = sampler.set_params(other.params)
    assert seconds > 0 and sampler.stats.last_swap_s == seconds
    outs = sampler.generate(prompts, max_new_tokens=8)
    assert [o.tokens for o in outs] == greedy_decode(other, prompts, 8)
    assert (sampler._prefill_fn._cache_size(), sampler._decode_fn._cache_size()) == compiled


def test_a_sampler_decodes_through_its_held_copies_and_swaps_them_with_the_weights(prompts):
    """On CPU the sampler keeps a tied embedding's [D, V] transpose for the lm head and each
    layer's weights unstacked (``held_weights``): exact against the reference decode, before
    and after a swap, which frees the old copies."""
    tied = dataclasses.replace(CONFIG, tie_word_embeddings=True)
    policy, other = Policy.init(tied, seed=3), Policy.init(tied, seed=99)
    sampler = Sampler(policy, max_slots=4, max_len=96)
    held = sampler._held
    assert held.unembedding.shape == (tied.hidden_size, tied.vocab_size)
    assert len(held.layers) == tied.num_hidden_layers
    outs = sampler.generate(prompts, max_new_tokens=8)
    assert [o.tokens for o in outs] == greedy_decode(policy, prompts, 8)
    sampler.set_params(other.params)
    assert all(a.is_deleted() for a in jax.tree.leaves(tuple(held)))
    outs = sampler.generate(prompts, max_new_tokens=8)
    assert [o.tokens for o in outs] == greedy_decode(other, prompts, 8)
    for prompt, out in zip(prompts, outs, strict=True):
        forward = other.token_logprobs(np.array(prompt + out.tokens)[None])[0, len(prompt) :]
        np.testing.assert_allclose(out.logprobs, np.asarray(forward), atol=1e-5)


def test_weight_swap_rejects_other_shapes(sampler):
    wrong = Policy.init(dataclasses.replace(CONFIG, hidden_size=32, head_dim=8), seed=0)
    with pytest.raises(ValueError, match="do not match"):
        sampler.set_params(wrong.params)


def test_incremental_api_abort_drops_partial_rollouts(policy, prompts):
    sampler = Sampler(policy, max_slots=2, max_len=96)
    for i, p in enumerate(prompts):
        sampler.add_request(Request.make(p, SamplingParams(max_new_tokens=40), request_id=i))
    sampler.step()
    assert sampler.num_active == 2
    dropped = sampler.abort()
    assert sorted(r.request_id for r in dropped) == list(range(len(prompts)))
    assert not sampler.has_unfinished
    # the sampler is clean afterwards: a fresh generate matches the reference
    assert [o.tokens for o in sampler.generate(prompts[:2], max_new_tokens=8)] == greedy_decode(
        policy, prompts[:2], 8
    )


def test_abort_leaves_nothing_that_compiles_again(policy, prompts, caplog):
    """A worker aborts at every weight reload; afterwards the same admission and decode shapes
    reuse their programs (an uncommitted array in the slot state compiled them all again)."""
    sampler = Sampler(policy, max_slots=2, max_len=96)
    sampler.generate(prompts[:2], max_new_tokens=8)
    sampler.abort()
    with jax.log_compiles(), caplog.at_level("WARNING"):
        caplog.clear()
        sampler.generate(prompts[:2], max_new_tokens=8)
    compiled = [r.getMessage() for r in caplog.records if "Compiling jit(" in r.getMessage()]
    assert not [m for m in compiled if "_prefill" in m or "_decode" in m], compiled


def test_admissions_pad_to_a_few_sizes_at_most_a_sixteenth_of_the_slots_apart():
    assert admission_sizes(128) == [8, 16, 32, 64, 128]
    assert admission_sizes(16) == [1, 2, 4, 8, 16]
    assert admission_sizes(100) == [8, 16, 32, 64, 128]
    for slots in (1, 3, 16, 64, 100, 128, 256):
        for n in range(1, slots + 1):
            rows = admission_rows(n, slots)
            assert rows >= n and rows in admission_sizes(slots)
            assert rows - n <= max(n, -(-slots // 16))  # at most doubled, or a sixteenth


def test_prompts_pad_to_powers_of_two_from_eight():
    """Short prompts (a tiny-arith prompt has 5-7 tokens) prefill at 8, not 16: half the rows
    of their prefill were padding."""
    assert [prompt_bucket(n, 64) for n in (1, 5, 8, 9, 16, 17, 40)] == [8, 8, 8, 16, 16, 32, 64]
    assert prompt_bucket(40, 32) == 32  # never past max_len


def _run_script(script: str, *args: str) -> subprocess.CompletedProcess:
    """``script`` in a fresh Python process (its own JAX configuration) from the repository root."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": root}
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True, text=True, cwd=root, timeout=300, env=env,
    )  # fmt: skip


_PRECOMPILE = """
import os, sys, jax
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
from rlax_tasks.models import Policy
from rlax_tasks.rollout import Request, Sampler, SamplingParams
from tests.tiny_model import tiny_model_config
policy = Policy.init(tiny_model_config("wide", vocab_size=97, eos_token_id=2), seed=3)
sampler = Sampler(policy, max_slots=16, max_len=200, precompile=sys.argv[2] == "on")
short = dict(max_new_tokens=4, temperature=1.0)
distinct = lambda n: [[5, 6, 7 + i] for i in range(n)]  # (equal prompts share a prefill row)
sampler.generate(distinct(8), **short)  # 8 rows, window 64: one size so far
print("after one size:", sum(t.is_alive() for t in sampler._precompiler.threads))
sampler.generate(distinct(3), **short)  # 4 rows: two sizes, as a whole-batch start can give
print("after two sizes:", sum(t.is_alive() for t in sampler._precompiler.threads))
sampler.generate(distinct(2), **short)  # 2 rows: sizes vary, the others (1, 16) follow
# a request that will reach 73 cache entries (past window 64: every entry, 200): one decode
# chunk, then dropped
long = SamplingParams(max_new_tokens=70, temperature=1.0, ignore_eos=True)
sampler.add_request(Request.make([5, 6, 7], long))
sampler.step()
sampler.abort()
sampler.wait_precompiled()
entries = lambda: {n: os.stat(os.path.join(sys.argv[1], n)).st_mtime_ns
                   for n in os.listdir(sys.argv[1])}
before = entries()
print("prefills:", sum(n.startswith("jit__prefill") for n in before))
print("decodes:", sum(n.startswith("jit__decode") for n in before))
sampler.generate(distinct(1), **short)
sampler.generate(distinct(16), **short)
sampler.generate(distinct(1), max_new_tokens=70, temperature=1.0, ignore_eos=True)
print("compiled later:", sorted(n for n, t in entries().items() if before.get(n) != t))
# groups of 4 equal prompts: 8 rows of 2 prompts compile here; then 16 rows of 4 prompts (or
# 5: a group split between admissions) are likely and follow in the background
sampler.generate(distinct(2), n=4, **short)
sampler.wait_precompiled()
before = entries()
sampler.generate(distinct(4), n=4, **short)
print("groups compiled later:", sorted(n for n, t in entries().items() if before.get(n) != t))
"""


@pytest.mark.slow
@pytest.mark.parametrize("precompile", ["on", "off"])
def test_admissions_of_varying_size_and_longer_requests_precompile_what_follows(
    tmp_path, precompile
):
    """With a persistent compilation cache, once admissions came in three sizes every other size
    compiles in the background, and so do the attention windows the slots' requests will
    reach: later calls only read the cache (a call that compiled would have written an entry).
    One or two admission sizes precompile nothing (a workload admitting whole batches, whose
    first requests trickled in)."""
    out = _run_script(_PRECOMPILE, str(tmp_path), precompile)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in out.stdout.splitlines())
    assert lines["after one size"] == "0" and lines["after two sizes"] == "0", out.stdout
    if precompile == "on":  # sizes 1, 2, 4, 8, 16; windows 64 and every entry
        assert lines["prefills"] == "5" and lines["decodes"] == "2", out.stdout
        assert lines["compiled later"] == "[]", out.stdout
        assert lines["groups compiled later"] == "[]", out.stdout
    else:  # the check can fail: without precompiling, the later calls compile
        assert lines["prefills"] == "4" and lines["decodes"] == "1", out.stdout  # 8, 4, 2, 1 rows
        assert "jit__prefill" in lines["compiled later"], out.stdout
        assert "jit__decode" in lines["compiled later"], out.stdout
        assert "jit__prefill" in lines["groups compiled later"], out.stdout


_EXIT_WHILE_PRECOMPILING = """
import sys, jax
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
from rlax_tasks.models import Policy
from rlax_tasks.rollout import Sampler
from tests.tiny_model import tiny_model_config
policy = Policy.init(tiny_model_config("wide", vocab_size=97, eos_token_id=2), seed=3)
sampler = Sampler(policy, max_slots=64, max_len=96, precompile=True)
sampler.generate([[5, 6, 7]] * 8, max_new_tokens=4, temperature=1.0)
sampler.generate([[5, 6, 7]] * 3, max_new_tokens=4, temperature=1.0)  # a second size
sampler.generate([[5, 6, 7]] * 12, max_new_tokens=4, temperature=1.0)  # a third: 32, 64 follow
print("alive:", any(t.is_alive() for t in sampler._precompiler.threads))
"""


@pytest.mark.slow
def test_a_process_that_exits_while_precompiling_exits_0(tmp_path):
    """The background compilation must not outlive the interpreter (a daemon thread inside
    XLA's compiler at exit aborted the process: exit 134)."""
    out = _run_script(_EXIT_WHILE_PRECOMPILING, str(tmp_path))
    assert "alive: True" in out.stdout, out.stdout  # it exited in the middle of precompiling
    assert out.returncode == 0, out.stderr[-2000:]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(stop_token_ids=[500]), "stop_token_ids"),
        (dict(max_new_tokens=90), "max_len"),
        (dict(n=0), "n must be"),
    ],
)
def test_bad_requests_name_the_problem(sampler, prompts, kwargs, message):
    with pytest.raises(ValueError, match=message):
        sampler.generate(prompts[3:4], **kwargs)
    assert not sampler.has_unfinished


def test_empty_prompt_and_bad_token_are_rejected(sampler):
    with pytest.raises(ValueError, match="empty"):
        sampler.generate([[]])
    with pytest.raises(ValueError, match="token ids"):
        sampler.generate([[5, 1000]])


def test_bfloat16_logprob_mismatch_is_small(prompts):
    """docs/design.md §5: sampler vs trainer-forward log-probs differ in bf16; report the p95 of
    |Δ|."""
    policy = Policy.init(CONFIG, dtype="bfloat16", seed=3)
    outs = Sampler(policy, max_slots=4, max_len=48).generate(
        prompts[:4], max_new_tokens=12, temperature=1.0, seed=0
    )
    gaps = forward_logprob_gaps(policy, prompts, outs)
    assert gaps.shape == (sum(len(o.tokens) for o in outs),)
    p95 = float(np.percentile(gaps, 95))
    print(f"bf16 sampler vs forward log-prob |delta| p95 = {p95:.4f}")
    assert p95 < 0.1


def test_a_seed_per_prompt_makes_the_samples_of_equal_prompts_independent(policy, prompts):
    """A seed is per request: one seed shared by many prompts shares their random stream, so
    evaluation gives each prompt its own seed (prompt_seeds)."""
    from rlax_tasks.evaluation.generation import sample_token_ids
    from rlax_tasks.rollout import SamplingParams, prompt_seeds

    seeds = prompt_seeds(0, 6)
    assert len(set(seeds)) == 6 and seeds == prompt_seeds(0, 6) and seeds != prompt_seeds(1, 6)
    same = [prompts[0]] * 6
    sampler = Sampler(policy, max_slots=8, max_len=96)
    shared = sampler.generate(same, max_new_tokens=12, temperature=1.0, seed=0)
    assert len({tuple(o.tokens) for o in shared}) == 1  # one seed: one random stream
    params = [SamplingParams(max_new_tokens=12, temperature=1.0, seed=s) for s in seeds]
    own = sampler.generate(same, params=params)
    assert len({tuple(o.tokens) for o in own}) > 1
    evaluated = sample_token_ids(
        policy, same, 1, max_new_tokens=12, temperature=1.0, seed=0, sampler=sampler
    )
    assert [e[0] for e in evaluated] == [o.tokens for o in own]
