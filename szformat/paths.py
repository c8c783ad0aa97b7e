"""Turn what a user passed as a checkpoint into a local path: a path as given, or the local copy of a Hub reference.

Kept apart from :mod:`szformat.hub` so that loading a local file never imports ``huggingface_hub``.
"""

from __future__ import annotations

import os
import stat
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


UNREADABLE = "a link to nothing that can be read"
"""What :func:`outside_the_folder` says of a link to nowhere (or a loop of links)."""


def outside_the_folder(root: Path, path: Path) -> str | None:
    """Why ``path``, found in model folder ``root``, must not be copied out of it or uploaded; ``None`` when it
    may: a regular file that lies inside ``root`` once links are resolved.

    A link can point anywhere (``/proc/self/environ`` holds the environment, Hub token included), so what a folder
    shows is not what it holds. One exception: a folder that is a snapshot of the Hugging Face cache
    (``models--owner--name/snapshots/<commit>/``) holds links into that repo's ``blobs/``, which are its own files.
    """
    try:
        is_link = path.is_symlink()
        real = path.resolve(strict=True)
        mode = real.stat().st_mode
    except (OSError, RuntimeError, ValueError):
        return UNREADABLE
    if stat.S_ISDIR(mode):
        return "a linked folder (not followed)" if is_link else None
    if not stat.S_ISREG(mode):
        return f"not a regular file ({'a link to ' + str(real) if is_link else 'a FIFO, socket or device'})"
    allowed = _own_tree(root)
    if not any(real == a or a in real.parents for a in allowed):
        return f"a link to {real}, outside the folder"
    return None


def _own_tree(root: Path) -> list[Path]:
    """The folders whose files ``root``'s links may point into: itself, and a Hub cache snapshot's repo folder."""
    real = root.resolve()
    trees = [real]
    if real.parent.name == "snapshots" and (real.parent.parent / "blobs").is_dir():
        trees.append(real.parent.parent / "blobs")
    return trees
