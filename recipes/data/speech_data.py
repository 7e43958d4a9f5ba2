"""The speech recipe's data: a wav/flac + ``*.trans.txt`` corpus at a local path, or generated digit strings or
spoken words."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from recipes.data.audio import LogMel, read_audio, resample
from recipes.data.digit_speech import DIGIT_WORDS, Engine, corpus_info, make_digit_corpus
from recipes.data.speech_corpus import check_corpus_folder, scan_corpus
from recipes.data.translation_data import default_cache_dir
from recipes.data.word_speech import WORDS, make_word_corpus

__all__ = ["CHARACTERS", "SpeechDataModule", "TranscribedAudio", "collate_speech"]

CHARACTERS = tuple("abcdefghijklmnopqrstuvwxyz'") + ("|",)
"""Character units for real corpora; ``|`` stands for the space between words."""


class TranscribedAudio(Dataset):
    """(log-mel features (T, F), label ids, transcript) per utterance; features are cached in memory when asked.

    Args:
        items: (audio path, transcript) pairs.
        units: output units (index + 1 is the class; 0 is the CTC blank).
        unit_kind: ``words`` (units are words) or ``chars`` (``|`` marks spaces).
        features: the feature extractor.
        cache: keep computed features in memory.
    """

    def __init__(self, items: list[tuple[Path, str]], units: tuple[str, ...], unit_kind: str, features: LogMel,
                 cache: bool) -> None:
        self.items, self.units, self.unit_kind, self.features, self.cache = items, units, unit_kind, features, cache
        self.index = {u: i + 1 for i, u in enumerate(units)}
        self._cached: dict[int, Tensor] = {}

    def __len__(self) -> int:
        return len(self.items)

    def labels(self, text: str) -> list[int]:
        """Class ids of ``text`` (unknown units are skipped)."""
        text = text.lower()
        seq = text.split() if self.unit_kind == "words" else list("|".join(text.split()))
        return [self.index[u] for u in seq if u in self.index]

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor, str]:
        path, text = self.items[i]
        feats = self._cached.get(i)
        if feats is None:
            samples, rate = read_audio(path)
            feats = self.features(resample(samples, rate, self.features.rate))
            if self.cache:
                self._cached[i] = feats
        return feats, torch.tensor(self.labels(text), dtype=torch.long), text


def collate_speech(batch: list[tuple[Tensor, Tensor, str]]) -> dict[str, Any]:
    """Pad features to (N, T, F); concatenate labels for CTC; keep lengths and texts."""
    feats = torch.nn.utils.rnn.pad_sequence([b[0] for b in batch], batch_first=True)
    return {"feats": feats, "feat_lens": torch.tensor([len(b[0]) for b in batch]),
            "labels": torch.cat([b[1] for b in batch]), "label_lens": torch.tensor([len(b[1]) for b in batch]),
            "texts": [b[2] for b in batch]}


class SpeechDataModule(pl.LightningDataModule):
    """Utterances for the BiLSTM-CTC recipe.

    Sources:

    * ``digits``: generated connected digit strings (:mod:`recipes.data.digit_speech`) in
      ``cache_dir/digits-<engine>-<sizes>-<seed>``, made once in ``prepare_data``; test voices are held out.
    * ``words``: generated phrases of ``min_words``-``max_words`` words over the first ``vocab_size`` of
      :data:`recipes.data.word_speech.WORDS`, spoken by espeak-ng (:mod:`recipes.data.word_speech`; needs
      ``espeak-ng``), in ``cache_dir/words-<sizes>-<seed>``, made once in ``prepare_data``; test voices are held out.
    * ``corpus``: ``root/<train_dir>`` and ``root/<val_dir>`` in LibriSpeech's layout (``*.trans.txt`` next to
      ``.flac``/``.wav``), e.g. ``root=/data/LibriSpeech, train_dir=train-clean-100, val_dir=dev-clean``.

    Args:
        source: ``digits``, ``words`` or ``corpus``.
        root: corpus folder (``corpus``).
        train_dir: training sub-folder of ``root``.
        val_dir: validation sub-folder of ``root``.
        units: ``words`` (the digit words, or the vocabulary of ``words``) or ``chars`` (letters, apostrophe,
            word boundary).
        engine: synthesiser for ``digits`` (``auto``: espeak-ng when installed, else tones).
        num_train: generated training utterances (``digits``, ``words``) or a cap (``corpus``).
        num_val: generated test utterances (``digits``, ``words``) or a cap (``corpus``).
        held_out: voices reserved for the test split (``digits``, ``words``).
        vocab_size: words the phrases draw from (``words``).
        min_words: shortest phrase (``words``).
        max_words: longest phrase (``words``).
        n_mels: log-mel bins.
        batch_size: per-process utterances per batch.
        cache_features: keep features in memory after the first epoch.
        cache_dir: where the generated corpus goes (default ``~/.cache/lightning_gradcomp/recipes``).
        seed: corpus generator seed.
    """

    def __init__(self, source: Literal["digits", "words", "corpus"] = "digits", root: Optional[str] = None,
                 train_dir: str = "train", val_dir: str = "test", units: Literal["words", "chars"] = "words",
                 engine: Engine = "auto", num_train: Optional[int] = 3000, num_val: Optional[int] = 300,
                 held_out: int = 20, vocab_size: int = 300, min_words: int = 1, max_words: int = 3,
                 n_mels: int = 40, batch_size: int = 32, num_workers: int = 0,
                 cache_features: bool = True, cache_dir: Optional[str] = None, seed: int = 0) -> None:
        super().__init__()
        if source not in ("digits", "words", "corpus"):
            raise ValueError(f"`source` must be 'digits', 'words' or 'corpus', got {source!r}")
        if source == "words" and not (2 <= vocab_size <= len(WORDS) and 1 <= min_words <= max_words):
            raise ValueError(f"source='words' needs 2 <= vocab_size <= {len(WORDS)} and 1 <= min_words <= max_words, "
                             f"got {vocab_size}, {min_words}, {max_words}")
        if units not in ("words", "chars"):
            raise ValueError(f"`units` must be 'words' or 'chars', got {units!r}")
        if source == "corpus" and root is None:
            raise ValueError("`root` (folder with the train/val sub-folders) is required for source='corpus'")
        if n_mels < 8 or batch_size < 1:
            raise ValueError(f"`n_mels` must be >= 8 and `batch_size` >= 1, got {n_mels}, {batch_size}")
        self.source, self.root, self.train_dir, self.val_dir = source, root, train_dir, val_dir
        words = WORDS[:vocab_size] if source == "words" else DIGIT_WORDS
        self.units = words if units == "words" else CHARACTERS
        self.vocab_size, self.min_words, self.max_words = vocab_size, min_words, max_words
        self.unit_kind, self.engine = units, engine
        self.num_train, self.num_val, self.held_out, self.seed = num_train, num_val, held_out, seed
        self.n_mels, self.batch_size, self.num_workers = n_mels, batch_size, num_workers
        self.cache_features = cache_features
        self.cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
        self.train_set: Optional[TranscribedAudio] = None
        self.val_set: Optional[TranscribedAudio] = None

    def check_data(self) -> None:
        """Raise ``FileNotFoundError`` naming the argument and the path when a corpus split folder is missing
        (``source='corpus'``; the generated digits need nothing), or ``espeak-ng`` for spoken words not generated
        yet; the recipes' CLI calls this before training starts any process. Lists no folder."""
        if self.source == "words" and corpus_info(self.corpus_root) is None:
            from recipes.data.digit_speech import espeak_available

            if not espeak_available():
                raise FileNotFoundError("`data.source`: 'words' is synthesised by espeak-ng, which is not installed "
                                        "(apt-get install -y espeak-ng)")
        if self.source != "corpus":
            return
        for name, split in (("train_dir", self.train_dir), ("val_dir", self.val_dir)):
            try:
                check_corpus_folder(self.corpus_root / split)
            except FileNotFoundError as err:
                raise FileNotFoundError(f"`data.root` / `data.{name}`: {err}") from None

    @property
    def num_classes(self) -> int:
        """CTC classes: blank + units."""
        return len(self.units) + 1

    @property
    def corpus_root(self) -> Path:
        """Folder holding the train / validation sub-folders."""
        if self.source == "corpus":
            return Path(self.root)  # type: ignore[arg-type]
        if self.source == "words":
            return self.cache_dir / (f"words-{self.vocab_size}-{self.min_words}-{self.max_words}-{self.num_train}-"
                                     f"{self.num_val}-{self.held_out}-{self.seed}")
        from recipes.data.digit_speech import resolve_engine

        engine = resolve_engine(self.engine)
        return self.cache_dir / f"digits-{engine}-{self.num_train}-{self.num_val}-{self.held_out}-{self.seed}"

    def prepare_data(self) -> None:
        """Generate the digit or spoken-words corpus once (local rank 0)."""
        if self.source == "corpus" or corpus_info(self.corpus_root) is not None:
            return
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        if self.source == "digits":
            make_digit_corpus(self.corpus_root, self.num_train or 3000, self.num_val or 300, self.engine,
                              self.seed, self.held_out)
        else:
            make_word_corpus(self.corpus_root, self.vocab_size, self.num_train or 8000, self.num_val or 400,
                             self.seed, self.held_out, self.min_words, self.max_words)

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        root = self.corpus_root
        train_dir, val_dir = (self.train_dir, self.val_dir) if self.source == "corpus" else ("train", "test")
        feats = LogMel(n_mels=self.n_mels)
        train = scan_corpus(root / train_dir)[: self.num_train]
        val = scan_corpus(root / val_dir)[: self.num_val]
        self.train_set = TranscribedAudio(train, self.units, self.unit_kind, feats, self.cache_features)
        self.val_set = TranscribedAudio(val, self.units, self.unit_kind, feats, self.cache_features)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True,
                          collate_fn=collate_speech, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=max(self.batch_size, 64), collate_fn=collate_speech,
                          num_workers=self.num_workers)
