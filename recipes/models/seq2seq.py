"""Encoder-decoder Transformer (Vaswani et al., 2017) over ``torch.nn.Transformer``, with greedy decoding.

Token id conventions shared with :mod:`recipes.data.vocab`: ``pad=0, unk=1, bos=2, eos=3``.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import Tensor, nn

from recipes.models.registry import register_model

__all__ = ["Seq2SeqTransformer", "sinusoidal_positions", "transformer_base", "transformer_tiny"]

PAD, BOS, EOS = 0, 2, 3


def sinusoidal_positions(length: int, dim: int) -> Tensor:
    """(length, dim) fixed sine/cosine position encodings."""
    pos = torch.arange(length, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(length, dim)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq[: dim // 2])
    return table


class Seq2SeqTransformer(nn.Module):
    """Token embeddings + sine positions -> ``nn.Transformer`` (pre-norm) -> output projection tied to the
    target embedding.

    Args:
        src_vocab: source vocabulary size.
        tgt_vocab: target vocabulary size.
        d_model: model width.
        nhead: attention heads.
        layers: encoder layers and decoder layers (each).
        ff: feed-forward width.
        dropout: dropout probability.
        max_len: longest sequence (tokens, including BOS/EOS) the positions cover.
    """

    def __init__(self, src_vocab: int, tgt_vocab: int, d_model: int = 128, nhead: int = 4, layers: int = 2,
                 ff: int = 512, dropout: float = 0.1, max_len: int = 256) -> None:
        super().__init__()
        if min(src_vocab, tgt_vocab) < 5:
            raise ValueError(f"`src_vocab` and `tgt_vocab` must be >= 5 (4 special tokens), "
                             f"got {src_vocab}, {tgt_vocab}")
        if d_model % nhead or d_model % 2:
            raise ValueError(f"`d_model` must be even and divisible by `nhead`, got {d_model} and {nhead}")
        self.d_model, self.max_len = d_model, max_len
        self.src_embed = nn.Embedding(src_vocab, d_model, padding_idx=PAD)
        self.tgt_embed = nn.Embedding(tgt_vocab, d_model, padding_idx=PAD)
        self.register_buffer("positions", sinusoidal_positions(max_len, d_model), persistent=False)
        with warnings.catch_warnings():  # "enable_nested_tensor is True, but ... norm_first": expected, harmless
            warnings.simplefilter("ignore", UserWarning)
            self.transformer = nn.Transformer(d_model, nhead, layers, layers, ff, dropout, batch_first=True,
                                              norm_first=True)
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(d_model, tgt_vocab, bias=False)
        self.out.weight = self.tgt_embed.weight
        nn.init.normal_(self.src_embed.weight, std=d_model ** -0.5)
        nn.init.normal_(self.tgt_embed.weight, std=d_model ** -0.5)

    def _embed(self, table: nn.Embedding, ids: Tensor) -> Tensor:
        if ids.shape[1] > self.max_len:
            raise ValueError(f"sequence of {ids.shape[1]} tokens exceeds max_len={self.max_len}")
        return self.drop(table(ids) * math.sqrt(self.d_model) + self.positions[: ids.shape[1]])

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor]:
        """``src`` (N, S) ids -> memory (N, S, d_model) and its padding mask (N, S)."""
        mask = src == PAD
        return self.transformer.encoder(self._embed(self.src_embed, src), src_key_padding_mask=mask), mask

    def decode(self, tgt_in: Tensor, memory: Tensor, memory_mask: Tensor) -> Tensor:
        """Teacher-forced decoder: ``tgt_in`` (N, T) -> logits (N, T, tgt_vocab)."""
        t = tgt_in.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=tgt_in.device).triu(1)
        h = self.transformer.decoder(self._embed(self.tgt_embed, tgt_in), memory, tgt_mask=causal,
                                     tgt_key_padding_mask=tgt_in == PAD, memory_key_padding_mask=memory_mask,
                                     tgt_is_causal=True)
        return self.out(h)

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """(N, S) source and (N, T) BOS-prefixed target ids -> (N, T, tgt_vocab) logits."""
        memory, mask = self.encode(src)
        return self.decode(tgt_in, memory, mask)

    @torch.no_grad()
    def greedy_decode(self, src: Tensor, max_new_tokens: int) -> Tensor:
        """Greedy decoding: (N, S) source -> (N, <= max_new_tokens) ids without BOS, padded after EOS."""
        memory, mask = self.encode(src)
        ys = torch.full((src.shape[0], 1), BOS, dtype=torch.long, device=src.device)
        done = torch.zeros(src.shape[0], dtype=torch.bool, device=src.device)
        for _ in range(min(max_new_tokens, self.max_len - 1)):
            nxt = self.decode(ys, memory, mask)[:, -1].argmax(-1)
            nxt = nxt.masked_fill(done, PAD)
            ys = torch.cat([ys, nxt[:, None]], dim=1)
            done |= nxt == EOS
            if bool(done.all()):
                break
        return ys[:, 1:]


@register_model
def transformer_tiny(src_vocab: int, tgt_vocab: int, dropout: float = 0.1, max_len: int = 64) -> Seq2SeqTransformer:
    """d128, 4 heads, 2+2 layers, ff 512: the CPU number-words recipe."""
    return Seq2SeqTransformer(src_vocab, tgt_vocab, 128, 4, 2, 512, dropout, max_len)


@register_model
def transformer_base(src_vocab: int, tgt_vocab: int, dropout: float = 0.1, max_len: int = 256) -> Seq2SeqTransformer:
    """Transformer-base: d512, 8 heads, 6+6 layers, ff 2048 (WMT14 EN-DE)."""
    return Seq2SeqTransformer(src_vocab, tgt_vocab, 512, 8, 6, 2048, dropout, max_len)
