"""A generated translation task: English number words -> German number words (needs reordering).

German puts the units before the tens and we split compounds into morphemes, e.g.
``885441`` -> EN ``eight hundred eighty-five thousand four hundred forty-one`` ->
DE ``acht hundert fünf und achtzig tausend vier hundert ein und vierzig``.
"""

from __future__ import annotations

import numpy as np

__all__ = ["DE_WORDS", "EN_WORDS", "german", "english", "number_pairs", "sample_numbers"]

_EN_ONES = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
            "sixteen seventeen eighteen nineteen").split()
_EN_TENS = "twenty thirty forty fifty sixty seventy eighty ninety".split()
_DE_ONES = ("null eins zwei drei vier fünf sechs sieben acht neun zehn elf zwölf dreizehn vierzehn fünfzehn "
            "sechzehn siebzehn achtzehn neunzehn").split()
_DE_TENS = "zwanzig dreißig vierzig fünfzig sechzig siebzig achtzig neunzig".split()

EN_WORDS = tuple(_EN_ONES + _EN_TENS + ["hundred", "thousand", "-"])
"""Every English token (``-`` joins tens and units: ``forty-one``)."""
DE_WORDS = tuple(_DE_ONES + _DE_TENS + ["ein", "und", "hundert", "tausend"])
"""Every German token."""

MAX_NUMBER = 999_999


def _check(n: int) -> None:
    if not 0 <= n <= MAX_NUMBER:
        raise ValueError(f"number must be in [0, {MAX_NUMBER}], got {n}")


def _en_chunk(n: int) -> list[str]:
    words: list[str] = []
    if n >= 100:
        words += [_EN_ONES[n // 100], "hundred"]
        n %= 100
    if n >= 20:
        words.append(_EN_TENS[n // 10 - 2] + (f"-{_EN_ONES[n % 10]}" if n % 10 else ""))
    elif n or not words:
        words.append(_EN_ONES[n])
    return words


def english(n: int) -> str:
    """English words for ``0 <= n <= 999999`` (``twenty-one``, ``one hundred five``)."""
    _check(n)
    high, low = divmod(n, 1000)
    if not high:
        return " ".join(_en_chunk(low))
    return " ".join(_en_chunk(high) + ["thousand"] + (_en_chunk(low) if low else []))


def _de_chunk(n: int, final: bool) -> list[str]:
    words: list[str] = []
    if n >= 100:
        words += ["ein" if n // 100 == 1 else _DE_ONES[n // 100], "hundert"]
        n %= 100
    if n >= 20:
        unit = n % 10
        if unit:
            words += ["ein" if unit == 1 else _DE_ONES[unit], "und"]
        words.append(_DE_TENS[n // 10 - 2])
    elif n or not words:
        words.append("ein" if (n == 1 and not final) else _DE_ONES[n])
    return words


def german(n: int) -> str:
    """German number words split into morphemes (``ein und zwanzig``, ``ein hundert fünf``)."""
    _check(n)
    high, low = divmod(n, 1000)
    if not high:
        return " ".join(_de_chunk(low, final=True))
    return " ".join(_de_chunk(high, final=False) + ["tausend"] + (_de_chunk(low, final=True) if low else []))


def sample_numbers(count: int, seed: int, exclude: frozenset[int] = frozenset()) -> list[int]:
    """``count`` distinct numbers, the digit count uniform in 1..6 (so short numbers are not rare), none in
    ``exclude``."""
    if count < 1 or count > 500_000:
        raise ValueError(f"`count` must be in [1, 500000], got {count}")
    rng = np.random.default_rng(seed)
    out: list[int] = []
    seen = set(exclude)
    while len(out) < count:
        digits = rng.integers(1, 7, size=4 * count)
        low = np.where(digits == 1, 0, 10 ** (digits - 1))
        for n in rng.integers(low, 10 ** digits).tolist():
            if n not in seen:
                seen.add(n)
                out.append(n)
                if len(out) == count:
                    break
    return out


def number_pairs(numbers: list[int]) -> list[tuple[str, str]]:
    """(English, German) sentence pairs of ``numbers``."""
    return [(english(n), german(n)) for n in numbers]
