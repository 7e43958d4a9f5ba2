"""Lightning callbacks that steer or observe the compression (filled in by later modules)."""

from lightning_gradcomp.callbacks.guard import CompressionGuard, CompressionWarning
from lightning_gradcomp.callbacks.lgreco import LGreCo
from lightning_gradcomp.callbacks.logger import CompressionLogger
from lightning_gradcomp.callbacks.lowpass import LowPassMemoryFilter

__all__: list[str] = ["CompressionGuard", "CompressionLogger", "CompressionWarning", "LGreCo", "LowPassMemoryFilter"]
