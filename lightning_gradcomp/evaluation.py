"""Evaluate a model other than the rank's training model: a mixin for strategies whose ranks drift apart.

SwarmSGD and Local SGD ranks each train their own copy of the model. For validation, test and predict such a
strategy swaps another model in (the mean over ranks, rank 0's, the last synchronized global model) and puts
the rank's own model back afterwards. The strategy defines :meth:`EvaluationSwap._enter_eval` (which fills
``self._eval_backup`` with the tensors it replaced) and :meth:`EvaluationSwap._exit_eval`; this mixin calls
them around every evaluation loop and gives checkpoints the rank's own training model.
"""

from __future__ import annotations

from typing import Any, Optional

from torch import Tensor

__all__ = ["EvaluationSwap"]


class EvaluationSwap:
    """Mixin (before the Lightning strategy base class): swaps the evaluated model in around evaluation loops."""

    _eval_backup: Optional[dict[str, Tensor]]
    lightning_module: Any

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
        state = {k: v.detach().clone() if isinstance(v, Tensor) else v
                 for k, v in self.lightning_module.state_dict().items()}
        if self._eval_backup is not None:
            state.update({k: v.clone() for k, v in self._eval_backup.items() if k in state})
        return state
