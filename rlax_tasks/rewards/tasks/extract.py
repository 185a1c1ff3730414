"""Cheap, linear-time extraction of final answers for the synthetic tasks (no sympy)."""

from __future__ import annotations

import re

from rlax_tasks.data.answers import last_boxed

_ANSWER_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_ANSWER_IS_RE = re.compile(r"answer\s*(?:is|:)\s*:?\s*([^\n]*)", re.IGNORECASE)
_INT_RE = re.compile(r"[-−]?\d[\d,]*")


def final_answer(text: str) -> str | None:
    r"""Last <answer>...</answer>, else last \boxed{}, else what follows the last "answer is"."""
    tags = _ANSWER_TAG_RE.findall(text)
    if tags:
        return tags[-1].strip()
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    said = _ANSWER_IS_RE.findall(text)
    if said and said[-1].strip():
        return said[-1].strip().rstrip(".").strip("$ ")
    return None


def final_integer(text: str) -> int | None:
    """The integer answer: from `final_answer` if there is one, else the last integer."""
    answer = final_answer(text)
    candidates = _INT_RE.findall(answer if answer is not None else text)
    if not candidates:
        return None
    token = candidates[-1].replace(",", "").replace("−", "-")
    if len(token) > 4000 or token in ("-", ""):
        return None
    return int(token)
