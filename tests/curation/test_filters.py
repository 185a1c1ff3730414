"""Language, interactive and decontamination filters."""

import pytest

from rlax_tasks.curation.decontam import NgramIndex
from rlax_tasks.curation.filters import interactive, missing_reference, non_english

ENGLISH = [
    "Find the number of positive integers n such that n divides 100 and n is odd.",
    "Let $f(x) = x^2 + 3x$. What is the value of f(2) when x is replaced by 2?",
    r"Compute $\int_0^1 x^2 \, dx$.",
    "x^2 + y^2 = 25",
    "Given an array of n integers, print the maximum sum of a contiguous subarray.",
]
FOREIGN = {
    "Trouvez le nombre de entiers positifs qui sont dans la liste et pour le cas": "French",
    "Finde die Zahl, die mit der Summe der Quadrate nicht gleich ist und für die": "German",
    "Encuentra el número de enteros que son mayores que la suma de los dos": "Spanish",
    "求所有满足条件的正整数的个数，并说明理由。": "non-Latin",
    "Найдите все натуральные числа, которые делятся на три и на пять.": "non-Latin",
}


@pytest.mark.parametrize("text", ENGLISH)
def test_english_and_formulas_are_kept(text):
    assert non_english(text) is None


@pytest.mark.parametrize("text,lang", FOREIGN.items())
def test_other_languages_are_flagged(text, lang):
    reason = non_english(text)
    assert reason is not None and lang in reason


def test_interactive_keywords_and_tags():
    assert "interactive" in interactive("This is an interactive problem. Guess the number.")
    assert interactive(
        "After printing a query do not forget to output end of line and flush the output."
    )
    assert interactive("You can ask at most 20 queries.")
    assert interactive("Read n and print n squared.") is None
    assert "tag" in interactive("Read n.", {"tags": ["math", "Interactive"]})
    assert interactive("Read n.", {"tags": ["math"]}) is None


def test_missing_reference():
    assert missing_reference(None, None)
    assert missing_reference(None, [])
    assert missing_reference("3", None) is None
    assert missing_reference(None, [{"input": "", "output": "1"}]) is None


def test_ngram_decontamination():
    index = NgramIndex(n=5)
    index.add(["The quick brown fox jumps over the lazy dog today", "Short one"], "bench")
    hit = index.match("Intro: the QUICK brown fox, jumps over a cat")
    assert hit is not None and "'bench'" in hit and "the quick brown fox jumps" in hit
    assert index.match("The quick brown cat jumps over the lazy cat") is None
    assert index.match("short ONE") is not None  # short texts match whole
    assert index.match("a short one here") is None
    with pytest.raises(ValueError):
        NgramIndex(n=0)
