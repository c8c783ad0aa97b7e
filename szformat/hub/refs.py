"""Hub references: ``hf://[TYPE/]namespace/name[@revision][/path]`` strings and their keyword equivalent.

Parsing is pure (no network, no huggingface_hub call that could reach one), so the loaders can tell a Hub reference
from a local path cheaply and refuse a malformed one before anything is downloaded.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import unquote

from huggingface_hub.utils import HFValidationError, validate_repo_id

from ..errors import HubReferenceError

HF_SCHEME = "hf://"

REPO_TYPE_PREFIXES = {"models": "model", "datasets": "dataset", "spaces": "space"}
"""Optional first segment of an ``hf://`` reference -> repo type, as in huggingface_hub's own ``hf://`` URIs."""

_SPECIAL_REVISION = re.compile(r"refs/(?:pr/\d+|convert/[\w.-]+)")
"""Hub revisions that contain a slash; everything else stops at the first ``/`` (write ``%2F`` for others)."""


@dataclass(frozen=True)
class HubRef:
    """A place on the Hub: a repo, a revision of it, and optionally a file (or folder) inside it.

    ``filename`` is ``""`` when the reference names the whole repo; ``revision`` is ``None`` for the default
    branch.
    """

    repo_id: str
    filename: str = ""
    revision: str | None = None
    repo_type: str = "model"

    def __str__(self) -> str:
        prefix = "" if self.repo_type == "model" else f"{self.repo_type}s/"
        revision = "" if self.revision is None else "@" + (
            self.revision if _SPECIAL_REVISION.fullmatch(self.revision) else self.revision.replace("/", "%2F"))
        filename = f"/{self.filename}" if self.filename else ""
        return f"{HF_SCHEME}{prefix}{self.repo_id}{revision}{filename}"


def is_hub_ref(path_or_ref: object) -> bool:
    """Whether ``path_or_ref`` is an ``hf://`` string (local paths, ``Path`` objects and anything else are not)."""
    return isinstance(path_or_ref, str) and path_or_ref.startswith(HF_SCHEME)


def parse_hub_ref(ref: str) -> HubRef:
    """Parse ``hf://[models/|datasets/|spaces/]namespace/name[@revision][/path/in/repo]``.

    Raises:
        HubReferenceError: the string is not a well-formed Hub reference.

    Example:
        >>> parse_hub_ref("hf://alice/tiny@v2/model.szt")
        HubRef(repo_id='alice/tiny', filename='model.szt', revision='v2', repo_type='model')
    """
    if not is_hub_ref(ref):
        raise HubReferenceError(f"{ref!r} is not a Hub reference; write hf://namespace/name[@revision][/file]")
    rest = ref[len(HF_SCHEME):]
    repo_type = "model"
    first, _, after_first = rest.partition("/")
    if first in REPO_TYPE_PREFIXES:
        repo_type, rest = REPO_TYPE_PREFIXES[first], after_first
    namespace, _, rest = rest.partition("/")
    name_and_revision, _, filename = _split_repo_segment(rest)
    name, at, revision = name_and_revision.partition("@")
    if at and not revision:
        raise HubReferenceError(f"{ref!r} has an empty revision after '@'")
    return make_hub_ref(f"{namespace}/{name}", filename, unquote(revision) if at else None, repo_type, source=ref)


def _split_repo_segment(rest: str) -> tuple[str, str, str]:
    """Split ``name[@revision]/path`` at the slash that ends the revision (``refs/pr/N`` keeps its slashes)."""
    name, at, after = rest.partition("@")
    if at:
        special = _SPECIAL_REVISION.match(after)
        if special and after[special.end():special.end() + 1] in ("", "/"):
            return f"{name}@{special.group()}", "/", after[special.end() + 1:]
    return rest.partition("/")


def make_hub_ref(repo_id: str, filename: str | None = None, revision: str | None = None,
                 repo_type: str | None = None, *, source: str | None = None) -> HubRef:
    """Validate the parts of a Hub reference and build it; ``source`` is what the user wrote, for messages.

    Raises:
        HubReferenceError: the repo id, file name or repo type is malformed.
    """
    what = repr(source) if source is not None else f"repo_id={repo_id!r}"
    repo_type = repo_type or "model"
    if repo_type not in REPO_TYPE_PREFIXES.values():
        raise HubReferenceError(f"{what}: repo type {repo_type!r} is not one of "
                                f"{', '.join(sorted(REPO_TYPE_PREFIXES.values()))}")
    if repo_id.count("/") != 1 or "" in repo_id.split("/"):
        raise HubReferenceError(f"{what}: the repo id must be 'namespace/name', got {repo_id!r}")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise HubReferenceError(f"{what}: {e}") from None
    if revision == "":
        raise HubReferenceError(f"{what}: the revision must not be empty")
    return HubRef(repo_id, check_repo_path(filename or "", what=what), revision, repo_type)


def check_repo_path(path: str, *, what: str) -> str:
    """Return ``path`` (a file or folder inside a repo) with any trailing slash removed, or raise.

    A repo path is relative and POSIX-style; it never climbs out of the repo with ``..`` and has no empty segment,
    so it cannot name a file outside the local snapshot it is downloaded into.
    """
    stripped = path.rstrip("/")
    if not stripped:
        return ""
    segments = stripped.split("/")
    if path.startswith("/") or "\\" in path or any(s in ("", ".", "..") for s in segments):
        raise HubReferenceError(f"{what}: {path!r} is not a relative path inside the repo")
    return stripped
