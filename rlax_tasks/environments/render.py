"""An episode's tokens through the model's own chat template (docs/design.md §15): the prompt,
then, after each assistant turn, the observation tokens that the template puts between that
turn's end and the next turn's start. Every piece is a text delta of full renderings, so the
concatenation decodes to the template's rendering of the whole conversation."""

from __future__ import annotations

import functools
import importlib.resources
from collections.abc import Sequence
from typing import Any

IM_END = "<|im_end|>"
# a neutral conversation, for templates that rewrite earlier turns once a later one follows
_REFERENCE = [{"role": "user", "content": "Hello."}]
_REFERENCE_TURN = "Hello! How can I help you today?"


@functools.cache
def hermes_chatml_template() -> str:
    """The packaged ChatML template with Hermes-style tools (templates/hermes_chatml.jinja)."""
    path = importlib.resources.files(__package__).joinpath("templates/hermes_chatml.jinja")
    return path.read_text(encoding="utf-8")


def end_of_turn_ids(tokenizer: Any) -> tuple[int, ...]:
    """The ids that end an assistant turn: ``<|im_end|>`` when the vocabulary has it, then eos."""
    ids = []
    vocab = tokenizer.get_vocab()
    if IM_END in vocab:
        ids.append(vocab[IM_END])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return tuple(ids)


class ChatRenderer:
    """Renders messages with ``tokenizer``'s chat template, or with the Hermes ChatML template
    when tools are given and that template has none (or there is no template at all).

    Args:
      tokenizer: a transformers tokenizer.
      tools: function schemas listed to the model (an environment's ``tools``).
    """

    def __init__(self, tokenizer: Any, tools: list[dict] | None = None) -> None:
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools else None
        own = getattr(tokenizer, "chat_template", None)
        own_text = str(own) if own else ""
        needs_ours = not own_text or (self.tools is not None and "tools" not in own_text)
        self.template: str | None = hermes_chatml_template() if needs_ours else None
        self._eot_ids = end_of_turn_ids(tokenizer)
        self._eot_texts = tuple(tokenizer.convert_ids_to_tokens(list(self._eot_ids)))

    def render(self, messages: Sequence[dict], add_generation_prompt: bool) -> str:
        """The text of ``messages`` under the template."""
        return self.tokenizer.apply_chat_template(
            list(messages),
            tools=self.tools,
            chat_template=self.template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )

    def encode(self, text: str) -> list[int]:
        """``text``'s ids, without the tokenizer's own bos/eos."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def initial_tokens(self, messages: Sequence[dict]) -> list[int]:
        """The prompt of an episode: ``messages`` and the generation prompt."""
        return self.encode(self.render(messages, add_generation_prompt=True))

    def end_of_turn_ids(self) -> tuple[int, ...]:
        """The ids that end an assistant turn (stop tokens of generation)."""
        return self._eot_ids

    def observation_tokens(
        self, history: Sequence[dict], turn_text: str, observation: Sequence[dict]
    ) -> list[int]:
        """The tokens after the assistant's end-of-turn token when ``observation`` follows the
        turn ``turn_text`` (after ``history``), ending with the next generation prompt."""
        delta = self._delta(history, turn_text, observation)
        if delta is None:  # the template rewrites earlier turns: measure on a neutral one
            delta = self._reference_delta(observation)
        return self.encode(delta)

    def _delta(
        self, history: Sequence[dict], turn_text: str, observation: Sequence[dict]
    ) -> str | None:
        """What rendering ``observation`` adds after the turn's end, or None when it changes
        the text before it."""
        turn = [*history, {"role": "assistant", "content": turn_text}]
        base = self.render(turn, add_generation_prompt=False)
        full = self.render([*turn, *observation], add_generation_prompt=True)
        if not full.startswith(base):
            return None
        return self._after_end_of_turn(base) + full[len(base) :]

    def _reference_delta(self, observation: Sequence[dict]) -> str:
        """The text after the assistant's end-of-turn in a reference exchange followed by
        ``observation``: the turn is found by its (unique) text, not by a prefix."""
        turn = [*_REFERENCE, {"role": "assistant", "content": _REFERENCE_TURN}]
        full = self.render([*turn, *observation], add_generation_prompt=True)
        at = full.find(_REFERENCE_TURN)
        if at == -1:
            raise ValueError(
                "the chat template drops the assistant's reply once messages follow it; it "
                "cannot render multi-turn episodes (give the tokenizer a template that keeps "
                "earlier turns)"
            )
        start = at + len(_REFERENCE_TURN)
        found = [(full.find(t, start), t) for t in self._eot_texts if t and t in full[start:]]
        if not found:
            return full[start:]
        end, eot = min(found)
        return full[end + len(eot) :]

    def _after_end_of_turn(self, text: str) -> str:
        """``text`` after its last end-of-turn string ("" when it has none)."""
        ends = [text.rfind(t) + len(t) for t in self._eot_texts if t and t in text]
        return text[max(ends) :] if ends else ""


def truncate_observation(tokens: Sequence[int], limit: int, tokenizer: Any) -> list[int]:
    """``tokens`` cut to about ``limit``: the head, a marker saying how much was cut, and the
    tail from the last end-of-turn token on (the next generation prompt). Only a ``limit``
    smaller than marker and tail together leaves more."""
    tokens = list(tokens)
    if len(tokens) <= limit:
        return tokens
    eot = set(end_of_turn_ids(tokenizer))
    last = max((i for i, t in enumerate(tokens) if t in eot), default=len(tokens))
    tail = tokens[last:]
    marker_text = f"\n[... observation cut: {len(tokens)} tokens, limit {limit} ...]\n"
    marker = list(tokenizer.encode(marker_text, add_special_tokens=False))
    head = tokens[: max(0, min(last, limit - len(marker) - len(tail)))]
    return head + marker + tail
