"""Row filters (missing reference, non-English statements, interactive problems): each returns,
per row, a reason string when the row should go, else None. Non-English, without a language
package: mostly non-Latin letters, or enough words hitting another language's stopwords more than
English's. Short statements (< ``min_words``) are kept; Latin-script languages without a list
here (Turkish, Vietnamese, ...), English-heavy mixed text and LaTeX-heavy statements pass."""

from __future__ import annotations

import re

ENGLISH_STOPWORDS = frozenset(
    "a an and are as at be by can do does each find for from given has have how if in into "
    "is it its let of on or such than that the their then there these this to was what when "
    "where which who why will with you your all any are be being both but compute determine "
    "number numbers show prove value values integer integers".split()
)
FOREIGN_STOPWORDS = {
    "french": frozenset(
        "le la les des du un une et est dans pour que qui sur avec pas nombre "
        "trouver soit sont par au aux".split()
    ),
    "german": frozenset(
        "der die das und ist ein eine nicht mit von zu den dem des für auf "
        "sei sind zahl finde wie".split()
    ),
    "spanish": frozenset(
        "el la los las de del y es en un una que por para con no sea son "
        "número encuentra cuál".split()
    ),
    "portuguese": frozenset(
        "o a os as de do da e é em um uma que por para com não seja são "
        "número encontre qual".split()
    ),
    "italian": frozenset(
        "il lo la gli le di del della e è in un una che per con non sia sono "
        "numero trova quale".split()
    ),
}
# foreign stopwords that are not English words (nor variable names): a text with none of
# them is not examined further
_DISTINCT_FOREIGN = frozenset(
    w
    for w in frozenset().union(*FOREIGN_STOPWORDS.values())
    if len(w) > 1 and w not in ENGLISH_STOPWORDS and w not in {"in", "no", "die", "sea", "um"}
)
_WORD_RE = re.compile(r"[^\W\d_]+")
_LATEX_RE = re.compile(r"\\[a-zA-Z]+|\$[^$]*\$")

INTERACTIVE_PATTERNS = (
    r"\binteractive (?:problem|task)\b",
    r"\bthis (?:problem|task) is interactive\b",
    r"\binteractor\b",
    r"\bflush (?:the )?(?:output|stdout|buffer)\b",
    r"\bfflush\s*\(\s*stdout\s*\)",
    r"\bcout\.flush\s*\(",
    r"\bsys\.stdout\.flush\s*\(",
    r"\bSystem\.out\.flush\s*\(",
    r"\bstdout\.flush\s*\(",
    r"\b(?:ask|make|use) (?:at most|no more than|up to) \d+ (?:queries|questions)\b",
    r"\bafter (?:printing|outputting|each) (?:a |the )?(?:query|question)\b",
    r"\bjury(?:'s)? (?:program|answers?|responds?)\b",
)
_INTERACTIVE_RE = re.compile("|".join(INTERACTIVE_PATTERNS), re.IGNORECASE)
# every pattern above contains one of these: texts without any skip the regex
_INTERACTIVE_HINTS = ("interact", "flush", "quer", "question", "jury")


def missing_reference(answer: str | None, tests: list | None) -> str | None:
    """A verifiable problem needs an answer or tests."""
    if answer is None and not tests:
        return "no answer and no tests: nothing to verify a response against"
    return None


def _is_latin(ch: str) -> bool:
    return ch < "\u0250" or "\u1e00" <= ch <= "\u1eff"  # Basic Latin .. IPA, Latin Extended Add.


def non_english(text: str, min_words: int = 6, min_latin: float = 0.5) -> str | None:
    """Reason if `text` looks non-English (the module docstring's heuristic)."""
    prose = _LATEX_RE.sub(" ", text) if "\\" in text or "$" in text else text
    if not prose.isascii():
        letters = [ch for ch in prose if ch.isalpha()]
        if letters:
            latin = sum(map(_is_latin, letters)) / len(letters)
            if latin < min_latin:
                return f"non-Latin script ({1 - latin:.0%} of letters outside Latin)"
    lowered = prose.lower()
    if _DISTINCT_FOREIGN.isdisjoint(lowered.split()):
        return None  # fast path: no distinctly foreign stopword at all
    words = _WORD_RE.findall(lowered)
    if len(words) < min_words:
        return None
    english = sum(w in ENGLISH_STOPWORDS for w in words) / len(words)
    lang, foreign = max(
        (
            (name, sum(w in stop for w in words) / len(words))
            for name, stop in FOREIGN_STOPWORDS.items()
        ),
        key=lambda item: item[1],
    )
    if foreign > english and foreign >= 0.15:
        return f"looks {lang.capitalize()} (stopwords: {foreign:.0%} {lang}, {english:.0%} English)"
    return None


def interactive(text: str, metadata: dict | None = None) -> str | None:
    """Reason if the statement describes an interactive problem (keyword heuristic), or
    metadata tags say so; such problems cannot be judged against fixed tests."""
    lowered = text.lower()
    match = _INTERACTIVE_RE.search(text) if any(h in lowered for h in _INTERACTIVE_HINTS) else None
    if match:
        return f"interactive problem (statement says {match.group(0)!r})"
    tags = (metadata or {}).get("tags")
    if isinstance(tags, str):
        tags = [tags]
    if isinstance(tags, list) and any(str(t).strip().lower() == "interactive" for t in tags):
        return "interactive problem (metadata tag 'interactive')"
    return None
