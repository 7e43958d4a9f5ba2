"""Speech data: WAV reading (stdlib), features, the LibriSpeech-layout corpus reader, generated digit corpora."""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np
import pytest
import torch

from recipes.data.audio import LogMel, mel_filterbank, read_audio, resample, write_wav
from recipes.data.digit_speech import (DIGIT_WORDS, corpus_info, espeak_available, make_digit_corpus,
                                       tone_utterance)
from recipes.data.speech_corpus import scan_corpus, write_transcripts
from recipes.data.speech_data import SpeechDataModule, collate_speech


def _write_pcm(path: Path, frames: np.ndarray, rate: int, width: int) -> None:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(frames.shape[1])
        w.setsampwidth(width)
        w.setframerate(rate)
        if width == 2:
            w.writeframes((frames * 32767).astype("<i2").tobytes())
        else:  # 24-bit little endian
            ints = (frames * (2 ** 23 - 1)).astype("<i4").reshape(-1)
            w.writeframes(b"".join(int(v).to_bytes(3, "little", signed=True) for v in ints))


@pytest.mark.parametrize("width", [2, 3])
def test_read_wav_stereo_pcm_averages_channels(tmp_path: Path, width: int):
    t = np.arange(800) / 8000
    left, right = 0.5 * np.sin(2 * np.pi * 440 * t), 0.25 * np.ones_like(t)
    _write_pcm(tmp_path / "x.wav", np.stack([left, right], 1), 8000, width)
    samples, rate = read_audio(tmp_path / "x.wav")
    assert rate == 8000 and samples.shape == (800,)
    assert np.allclose(samples, (left + right) / 2, atol=2e-4)


def test_write_then_read_and_resample(tmp_path: Path):
    x = np.linspace(-1, 1, 2205).astype(np.float32)
    write_wav(tmp_path / "a.wav", x, 22050)
    y, rate = read_audio(tmp_path / "a.wav")
    assert rate == 22050 and np.allclose(x, y, atol=1e-4)
    z = resample(y, 22050, 16000)
    assert len(z) == 1600 and np.allclose(z[[0, -1]], [-1, 1], atol=2e-3)
    with pytest.raises((ImportError, RuntimeError, Exception)):
        read_audio(tmp_path / "missing.flac")


def test_flac_needs_soundfile(tmp_path: Path):
    soundfile = pytest.importorskip("soundfile")
    x = (0.3 * np.sin(np.arange(1600) / 5)).astype(np.float32)
    soundfile.write(str(tmp_path / "a.flac"), x, 16000)
    y, rate = read_audio(tmp_path / "a.flac")
    assert rate == 16000 and np.allclose(x, y, atol=1e-4)


def test_log_mel_shapes_and_filterbank():
    fb = mel_filterbank(40, 400, 16000)
    assert fb.shape == (201, 40) and float(fb.min()) >= 0 and float(fb.max()) <= 1
    assert bool((fb.sum(0) > 0).all())  # no empty filter
    feats = LogMel()(np.random.default_rng(0).normal(size=16000).astype(np.float32))
    assert feats.shape == (101, 40)
    assert torch.allclose(feats.mean(0), torch.zeros(40), atol=1e-4)
    tone = LogMel()(np.sin(2 * np.pi * 1000 * np.arange(16000) / 16000))
    assert tone.shape == (101, 40)


def _write_librispeech_like(root: Path) -> None:
    for split, speakers in (("train-clean", ("19", "26")), ("dev-clean", ("84",))):
        for spk in speakers:
            folder = root / split / spk / "198"
            folder.mkdir(parents=True)
            entries = []
            for i in range(3):
                utt = f"{spk}-198-{i:04d}"
                write_wav(folder / f"{utt}.wav", 0.1 * np.random.default_rng(i).normal(size=4000), 16000)
                entries.append((utt, "HELLO WORLD" if i else "IT'S A TEST"))
            write_transcripts(folder / f"{spk}-198.trans.txt", entries)


def test_scan_corpus_and_char_units(tmp_path: Path):
    _write_librispeech_like(tmp_path)
    items = scan_corpus(tmp_path / "train-clean")
    assert len(items) == 6 and items[0][0].name == "19-198-0000.wav" and items[0][1] == "IT'S A TEST"
    dm = SpeechDataModule(source="corpus", root=str(tmp_path), train_dir="train-clean", val_dir="dev-clean",
                          units="chars", batch_size=2)
    assert dm.num_classes == 29
    dm.setup("fit")
    feats, labels, text = dm.train_set[0]
    assert feats.shape == (26, 40)
    assert labels.tolist() == [9, 20, 27, 19, 28, 1, 28, 20, 5, 19, 20]  # i t ' s | a | t e s t
    batch = next(iter(dm.val_dataloader()))
    assert batch["feats"].shape[0] == 3 and batch["labels"].numel() == int(batch["label_lens"].sum())
    (tmp_path / "train-clean" / "19" / "198" / "19-198-0001.wav").unlink()
    with pytest.raises(FileNotFoundError, match="19-198-0001"):
        scan_corpus(tmp_path / "train-clean")
    with pytest.raises(FileNotFoundError):
        scan_corpus(tmp_path / "nothing")


def test_collate_pads_and_concatenates():
    batch = collate_speech([(torch.ones(5, 3), torch.tensor([1, 2]), "a"), (torch.ones(2, 3), torch.tensor([3]), "b")])
    assert batch["feats"].shape == (2, 5, 3) and float(batch["feats"][1, 2:].abs().sum()) == 0
    assert batch["labels"].tolist() == [1, 2, 3] and batch["label_lens"].tolist() == [2, 1]
    assert batch["feat_lens"].tolist() == [5, 2]


def test_tone_corpus_layout_and_held_out_voices(tmp_path: Path):
    info = make_digit_corpus(tmp_path / "c", num_train=8, num_test=4, engine="tones", held_out=3)
    assert info["engine"] == "tones" and corpus_info(tmp_path / "c") == info
    train, test = scan_corpus(tmp_path / "c" / "train"), scan_corpus(tmp_path / "c" / "test")
    assert len(train) == 8 and len(test) == 4
    for _, text in train + test:
        words = text.split()
        assert 3 <= len(words) <= 6 and set(words) <= set(DIGIT_WORDS)
    samples, rate = read_audio(train[0][0])
    assert rate == 16000 and len(samples) > 0.3 * rate
    assert not (tmp_path / "c.partial").exists()


def test_tone_utterance_length_grows_with_digits():
    rng = np.random.default_rng(0)
    voice = np.array([1.0, 1.0, 0.3, 0.0])
    short, long = tone_utterance([1, 2], voice, rng), tone_utterance([1, 2, 3, 4, 5, 6], voice, rng)
    assert len(long) > len(short)


@pytest.mark.skipif(not espeak_available(), reason="espeak-ng not installed")
def test_espeak_corpus_voices_differ(tmp_path: Path):
    make_digit_corpus(tmp_path / "e", num_train=4, num_test=2, engine="espeak", held_out=5)
    items = scan_corpus(tmp_path / "e" / "train")
    audio = [read_audio(p)[0] for p, _ in items]
    assert len({a.tobytes() for a in audio}) == 4
    assert all(r == 16000 for _, r in (read_audio(p) for p, _ in items))


def test_digit_datamodule_generates_once(tmp_path: Path):
    dm = SpeechDataModule(source="digits", engine="tones", num_train=6, num_val=3, held_out=2,
                          cache_dir=str(tmp_path), batch_size=3)
    dm.prepare_data()
    stamp = (dm.corpus_root / "corpus.json").stat().st_mtime_ns
    dm.prepare_data()
    assert (dm.corpus_root / "corpus.json").stat().st_mtime_ns == stamp
    dm.setup("fit")
    assert dm.num_classes == 11 and len(dm.train_set) == 6
    _, labels, text = dm.train_set[0]
    assert [DIGIT_WORDS[i - 1] for i in labels.tolist()] == text.split()


def test_auto_engine_warns_when_it_falls_back_to_tones(monkeypatch: pytest.MonkeyPatch) -> None:
    from recipes.data import digit_speech

    monkeypatch.setattr(digit_speech, "espeak_available", lambda: False)
    with pytest.warns(UserWarning, match="espeak-ng is not installed"):
        assert digit_speech.resolve_engine("auto") == "tones"
    monkeypatch.setattr(digit_speech, "espeak_available", lambda: True)
    assert digit_speech.resolve_engine("auto") == "espeak"
