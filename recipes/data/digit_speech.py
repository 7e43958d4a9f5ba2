"""Generate the offline speech corpus: connected digit strings, as wav files + ``*.trans.txt`` transcripts.

Engines:

* ``espeak``: Debian's ``espeak-ng`` (``apt-get install -y espeak-ng``) speaks each string with a random
  English accent, voice variant, rate and pitch. Test utterances use voice variants never used in training.
* ``tones``: no synthesiser needed. Each digit is a DTMF-like pair of tones (telephone keypad frequencies),
  and a "voice" is a random pitch scale, tempo, overtone mix and noise level; test voices are held out.
  It keeps the task (segment and label a variable-length digit sequence) but is acoustically easier.

``engine="auto"`` uses espeak-ng when it is on ``PATH`` and tones otherwise. The corpus is written in the layout
read by :func:`recipes.data.speech_corpus.scan_corpus` (``<root>/train`` and ``<root>/test``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal, Optional, Union

import numpy as np

from recipes.data.audio import resample, write_wav
from recipes.data.speech_corpus import write_transcripts

__all__ = ["DIGIT_WORDS", "ESPEAK_ACCENTS", "corpus_info", "espeak_available", "espeak_variants", "make_digit_corpus",
           "resolve_engine", "tone_utterance"]

DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
ESPEAK_ACCENTS = ("en-us", "en-gb", "en-gb-scotland", "en-gb-x-rp", "en-029", "en-gb-x-gbclan", "en-gb-x-gbcwmd")
RATE = 16000
Engine = Literal["auto", "espeak", "tones"]

_ROWS = (697.0, 770.0, 852.0, 941.0)
_COLS = (1209.0, 1336.0, 1477.0)


def espeak_available() -> bool:
    """Whether ``espeak-ng`` is on ``PATH``."""
    return shutil.which("espeak-ng") is not None


def resolve_engine(engine: Engine) -> str:
    """``auto`` -> ``espeak`` when available else ``tones``; ``espeak`` without the program raises."""
    if engine not in ("auto", "espeak", "tones"):
        raise ValueError(f"`engine` must be 'auto', 'espeak' or 'tones', got {engine!r}")
    if engine == "auto":
        if espeak_available():
            return "espeak"
        warnings.warn("speech data: espeak-ng is not installed, so engine='auto' synthesises digits with the 'tones' "
                      "fallback; results are not comparable with espeak-ng runs (docs/benchmarks-history.md). "
                      "Install it with `apt-get install -y espeak-ng`, or pass engine='tones' to silence this warning.")
        return "tones"
    if engine == "espeak" and not espeak_available():
        raise FileNotFoundError("espeak-ng is not installed (apt-get install -y espeak-ng), use engine='tones'")
    return engine


def espeak_variants() -> list[str]:
    """Voice-variant *file* names (case-sensitive: an unknown name silently falls back to the default voice)."""
    out = subprocess.run(["espeak-ng", "--voices=variant"], capture_output=True, text=True, check=True).stdout
    names = []
    for line in out.splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 5 and fields[4].startswith("!v/"):
            names.append(fields[4][3:])
    return sorted(set(names))


def _espeak(text: str, voice: str, speed: int, pitch: int) -> np.ndarray:
    raw = subprocess.run(["espeak-ng", "--stdout", "-v", voice, "-s", str(speed), "-p", str(pitch), text],
                         capture_output=True, check=True).stdout
    pos = raw.find(b"data")
    if raw[:4] != b"RIFF" or pos < 0:
        raise RuntimeError(f"espeak-ng returned no WAV data for voice {voice!r}")
    rate = int.from_bytes(raw[24:28], "little")
    samples = np.frombuffer(raw[pos + 8:len(raw) - (len(raw) - pos - 8) % 2], "<i2").astype(np.float32) / 32768.0
    return resample(samples, rate, RATE)


def tone_utterance(digits: list[int], voice: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Samples at 16 kHz for ``digits`` spoken by a tone ``voice`` = (pitch scale, tempo, overtone, noise)."""
    scale, tempo, overtone, noise = (float(v) for v in voice)
    parts = [np.zeros(int(RATE * rng.uniform(0.05, 0.2)), np.float32)]
    for d in digits:
        row, col = (3, 1) if d == 0 else divmod(d - 1, 3)
        n = int(RATE * rng.uniform(0.12, 0.22) / tempo)
        t = np.arange(n) / RATE
        tone = sum(np.sin(2 * np.pi * f * scale * t) + overtone * np.sin(4 * np.pi * f * scale * t)
                   for f in (_ROWS[row], _COLS[col]))
        envelope = np.minimum(1.0, np.minimum(t, t[::-1]) * 80.0)
        parts.append((0.25 * tone * envelope).astype(np.float32))
        parts.append(np.zeros(int(RATE * rng.uniform(0.04, 0.12) / tempo), np.float32))
    x = np.concatenate(parts)
    return x + rng.normal(0.0, noise, x.shape).astype(np.float32)


def _strings(n: int, rng: np.random.Generator, min_digits: int, max_digits: int) -> list[list[int]]:
    return [rng.integers(0, 10, size=int(rng.integers(min_digits, max_digits + 1))).tolist() for _ in range(n)]


def make_digit_corpus(out: Union[str, Path], num_train: int = 3000, num_test: int = 300, engine: Engine = "auto",
                      seed: int = 0, held_out: int = 20, min_digits: int = 3, max_digits: int = 6,
                      workers: int = 2) -> dict[str, object]:
    """Write ``out/train`` and ``out/test`` (wav + ``digits.trans.txt``) and ``out/corpus.json``; return its info.

    Args:
        out: corpus folder (replaced when it exists).
        num_train: training utterances.
        num_test: test utterances, all from held-out voices.
        engine: ``auto``, ``espeak`` or ``tones``.
        seed: controls strings, voices, rates and pitches.
        held_out: voice variants (espeak) or tone voices reserved for test.
        min_digits: shortest string.
        max_digits: longest string.
        workers: parallel synthesiser processes (espeak).
    """
    if num_train < 1 or num_test < 1 or not 1 <= min_digits <= max_digits or held_out < 1:
        raise ValueError(f"need num_train, num_test, held_out >= 1 and 1 <= min_digits <= max_digits, got "
                         f"{num_train}, {num_test}, {held_out}, {min_digits}, {max_digits}")
    engine = resolve_engine(engine)
    rng = np.random.default_rng(seed)
    out = Path(out)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    if engine == "espeak":
        variants = list(espeak_variants())
        rng.shuffle(variants)
        if len(variants) <= held_out:
            raise ValueError(f"only {len(variants)} espeak-ng variants, cannot hold out {held_out}")
        pools = {"test": variants[:held_out], "train": variants[held_out:]}
    else:
        voices = np.column_stack([rng.uniform(0.8, 1.25, 40 + held_out), rng.uniform(0.7, 1.4, 40 + held_out),
                                  rng.uniform(0.0, 0.6, 40 + held_out), rng.uniform(0.0, 0.05, 40 + held_out)])
        pools = {"test": list(range(held_out)), "train": list(range(held_out, 40 + held_out))}
    for split, count in (("train", num_train), ("test", num_test)):
        folder = tmp / split
        folder.mkdir(parents=True)
        strings = _strings(count, rng, min_digits, max_digits)
        texts = [" ".join(DIGIT_WORDS[d] for d in s) for s in strings]
        ids = [f"{split}-{i:05d}" for i in range(count)]
        if engine == "espeak":
            pool = pools[split]
            jobs = []
            for t in texts:
                accent = ESPEAK_ACCENTS[int(rng.integers(len(ESPEAK_ACCENTS)))]
                variant = pool[int(rng.integers(len(pool)))]
                jobs.append((t, f"{accent}+{variant}", int(rng.integers(120, 221)), int(rng.integers(20, 81))))
            with ThreadPoolExecutor(max(1, workers)) as ex:
                audio = list(ex.map(lambda job: _espeak(*job), jobs))
        else:
            picks = [int(pools[split][int(rng.integers(len(pools[split])))]) for _ in strings]
            audio = [tone_utterance(s, voices[v], rng) for s, v in zip(strings, picks)]
        for utt, samples in zip(ids, audio):
            write_wav(folder / f"{utt}.wav", samples, RATE)
        write_transcripts(folder / "digits.trans.txt", zip(ids, texts))
    info: dict[str, object] = {"engine": engine, "num_train": num_train, "num_test": num_test, "seed": seed,
                               "held_out": held_out, "sample_rate": RATE}
    (tmp / "corpus.json").write_text(json.dumps(info, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return info


def corpus_info(root: Union[str, Path]) -> Optional[dict[str, object]]:
    """The ``corpus.json`` of a finished corpus, or ``None``."""
    path = Path(root) / "corpus.json"
    return json.loads(path.read_text()) if path.is_file() else None
