"""The language recipe's data: a byte-level language model over sentence lines.

Sources:

* ``ding``: the Ding dictionary's English-German example sentences (:func:`recipes.data.parallel_text.read_ding`,
  ``apt-get install -y trans-de-en``), one line per pair: ``English<TAB>German``, so the model learns both languages
  and, on the German half, from the English it has just read.
* ``text``: any UTF-8 file, one sentence (or paragraph) per line.

The split is by line and deterministic (:func:`recipes.data.parallel_text.is_held_out`: a line goes to validation
when the CRC32 of its text is divisible by ``val_every``), and so is the tokenizer: token ``b + 4`` is UTF-8 byte
``b`` (ids 0-3 are the shared specials of :mod:`recipes.data.vocab`; 260 ids), so nothing is trained or cached.
Each split's lines, ``\\n``-terminated, are concatenated into one byte stream cut into non-overlapping windows of
``context + 1`` tokens (the input is the first ``context``, the target the last ``context``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from recipes.data.parallel_text import DING_PATH, is_held_out, read_ding
from recipes.data.vocab import SPECIALS

__all__ = ["BYTE_VOCAB", "ByteWindows", "LanguageDataModule", "decode_bytes", "encode_bytes", "split_lines"]

BYTE_VOCAB = 256 + len(SPECIALS)
"""Token ids: the 4 specials, then the 256 byte values."""


def encode_bytes(text: str) -> list[int]:
    """UTF-8 bytes of ``text`` shifted past the specials."""
    return [b + len(SPECIALS) for b in text.encode("utf-8")]


def decode_bytes(ids: list[int]) -> str:
    """Inverse of :func:`encode_bytes` (specials dropped, invalid UTF-8 replaced)."""
    return bytes(i - len(SPECIALS) for i in ids if i >= len(SPECIALS)).decode("utf-8", errors="replace")


def split_lines(lines: list[str], val_every: int) -> tuple[list[str], list[str]]:
    """(training lines, held-out lines), split by the CRC32 of each line (:func:`is_held_out`)."""
    train = [t for t in lines if not is_held_out(t, val_every)]
    return train, [t for t in lines if is_held_out(t, val_every)]


class ByteWindows(Dataset):
    """Non-overlapping ``context + 1``-token windows of the concatenated, ``\\n``-terminated ``lines``; the tail that
    does not fill a window is dropped."""

    def __init__(self, lines: list[str], context: int) -> None:
        stream = torch.tensor(encode_bytes("".join(f"{t}\n" for t in lines)), dtype=torch.long)
        n = len(stream) // (context + 1)
        self.windows = stream[: n * (context + 1)].view(n, context + 1)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        w = self.windows[index]
        return w[:-1], w[1:]


class LanguageDataModule(pl.LightningDataModule):
    """Byte-level language-model windows over Ding sentence pairs or a text file (see the module docstring).

    Args:
        source: ``ding`` or ``text``.
        root: the Ding dictionary (``ding``, default ``/usr/share/trans/de-en``) or the text file (``text``).
        context: tokens (bytes) per training window.
        val_every: hash-split rate: about one line in ``val_every`` is held out.
        num_train: a cap on the training lines (``None``: all).
        batch_size: per-process windows per batch.
    """

    def __init__(self, source: Literal["ding", "text"] = "ding", root: Optional[str] = None, context: int = 128,
                 val_every: int = 50, num_train: Optional[int] = None, batch_size: int = 16,
                 num_workers: int = 0) -> None:
        super().__init__()
        if source not in ("ding", "text"):
            raise ValueError(f"`source` must be 'ding' or 'text', got {source!r}")
        if source == "text" and not root:
            raise ValueError("source='text' needs `root`, the text file (one sentence per line)")
        if context < 2 or val_every < 2 or batch_size < 1:
            raise ValueError(f"need context >= 2, val_every >= 2, batch_size >= 1; got {context}, {val_every}, "
                             f"{batch_size}")
        self.source, self.root, self.context, self.val_every = source, root, context, val_every
        self.num_train, self.batch_size, self.num_workers = num_train, batch_size, num_workers
        self.train_set: Optional[ByteWindows] = None
        self.val_set: Optional[ByteWindows] = None

    @property
    def vocab_size(self) -> int:
        """Embedding / output rows (bytes + specials)."""
        return BYTE_VOCAB

    @property
    def path(self) -> Path:
        """The file read."""
        return Path(self.root or DING_PATH)

    def check_data(self) -> None:
        """``FileNotFoundError`` naming ``data.root`` when the file is missing (reads nothing)."""
        if not self.path.is_file():
            hint = " (apt-get install trans-de-en)" if self.source == "ding" else ""
            raise FileNotFoundError(f"`data.root`: {self.path} is not a file{hint}")

    def lines(self) -> list[str]:
        """Every line of the source, in file order."""
        if self.source == "ding":
            return [f"{en}\t{de}" for en, de in read_ding(self.path)]
        text = self.path.read_text(encoding="utf-8")
        return [t.strip() for t in text.splitlines() if t.strip()]

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        train, val = split_lines(self.lines(), self.val_every)
        self.train_set = ByteWindows(train[: self.num_train], self.context)
        self.val_set = ByteWindows(val, self.context)
        if not len(self.train_set) or not len(self.val_set):
            raise ValueError(f"{self.path}: too little text for one {self.context + 1}-byte window in each split "
                             f"({len(train)} training / {len(val)} held-out lines)")

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True,
                          num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=max(self.batch_size, 64), num_workers=self.num_workers)
