"""evaluate_pass_rates on a hand-built bigram policy whose answers are known exactly."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlax_tasks.models import Policy
from rlax_tasks.models.tokenizer import char_tokenizer
from rlax_tasks.rewards.tasks import ArithmeticTask, Problem
from rlax_tasks.warmup import TinyArith, evaluate_pass_rates
from tests.tiny_model import tiny_model_config

TOKENIZER = char_tokenizer()
VOCAB = len(TOKENIZER)
HIDDEN = 80  # >= VOCAB: the embedding is the identity, so the model is a bigram table


def _id(char: str) -> int:
    return TOKENIZER.convert_tokens_to_ids(char)


def bigram_policy(next_tokens: dict[str, list[str]]) -> Policy:
    """A transformer whose next token depends only on the current one: after character c it
    emits one of next_tokens[c] (uniformly at temperature 1), else <eos>.

    Attention and MLP outputs are zero, so the residual stream is the one-hot embedding of the
    current token; the LM head row of that token holds the bigram logits.
    """
    config = tiny_model_config(
        "one_layer",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=16,
        head_dim=40,
        qkv_bias=False,
        eos_token_id=TOKENIZER.eos_token_id,
        bos_token_id=TOKENIZER.bos_token_id,
        pad_token_id=TOKENIZER.pad_token_id,
    )
    policy = Policy.init(config, seed=0, tokenizer=TOKENIZER)
    pure = nnx.to_pure_dict(policy.params)
    layers = pure["layers"]
    layers["self_attn"]["o_proj"]["kernel"] = jnp.zeros_like(
        layers["self_attn"]["o_proj"]["kernel"]
    )
    layers["mlp"]["down_proj"]["kernel"] = jnp.zeros_like(layers["mlp"]["down_proj"]["kernel"])
    pure["embed_tokens"]["embedding"] = jnp.eye(VOCAB, HIDDEN)
    pure["norm"]["weight"] = jnp.ones(HIDDEN)
    # after the final RMSNorm the hidden state is onehot * sqrt(HIDDEN): logit 40 where allowed
    head = np.zeros((HIDDEN, VOCAB), np.float32)
    head[:VOCAB, TOKENIZER.eos_token_id] = 40.0 / np.sqrt(HIDDEN)
    for char, nexts in next_tokens.items():
        head[_id(char)] = 0.0
        for nxt in nexts:
            head[_id(char), _id(nxt)] = 40.0 / np.sqrt(HIDDEN)
    pure["lm_head"]["kernel"] = jnp.asarray(head)
    nnx.replace_by_pure_dict(policy.params, pure)
    return policy


def arithmetic(expression: str, answer: int) -> Problem:
    return Problem(
        "arithmetic", expression, expression + "=", str(answer), {"expression": expression}
    )


PROBLEMS = [arithmetic("1 + 2", 3), arithmetic("5 - 2", 3), arithmetic("2 + 2", 4)]
FORMAT = TinyArith(ArithmeticTask(min_digits=1, max_digits=1, num_operands=2))


def test_greedy_bigram_answers_three_for_every_prompt() -> None:
    policy = bigram_policy({"=": ["3"]})  # "...=" -> "3" -> <eos>
    result = evaluate_pass_rates(
        policy, PROBLEMS, n=4, k_list=(1, 4), temperature=0.0, max_new_tokens=4, task_format=FORMAT
    )
    # two of three answers are 3; greedy samples are identical, so pass@4 == pass@1
    assert result["pass@1"] == pytest.approx(2 / 3)
    assert result["pass@4"] == pytest.approx(2 / 3)
    assert result["mean_reward"] == pytest.approx(2 / 3)
    assert result["num_prompts"] == 3 and result["num_samples"] == 4


def test_sampled_bigram_is_right_half_the_time() -> None:
    policy = bigram_policy({"=": ["3", "4"]})  # "3" or "4" with probability 1/2 each
    result = evaluate_pass_rates(
        policy,
        PROBLEMS,
        n=200,
        k_list=(1, 8),
        temperature=1.0,
        max_new_tokens=4,
        seed=3,
        task_format=FORMAT,
    )
    assert result["pass@1"] == pytest.approx(0.5, abs=0.08)
    # pass@8 of a coin flip: 1 - 2^-8 (the unbiased estimator from 200 samples is close to it)
    assert result["pass@8"] == pytest.approx(1 - 0.5**8, abs=0.01)


def test_wrong_answers_and_unfinished_completions_score_zero() -> None:
    policy = bigram_policy({"=": ["7"], "7": ["7"]})  # "7777..." never ends
    result = evaluate_pass_rates(
        policy, PROBLEMS, n=2, k_list=(1, 2), temperature=0.0, max_new_tokens=3, task_format=FORMAT
    )
    assert result["pass@1"] == 0.0 and result["pass@2"] == 0.0


def test_invalid_arguments_name_the_field() -> None:
    policy = bigram_policy({"=": ["3"]})
    with pytest.raises(ValueError, match="k_list"):
        evaluate_pass_rates(policy, PROBLEMS, n=4, k_list=(8,), task_format=FORMAT)
    with pytest.raises(ValueError, match="n must be"):
        evaluate_pass_rates(policy, PROBLEMS, n=0, k_list=(1,), task_format=FORMAT)
    with pytest.raises(ValueError, match="at least one problem"):
        evaluate_pass_rates(policy, [], n=1, k_list=(1,), task_format=FORMAT)
