"""Text normalization: a conservative clean-up for the output, and a loose key for dedup."""

from __future__ import annotations

import re
import unicodedata

_INVISIBLE_RE = re.compile("[\u200b\u200c\u200d\u2060\ufeff]")
_CONTROL_RE = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_TRAILING_WS_RE = re.compile(r"[ \t]+\n")
_BLANK_LINES_RE = re.compile(r"\n{3,}")


def normalize_text(text: str) -> str:
    """NFC, Unix newlines, no zero-width or control characters, no trailing spaces on a line,
    at most one blank line in a row, stripped. Inner spacing (code indentation) is kept."""
    if text.isascii() and text.isprintable():  # fast path: one line of printable ASCII
        return text.strip()
    text = unicodedata.normalize("NFC", text)
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _INVISIBLE_RE.sub("", text)
    text = _CONTROL_RE.sub("", text)
    if "\n" in text:
        text = _TRAILING_WS_RE.sub("\n", text)
        text = _BLANK_LINES_RE.sub("\n\n", text)
    return text.strip()


def dedup_key(text: str) -> str:
    """The form two prompts share when they differ only in case, whitespace or Unicode
    compatibility forms (NFKC, casefolded, whitespace runs collapsed to one space)."""
    if not text.isascii():
        text = _INVISIBLE_RE.sub("", unicodedata.normalize("NFKC", text))
    return " ".join(text.casefold().split())


def normalize_prompt(prompt: str | list[dict[str, str]]) -> str | list[dict[str, str]]:
    """``normalize_text`` of a prompt text, or of each message's content."""
    if isinstance(prompt, str):
        return normalize_text(prompt)
    return [{"role": m["role"], "content": normalize_text(m["content"])} for m in prompt]
