"""Decoder-only (causal) Transformer language model over ``torch.nn.TransformerEncoder``, output tied to the input
embedding. Token ids follow :mod:`recipes.data.vocab` (``pad=0``)."""

from __future__ import annotations

import math
import warnings

import torch
from torch import Tensor, nn

from recipes.models.registry import register_model
from recipes.models.seq2seq import sinusoidal_positions

__all__ = ["CausalLM", "lm_base", "lm_small"]

PAD = 0


class CausalLM(nn.Module):
    """Token embeddings + sine positions -> pre-norm causal ``nn.TransformerEncoder`` -> final norm -> logits.

    Args:
        vocab: vocabulary size (ids ``0 .. vocab - 1``; ``0`` is padding).
        d_model: model width.
        nhead: attention heads.
        layers: Transformer layers.
        ff: feed-forward width.
        dropout: dropout probability.
        max_len: longest sequence the positions cover.
    """

    def __init__(self, vocab: int, d_model: int = 128, nhead: int = 4, layers: int = 2, ff: int = 512,
                 dropout: float = 0.1, max_len: int = 256) -> None:
        super().__init__()
        if vocab < 5:
            raise ValueError(f"`vocab` must be >= 5 (4 special tokens), got {vocab}")
        if d_model % nhead or d_model % 2:
            raise ValueError(f"`d_model` must be even and divisible by `nhead`, got {d_model} and {nhead}")
        self.d_model, self.max_len = d_model, max_len
        self.embed = nn.Embedding(vocab, d_model, padding_idx=PAD)
        self.register_buffer("positions", sinusoidal_positions(max_len, d_model), persistent=False)
        layer = nn.TransformerEncoderLayer(d_model, nhead, ff, dropout, batch_first=True, norm_first=True)
        with warnings.catch_warnings():  # "enable_nested_tensor is True, but ... norm_first": expected, harmless
            warnings.simplefilter("ignore", UserWarning)
            self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(d_model, vocab, bias=False)
        self.out.weight = self.embed.weight
        nn.init.normal_(self.embed.weight, std=d_model ** -0.5)

    def forward(self, ids: Tensor) -> Tensor:
        """(N, T) ids -> (N, T, vocab) next-token logits (position ``t`` sees ids ``<= t``)."""
        t = ids.shape[1]
        if t > self.max_len:
            raise ValueError(f"sequence of {t} tokens exceeds max_len={self.max_len}")
        x = self.drop(self.embed(ids) * math.sqrt(self.d_model) + self.positions[:t])
        causal = torch.ones(t, t, dtype=torch.bool, device=ids.device).triu(1)
        return self.out(self.norm(self.blocks(x, mask=causal, is_causal=True)))


@register_model
def lm_small(vocab: int, dropout: float = 0.1, max_len: int = 128) -> CausalLM:
    """d128, 4 heads, 2 layers, ff 512 (about 0.43M parameters with a byte vocabulary): the CPU horizon task."""
    return CausalLM(vocab, 128, 4, 2, 512, dropout, max_len)


@register_model
def lm_base(vocab: int, dropout: float = 0.1, max_len: int = 512) -> CausalLM:
    """d512, 8 heads, 6 layers, ff 2048 (about 19M parameters): GPU-sized."""
    return CausalLM(vocab, 512, 8, 6, 2048, dropout, max_len)
