"""Lightning callbacks that steer or observe the compression."""

from lightning_gradcomp.callbacks.guard import CompressionGuard, CompressionWarning
from lightning_gradcomp.callbacks.lgreco import LGreCo
from lightning_gradcomp.callbacks.logger import CompressionLogger

__all__: list[str] = ["CompressionGuard", "CompressionLogger", "CompressionWarning", "LGreCo"]
