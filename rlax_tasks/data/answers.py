r"""Reading the reference answer out of a public dataset's solution text.

GSM8K ends its worked solution with ``#### <number>``; MATH puts the answer in the last
``\boxed{...}`` of the solution. Both are plain text functions with no model or verifier.
"""

from __future__ import annotations

import re

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_GSM8K_RE = re.compile(r"####\s*(.*?)\s*$", re.DOTALL)
_NUMBER_RE = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")


def last_boxed(text: str) -> str | None:
    r"""Content of the last \boxed{...} / \fbox{...} with balanced braces, or None.

    Linear time: a \boxed{ left open stays open to the end, so an earlier one can only close
    before it and its scan stops there (degenerate "\boxed{\boxed{..." output stays cheap)."""
    end = len(text)
    for match in reversed(list(_BOXED_RE.finditer(text))):
        depth, start = 1, match.end()
        for i in range(start, end):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i].strip()
        end = match.start()
    return None


def gsm8k_answer(solution: str) -> str | None:
    """The number after the last ``####`` of a GSM8K solution, thousands separators removed
    (``#### 1,000`` -> "1000", ``#### -5`` -> "-5", ``#### 0.75`` -> "0.75"); None without one."""
    if "####" not in solution:
        return None
    match = _GSM8K_RE.search(solution[solution.rindex("####") :])
    if match is None:
        return None
    text = match.group(1).replace(",", "").replace("$", "").strip().rstrip(".")
    text = text.replace("\u2212", "-")  # a typographic minus
    if not _NUMBER_RE.fullmatch(text):
        return None
    return text.lstrip("+")
