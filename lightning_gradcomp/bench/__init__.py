"""``lightning-gradcomp bench``: is compression worth it on this network?"""

from lightning_gradcomp.bench.runner import recommend, run_bench, summarise

__all__ = ["recommend", "run_bench", "summarise"]
