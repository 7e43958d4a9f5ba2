"""Issue 49's tasks with a horizon: the byte-level language data (Ding sentences or a text file), the causal LM,
the spoken-words corpus, and their data modules. Each test takes a few seconds at most."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from recipes.data.digit_speech import espeak_available
from recipes.data.language_data import (BYTE_VOCAB, ByteWindows, LanguageDataModule, decode_bytes, encode_bytes,
                                        split_lines)
from recipes.data.parallel_text import DING_PATH
from recipes.data.speech_corpus import scan_corpus
from recipes.data.speech_data import CHARACTERS, SpeechDataModule
from recipes.data.word_speech import WORDS, make_word_corpus
from recipes.models import create_model

needs_ding = pytest.mark.skipif(not Path(DING_PATH).is_file(),
                                reason=f"{DING_PATH} missing (apt-get install trans-de-en)")
needs_espeak = pytest.mark.skipif(not espeak_available(), reason="espeak-ng not installed (apt-get install espeak-ng)")


def _text(tmp_path: Path, lines: int = 300) -> Path:
    path = tmp_path / "text.txt"
    path.write_text("".join(f"Line {i} über alles.\n\n" for i in range(lines)), encoding="utf-8")
    return path


def test_byte_tokens_round_trip_and_cover_every_byte():
    text = "Grüße, naïve café\t!"
    ids = encode_bytes(text)
    assert len(ids) == len(text.encode()) and min(ids) >= 4 and max(ids) < BYTE_VOCAB == 260
    assert decode_bytes([0, 2, *ids, 3]) == text


def test_split_is_deterministic_and_about_one_in_val_every():
    lines = [f"sentence {i}" for i in range(5000)]
    train, val = split_lines(lines, 50)
    assert (train, val) == split_lines(list(lines), 50)
    assert not set(train) & set(val) and len(train) + len(val) == 5000
    assert 50 <= len(val) <= 150


def test_windows_are_shifted_by_one_token():
    ds = ByteWindows(["abcdefgh", "ij"], context=4)
    assert len(ds) == len("abcdefgh\nij\n") // 5
    x, y = ds[1]
    assert decode_bytes(x.tolist()) == "fgh\n" and decode_bytes(y.tolist()) == "gh\ni"


def test_text_datamodule_batches_and_missing_file(tmp_path: Path):
    dm = LanguageDataModule(source="text", root=str(_text(tmp_path)), context=16, batch_size=4)
    dm.check_data()
    dm.setup("fit")
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == y.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])
    assert len(dm.val_set) > 0 and dm.vocab_size == BYTE_VOCAB
    with pytest.raises(FileNotFoundError, match="`data.root`: .*missing"):
        LanguageDataModule(source="text", root=str(tmp_path / "missing")).check_data()
    with pytest.raises(ValueError, match="`source`"):
        LanguageDataModule(source="wiki")  # type: ignore[arg-type]


@needs_ding
def test_ding_lines_pair_english_and_german():
    dm = LanguageDataModule(source="ding", context=128)
    lines = dm.lines()
    assert len(lines) > 10_000 and all(line.count("\t") == 1 for line in lines[:100])
    dm.setup("fit")
    assert len(dm.train_set) > 10_000 and 100 < len(dm.val_set) < 400  # 128-byte windows, ~1/50 held out


def test_lm_small_size_and_causality():
    torch.manual_seed(0)
    model = create_model("lm_small", vocab=BYTE_VOCAB, max_len=32).eval()
    assert sum(p.numel() for p in model.parameters()) == 430_080
    ids = torch.randint(4, BYTE_VOCAB, (2, 12))
    changed = ids.clone()
    changed[:, 8] = 5
    a, b = model(ids), model(changed)
    assert a.shape == (2, 12, BYTE_VOCAB)
    assert torch.allclose(a[:, :8], b[:, :8], atol=1e-5) and not torch.allclose(a[:, 8:], b[:, 8:])
    with pytest.raises(ValueError, match="max_len"):
        model(torch.ones(1, 33, dtype=torch.long))


def test_word_list_is_letters_only_and_distinct():
    assert len(WORDS) == len(set(WORDS)) == 300
    assert all(w.isalpha() and w.islower() for w in WORDS)
    assert set("".join(WORDS)) <= set(CHARACTERS)


@needs_espeak
def test_word_corpus_layout_vocabulary_and_datamodule(tmp_path: Path):
    info = make_word_corpus(tmp_path / "w", vocab_size=10, num_train=6, num_test=3, held_out=3, min_words=1,
                            max_words=2)
    assert info["vocab_size"] == 10
    train, test = scan_corpus(tmp_path / "w" / "train"), scan_corpus(tmp_path / "w" / "test")
    assert len(train) == 6 and len(test) == 3
    assert all(1 <= len(t.split()) <= 2 and set(t.split()) <= set(WORDS[:10]) for _, t in train + test)
    dm = SpeechDataModule(source="words", units="chars", vocab_size=10, num_train=6, num_val=3, held_out=3,
                          max_words=2, cache_dir=str(tmp_path / "cache"), batch_size=2)
    dm.check_data()
    dm.prepare_data()
    dm.setup("fit")
    assert dm.num_classes == len(CHARACTERS) + 1 and len(dm.train_set) == 6
    _, labels, text = dm.train_set[0]
    assert "".join(CHARACTERS[i - 1] for i in labels.tolist()) == "|".join(text.split())
    words = SpeechDataModule(source="words", units="words", vocab_size=10, cache_dir=str(tmp_path))
    assert words.num_classes == 11


def test_words_need_espeak_and_a_valid_vocabulary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from recipes.data import digit_speech

    monkeypatch.setattr(digit_speech, "espeak_available", lambda: False)
    with pytest.raises(FileNotFoundError, match="espeak-ng"):
        SpeechDataModule(source="words", cache_dir=str(tmp_path)).check_data()
    with pytest.raises(ValueError, match="vocab_size"):
        SpeechDataModule(source="words", vocab_size=301)
