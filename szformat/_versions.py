"""Installed distributions' versions, and their order (PEP 440), without the ``packaging`` dependency: what the
route checks, DDO's pin, the GPU codec's Triton and the integrations' behaviour by release compare."""

from __future__ import annotations

import importlib.metadata
import re

__all__ = ["installed_version", "parse_version"]


def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution`` (its metadata: nothing is imported), or ``None``."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


_VERSION = re.compile(
    r"^v?(?P<release>\d+(?:\.\d+)*)"
    r"(?:[-_.]?(?P<pre>a|alpha|b|beta|c|rc|pre|preview)[-_.]?(?P<pre_n>\d*))?"
    r"(?:[-_.]?(?:post|rev|r)[-_.]?(?P<post>\d*))?"
    r"(?:[-_.]?dev[-_.]?(?P<dev>\d*))?"
    r"(?:\+[a-z0-9]+(?:[-_.][a-z0-9]+)*)?$")
_PRE_RANK = {"a": 0, "alpha": 0, "b": 1, "beta": 1, "c": 2, "rc": 2, "pre": 2, "preview": 2}


def parse_version(text: str) -> tuple:
    """A sort key for a PEP 440 version: ``1.0.dev0 < 1.0a1 < 1.0rc1 < 1.0 == 1.0.0 < 1.0.post1``.

    Local labels (``+cu130``) are ignored. Raises ValueError for text that is not a version.
    """
    match = _VERSION.match(text.strip().lower())
    if match is None:
        raise ValueError(f"not a version: {text!r}")
    release = [int(part) for part in match["release"].split(".")]
    while len(release) > 1 and release[-1] == 0:
        release.pop()
    pre, post, dev = match["pre"], match["post"], match["dev"]
    if pre is not None:
        pre_key = (_PRE_RANK[pre], int(match["pre_n"] or 0))
    elif dev is not None and post is None:
        pre_key = (-1, 0)  # 1.0.dev0 sorts before 1.0a0
    else:
        pre_key = (3, 0)
    post_key = int(post or 0) if post is not None else -1
    dev_key = (0, int(dev or 0)) if dev is not None else (1, 0)
    return tuple(release), pre_key, post_key, dev_key
