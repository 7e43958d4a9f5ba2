"""Generate a spoken-words corpus with espeak-ng: short phrases over a fixed English vocabulary, as wav files +
``*.trans.txt`` transcripts (the layout :func:`recipes.data.speech_corpus.scan_corpus` reads).

Each utterance is ``min_words``-``max_words`` words drawn uniformly from the first ``vocab_size`` words of
:data:`WORDS` (300 common English words, letters only, no two of which sound alike), spoken by
``espeak-ng`` with a random English accent, voice variant, rate and pitch. The test utterances use voice variants
that never occur in training. Needs ``apt-get install -y espeak-ng`` (there is no tone fallback for words).
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Union

import numpy as np

from recipes.data.audio import write_wav
from recipes.data.digit_speech import ESPEAK_ACCENTS, RATE, _espeak, espeak_available, espeak_variants
from recipes.data.speech_corpus import write_transcripts

__all__ = ["WORDS", "make_word_corpus"]

WORDS = tuple("""
time year people way day man thing woman life child world school state family student group country problem hand
part place case week company system program question work government number night point home water room mother
area money story fact month lot study book eye job word business issue side kind head house service friend father
power hour game line end member law car city name president team minute idea kid body information back parent face
others level office door health person art war history party result change morning reason research girl guy moment
air teacher force education foot boy age policy music market sense nation plan college interest death experience
effect class control care field development role effort rate heart drug show leader light voice wife police mind
price report decision son view relationship town road arm difference value building action model season society
tax director position player record paper space ground form event official matter center couple site project
activity star table need court oil situation cost industry figure street image phone data picture practice piece
land product doctor wall patient worker news test movie north love support technology step baby computer type
attention film tree source organization hair window evidence population truth song dog animal
bring happen write provide sit stand lose pay include continue learn lead understand watch follow stop create speak
read spend grow open walk offer remember consider appear buy wait serve die send expect build stay fall cut reach
kill remain suggest raise pass sell require decide return explain hope develop carry break receive agree
good first last long great little own old big high different small large next early young important few public bad
same able human local sure free better true whole major special hard clear recent late simple strong green
""".split())
"""300 common English words; none sounds like another (no *write/right*, *son/sun*, *buy/by* pairs)."""


def _phrases(n: int, rng: np.random.Generator, words: tuple[str, ...], lo: int, hi: int) -> list[str]:
    return [" ".join(words[int(i)] for i in rng.integers(0, len(words), size=int(rng.integers(lo, hi + 1))))
            for _ in range(n)]


def make_word_corpus(out: Union[str, Path], vocab_size: int = 300, num_train: int = 8000, num_test: int = 400,
                     seed: int = 0, held_out: int = 20, min_words: int = 1, max_words: int = 3,
                     workers: int = 2) -> dict[str, object]:
    """Write ``out/train`` and ``out/test`` (wav + ``words.trans.txt``) and ``out/corpus.json``; return its info.

    Args:
        out: corpus folder (replaced when it exists).
        vocab_size: how many of :data:`WORDS` (the first ones) phrases draw from.
        num_train: training utterances.
        num_test: test utterances, all from held-out voices.
        seed: controls phrases, voices, rates and pitches.
        held_out: espeak-ng voice variants reserved for test.
        min_words: shortest phrase.
        max_words: longest phrase.
        workers: parallel synthesiser processes.
    """
    if not 2 <= vocab_size <= len(WORDS):
        raise ValueError(f"`vocab_size` must be in [2, {len(WORDS)}], got {vocab_size}")
    if num_train < 1 or num_test < 1 or not 1 <= min_words <= max_words or held_out < 1:
        raise ValueError(f"need num_train, num_test, held_out >= 1 and 1 <= min_words <= max_words, got "
                         f"{num_train}, {num_test}, {held_out}, {min_words}, {max_words}")
    if not espeak_available():
        raise FileNotFoundError("the spoken-words corpus needs espeak-ng (apt-get install -y espeak-ng)")
    rng = np.random.default_rng(seed)
    variants = list(espeak_variants())
    rng.shuffle(variants)
    if len(variants) <= held_out:
        raise ValueError(f"only {len(variants)} espeak-ng variants, cannot hold out {held_out}")
    pools = {"test": variants[:held_out], "train": variants[held_out:]}
    out = Path(out)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    for split, count in (("train", num_train), ("test", num_test)):
        folder = tmp / split
        folder.mkdir(parents=True)
        texts = _phrases(count, rng, WORDS[:vocab_size], min_words, max_words)
        pool = pools[split]
        jobs = [(t, f"{ESPEAK_ACCENTS[int(rng.integers(len(ESPEAK_ACCENTS)))]}+{pool[int(rng.integers(len(pool)))]}",
                 int(rng.integers(120, 221)), int(rng.integers(20, 81))) for t in texts]
        with ThreadPoolExecutor(max(1, workers)) as ex:
            audio = list(ex.map(lambda job: _espeak(*job), jobs))
        ids = [f"{split}-{i:05d}" for i in range(count)]
        for utt, samples in zip(ids, audio):
            write_wav(folder / f"{utt}.wav", samples, RATE)
        write_transcripts(folder / "words.trans.txt", zip(ids, texts))
    info: dict[str, object] = {"engine": "espeak", "vocab_size": vocab_size, "num_train": num_train,
                               "num_test": num_test, "seed": seed, "held_out": held_out, "min_words": min_words,
                               "max_words": max_words, "sample_rate": RATE}
    (tmp / "corpus.json").write_text(json.dumps(info, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return info
