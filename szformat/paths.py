"""Turn what a user passed as a checkpoint into a local path: a path as given, or the local copy of a Hub reference.

Kept apart from :mod:`szformat.hub` so that loading a local file never imports ``huggingface_hub``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .errors import HubReferenceError


def resolve_path(filename: str | os.PathLike, *, repo_id: str | None = None, **hub_kwargs: Any) -> Path:
    """A local path, or the local copy of a Hub reference (``hf://...`` or ``repo_id`` + ``filename``).

    The Hub module is imported only when a reference needs it.

    Raises:
        HubReferenceError: Hub keywords (``revision=``, ``token=``...) given with a local path.
    """
    if repo_id is None and not str(filename).startswith("hf://"):
        refuse_hub_options(filename, hub_kwargs, "Hub references (hf://... or repo_id=)")
        return Path(filename)
    from .hub import resolve

    if repo_id is not None:
        return resolve(repo_id=repo_id, filename=os.fspath(filename), **hub_kwargs)
    return resolve(os.fspath(filename), **hub_kwargs)


def refuse_hub_options(path: str | os.PathLike, hub_kwargs: dict[str, Any], applies_to: str) -> None:
    """Refuse Hub keywords (``revision=``, ``token=``...) given with a local ``path``: silently ignoring one would
    load something other than what the caller asked for.

    Raises:
        HubReferenceError: naming the keywords, and what they ``applies_to``.
    """
    given = [k for k, v in hub_kwargs.items() if v not in (None, False)]
    if given:
        raise HubReferenceError(f"{', '.join(given)} only apply to {applies_to}", path=path)
