"""Pure tensor math used by the compressors (no process groups, unit-testable)."""

from lightning_gradcomp.functional.lattice import lattice_checksum, lattice_decode, lattice_index
from lightning_gradcomp.functional.layerwise import solve_layerwise
from lightning_gradcomp.functional.lowrank import orthogonalize
from lightning_gradcomp.functional.packing import pack_bits, packed_nbytes, unpack_bits
from lightning_gradcomp.functional.quantize import (
    Quantized,
    alpha_p,
    block_quantize,
    dequantize,
    qsgd_quantize,
    sign_quantize,
    stochastic_quantize,
    terngrad_quantize,
)
from lightning_gradcomp.functional.selection import approx_topk_indices, exact_topk_indices, topk_indices
from lightning_gradcomp.functional.sparsify import kept_count, scatter_dense, stratified_indices

__all__ = [
    "approx_topk_indices",
    "exact_topk_indices",
    "kept_count",
    "lattice_checksum",
    "lattice_decode",
    "lattice_index",
    "orthogonalize",
    "stratified_indices",
    "scatter_dense",
    "solve_layerwise",
    "topk_indices",
    "Quantized",
    "alpha_p",
    "block_quantize",
    "dequantize",
    "pack_bits",
    "packed_nbytes",
    "qsgd_quantize",
    "sign_quantize",
    "stochastic_quantize",
    "terngrad_quantize",
    "unpack_bits",
]
