"""Parallel text readers: WMT-style aligned files (``train.en`` / ``train.de``) and Debian's Ding dictionary.

``read_parallel`` reads two files with one sentence per line (line ``i`` of one is the translation of line
``i`` of the other), plain or gzipped, as produced by WMT's preprocessing (or by ``sacrebleu --echo``).
``read_ding`` extracts clean example-sentence pairs from ``/usr/share/trans/de-en`` (package ``trans-de-en``).
"""

from __future__ import annotations

import gzip
import re
import zlib
from itertools import zip_longest
from pathlib import Path
from typing import Iterator, Optional, TextIO, Union

__all__ = ["DING_PATH", "is_held_out", "read_ding", "read_parallel"]

DING_PATH = "/usr/share/trans/de-en"
"""Where Debian's ``trans-de-en`` installs the Ding German-English dictionary."""

_ANNOTATION = re.compile(r"\{[^}]*\}|\[[^\]]*\]|\([^)]*\)")
_PLACEHOLDER = re.compile(r"\b(sb|sth|jdn|jdm|jds|etw|so|sb's)\b\.?", re.IGNORECASE)


def _open(path: Path) -> TextIO:
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")


def read_parallel(src_path: Union[str, Path], tgt_path: Union[str, Path], limit: Optional[int] = None,
                  skip_empty: bool = True) -> list[tuple[str, str]]:
    """Aligned (source, target) lines of two files; ``ValueError`` when their line counts differ."""
    src_path, tgt_path = Path(src_path), Path(tgt_path)
    pairs: list[tuple[str, str]] = []
    with _open(src_path) as fs, _open(tgt_path) as ft:
        for s, t in _zip_strict(fs, ft, src_path, tgt_path):
            if limit is not None and len(pairs) >= limit:
                break
            s, t = s.strip(), t.strip()
            if skip_empty and not (s and t):
                continue
            pairs.append((s, t))
    return pairs


def _zip_strict(a: TextIO, b: TextIO, pa: Path, pb: Path) -> Iterator[tuple[str, str]]:
    for x, y in zip_longest(a, b):
        if x is None or y is None:
            raise ValueError(f"{pa} and {pb} have different numbers of lines (they must be aligned line by line)")
        yield x, y


def _clean(phrase: str) -> str:
    return " ".join(_ANNOTATION.sub(" ", phrase).split())


def _is_sentence(text: str) -> bool:
    return (len(text.split()) >= 3 and text[-1] in ".?!" and text[0].isupper() and "/" not in text
            and ";" not in text and "~" not in text and not _PLACEHOLDER.search(text))


def read_ding(path: Union[str, Path] = DING_PATH, limit: Optional[int] = None) -> list[tuple[str, str]]:
    """(English, German) example sentences from the Ding dictionary (``de ... :: en ...`` lines whose
    ``|``-separated sub-entries align), with annotations removed and placeholders / fragments dropped."""
    pairs: list[tuple[str, str]] = []
    seen: set[str] = set()
    with _open(Path(path)) as f:
        for line in f:
            if line.startswith("#") or " :: " not in line:
                continue
            de_side, en_side = line.rstrip("\n").split(" :: ", 1)
            de_parts, en_parts = de_side.split(" | "), en_side.split(" | ")
            if len(de_parts) != len(en_parts):
                continue
            for de, en in zip(de_parts, en_parts):
                de, en = _clean(de), _clean(en)
                if _is_sentence(de) and _is_sentence(en) and en not in seen:
                    seen.add(en)
                    pairs.append((en, de))
                    if limit is not None and len(pairs) >= limit:
                        return pairs
    return pairs


def is_held_out(text: str, every: int) -> bool:
    """Deterministic split: a pair goes to validation when the CRC32 of its source side is divisible by ``every``."""
    return zlib.crc32(text.encode("utf-8")) % every == 0
