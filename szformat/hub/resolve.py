"""Turn what a user passed to a loader (a local path, an ``hf://`` reference, ``repo_id=``...) into local files.

Downloads go through huggingface_hub, so its cache, ``HF_HUB_OFFLINE``, ``local_files_only``, tokens and revision
pinning behave as everywhere else in the Hugging Face ecosystem. A sharded checkpoint is fetched by its index: the
index first, then exactly the shards it names, all from the commit the index came from, so a push landing in
between cannot mix shards of two versions.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from urllib.parse import urlsplit

from huggingface_hub import constants, hf_hub_download, snapshot_download
from huggingface_hub.utils import EntryNotFoundError, LocalEntryNotFoundError

from ..errors import HubCheckpointNotFoundError, HubOfflineError, HubReferenceError
from ..format.constants import FILE_SUFFIX, INDEX_SUFFIX
from ..format.index import read_index, shard_path
from .client import library_info
from .refs import HubRef, is_hub_ref, make_hub_ref, parse_hub_ref

DEFAULT_FILE = "model" + FILE_SUFFIX
DEFAULT_INDEX = "model" + INDEX_SUFFIX
"""What a reference to a whole repo loads: the sharded index if the repo has one, else the single file."""

SOURCE_PATTERNS = ("*.safetensors", "*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja", "*.py", "README.md",
                   "LICENSE*")
"""What ``download_safetensors_repo`` fetches: weights, their index, config and tokenizer files, chat templates,
model code (run only with ``trust_remote_code``), card and license. Pickled weights (``.bin``, ``.pt``, ``.ckpt``)
and other formats are left on the Hub."""

MODEL_PATTERNS = ("*" + FILE_SUFFIX, "*" + INDEX_SUFFIX,
                  *(p for p in SOURCE_PATTERNS if not p.endswith(".safetensors")))
"""What ``download_model_repo`` fetches: .szt weights and their indexes, configs, tokenizers, schedulers, card and
license, from every folder of the repo. Other weight formats (an original ``.safetensors`` left beside) stay there."""

_COMMIT_SHA = re.compile(r"[0-9a-f]{40}")
_MAX_PARALLEL_DOWNLOADS = 8


def resolve(path_or_ref: str | os.PathLike | None = None, *, repo_id: str | None = None,
            filename: str | None = None, revision: str | None = None, repo_type: str | None = None,
            local_files_only: bool = False, token: str | bool | None = None,
            cache_dir: str | os.PathLike | None = None, endpoint: str | None = None) -> Path:
    """The local path of a checkpoint: a local path as given, or what a Hub reference downloads to.

    What a Hub reference resolves to, in the Hugging Face cache:

    - a file (``hf://user/repo/model.szt``): that file;
    - a sharded index (``hf://user/repo/model.szt.index.json``): the index, once every shard it names is beside it;
    - a repo (``hf://user/repo``): its ``model.szt.index.json`` as above if it has one, else its ``model.szt``.

    Args:
        path_or_ref (`str` or `os.PathLike`, *optional*): a local path (returned unchanged, as a `Path`) or an
            ``hf://[models/|datasets/|spaces/]namespace/name[@revision][/file]`` reference.
        repo_id (`str`, *optional*): instead of ``path_or_ref``: the repo, with ``filename``, ``revision`` and
            ``repo_type`` as separate keywords.
        filename (`str`, *optional*): file in the repo; with an ``hf://`` reference that names no file, added to it.
        revision (`str`, *optional*): branch, tag or commit sha; must agree with an ``@revision`` in the reference.
        repo_type (`str`, *optional*): ``"model"`` (default), ``"dataset"`` or ``"space"``; with ``repo_id`` only.
        local_files_only (`bool`, *optional*): never touch the network, use the cache only.
        token (`str` or `bool`, *optional*): Hub token for private repos; by default huggingface_hub's own lookup.
        cache_dir (`str` or `os.PathLike`, *optional*): Hugging Face cache folder; defaults to ``HF_HUB_CACHE``.
        endpoint (`str`, *optional*): Hub URL; defaults to huggingface_hub's (``HF_ENDPOINT``).

    Returns:
        `Path`: the local file or index; its folder is the cache snapshot of the commit it came from.

    Raises:
        HubReferenceError: the reference is malformed, or the keywords contradict it.
        HubCheckpointNotFoundError: a repo reference, and the repo has neither ``model.szt.index.json`` nor
            ``model.szt``.
        ShardIndexError: a downloaded index is malformed (not JSON, no weight map, a shard outside its folder).
        huggingface_hub.utils.RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError: the repo (or
            a private repo without the right token), the revision or the file does not exist.
        huggingface_hub.utils.LocalEntryNotFoundError: offline (or the Hub unreachable) and not in the cache.

    Example:
        >>> resolve("hf://alice/tiny-szt@v1/model.szt")  # doctest: +SKIP
        PosixPath('/home/me/.cache/huggingface/hub/models--alice--tiny-szt/snapshots/1f0c.../model.szt')
    """
    ref = hub_ref_from_arguments(path_or_ref, repo_id=repo_id, filename=filename, revision=revision,
                                 repo_type=repo_type)
    if ref is None:
        return Path(path_or_ref)
    return _Downloader(ref, local_files_only=local_files_only, token=token, cache_dir=cache_dir,
                       endpoint=endpoint).checkpoint()


def hub_ref_from_arguments(path_or_ref: str | os.PathLike | None, *, repo_id: str | None = None,
                           filename: str | None = None, revision: str | None = None,
                           repo_type: str | None = None) -> HubRef | None:
    """The Hub reference the arguments describe, or ``None`` for a local path; refuses contradictions.

    Raises:
        HubReferenceError: malformed reference, or arguments that contradict each other.
    """
    if repo_id is not None:
        if path_or_ref is not None:
            raise HubReferenceError(f"pass either a path or hf:// reference ({path_or_ref!r}) or repo_id=, not both")
        return make_hub_ref(repo_id, filename, revision, repo_type)
    if path_or_ref is None:
        raise HubReferenceError("nothing to open: pass a local path, an hf:// reference or repo_id=")
    if not is_hub_ref(path_or_ref):
        hub_only = [f"{k}=" for k, v in (("filename", filename), ("revision", revision), ("repo_type", repo_type))
                    if v is not None]
        if hub_only:
            raise HubReferenceError(f"{', '.join(hub_only)} only apply to Hub references, and {path_or_ref!r} is "
                                    "a local path; write hf://namespace/name[@revision][/file] or pass repo_id=")
        return None
    ref = parse_hub_ref(path_or_ref)
    if repo_type is not None:
        raise HubReferenceError(f"repo_type= cannot be combined with {path_or_ref!r}; write the type in the "
                                "reference (hf://datasets/namespace/name/...)")
    if revision is not None and ref.revision is not None and revision != ref.revision:
        raise HubReferenceError(f"revision={revision!r} contradicts the revision {ref.revision!r} of {path_or_ref!r}")
    if filename is not None and ref.filename:
        raise HubReferenceError(f"filename={filename!r} given, but {path_or_ref!r} already names a file")
    if filename is not None:
        ref = make_hub_ref(ref.repo_id, filename, ref.revision, ref.repo_type, source=path_or_ref)
    return replace(ref, revision=revision or ref.revision)


def download_safetensors_repo(ref: str | HubRef, *, revision: str | None = None, local_files_only: bool = False,
                              token: str | bool | None = None, cache_dir: str | os.PathLike | None = None,
                              endpoint: str | None = None) -> Path:
    """Download a safetensors model from the Hub for conversion, and return its local path.

    For a ``.safetensors`` file, that file. Anything else is a repo or a folder in it (``hf://user/repo``,
    ``hf://user/repo@rev/transformer``): only the files matching `SOURCE_PATTERNS` are fetched, and the local
    folder is returned.

    Args:
        ref (`str` or `HubRef`): the ``hf://`` reference of the source.
        revision (`str`, *optional*): branch, tag or commit sha; must agree with an ``@revision`` in the reference.
        local_files_only, token, cache_dir, endpoint: as in `resolve`.

    Raises:
        HubReferenceError: not an ``hf://`` reference, malformed, or contradicting ``revision``.
        HubCheckpointNotFoundError: the repo or folder holds no ``.safetensors`` file.
        huggingface_hub.utils.HfHubHTTPError (or a subclass), LocalEntryNotFoundError: as in `resolve`.
    """
    if not is_hub_ref(str(ref)):
        raise HubReferenceError(f"{str(ref)!r} is not a Hub reference; write hf://namespace/name[@revision][/path]")
    ref = hub_ref_from_arguments(str(ref), revision=revision)
    downloader = _Downloader(ref, local_files_only=local_files_only, token=token, cache_dir=cache_dir,
                             endpoint=endpoint)
    if ref.filename.endswith(".safetensors"):
        return downloader.file(ref.filename)
    local = downloader.folder(SOURCE_PATTERNS)
    if not any(local.rglob("*.safetensors")):
        raise HubCheckpointNotFoundError(f"{ref} holds no .safetensors file to convert", path=local)
    return local


def download_model_repo(ref: str | HubRef, *, revision: str | None = None, local_files_only: bool = False,
                        token: str | bool | None = None, cache_dir: str | os.PathLike | None = None,
                        endpoint: str | None = None) -> Path:
    """Download a converted model or pipeline repo (every file `MODEL_PATTERNS` matches, from one commit) and
    return its local folder, for ``szformat.transformers`` and ``szformat.diffusers``.

    Args:
        ref (`str` or `HubRef`): ``hf://namespace/name[@revision][/folder]``.
        revision, local_files_only, token, cache_dir, endpoint: as in `resolve`.

    Raises:
        HubReferenceError: not an ``hf://`` reference, malformed, naming a file, or contradicting ``revision``.
        huggingface_hub.utils.HfHubHTTPError (or a subclass), LocalEntryNotFoundError: as in `resolve`.
    """
    if not is_hub_ref(str(ref)):
        raise HubReferenceError(f"{str(ref)!r} is not a Hub reference; write hf://namespace/name[@revision]")
    ref = hub_ref_from_arguments(str(ref), revision=revision)
    if ref.filename.endswith((FILE_SUFFIX, INDEX_SUFFIX, ".json")):
        raise HubReferenceError(f"{ref} names a file; a model loads from a repo or a folder of one")
    downloader = _Downloader(ref, local_files_only=local_files_only, token=token, cache_dir=cache_dir,
                             endpoint=endpoint)
    return downloader.folder(MODEL_PATTERNS)


class _Downloader:
    """One Hub reference plus the download options; fetches files of that repo through the Hugging Face cache."""

    def __init__(self, ref: HubRef, *, local_files_only: bool, token: str | bool | None,
                 cache_dir: str | os.PathLike | None, endpoint: str | None):
        self.ref = ref
        self.endpoint = endpoint or constants.ENDPOINT
        self.unreachable = None if local_files_only or constants.HF_HUB_OFFLINE else hub_unreachable(self.endpoint)
        """Why the Hub did not answer a quick connection, if it did not: then only the cache is read (huggingface_hub
        would retry for about a minute before falling back to it)."""
        self.options = dict(repo_id=ref.repo_id, repo_type=ref.repo_type,
                            local_files_only=local_files_only or self.unreachable is not None, token=token,
                            cache_dir=cache_dir, endpoint=endpoint, **library_info())

    def file(self, filename: str, revision: str | None = None) -> Path:
        with self.offline_as_ours():
            return Path(hf_hub_download(filename=filename, revision=revision or self.ref.revision, **self.options))

    @contextmanager
    def offline_as_ours(self) -> Iterator[None]:
        """A file neither downloadable nor cached: :class:`HubOfflineError`, saying why, in one line."""
        try:
            yield
        except LocalEntryNotFoundError:
            why = (f"cannot reach the Hub at {self.endpoint} ({self.unreachable})" if self.unreachable else
                   "downloads are off (HF_HUB_OFFLINE or local_files_only)")
            raise HubOfflineError(f"{why}, and {self.ref} is not in the local cache") from None

    def folder(self, patterns: Sequence[str]) -> Path:
        """The files of the referenced folder (the whole repo when it names none) that ``patterns`` match, from
        one commit; returns that folder's local path."""
        within = self.ref.filename
        allow = [f"{within}/{p}" if within else p for p in patterns]
        with self.offline_as_ours():
            root = Path(snapshot_download(revision=self.ref.revision, allow_patterns=allow, **self.options))
        return root.joinpath(*within.split("/")) if within else root

    def checkpoint(self) -> Path:
        """What `resolve` returns for this reference (see there)."""
        if self.ref.filename and not self.ref.filename.endswith(INDEX_SUFFIX):
            return self.file(self.ref.filename)
        if self.ref.filename:
            return self.sharded(self.ref.filename)
        try:
            index = self.file(DEFAULT_INDEX)
        except EntryNotFoundError:
            try:
                single = self.file(DEFAULT_FILE)
            except EntryNotFoundError:
                raise HubCheckpointNotFoundError(
                    f"{self.ref} holds neither {DEFAULT_INDEX} nor {DEFAULT_FILE}; name the file to load "
                    f"(hf://{self.ref.repo_id}/<file>.szt)") from None
            return single
        self.shards(index, DEFAULT_INDEX)
        return index

    def sharded(self, index_name: str) -> Path:
        """Download an index and the shards it names; return the local index."""
        index = self.file(index_name)
        self.shards(index, index_name)
        return index

    def shards(self, index: Path, index_name: str) -> None:
        """Download every shard a downloaded index names, from the commit the index came from."""
        commit = _snapshot_commit(index, index_name)
        names = [shard_path(index_name, shard) for shard in read_index(index).shard_names()]
        with ThreadPoolExecutor(max_workers=max(1, min(_MAX_PARALLEL_DOWNLOADS, len(names)))) as pool:
            list(pool.map(lambda name: self.file(name, revision=commit), names))


PROBE_SECONDS = 3.0
"""How long the quick connection to the Hub may take before it counts as unreachable."""


def hub_unreachable(endpoint: str) -> str | None:
    """``None`` when a TCP connection to ``endpoint``'s host opens within :data:`PROBE_SECONDS`, else why not. One
    connection per Hub reference resolved (a load, not a file): a few milliseconds where the Hub answers."""
    url = urlsplit(endpoint)
    try:
        with socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                      timeout=PROBE_SECONDS):
            return None
    except OSError as e:
        return e.strerror or str(e) or type(e).__name__


def _snapshot_commit(local: Path, filename: str) -> str | None:
    """The commit sha of the cache snapshot a downloaded file sits in (``.../snapshots/<sha>/<filename>``)."""
    snapshot = local.parents[filename.count("/")]
    return snapshot.name if _COMMIT_SHA.fullmatch(snapshot.name) else None
