"""Answer extraction and equivalence with math-verify, run only inside pool worker processes.

math-verify's own signal.alarm timeouts are disabled here: the pool enforces a hard wall-clock
timeout by killing the worker, which also covers hangs inside sympy's C-level arithmetic.
"""

from __future__ import annotations

import functools
import logging
import re
from typing import Any

from rlax_tasks.data.answers import last_boxed

_MAX_ANSWER_CHARS = 2000


def init() -> None:
    """Import math-verify (slow: sympy, antlr) once per worker and silence its warnings."""
    import math_verify  # noqa: F401 - lazy: heavy (sympy, antlr), for worker processes only

    for name in ("math_verify", "latex2sympy2_extended"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    compare("\\frac{1}{2}", "0.5")  # warm up sympy and the LaTeX parser


@functools.lru_cache(maxsize=1)
def _configs() -> tuple[Any, Any]:
    # lazy: heavy, worker processes only
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    boxed = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    free = [LatexExtractionConfig(), ExprExtractionConfig()]
    return boxed, free


def _parse(text: str, config: list) -> list:
    from math_verify import parse  # lazy: heavy, worker processes only

    return parse(text, extraction_config=config, parsing_timeout=None)


def extract(response: str) -> str | None:
    r"""The answer in a response: last \boxed{}, else "answer is ...", else the final number."""
    boxed_cfg, free_cfg = _configs()
    content = last_boxed(response)
    if content is not None:
        parsed = _parse("\\boxed{" + content + "}", boxed_cfg)
        answer = parsed[1] if len(parsed) >= 2 else content
    else:
        parsed = _parse(response, free_cfg)
        answer = parsed[1] if len(parsed) >= 2 else None
    if answer is None or not str(answer).strip():
        return None
    return str(answer).strip()[:_MAX_ANSWER_CHARS]


@functools.lru_cache(maxsize=4096)
def _parse_answer(answer: str) -> tuple:
    boxed_cfg, _ = _configs()
    text = answer.strip()
    if len(text) >= 2 and text.startswith("$") and text.endswith("$"):
        text = text.strip("$")
    inner = last_boxed(text)
    if inner is not None:
        text = inner
    return tuple(_parse("\\boxed{" + text + "}", boxed_cfg))


def _normalize(text: str) -> str:
    return re.sub(r"\s+", "", text.strip().strip("$").rstrip(".")).lower()


def compare(reference: str, answer: str) -> bool:
    """True if the extracted answer is mathematically equivalent to the reference."""
    from math_verify import verify  # lazy: heavy, worker processes only

    if _normalize(reference) == _normalize(answer):
        return True
    gold = list(_parse_answer(reference))
    pred = list(_parse_answer(answer))
    if not gold or not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=None))
