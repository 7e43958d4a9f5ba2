"""Text <-> token ids: a word-level vocabulary and a SentencePiece wrapper (optional ``sentencepiece``).

Both use the ids ``pad=0, unk=1, bos=2, eos=3``.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Iterable, Protocol, Sequence, Union

__all__ = ["BOS", "EOS", "PAD", "SPECIALS", "UNK", "SentencePieceVocab", "TextCodec", "WordVocab",
           "train_sentencepiece", "word_tokens"]

PAD, UNK, BOS, EOS = 0, 1, 2, 3
SPECIALS = ("<pad>", "<unk>", "<s>", "</s>")
_WORD = re.compile(r"\w+|[^\w\s]")


def word_tokens(text: str) -> list[str]:
    """Split into words and single punctuation marks (``twenty-one.`` -> ``twenty``, ``-``, ``one``, ``.``)."""
    return _WORD.findall(text)


class TextCodec(Protocol):
    """What the translation recipe needs of a tokenizer."""

    def __len__(self) -> int: ...

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS/EOS)."""

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` (specials dropped)."""


class WordVocab:
    """Word-level vocabulary: ``SPECIALS`` then ``words`` in the given order; unknown words map to ``<unk>``."""

    def __init__(self, words: Iterable[str]) -> None:
        self.itos = list(SPECIALS) + [w for w in dict.fromkeys(words) if w not in SPECIALS]
        self.stoi = {w: i for i, w in enumerate(self.itos)}

    @classmethod
    def from_texts(cls, texts: Iterable[str], size: int) -> "WordVocab":
        """The ``size - 4`` most frequent words of ``texts`` (ties broken alphabetically)."""
        counts = Counter(w for t in texts for w in word_tokens(t))
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        return cls(w for w, _ in ranked[: max(0, size - len(SPECIALS))])

    def __len__(self) -> int:
        return len(self.itos)

    def encode(self, text: str) -> list[int]:
        return [self.stoi.get(w, UNK) for w in word_tokens(text)]

    def decode(self, ids: Sequence[int]) -> str:
        words = [self.itos[i] for i in ids if i >= len(SPECIALS) and i < len(self.itos)]
        return re.sub(r" ([^\w\s])", r"\1", " ".join(words)).replace("- ", "-") if words else ""


class SentencePieceVocab:
    """A trained SentencePiece model (``pip install sentencepiece``)."""

    def __init__(self, model_file: Union[str, Path]) -> None:
        import sentencepiece as spm

        self.sp = spm.SentencePieceProcessor(model_file=str(model_file))

    def __len__(self) -> int:
        return int(self.sp.get_piece_size())

    def encode(self, text: str) -> list[int]:
        return list(self.sp.encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.sp.decode([int(i) for i in ids if i > EOS]))


def train_sentencepiece(texts: Iterable[str], model_prefix: Union[str, Path], vocab_size: int,
                        model_type: str = "unigram") -> Path:
    """Train a SentencePiece model offline on ``texts``; returns ``<model_prefix>.model``.

    The vocabulary may come out smaller than ``vocab_size`` on small corpora (``hard_vocab_limit=False``).
    """
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(list(texts)), model_prefix=str(model_prefix), vocab_size=vocab_size,
        model_type=model_type, pad_id=PAD, unk_id=UNK, bos_id=BOS, eos_id=EOS, hard_vocab_limit=False,
        character_coverage=1.0, input_sentence_size=2_000_000, shuffle_input_sentence=True,
        num_threads=1, minloglevel=2)
    return Path(f"{model_prefix}.model")
