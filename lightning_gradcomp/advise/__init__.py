"""``lightning-gradcomp advise``: will compression pay on a given cluster? A calibrated latency-bandwidth model.

:mod:`~lightning_gradcomp.advise.costs` holds the cost model (pure functions), :mod:`.calibrate` measures a
configuration's step on this machine with free collectives, :mod:`.command` is the command line and
:mod:`.probe` measures a real job's links.
"""

from lightning_gradcomp.advise.costs import Link, Prediction, StepTrace, Topology, parse_link, predict, simulate_step

__all__ = ["Link", "Prediction", "StepTrace", "Topology", "parse_link", "predict", "simulate_step"]
