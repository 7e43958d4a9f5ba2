"""A speech corpus on disk in LibriSpeech's layout: audio files next to ``*.trans.txt`` transcript files.

Each line of a ``*.trans.txt`` file is ``<utterance-id> <transcript>``; the audio is
``<utterance-id>.flac`` or ``<utterance-id>.wav`` in the same folder. Any folder depth works.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Union

__all__ = ["AUDIO_EXTENSIONS", "check_corpus_folder", "scan_corpus", "write_transcripts"]

AUDIO_EXTENSIONS = (".flac", ".wav")


def check_corpus_folder(root: Union[str, Path]) -> Path:
    """``root`` as a ``Path``; ``FileNotFoundError`` when it is not a folder (lists nothing)."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"speech corpus folder {root} does not exist")
    return root


def scan_corpus(root: Union[str, Path]) -> list[tuple[Path, str]]:
    """Every (audio path, transcript) under ``root``, sorted by path; ``FileNotFoundError`` when there are none
    or a listed utterance has no audio file."""
    root = check_corpus_folder(root)
    items: list[tuple[Path, str]] = []
    for trans in sorted(root.rglob("*.trans.txt")):
        for line in trans.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            utt, _, text = line.strip().partition(" ")
            audio = next((trans.parent / f"{utt}{ext}" for ext in AUDIO_EXTENSIONS
                          if (trans.parent / f"{utt}{ext}").is_file()), None)
            if audio is None:
                raise FileNotFoundError(f"{trans} lists {utt!r} but {utt}.flac/.wav is missing")
            items.append((audio, text.strip()))
    if not items:
        raise FileNotFoundError(f"no *.trans.txt transcript files under {root}")
    return items


def write_transcripts(path: Union[str, Path], entries: Iterable[tuple[str, str]]) -> None:
    """Write ``<utterance-id> <transcript>`` lines."""
    Path(path).write_text("".join(f"{utt} {text}\n" for utt, text in entries), encoding="utf-8")
