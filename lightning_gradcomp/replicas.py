"""A mixin for strategies whose ranks train different copies of the model (SwarmSGD, Local SGD).

Two things follow from replicas that drift apart:

* **Evaluation** uses another model than the rank's training model (the mean over ranks, rank 0's, the last
  synchronized global model). The strategy defines :meth:`DivergentReplicas._enter_eval` (which fills
  ``self._eval_backup`` with the tensors it replaced) and :meth:`DivergentReplicas._exit_eval`; the mixin calls
  them around every validation, test and predict loop.
* **Checkpoints** hold every rank's own model and optimizer state (each rank writes its own shard file, see
  :mod:`lightning_gradcomp.sharded_checkpoints`, and the strategy loads it into ``self._restored`` on load); a
  rank restores its own when it has them, else the checkpoint's ``state_dict`` and rank 0's optimizer state
  (after a world-size change).
* **A NaN/Inf gradient stays on its rank**: nothing averages it away before the local step, so
  :meth:`DivergentReplicas._guarded` zeroes it first (unless a loss scaler is in charge).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

from torch import Tensor
from torch.optim import Optimizer

from lightning_gradcomp.functional.finite import zero_if_nonfinite

__all__ = ["DivergentReplicas"]


class DivergentReplicas:
    """Mixin, listed before the Lightning strategy base class (see the module docstring)."""

    _eval_backup: Optional[dict[str, Tensor]]
    _restored: Optional[dict[str, Any]]
    lightning_module: Any
    precision_plugin: Any

    def _guarded(
        self, optimizer: Optimizer, closure: Callable[[], Any], count: Callable[[Tensor], None]
    ) -> Callable[[], Any]:
        """``closure`` (forward and backward), then every gradient of ``optimizer`` zeroed when one holds NaN/Inf
        (:func:`~lightning_gradcomp.functional.finite.zero_if_nonfinite`; ``count`` receives its one-element flag),
        so the local step cannot take the value into the rank's model or optimizer state. ``closure`` itself
        with a loss scaler (fp16 AMP): the scaler skips such steps."""
        if getattr(self.precision_plugin, "scaler", None) is not None:
            return closure

        def guarded() -> Any:
            result = closure()
            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            if grads:
                count(zero_if_nonfinite(grads))
            return result

        return guarded

    def _enter_eval(self) -> None:
        """Swap the evaluated model in (and keep what it replaced in ``self._eval_backup``)."""
        raise NotImplementedError

    def _exit_eval(self) -> None:
        """Put the rank's own model back."""
        raise NotImplementedError

    def on_validation_start(self) -> None:
        self._enter_eval()
        super().on_validation_start()  # type: ignore[misc]

    def on_validation_end(self) -> None:
        self._exit_eval()
        super().on_validation_end()  # type: ignore[misc]

    def on_test_start(self) -> None:
        self._enter_eval()
        super().on_test_start()  # type: ignore[misc]

    def on_test_end(self) -> None:
        self._exit_eval()
        super().on_test_end()  # type: ignore[misc]

    def on_predict_start(self) -> None:
        self._enter_eval()
        super().on_predict_start()  # type: ignore[misc]

    def on_predict_end(self) -> None:
        self._exit_eval()
        super().on_predict_end()  # type: ignore[misc]

    def _local_model_state(self) -> dict[str, Any]:
        """This rank's own training model's state dict, even while another model is swapped in."""
        state = {
            k: v.detach().clone() if isinstance(v, Tensor) else v for k, v in self.lightning_module.state_dict().items()
        }
        if self._eval_backup is not None:
            state.update({k: v.clone() for k, v in self._eval_backup.items() if k in state})
        return state

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Load this rank's own model when the checkpoint has it, else the checkpoint's ``state_dict``."""
        if self._restored is not None:
            self.lightning_module.load_state_dict(self._restored["model"], strict=strict)
            return
        super().load_model_state_dict(checkpoint, strict=strict)  # type: ignore[misc]

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Load this rank's own optimizer states when the checkpoint has them, else rank 0's."""
        if self._restored is not None:
            checkpoint = {**checkpoint, "optimizer_states": self._restored["optimizers"]}
        super().load_optimizer_state_dict(checkpoint)  # type: ignore[misc]
