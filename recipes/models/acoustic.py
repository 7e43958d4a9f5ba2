"""BiLSTM + CTC acoustic model (like ScaleCom's SWB300 LSTM), with greedy CTC decoding."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from recipes.models.registry import register_model

__all__ = ["CTCAcousticModel", "ctc_greedy", "lstm_ctc_base", "lstm_ctc_small"]


class CTCAcousticModel(nn.Module):
    """Conv1d front end (subsamples time by ``subsample``) -> bidirectional LSTM -> per-frame CTC logits.

    Args:
        n_feats: input features per frame (log-mel bins).
        num_classes: output classes including the CTC blank (index 0).
        hidden: LSTM hidden size per direction.
        layers: LSTM layers.
        subsample: time stride of the front end (1 or 2).
        dropout: dropout between LSTM layers and before the classifier.
    """

    def __init__(self, n_feats: int = 40, num_classes: int = 11, hidden: int = 128, layers: int = 2,
                 subsample: int = 2, dropout: float = 0.1) -> None:
        super().__init__()
        if subsample not in (1, 2):
            raise ValueError(f"`subsample` must be 1 or 2, got {subsample}")
        if num_classes < 2 or n_feats < 1 or hidden < 1 or layers < 1:
            raise ValueError(f"`num_classes` >= 2, `n_feats`, `hidden`, `layers` >= 1 required, got "
                             f"{num_classes}, {n_feats}, {hidden}, {layers}")
        self.subsample = subsample
        self.front = nn.Sequential(nn.Conv1d(n_feats, hidden, 3, subsample, 1), nn.GELU())
        self.lstm = nn.LSTM(hidden, hidden, layers, batch_first=True, bidirectional=True,
                            dropout=dropout if layers > 1 else 0.0)
        self.drop = nn.Dropout(dropout)
        self.classifier = nn.Linear(2 * hidden, num_classes)

    def output_lengths(self, lengths: Tensor) -> Tensor:
        """Frames after the front end for inputs of ``lengths`` frames."""
        return (lengths - 1) // self.subsample + 1

    def forward(self, feats: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        """``feats`` (N, T, F), ``lengths`` (N,) -> log-probabilities (N, T', C) and output lengths (N,)."""
        x = self.front(feats.transpose(1, 2)).transpose(1, 2)
        out_len = self.output_lengths(lengths)
        packed = nn.utils.rnn.pack_padded_sequence(x, out_len.cpu(), batch_first=True, enforce_sorted=False)
        h, _ = self.lstm(packed)
        h, _ = nn.utils.rnn.pad_packed_sequence(h, batch_first=True, total_length=x.shape[1])
        return self.classifier(self.drop(h)).log_softmax(-1), out_len


def ctc_greedy(log_probs: Tensor, lengths: Tensor, blank: int = 0) -> list[list[int]]:
    """Best-path decoding: argmax per frame, collapse repeats, drop blanks; one id list per utterance."""
    best = log_probs.argmax(-1).cpu()
    out = []
    for row, n in zip(best, lengths.tolist()):
        ids = torch.unique_consecutive(row[:n]).tolist()
        out.append([i for i in ids if i != blank])
    return out


@register_model
def lstm_ctc_small(n_feats: int = 40, num_classes: int = 11, dropout: float = 0.1) -> CTCAcousticModel:
    """2-layer BiLSTM h=128 (about 0.7M parameters): the CPU digit recipe."""
    return CTCAcousticModel(n_feats, num_classes, 128, 2, 2, dropout)


@register_model
def lstm_ctc_base(n_feats: int = 40, num_classes: int = 29, dropout: float = 0.2) -> CTCAcousticModel:
    """4-layer BiLSTM h=512 (SWB300-sized, about 20M parameters)."""
    return CTCAcousticModel(n_feats, num_classes, 512, 4, 2, dropout)
