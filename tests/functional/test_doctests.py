"""The ``Example::`` doctests of ``lightning_gradcomp.functional``: they pass, and every public function has one."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ["axpy", "dequantize", "hashed_draws", "lattice", "layerwise", "lowrank", "packing", "quantization_groups",
           "realview", "sampling", "scaled_sign", "selection", "slot_views", "sparsify", "stochastic_rounding"]
# ``quantize`` re-exports the quantizers of ``dequantize``, ``hashed_draws``, ``quantization_groups``, ``scaled_sign``
# and ``stochastic_rounding``, whose examples run above.
NO_EXAMPLE = {"selection": {"prepare_native"}}  # builds the compiled kernel (7-20 s): not a pure function


def _run_examples(module: object) -> tuple[doctest.TestResults, set[str], str]:
    """Run the module's doctests: ``(results, names of the objects with examples, failure report)``."""
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    report: list[str] = []
    documented = set()
    failed = attempted = 0
    prefix = module.__name__ + "."
    for test in doctest.DocTestFinder().find(module):
        if test.examples:
            documented.add(test.name.removeprefix(prefix))
            result = runner.run(test, out=report.append)
            failed, attempted = failed + result.failed, attempted + result.attempted
    return doctest.TestResults(failed, attempted), documented, "".join(report)


@pytest.mark.parametrize("name", MODULES)
def test_functional_examples_pass_and_cover_the_public_functions(name: str) -> None:
    module = importlib.import_module(f"lightning_gradcomp.functional.{name}")
    results, documented, report = _run_examples(module)
    assert results.failed == 0, report
    public = {n for n in module.__all__ if callable(getattr(module, n))} - NO_EXAMPLE.get(name, set())
    assert not public - documented, f"public functions without an example: {sorted(public - documented)}"
    assert results.attempted >= len(public) > 0  # at least one example (``>>>`` line) per public function
