"""How szformat identifies itself to the Hub: ``library_name``/``library_version`` for the user agent."""

from __future__ import annotations


def library_info() -> dict[str, str]:
    """Keyword arguments naming szformat and its version, for ``HfApi``, ``hf_hub_download``, ``snapshot_download``."""
    from .. import __version__  # the package root imports this package: read the version at call time

    return {"library_name": "szformat", "library_version": __version__}
