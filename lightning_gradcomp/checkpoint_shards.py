"""Deprecated name of :mod:`lightning_gradcomp.shard_files` (the per-rank shard files' format), kept for one release.

``import lightning_gradcomp.checkpoint_shards`` warns and gives the very module ``shard_files`` (the same object, so
attributes set through either name are seen by both).
"""

import sys
import warnings

from lightning_gradcomp import shard_files

warnings.warn(
    "lightning_gradcomp.checkpoint_shards is renamed lightning_gradcomp.shard_files (the per-rank shard files); "
    "the old name goes away in the next release",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = shard_files
