"""Translation data: number words, WMT-style parallel files, the Ding dictionary format, tokenizers."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest
import torch

from recipes.data.numwords import DE_WORDS, EN_WORDS, english, german, number_pairs, sample_numbers
from recipes.data.parallel_text import is_held_out, read_ding, read_parallel
from recipes.data.translation_data import TranslationDataModule, collate_pairs
from recipes.data.vocab import BOS, EOS, PAD, UNK, WordVocab, word_tokens


@pytest.mark.parametrize("n, en, de", [
    (0, "zero", "null"),
    (1, "one", "eins"),
    (17, "seventeen", "siebzehn"),
    (21, "twenty-one", "ein und zwanzig"),
    (30, "thirty", "dreißig"),
    (101, "one hundred one", "ein hundert eins"),
    (1000, "one thousand", "ein tausend"),
    (21_000, "twenty-one thousand", "ein und zwanzig tausend"),
    (101_001, "one hundred one thousand one", "ein hundert ein tausend eins"),
    (885_441, "eight hundred eighty-five thousand four hundred forty-one",
     "acht hundert fünf und achtzig tausend vier hundert ein und vierzig"),
])
def test_number_words(n: int, en: str, de: str):
    assert english(n) == en
    assert german(n) == de


def test_number_words_vocabularies_cover_every_number_and_range_is_checked():
    for n in list(range(0, 1200)) + [999_999, 123_456, 70_070]:
        assert set(word_tokens(english(n))) <= set(EN_WORDS)
        assert set(german(n).split()) <= set(DE_WORDS)
    with pytest.raises(ValueError, match="number"):
        english(1_000_000)


def test_sample_numbers_distinct_and_excluding():
    val = sample_numbers(200, seed=1)
    train = sample_numbers(2000, seed=0, exclude=frozenset(val))
    assert len(set(train)) == 2000 and not set(train) & set(val)
    assert sample_numbers(50, seed=0) == sample_numbers(50, seed=0)
    lengths = {len(str(n)) for n in train}
    assert lengths == {1, 2, 3, 4, 5, 6}


def test_read_parallel_plain_and_gzip(tmp_path: Path):
    (tmp_path / "train.en").write_text("Hello world.\n\nGood morning.\n", encoding="utf-8")
    with gzip.open(tmp_path / "train.de.gz", "wt", encoding="utf-8") as f:
        f.write("Hallo Welt.\nLeer.\nGuten Morgen.\n")
    pairs = read_parallel(tmp_path / "train.en", tmp_path / "train.de.gz")
    assert pairs == [("Hello world.", "Hallo Welt."), ("Good morning.", "Guten Morgen.")]  # empty side skipped
    for lines in ("Eins.\nZwei.\n", "Eins.\nZwei.\nDrei.\nVier.\n"):  # one line short / one line long
        (tmp_path / "other.de").write_text(lines, encoding="utf-8")
        with pytest.raises(ValueError, match="different numbers of lines"):
            read_parallel(tmp_path / "train.en", tmp_path / "other.de")


def test_read_ding_extracts_aligned_clean_sentences(tmp_path: Path):
    lines = [
        "# Version :: test",
        "Rollo {n} | Die Rollos sind heruntergelassen. :: blind | The blinds are drawn.",
        "Haus {n} | Das Haus ist (sehr) alt. | Er baut ein Haus. :: house | The house is (very) old.",  # misaligned
        "etw. tun | Er hat etw. gesagt. :: to do sth. | He said sth. to me.",  # placeholders
        "Ja/Nein | Kommst du heute mit? :: yes/no | Are you coming along today?",
        "kurz | Zu kurz. :: short | Too short.",
    ]
    path = tmp_path / "de-en"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert read_ding(path) == [("The blinds are drawn.", "Die Rollos sind heruntergelassen."),
                               ("Are you coming along today?", "Kommst du heute mit?")]


def test_word_vocab_round_trip_and_unknowns():
    vocab = WordVocab.from_texts(["a b b c", "c c d"], size=6)
    assert vocab.itos[:4] == ["<pad>", "<unk>", "<s>", "</s>"] and vocab.itos[4:] == ["c", "b"]
    assert vocab.encode("c b z") == [4, 5, UNK]
    assert vocab.decode([BOS, 4, 5, EOS, PAD]) == "c b"
    nums = WordVocab(EN_WORDS)
    assert nums.decode(nums.encode("twenty-one thousand")) == "twenty-one thousand"


def test_numbers_datamodule_batches(tmp_path: Path):
    dm = TranslationDataModule(source="numbers", num_train=64, num_val=16, batch_size=8, cache_dir=str(tmp_path))
    dm.prepare_data()
    dm.setup("fit")
    assert (dm.src_vocab_size, dm.tgt_vocab_size) == (len(EN_WORDS) + 4, len(DE_WORDS) + 4)
    batch = next(iter(dm.train_dataloader()))
    assert batch["src"].shape[0] == 8
    assert bool((batch["tgt_in"][:, 0] == BOS).all())
    lengths = (batch["tgt_out"] != PAD).sum(1)
    assert bool((batch["tgt_out"][torch.arange(8), lengths - 1] == EOS).all())
    shifted = batch["tgt_out"][:, :-1]
    assert torch.equal(batch["tgt_in"][:, 1:], shifted.masked_fill(shifted == EOS, PAD))  # teacher forcing
    ref = batch["ref"][0]
    ids = batch["tgt_out"][0][: lengths[0] - 1].tolist()
    assert dm.tgt_codec.decode(ids) == ref


def _write_wmt(tmp_path: Path) -> dict[str, str]:
    pairs = number_pairs(sample_numbers(120, seed=5))
    files = {}
    for split, chunk in (("train", pairs[:100]), ("val", pairs[100:])):
        for side, lang in ((0, "en"), (1, "de")):
            path = tmp_path / f"{split}.{lang}"
            path.write_text("".join(p[side] + "\n" for p in chunk), encoding="utf-8")
            files[f"{split}_{'src' if side == 0 else 'tgt'}"] = str(path)
    return files


def test_parallel_files_with_word_vocabularies(tmp_path: Path):
    files = _write_wmt(tmp_path)
    dm = TranslationDataModule(source="parallel", tokenizer="word", vocab_size=64, batch_size=10, **files)
    assert dm.src_vocab_size == 64
    dm.prepare_data()
    dm.setup("fit")
    assert len(dm.train_set) == 100 and len(dm.val_set) == 20
    assert len(dm.tgt_codec) <= 64
    batch = collate_pairs([dm.val_set[0], dm.val_set[1]])
    assert batch["src"].shape[0] == 2
    with pytest.raises(ValueError, match="train_src"):
        TranslationDataModule(source="parallel")


def test_parallel_files_with_sentencepiece(tmp_path: Path):
    pytest.importorskip("sentencepiece")
    files = _write_wmt(tmp_path)
    dm = TranslationDataModule(source="parallel", tokenizer="sentencepiece", vocab_size=60, batch_size=10,
                               cache_dir=str(tmp_path / "cache"), **files)
    dm.prepare_data()
    models = list((tmp_path / "cache").glob("spm-parallel-*.model"))
    assert len(models) == 1
    dm.prepare_data()  # cached: nothing new
    assert list((tmp_path / "cache").glob("spm-parallel-*.model")) == models
    dm.setup("fit")
    assert 4 < len(dm.src_codec) <= 60
    text = "ein und zwanzig tausend"
    assert dm.tgt_codec.decode(dm.tgt_codec.encode(text)) == text


def test_held_out_split_is_deterministic():
    texts = [f"sentence {i}." for i in range(1000)]
    held = [t for t in texts if is_held_out(t, 10)]
    assert 50 < len(held) < 150
    assert held == [t for t in texts if is_held_out(t, 10)]


@pytest.mark.parametrize("empty", ["train", "val"])
def test_parallel_files_without_a_sentence_pair_are_named(tmp_path: Path, empty: str):
    """Before, an empty file surfaced as the sampler's ``num_samples=0`` on every rank, naming nothing."""
    files = _write_wmt(tmp_path)
    for side in ("src", "tgt"):
        Path(files[f"{empty}_{side}"]).write_text("\n\n", encoding="utf-8")  # lines, but none with text
    dm = TranslationDataModule(source="parallel", tokenizer="word", vocab_size=64, batch_size=10, **files)
    with pytest.raises(ValueError, match=f"no sentence pairs .* in {files[f'{empty}_src']} and {files[f'{empty}_tgt']}"):
        dm.prepare_data()
        dm.setup("fit")
