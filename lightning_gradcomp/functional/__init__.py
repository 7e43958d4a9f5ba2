"""Pure tensor math used by the compressors (no process groups, unit-testable)."""

from lightning_gradcomp.functional.lattice import lattice_checksum, lattice_decode, lattice_index
from lightning_gradcomp.functional.layerwise import solve_layerwise
from lightning_gradcomp.functional.lowrank import orthogonalize
from lightning_gradcomp.functional.sparsify import kept_count, random_indices, scatter_dense, topk_indices

__all__ = ["kept_count", "lattice_checksum", "lattice_decode", "lattice_index", "orthogonalize", "random_indices",
           "scatter_dense", "solve_layerwise", "topk_indices"]
