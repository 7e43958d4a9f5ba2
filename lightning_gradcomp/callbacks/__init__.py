"""Lightning callbacks that steer or observe the compression (filled in by later modules)."""

__all__: list[str] = []
