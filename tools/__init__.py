"""Format and developer tooling: golden vectors, the fuzz targets, the real-weight fetchers
(``python tools/fetch_minilm.py``, ``python -m tools.<name>``)."""
