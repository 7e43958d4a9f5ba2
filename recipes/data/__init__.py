"""Recipe data: real-format loaders (ImageFolder, IDX, parallel text, wav/flac corpora) and offline generators."""

__all__: list[str] = []
