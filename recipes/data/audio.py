"""Audio I/O and log-mel features in plain numpy / torch (no torchaudio).

WAV (PCM 8/16/24/32-bit) is read with the standard library; FLAC and other formats need the optional
``soundfile`` package (its wheels bundle libsndfile).
"""

from __future__ import annotations

import math
import wave
from pathlib import Path
from typing import Union

import numpy as np
import torch
from torch import Tensor

__all__ = ["LogMel", "mel_filterbank", "read_audio", "resample", "write_wav"]


def _pcm_to_float(raw: bytes, width: int) -> np.ndarray:
    if width == 1:
        return (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) / 128.0
    if width == 2:
        return np.frombuffer(raw, "<i2").astype(np.float32) / 32768.0
    if width == 3:
        b = np.frombuffer(raw, np.uint8).reshape(-1, 3).astype(np.int32)
        v = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        return (np.where(v >= 1 << 23, v - (1 << 24), v)).astype(np.float32) / float(1 << 23)
    if width == 4:
        return np.frombuffer(raw, "<i4").astype(np.float32) / float(1 << 31)
    raise ValueError(f"unsupported PCM sample width {width} bytes")


def read_audio(path: Union[str, Path]) -> tuple[np.ndarray, int]:
    """Mono float32 samples in [-1, 1] and the sample rate (channels are averaged)."""
    path = Path(path)
    if path.suffix.lower() == ".wav":
        try:
            with wave.open(str(path), "rb") as w:
                channels, width, rate = w.getnchannels(), w.getsampwidth(), w.getframerate()
                data = _pcm_to_float(w.readframes(w.getnframes()), width)
            return data.reshape(-1, channels).mean(axis=1), rate
        except wave.Error:
            pass  # e.g. float WAV: let soundfile try
    try:
        import soundfile
    except ImportError as err:
        raise ImportError(f"reading {path.suffix} files needs `pip install soundfile`") from err
    data, rate = soundfile.read(str(path), dtype="float32", always_2d=True)
    return data.mean(axis=1), int(rate)


def write_wav(path: Union[str, Path], samples: np.ndarray, rate: int) -> None:
    """Write mono float samples (clipped to [-1, 1]) as 16-bit PCM WAV."""
    pcm = (np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())


def resample(samples: np.ndarray, rate: int, target: int) -> np.ndarray:
    """Linear-interpolation resampling (adequate for speech features at 16 kHz)."""
    if rate == target or len(samples) == 0:
        return samples.astype(np.float32, copy=False)
    n = max(1, int(round(len(samples) * target / rate)))
    positions = np.arange(n, dtype=np.float64) * (rate / target)
    return np.interp(positions, np.arange(len(samples)), samples).astype(np.float32)


def _hz_to_mel(f: Union[float, Tensor]) -> Union[float, Tensor]:
    return 2595.0 * (torch.log10(1.0 + f / 700.0) if isinstance(f, Tensor) else math.log10(1.0 + f / 700.0))


def mel_filterbank(n_mels: int, n_fft: int, rate: int, fmin: float = 20.0, fmax: float = 7600.0) -> Tensor:
    """(n_fft // 2 + 1, n_mels) triangular filters on the HTK mel scale."""
    freqs = torch.linspace(0, rate / 2, n_fft // 2 + 1)
    mels = torch.linspace(_hz_to_mel(fmin), _hz_to_mel(min(fmax, rate / 2)), n_mels + 2)
    hz = 700.0 * (10 ** (mels / 2595.0) - 1.0)
    lower, center, upper = hz[:-2], hz[1:-1], hz[2:]
    up = (freqs[:, None] - lower) / (center - lower)
    down = (upper - freqs[:, None]) / (upper - center)
    return torch.clamp(torch.minimum(up, down), min=0.0)


class LogMel:
    """Waveform -> (frames, n_mels) log-mel features, mean/variance normalised per utterance.

    Args:
        rate: expected sample rate in Hz.
        n_mels: mel bins.
        win_ms: window length in milliseconds (Hann).
        hop_ms: hop in milliseconds.
    """

    def __init__(self, rate: int = 16000, n_mels: int = 40, win_ms: float = 25.0, hop_ms: float = 10.0) -> None:
        self.rate, self.n_mels = rate, n_mels
        self.n_fft = int(round(rate * win_ms / 1000))
        self.hop = int(round(rate * hop_ms / 1000))
        self.window = torch.hann_window(self.n_fft)
        self.fbank = mel_filterbank(n_mels, self.n_fft, rate)

    def __call__(self, samples: Union[np.ndarray, Tensor]) -> Tensor:
        x = torch.as_tensor(samples, dtype=torch.float32)
        if x.numel() < self.n_fft:
            x = torch.nn.functional.pad(x, (0, self.n_fft - x.numel()))
        spec = torch.stft(x, self.n_fft, self.hop, window=self.window, center=True, return_complex=True)
        feats = torch.log(spec.abs().pow(2).T @ self.fbank + 1e-6)
        return (feats - feats.mean(0)) / (feats.std(0) + 1e-5)
