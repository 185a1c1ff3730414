"""Prompt rendering (docs/design.md §11): one ``prompt`` section (``PromptSettings``) turns every
row into the tokens the sampler sees, in training, held-out evaluation, ``rlax eval``, the pass-rate
filter and the DAGs."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

from rlax_tasks.models.model_cache import local_model_dir
from rlax_tasks.models.tokenizer_loading import load_tokenizer

TEMPLATES = ("raw", "chat")

Messages = list[dict[str, str]]


class PromptSettingsError(ValueError):
    """An invalid ``prompt`` setting; ``field`` names it (template, system, instruction, stop)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


@dataclasses.dataclass(frozen=True)
class PromptSettings:
    """The ``prompt`` section of a run configuration. ``template``: ``chat`` renders the chat
    template with the generation prompt (its text then tokenized without special tokens: one BOS),
    ``raw`` joins system, problem and instruction with blank lines as plain text. ``system``: when
    the row has none; ``instruction``: appended to the last user message; ``stop``: strings that
    end a completion besides the model's EOS ids (``generation_config.json``'s included)."""

    template: str = "raw"
    system: str | None = None
    instruction: str | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.template not in TEMPLATES:
            raise PromptSettingsError(
                "template", f"must be one of {list(TEMPLATES)}, got {self.template!r}"
            )
        for name in ("system", "instruction"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise PromptSettingsError(
                    name, f"must be a non-empty string or null, got {value!r}"
                )
        stop = self.stop
        if isinstance(stop, str) or not isinstance(stop, Sequence):
            raise PromptSettingsError("stop", f"must be a list of strings, got {stop!r}")
        for s in stop:
            if not isinstance(s, str) or not s:
                raise PromptSettingsError("stop", f"each stop string must be non-empty, got {s!r}")
        object.__setattr__(self, "stop", tuple(stop))

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None) -> PromptSettings:
        """From plain data; unknown keys are errors naming them."""
        raw = dict(raw or {})
        known = [f.name for f in dataclasses.fields(cls)]
        for key in raw:
            if key not in known:
                raise PromptSettingsError(str(key), f"unknown key; valid: {', '.join(known)}")
        return cls(**raw)

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "stop": list(self.stop)}


class PromptRenderer:
    """Renders prompts (text or chat messages) with ``settings`` and ``tokenizer`` (None only
    to show raw text without tokens)."""

    def __init__(self, settings: PromptSettings, tokenizer: Any) -> None:
        if tokenizer is None and settings.template == "chat":
            raise ValueError("prompt.template: 'chat' renders with a tokenizer; the model has none")
        if settings.template == "chat" and not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "prompt.template: 'chat' needs a tokenizer with a chat template "
                "(tokenizer_config.json 'chat_template' or chat_template.jinja); this model has "
                "none: use template 'raw' or add a template"
            )
        self.settings, self.tokenizer = settings, tokenizer

    @classmethod
    def for_model(cls, settings: PromptSettings, model_dir: str) -> PromptRenderer:
        """A renderer with the tokenizer of the HF directory ``model_dir`` (local, or gs:// whose
        config and tokenizer files are fetched into the model cache, without the weights)."""
        model_dir = local_model_dir(model_dir, weights=False)
        if not os.path.isdir(model_dir):  # else transformers would look for a hub repo id
            raise FileNotFoundError(f"{model_dir}: no such model directory")
        try:
            tokenizer = load_tokenizer(model_dir)
        except (OSError, ValueError) as e:
            raise ValueError(f"{model_dir}: no tokenizer loads: {e}") from None
        return cls(settings, tokenizer)

    # ------------------------------------------------------------------ rendering
    def messages(self, prompt: str | Sequence[Mapping[str, str]]) -> Messages:
        """The chat of a prompt: the system prompt (unless the row has one), its messages,
        the instruction appended to the last user message."""
        s = self.settings
        if isinstance(prompt, str):
            chat = [{"role": "user", "content": prompt}]
        else:
            chat = [{"role": m["role"], "content": m["content"]} for m in prompt]
        if s.system is not None and not any(m["role"] == "system" for m in chat):
            chat.insert(0, {"role": "system", "content": s.system})
        if s.instruction is not None:
            last = max(i for i, m in enumerate(chat) if m["role"] == "user")
            chat[last] = {"role": "user", "content": f"{chat[last]['content']}\n\n{s.instruction}"}
        return chat

    def text(self, prompt: str | Sequence[Mapping[str, str]]) -> str:
        """The rendered prompt text, exactly as it is tokenized; ValueError when the chat
        template refuses the prompt (some templates reject a system message, for example)."""
        chat = self.messages(prompt)
        if self.settings.template == "raw":
            return "\n\n".join(m["content"] for m in chat)
        try:
            return self.tokenizer.apply_chat_template(
                chat, add_generation_prompt=True, tokenize=False
            )
        except Exception as exc:  # noqa: BLE001 - jinja's TemplateError and raise_exception()
            roles = "/".join(m["role"] for m in chat)
            raise ValueError(f"the chat template cannot render this prompt ({roles}): {exc}") from (
                exc
            )

    def encode(self, prompt: str | Sequence[Mapping[str, str]]) -> list[int]:
        """The token ids the sampler receives; ValueError when the tokenizer cannot encode it."""
        if self.tokenizer is None:
            raise ValueError("the model has no tokenizer files; save one next to config.json")
        text = self.text(prompt)
        chat = self.settings.template == "chat"
        try:
            ids = self.tokenizer(text, add_special_tokens=not chat)["input_ids"]
        except Exception as exc:  # noqa: BLE001 - tokenizers raise a plain Exception
            raise ValueError(f"the tokenizer cannot encode the prompt ({exc})") from exc
        ids = [int(t) for t in ids]
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if not chat and ids and ids[-1] == eos and not text.endswith(str(self.tokenizer.eos_token)):
            ids.pop()  # a tokenizer that appends EOS to text would end the prompt early
        if not ids:
            raise ValueError("the prompt encodes to no tokens")
        return ids

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """Stop strings for the sampler (the model's EOS ids stop it anyway)."""
        return self.settings.stop
