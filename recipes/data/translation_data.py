"""The translation recipe's data: generated number words, WMT-style parallel files, or Debian's Ding sentences."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Literal, Optional

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from recipes.data.numwords import DE_WORDS, EN_WORDS, number_pairs, sample_numbers
from recipes.data.parallel_text import DING_PATH, is_held_out, read_ding, read_parallel
from recipes.data.vocab import BOS, EOS, PAD, SentencePieceVocab, TextCodec, WordVocab, train_sentencepiece

__all__ = ["PairDataset", "TranslationDataModule", "collate_pairs", "default_cache_dir"]

TextSource = Literal["numbers", "parallel", "ding"]


def default_cache_dir() -> Path:
    """``$LIGHTNING_GRADCOMP_CACHE`` or ``~/.cache/lightning_gradcomp/recipes``."""
    env = os.environ.get("LIGHTNING_GRADCOMP_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "lightning_gradcomp" / "recipes"


class PairDataset(Dataset):
    """Encoded (source ids, target ids, target text) triples."""

    def __init__(self, pairs: list[tuple[str, str]], src: TextCodec, tgt: TextCodec, max_len: int,
                 drop_long: bool) -> None:
        self.items: list[tuple[Tensor, Tensor, str]] = []
        for s, t in pairs:
            si, ti = src.encode(s), tgt.encode(t)
            if drop_long and (len(si) > max_len - 2 or len(ti) > max_len - 2):
                continue
            self.items.append((torch.tensor(si[: max_len - 2] + [EOS]), torch.tensor(ti[: max_len - 2]), t))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor, str]:
        return self.items[index]


def collate_pairs(batch: list[tuple[Tensor, Tensor, str]]) -> dict[str, Any]:
    """Pad into ``src`` (N, S), ``tgt_in`` = BOS + target (N, T), ``tgt_out`` = target + EOS, and ``ref`` texts."""
    pad = torch.nn.utils.rnn.pad_sequence
    src = pad([b[0] for b in batch], batch_first=True, padding_value=PAD)
    tgt_in = pad([torch.cat([torch.tensor([BOS]), b[1]]) for b in batch], batch_first=True, padding_value=PAD)
    tgt_out = pad([torch.cat([b[1], torch.tensor([EOS])]) for b in batch], batch_first=True, padding_value=PAD)
    return {"src": src, "tgt_in": tgt_in, "tgt_out": tgt_out, "ref": [b[2] for b in batch]}


class TranslationDataModule(pl.LightningDataModule):
    """Sentence pairs for the Transformer recipe.

    Sources:

    * ``numbers``: generated English -> German number words (:mod:`recipes.data.numwords`), word vocabularies.
    * ``parallel``: WMT-style aligned files ``train_src``/``train_tgt`` and ``val_src``/``val_tgt``
      (e.g. ``train.en``/``train.de`` and ``newstest2013.en``/``.de``; plain or ``.gz``).
    * ``ding``: example sentences of Debian's ``trans-de-en`` dictionary (``root``, default
      ``/usr/share/trans/de-en``); every ``val_every``-th pair (by hash) is held out.

    Real text uses a joint SentencePiece model trained offline in ``prepare_data`` (``tokenizer="sentencepiece"``,
    needs ``pip install sentencepiece``) or word vocabularies of the most frequent words (``"word"``).

    Args:
        source: one of the above.
        root: Ding dictionary path (``ding``).
        train_src: source-language training file (``parallel``).
        train_tgt: target-language training file (``parallel``).
        val_src: source-language validation file (``parallel``).
        val_tgt: target-language validation file (``parallel``).
        tokenizer: ``sentencepiece`` or ``word`` (``numbers`` always uses its fixed word lists).
        vocab_size: SentencePiece / word vocabulary size (ids the model must cover).
        max_len: longest sequence in tokens (training pairs beyond it are dropped, validation truncated).
        num_train: generated training pairs (``numbers``) or a cap on the pairs read (others).
        num_val: generated / used validation pairs.
        val_every: hash-split rate for ``ding``.
        batch_size: per-process sentences per batch.
        cache_dir: where SentencePiece models go (default :func:`default_cache_dir`).
        seed: generator seed for ``numbers``.
    """

    def __init__(self, source: TextSource = "numbers", root: Optional[str] = None, train_src: Optional[str] = None,
                 train_tgt: Optional[str] = None, val_src: Optional[str] = None, val_tgt: Optional[str] = None,
                 tokenizer: Literal["sentencepiece", "word"] = "sentencepiece", vocab_size: int = 8000,
                 max_len: int = 64, num_train: Optional[int] = 50_000, num_val: Optional[int] = 1000,
                 val_every: int = 50, batch_size: int = 128, num_workers: int = 0, cache_dir: Optional[str] = None,
                 seed: int = 0) -> None:
        super().__init__()
        if source not in ("numbers", "parallel", "ding"):
            raise ValueError(f"`source` must be 'numbers', 'parallel' or 'ding', got {source!r}")
        if tokenizer not in ("sentencepiece", "word"):
            raise ValueError(f"`tokenizer` must be 'sentencepiece' or 'word', got {tokenizer!r}")
        if source == "parallel" and not (train_src and train_tgt and val_src and val_tgt):
            raise ValueError("source='parallel' needs `train_src`, `train_tgt`, `val_src` and `val_tgt` files")
        if vocab_size < 16 or max_len < 4 or batch_size < 1 or val_every < 2:
            raise ValueError(f"need vocab_size >= 16, max_len >= 4, batch_size >= 1, val_every >= 2; got "
                             f"{vocab_size}, {max_len}, {batch_size}, {val_every}")
        self.source, self.root, self.tokenizer = source, root, tokenizer
        self.files = (train_src, train_tgt, val_src, val_tgt)
        self.vocab_size, self.max_len = vocab_size, max_len
        self.num_train, self.num_val, self.val_every = num_train, num_val, val_every
        self.batch_size, self.num_workers, self.seed = batch_size, num_workers, seed
        self.cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
        self.src_codec: Optional[TextCodec] = None
        self.tgt_codec: Optional[TextCodec] = None
        self.train_set: Optional[PairDataset] = None
        self.val_set: Optional[PairDataset] = None

    def check_data(self) -> None:
        """Raise ``FileNotFoundError`` naming the argument and the path when a file this module reads is missing
        (the four ``parallel`` files, or the Ding dictionary); the recipes' CLI calls this before training starts any
        process. Reads no file."""
        if self.source == "parallel":
            for name, path in zip(("train_src", "train_tgt", "val_src", "val_tgt"), self.files):
                if not Path(path).is_file():  # type: ignore[arg-type]
                    raise FileNotFoundError(f"`data.{name}`: {path} is not a file")
        elif self.source == "ding" and not Path(self.root or DING_PATH).is_file():
            raise FileNotFoundError(
                f"`data.root`: the Ding dictionary {self.root or DING_PATH} is not a file (apt-get install trans-de-en)"
            )

    # ------------------------------------------------------------------ sizes the model needs at build time
    @property
    def src_vocab_size(self) -> int:
        """Source embedding rows."""
        return len(EN_WORDS) + 4 if self.source == "numbers" else self.vocab_size

    @property
    def tgt_vocab_size(self) -> int:
        """Target embedding / output rows."""
        return len(DE_WORDS) + 4 if self.source == "numbers" else self.vocab_size

    # ------------------------------------------------------------------ data
    def _pairs(self) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        if self.source == "numbers":
            val_numbers = sample_numbers(self.num_val or 1000, self.seed + 1)
            train_numbers = sample_numbers(self.num_train or 50_000, self.seed, exclude=frozenset(val_numbers))
            return number_pairs(train_numbers), number_pairs(val_numbers)
        if self.source == "ding":
            every = read_ding(self.root or DING_PATH)
            train = [p for p in every if not is_held_out(p[0], self.val_every)]
            val = [p for p in every if is_held_out(p[0], self.val_every)]
        else:
            train_src, train_tgt, val_src, val_tgt = self.files
            train = read_parallel(train_src, train_tgt)  # type: ignore[arg-type]
            val = read_parallel(val_src, val_tgt)  # type: ignore[arg-type]
            for pairs, src, tgt in ((train, train_src, train_tgt), (val, val_src, val_tgt)):
                if not pairs:
                    raise ValueError(f"no sentence pairs (non-empty on both sides) in {src} and {tgt}")
        return train[: self.num_train], val[: self.num_val]

    def _spm_prefix(self) -> Path:
        key = f"{self.source}|{self.root}|{self.files}|{self.num_train}|{self.val_every}|{self.vocab_size}"
        for path in (self.root, *self.files):
            if path and Path(path).exists():
                stat = Path(path).stat()
                key += f"|{stat.st_size}|{int(stat.st_mtime)}"
        return self.cache_dir / f"spm-{self.source}-{hashlib.sha1(key.encode()).hexdigest()[:12]}"

    def prepare_data(self) -> None:
        """Train the SentencePiece model once (local rank 0), on both sides of the training pairs."""
        if self.source == "numbers" or self.tokenizer != "sentencepiece":
            return
        prefix = self._spm_prefix()
        if Path(f"{prefix}.model").is_file():
            return
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        train, _ = self._pairs()
        tmp = prefix.with_name(prefix.name + f".tmp{os.getpid()}")
        train_sentencepiece([t for pair in train for t in pair], tmp, self.vocab_size)
        for ext in (".model", ".vocab"):
            os.replace(f"{tmp}{ext}", f"{prefix}{ext}")

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        train, val = self._pairs()
        if self.source == "numbers":
            self.src_codec, self.tgt_codec = WordVocab(EN_WORDS), WordVocab(DE_WORDS)
        elif self.tokenizer == "sentencepiece":
            self.src_codec = self.tgt_codec = SentencePieceVocab(f"{self._spm_prefix()}.model")
        else:
            self.src_codec = WordVocab.from_texts((s for s, _ in train), self.vocab_size)
            self.tgt_codec = WordVocab.from_texts((t for _, t in train), self.vocab_size)
        for codec, size in ((self.src_codec, self.src_vocab_size), (self.tgt_codec, self.tgt_vocab_size)):
            if len(codec) > size:
                raise ValueError(f"tokenizer has {len(codec)} ids but the model covers {size}")
        self.train_set = PairDataset(train, self.src_codec, self.tgt_codec, self.max_len, drop_long=True)
        self.val_set = PairDataset(val, self.src_codec, self.tgt_codec, self.max_len, drop_long=False)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True,
                          collate_fn=collate_pairs, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=max(self.batch_size, 250), collate_fn=collate_pairs,
                          num_workers=self.num_workers)
