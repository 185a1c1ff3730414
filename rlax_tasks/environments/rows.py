"""An episode's dataset row: its required keys and its prompt as the first chat messages."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def require(row: Any, keys: Sequence[str]) -> dict:
    """``row`` as a dict holding every key of ``keys``; a ValueError names the first missing."""
    if not isinstance(row, Mapping):
        raise ValueError(
            f"a row must be a mapping with keys {list(keys)}, got {type(row).__name__}"
        )
    for key in keys:
        if key not in row or row[key] is None:
            raise ValueError(
                f"the row has no {key!r} (this environment reads {', '.join(keys)}; it has "
                f"{', '.join(map(str, row)) or 'no keys'})"
            )
    return dict(row)


def first_messages(prompt: Any, system: str | None = None) -> list[dict]:
    """The chat messages of a row's ``prompt`` (a string or a list of {role, content}), after
    the ``system`` message unless the prompt brings its own."""
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, Sequence) and prompt:
        messages = [_message(i, m) for i, m in enumerate(prompt)]
    else:
        raise ValueError(
            f"prompt must be a string or a non-empty list of chat messages, got {prompt!r:.80}"
        )
    if system and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system})
    return messages


def _message(index: int, message: Any) -> dict:
    if (
        not isinstance(message, Mapping)
        or not isinstance(message.get("role"), str)
        or not isinstance(message.get("content"), str)
    ):
        raise ValueError(
            f"prompt[{index}] must be a chat message {{role: str, content: str}}, got "
            f"{message!r:.80}"
        )
    return dict(message)
