"""Episode tokens through real chat templates: prompt + model turns + observation tokens decode
to the template's rendering of the whole conversation (SmolLM2-135M-Instruct's tokenizer, whose
ChatML template has no tools, so the Hermes template applies; and a character tokenizer)."""

from __future__ import annotations

import string

import pytest
import transformers

from rlax_tasks.environments import (
    ChatRenderer,
    EnvironmentSpec,
    ToolCall,
    format_tool_call,
    make_environment,
    truncate_observation,
)
from rlax_tasks.models.packaged import ensure_packaged_model
from rlax_tasks.models.tokenizer import char_tokenizer

IM_START, IM_END = "<|im_start|>", "<|im_end|>"


@pytest.fixture(scope="module")
def smollm2():
    """The SmolLM2-135M-Instruct tokenizer (the packaged model, imported once and cached)."""
    return transformers.AutoTokenizer.from_pretrained(
        ensure_packaged_model("smollm2-135m-instruct")
    )


@pytest.fixture(scope="module")
def chars():
    """A character tokenizer over printable ASCII with ChatML's markers, without a template."""
    tok = char_tokenizer(string.printable)
    tok.add_special_tokens({"additional_special_tokens": [IM_START, IM_END]})
    return tok


def calc(expression: str) -> str:
    return format_tool_call(ToolCall("calculator", {"expression": expression}))


# three assistant turns, each with tool calls: the calculator environment answers them
TURNS = [
    "First the product.\n" + calc("12 * 34"),
    calc("408 + 5") + "\n" + calc("408 / 0"),
    'Check: <tool_call>{"name": "calculator"</tool_call>',
]


def episode(renderer: ChatRenderer, env) -> tuple[list[int], list[dict]]:
    """Tokens of a 3-turn episode as a worker builds them, and its messages."""
    messages = env.reset({"prompt": "What is 12 * 34 + 5?", "answer": "413"})
    tokens = renderer.initial_tokens(messages)
    for turn in TURNS:
        tokens += renderer.encode(turn + IM_END)  # what the model samples, ending at <|im_end|>
        result = env.step(turn)
        assert not result.done and result.messages
        tokens += renderer.observation_tokens(messages, turn, list(result.messages))
        messages = [*messages, {"role": "assistant", "content": turn}, *result.messages]
    return tokens, messages


@pytest.mark.parametrize("tokenizer", ["smollm2", "chars"])
def test_episode_tokens_decode_to_the_whole_conversation(tokenizer, request) -> None:
    tok = request.getfixturevalue(tokenizer)
    env = make_environment(EnvironmentSpec("calculator"))
    renderer = ChatRenderer(tok, env.tools)
    assert renderer.template is not None  # no tools in the tokenizer's template: Hermes ChatML
    tokens, messages = episode(renderer, env)
    want = tok.apply_chat_template(
        messages,
        tools=env.tools,
        chat_template=renderer.template,
        add_generation_prompt=True,
        tokenize=False,
    )
    got = tok.decode(tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert got == want
    # the Hermes layout: tools in the system turn, results in user turns, the next prompt last
    assert '<tools>\n{"type": "function", "function": {"name": "calculator"' in got
    assert "<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n" in got
    assert (
        "<tool_response>\n413\n</tool_response>\n<tool_response>\ncalculator: division by zero"
        in got
    )
    assert got.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert got.count("<|im_start|>assistant\n") == 4


def test_without_tools_the_tokenizers_own_template_is_used(smollm2) -> None:
    renderer = ChatRenderer(smollm2)
    assert renderer.template is None
    history = [{"role": "user", "content": "Hi!"}]
    tokens = renderer.initial_tokens(history) + renderer.encode("Hello." + IM_END)
    observation = [{"role": "user", "content": "Tell me more."}]
    tokens += renderer.observation_tokens(history, "Hello.", observation)
    whole = [*history, {"role": "assistant", "content": "Hello."}, *observation]
    want = smollm2.apply_chat_template(whole, add_generation_prompt=True, tokenize=False)
    assert smollm2.decode(tokens) == want
    assert want.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_end_of_turn_ids_are_im_end_and_eos(smollm2, chars) -> None:
    assert ChatRenderer(smollm2).end_of_turn_ids() == (smollm2.convert_tokens_to_ids(IM_END),)
    assert ChatRenderer(chars).end_of_turn_ids() == (
        chars.convert_tokens_to_ids(IM_END),
        chars.eos_token_id,
    )


def test_a_template_that_rewrites_history_falls_back_to_a_reference(smollm2) -> None:
    """A template that marks the last assistant turn differently (as reasoning templates strip
    earlier thoughts): the observation's tokens come from a neutral conversation."""
    tok = transformers.AutoTokenizer.from_pretrained(smollm2.name_or_path)
    tok.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
        "{% if m['role'] == 'assistant' and loop.last %}{{ '[latest] ' }}{% endif %}"
        "{{ m['content'] + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    renderer = ChatRenderer(tok)
    obs = [{"role": "user", "content": "more"}]
    tokens = renderer.observation_tokens([{"role": "user", "content": "hi"}], "hello", obs)
    assert tok.decode(tokens) == "\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n"


def test_truncate_observation_keeps_the_head_and_the_next_prompt(smollm2) -> None:
    renderer = ChatRenderer(smollm2, [{"type": "function", "function": {"name": "f"}}])
    long_output = " ".join(f"line{i}" for i in range(400))
    obs = [{"role": "tool", "name": "f", "content": long_output}]
    tokens = renderer.observation_tokens([{"role": "user", "content": "go"}], "ok", obs)
    assert len(tokens) > 300
    cut = truncate_observation(tokens, 64, smollm2)
    assert len(cut) == 64
    text = smollm2.decode(cut)
    assert text.startswith("\n<|im_start|>user\n<tool_response>\nline0 line1")
    assert f"[... observation cut: {len(tokens)} tokens, limit 64 ...]" in text
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert truncate_observation(tokens, len(tokens), smollm2) == tokens
