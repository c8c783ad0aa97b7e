"""Publish a converted checkpoint (one .szt file, or a converted folder) to a Hub repo in one commit.

Everything that can be checked locally is checked before the first request: the path holds .szt files, each opens
as a valid .szt file, and every shard a sharded index names is present. Then the repo (and branch) is created if
needed and all files plus a generated model card go up in a single commit, which also deletes the .szt files of an
earlier push that the folder no longer holds. huggingface_hub compares each file with the one already on the branch
(sha256 for LFS files, git oid otherwise), uploads only what changed, and makes no commit at all when nothing did,
so pushing the same folder again is a no-op.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from huggingface_hub import CommitInfo, CommitOperationAdd, CommitOperationDelete, HfApi, get_token

from ..errors import PushError
from ..format.constants import FILE_SUFFIX, INDEX_SUFFIX
from ..format.index import read_index, shard_path
from ..paths import outside_the_folder
from .card import carried_metadata, checkpoint_stats, render_model_card
from .client import library_info, one_line_errors
from .refs import HubRef
from .resolve import DEFAULT_INDEX

DEFAULT_COMMIT_MESSAGE = "Upload szformat checkpoint"
MODEL_CARD = "README.md"


def push_to_hub(path: str | os.PathLike, repo_id: str, *, private: bool | None = None, revision: str | None = None,
                commit_message: str | None = None, token: str | bool | None = None, endpoint: str | None = None,
                base_model: str | None = None, model_card: bool = True) -> CommitInfo:
    """Upload a .szt file or a converted folder to a model repo, with a generated model card, in one commit.

    For a folder, every file goes up under its relative path (.szt shards, ``model.szt.index.json``, the copied
    config and tokenizer files), except hidden files and folders, and the branch's .szt files and indexes become
    those of the folder: any other ones (left by an earlier push of a differently sharded conversion) are deleted in
    the same commit; other files on the branch are left as they are. A single .szt file is only added. A
    ``README.md`` in the folder (typically the source model's card) is replaced by the generated card, which keeps
    its license fields.

    Args:
        path (`str` or `os.PathLike`): a .szt file, or a folder holding at least one.
        repo_id (`str`): ``namespace/name`` of the model repo; created if it does not exist.
        private (`bool`, *optional*): visibility of a repo this call creates; an existing repo keeps its own.
        revision (`str`, *optional*): branch to commit to, created from ``main`` if missing; defaults to ``main``.
        commit_message (`str`, *optional*): summary of the commit.
        token (`str` or `bool`, *optional*): Hub token; by default huggingface_hub's own lookup (``HF_TOKEN``, then
            the token saved by ``hf auth login``).
        endpoint (`str`, *optional*): Hub URL; defaults to huggingface_hub's (``HF_ENDPOINT``).
        base_model (`str`, *optional*): repo id of the source model, recorded as ``base_model`` in the card.
        model_card (`bool`, *optional*): generate ``README.md`` (default); with ``False`` a ``README.md`` in the
            folder goes up unchanged.

    Returns:
        `CommitInfo`: the commit made, or the branch's current commit when nothing changed.

    Raises:
        PushError: the path holds no .szt file, or an index names a shard that is not in the folder.
        ShardIndexError: an index is malformed.
        FormatError (or a subclass): a .szt file is not valid.
        HubRequestError: the Hub refused a request (token, permissions) or cannot be reached; an ``OSError``,
            whose message fits on one line (huggingface_hub's error is its ``__cause__``).

    Example:
        >>> push_to_hub("./model-szt", "alice/tiny-szt", base_model="alice/tiny")  # doctest: +SKIP
    """
    path = Path(path)
    files = _files_to_push(path, keep_readme=not model_card)
    _check_index_shards(path, files)
    stats = checkpoint_stats(local for name, local in files.items() if name.endswith(FILE_SUFFIX))
    operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(local)) for name, local in files.items()]
    if model_card:
        card = render_model_card(
            repo_id=repo_id, stats=stats, load_ref=_load_ref(repo_id, revision, files),
            szformat_version=library_info()["library_version"], base_model=base_model,
            carried=carried_metadata(path / MODEL_CARD if path.is_dir() else None), integration=_integration(files),
            repo_ref=str(HubRef(repo_id, "", revision)))
        operations.append(CommitOperationAdd(path_in_repo=MODEL_CARD, path_or_fileobj=card.encode()))

    api = HfApi(endpoint=endpoint, token=token, **library_info())
    with one_line_errors():
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision is not None and not api.revision_exists(repo_id, revision):
            api.create_branch(repo_id, branch=revision)
        if path.is_dir():
            operations += [CommitOperationDelete(path_in_repo=name)
                           for name in _stale_checkpoint_files(api.list_repo_files(repo_id, revision=revision), files)]
        return api.create_commit(repo_id, operations, commit_message=commit_message or DEFAULT_COMMIT_MESSAGE,
                                 revision=revision)


def check_push_access(repo_id: str, *, private: bool | None = None, token: str | bool | None = None,
                      endpoint: str | None = None) -> None:
    """Check, before a long conversion, that a push to ``repo_id`` can go through: a token is at hand, the Hub
    answers and accepts it, its owner may write to the repo's namespace, and the repo exists or can be created
    (it is created, with ``private``, as `push_to_hub` would).

    Raises:
        PushError: no token is configured, or the token's owner cannot write to the repo's namespace.
        HubRequestError: the Hub refused a request or cannot be reached (an ``OSError``).
    """
    if token is False or (not isinstance(token, str) and get_token() is None):
        raise PushError(f"pushing to {repo_id!r} needs a Hub token: pass one (--token), set HF_TOKEN or run "
                        "'hf auth login'")
    api = HfApi(endpoint=endpoint, token=token, **library_info())
    with one_line_errors():  # a PushError raised inside passes through as it is
        user = api.whoami()
        namespace = repo_id.split("/")[0] if "/" in repo_id else user["name"]
        writable = {user["name"]} | {org["name"] for org in user.get("orgs") or []}
        if namespace not in writable:
            raise PushError(f"the token belongs to {user['name']!r}, who cannot write to {repo_id!r} (namespaces: "
                            f"{', '.join(sorted(writable))})")
        api.create_repo(repo_id, private=private, exist_ok=True)


def _stale_checkpoint_files(on_branch: list[str], pushed: dict[str, Path]) -> list[str]:
    """The .szt files and .szt indexes on the branch that the pushed folder does not hold: shards of an earlier
    conversion (sharded differently, or not at all) that would otherwise stay beside the new ones, and an index that
    would still shadow a new single ``model.szt``. Other files are never touched."""
    return sorted(name for name in on_branch if name.endswith((FILE_SUFFIX, INDEX_SUFFIX)) and name not in pushed)


def _files_to_push(path: Path, *, keep_readme: bool) -> dict[str, Path]:
    """Repo path -> local file, sorted; raises PushError unless at least one .szt file is among them."""
    if path.is_file():
        if not path.name.endswith(FILE_SUFFIX):
            is_index = path.name.endswith(INDEX_SUFFIX)
            hint = " (push the folder that holds the index and its shards)" if is_index else ""
            raise PushError(f"only .szt files or converted folders can be pushed{hint}", path=path)
        return {path.name: path}
    if not path.is_dir():
        raise PushError("no such file or folder", path=path)
    files, refused = {}, []
    for directory, subdirs, names in os.walk(path):
        subdirs[:] = sorted(d for d in subdirs if not d.startswith("."))
        for entry in [*subdirs, *sorted(n for n in names if not n.startswith("."))]:
            local = Path(directory, entry)
            name = local.relative_to(path).as_posix()
            problem = outside_the_folder(path, local)
            if problem:
                refused.append(f"{name} ({problem})")
            elif entry in names and (keep_readme or name != MODEL_CARD):
                files[name] = local
        subdirs[:] = [d for d in subdirs if not Path(directory, d).is_symlink()]
    if refused:
        raise PushError(f"not pushed: only files inside the folder are uploaded; remove {', '.join(refused)}",
                        path=path)
    if not any(name.endswith(FILE_SUFFIX) for name in files):
        raise PushError("the folder holds no .szt file; convert it first with szconvert", path=path)
    return files


def _check_index_shards(path: Path, files: dict[str, Path]) -> None:
    """Refuse to publish a sharded index whose shards are not all being pushed beside it."""
    for name, local in files.items():
        if not name.endswith(INDEX_SUFFIX):
            continue
        missing = [s for s in read_index(local).shard_names() if shard_path(name, s) not in files]
        if missing:
            raise PushError(f"index {name} names shard(s) absent from the folder: {', '.join(missing)}", path=path)


def _integration(files: dict[str, Path]) -> str | None:
    """What loads the pushed folder whole: diffusers for a pipeline (``model_index.json``), transformers for a
    model folder (a transformers ``config.json`` beside .szt weights), nothing else (a single diffusers model)."""
    if "model_index.json" in files:
        return "diffusers"
    if "config.json" not in files or not any("/" not in name and name.endswith(FILE_SUFFIX) for name in files):
        return None
    try:
        config = json.loads(files["config.json"].read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return "transformers" if isinstance(config, dict) and "_diffusers_version" not in config else None


def _load_ref(repo_id: str, revision: str | None, files: dict[str, Path]) -> str:
    """The reference the card's loading example uses: the file of a single-file checkpoint, the repo for a root
    ``model.szt.index.json``, else the first index, else the first .szt file."""
    szt_files = [name for name in files if name.endswith(FILE_SUFFIX)]
    indexes = [name for name in files if name.endswith(INDEX_SUFFIX)]
    if DEFAULT_INDEX in indexes:
        filename = ""
    else:
        filename = szt_files[0] if len(szt_files) == 1 or not indexes else indexes[0]
    return str(HubRef(repo_id, filename, revision))
