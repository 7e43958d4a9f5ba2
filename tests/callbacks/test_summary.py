"""The end-of-fit rich summary table."""

from __future__ import annotations

import io
import math

import pytest
from rich.console import Console

from lightning_gradcomp.callbacks.summary import format_bytes, print_summary, summary_rows
from lightning_gradcomp.comm import CommStats, LayerStats


def stats() -> CommStats:
    s = CommStats(wire_bytes=5000.0, dense_bytes=20000.0, steps=10, compressed_steps=8, hook_seconds=0.05)
    s.layers["enc.weight"] = LayerStats(numel=4096, compressed=True, param=0.05, wire_bytes=3000.0,
                                        dense_bytes=16000.0)
    s.layers["enc.bias"] = LayerStats(numel=64, compressed=False, wire_bytes=2000.0, dense_bytes=4000.0)
    return s


def test_rows_and_totals() -> None:
    rows, total = summary_rows(stats(), {"enc.weight": 0.5}, total_error=0.4)
    assert [r.name for r in rows] == ["enc.weight", "enc.bias"]
    assert rows[0].bytes_per_step == 300.0 and rows[0].compression == pytest.approx(16 / 3) and rows[0].error == 0.5
    assert rows[1].param is None and math.isnan(rows[1].error)
    assert total.numel == 4160 and total.bytes_per_step == 500.0 and total.compression == 4.0 and total.error == 0.4


def test_printed_table() -> None:
    buf = io.StringIO()
    print_summary(stats(), {"enc.weight": 0.5}, total_error=0.4, param_name="density", title="T",
                  console=Console(file=buf, width=120))
    text = buf.getvalue()
    lines = {line.split()[1]: line for line in text.splitlines() if line.split()[1:2] in (["enc.weight"],
                                                                                          ["enc.bias"], ["total"])}
    cells = [c.strip() for c in lines["enc.weight"].split("│")[1:-1]]
    assert cells == ["enc.weight", "4,096", "yes", "0.05", "300 B", "5.33x", "0.5"]
    assert [c.strip() for c in lines["enc.bias"].split("│")[1:-1]] == ["enc.bias", "64", "no", "-", "200 B", "2.00x",
                                                                       "-"]
    for cell in ("4,160", "1/2", "500 B", "4.00x", "0.4"):
        assert cell in lines["total"]
    assert "param (density)" in text and "10 steps (8 compressed), hook 5.00 ms/step" in " ".join(text.split())


def test_table_says_whole_run_and_gives_the_compressed_steps_beside_it() -> None:
    """The table's 4.00x is dense / wire of the whole run (the 2 dense warm-up steps included); the progress bar's
    per-step rate was printed nowhere beside it, and both were called 'ratio' / 'dense/wire'."""
    buf = io.StringIO()
    print_summary(stats(), {}, param_name="density", title="T", console=Console(file=buf, width=200),
                  compressed_steps_compression=12.5)
    text = " ".join(buf.getvalue().split())
    assert "compression (whole run)" in text and "bytes/step (whole run)" in text and "dense/wire" not in text
    assert ("compression 4.00x over the whole run (2 dense warm-up steps included), 12.50x over the compressed "
            "steps alone") in text
    with pytest.warns(DeprecationWarning, match="compression"):
        assert summary_rows(stats(), {})[1].ratio == 4.0


@pytest.mark.parametrize("nbytes, text", [(0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (3 * 2**20, "3.0 MiB"),
                                          (2**50, "1024.0 TiB")])
def test_format_bytes(nbytes: float, text: str) -> None:
    assert format_bytes(nbytes) == text
