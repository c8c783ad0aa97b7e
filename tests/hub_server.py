"""A Hugging Face Hub-compatible HTTP server on loopback, for tests that drive the real ``huggingface_hub`` client.

It implements the endpoints the client calls to identify a token (whoami), create repos and branches, commit files
(preupload, LFS batch, the upload PUT, the ndjson commit), describe repos (repo info, tree) and resolve files (HEAD
and GET with ``ETag``, ``X-Repo-Commit``, ``X-Linked-Etag``/``X-Linked-Size`` for LFS files, byte ranges), and
answers errors with the ``X-Error-Code`` headers the client maps to ``RepositoryNotFoundError``,
``RevisionNotFoundError`` and ``EntryNotFoundError``. Private repos are readable only with their owner's token. Only
model repos exist here.

Repos live in memory. Every request is logged, so a test can assert that a call stayed in the local cache, and
:meth:`LoopbackHub.stop` also cuts kept-alive connections, so a stopped server behaves like a network outage.

Example:
    >>> with LoopbackHub(tokens={"hf_owner": "alice"}) as hub:  # doctest: +SKIP
    ...     HfApi(endpoint=hub.endpoint, token="hf_owner").create_repo("alice/tiny")
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import re
import secrets
import socket
import threading
from dataclasses import dataclass, field
from typing import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

from huggingface_hub import ModelCard

LFS_SUFFIXES = (".szt", ".safetensors", ".bin", ".pt", ".gguf")
"""Files stored through LFS whatever their size, as the Hub's default ``.gitattributes`` does."""
LFS_MIN_SIZE = 10 * 1024 * 1024
GITATTRIBUTES = b"".join(f"*{s} filter=lfs diff=lfs merge=lfs -text\n".encode() for s in LFS_SUFFIXES)
LFS_POINTER_SIZE = 134


@dataclass(frozen=True)
class Blob:
    """File content as the Hub stores it: a git blob, or an LFS object addressed by its sha256."""

    data: bytes
    lfs: bool

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def git_oid(self) -> str:
        return hashlib.sha1(b"blob %d\0" % len(self.data) + self.data).hexdigest()

    @property
    def etag(self) -> str:
        """What the client caches the blob under: the sha256 for LFS files, the git oid otherwise."""
        return self.sha256 if self.lfs else self.git_oid


@dataclass
class Commit:
    oid: str
    title: str
    files: dict[str, Blob]


@dataclass
class Repo:
    repo_id: str
    private: bool
    branches: dict[str, str] = field(default_factory=dict)
    commits: dict[str, Commit] = field(default_factory=dict)

    def find_commit(self, revision: str) -> Commit | None:
        oid = self.branches.get(revision, revision)
        return self.commits.get(oid)


class HubError(Exception):
    """An HTTP error answer, with the headers the client reads to pick its exception class."""

    def __init__(self, status: int, message: str, code: str | None = None, commit: str | None = None,
                 extra: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.commit = status, message, code, commit
        self.extra = extra or {}


@dataclass
class Request:
    method: str
    segments: list[str]
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: bytes
    user: str | None

    def json(self):
        return json.loads(self.body or b"null")


@dataclass
class Response:
    status: int = 200
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of_json(cls, value, status: int = 200) -> "Response":
        return cls(status, json.dumps(value).encode(), {"Content-Type": "application/json"})


class HubState:
    """Repos, LFS objects, pending uploads and tokens, behind one lock."""

    def __init__(self, tokens: dict[str, str]):
        self.tokens = dict(tokens)
        self.repos: dict[str, Repo] = {}
        self.lfs_objects: dict[str, bytes] = {}
        self.pending_uploads: dict[str, tuple[str, int]] = {}
        self.lock = threading.Lock()
        self._commit_counter = itertools.count()

    # -- access rules ------------------------------------------------------------------------------------------

    def readable_repo(self, req: Request, repo_id: str) -> Repo:
        repo = self.repos.get(repo_id)
        if repo is None or (repo.private and req.user != repo_id.split("/")[0]):
            # The Hub answers 401 to anonymous callers and 404 to others, so a private repo's existence never leaks.
            raise HubError(401 if req.user is None else 404, "Repository not found", "RepoNotFound")
        return repo

    def writable_repo(self, req: Request, repo_id: str) -> Repo:
        repo = self.readable_repo(req, repo_id)
        self.require_namespace(req, repo_id)
        return repo

    @staticmethod
    def require_namespace(req: Request, repo_id: str) -> None:
        if req.user is None:
            raise HubError(401, "Invalid username or password.")
        if req.user != repo_id.split("/")[0]:
            raise HubError(403, f"You don't have the rights to write to {repo_id}")

    @staticmethod
    def commit_at(repo: Repo, revision: str) -> Commit:
        commit = repo.find_commit(revision)
        if commit is None:
            raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return commit

    # -- writes ------------------------------------------------------------------------------------------------

    def new_commit(self, repo: Repo, branch: str, title: str, files: dict[str, Blob]) -> Commit:
        parent = repo.branches.get(branch, "")
        seed = f"{repo.repo_id}\0{parent}\0{title}\0{next(self._commit_counter)}".encode()
        for path in sorted(files):
            seed += f"\0{path}\0{files[path].etag}".encode()
        commit = Commit(hashlib.sha1(seed).hexdigest(), title, files)
        repo.commits[commit.oid] = commit
        repo.branches[branch] = commit.oid
        return commit


def _is_lfs(path: str, size: int, sample: bytes) -> bool:
    return path.endswith(LFS_SUFFIXES) or size >= LFS_MIN_SIZE or b"\0" in sample


def _tree_entries(commit: Commit, prefix: str, recursive: bool) -> list[dict]:
    """Files and folders under ``prefix`` (direct children only unless ``recursive``), as the tree API lists them."""
    base = f"{prefix}/" if prefix else ""
    entries: dict[str, dict] = {}
    for path in sorted(commit.files):
        if not path.startswith(base):
            continue
        parts = path[len(base):].split("/")
        depth = len(parts) if recursive else 1
        for i in range(1, min(depth, len(parts) - 1) + 1):
            folder = base + "/".join(parts[:i])
            entries.setdefault(folder, {"type": "directory", "path": folder,
                                        "oid": hashlib.sha1(folder.encode()).hexdigest()})
        if recursive or len(parts) == 1:
            blob = commit.files[path]
            entry = {"type": "file", "path": path, "size": len(blob.data),
                     "oid": hashlib.sha1(blob.sha256.encode()).hexdigest() if blob.lfs else blob.git_oid}
            if blob.lfs:
                entry["lfs"] = {"oid": blob.sha256, "size": len(blob.data), "pointerSize": LFS_POINTER_SIZE}
            entries[path] = entry
    if prefix and not entries:
        raise HubError(404, f"{prefix} does not exist", "EntryNotFound", commit=commit.oid)
    return list(entries.values())


class Routes:
    """One method per endpoint; ``dispatch`` picks it from the method and the path shape."""

    def __init__(self, state: HubState, endpoint: str):
        self.state = state
        self.endpoint = endpoint

    def dispatch(self, req: Request) -> Response:
        s, m = req.segments, req.method
        if m == "POST" and s == ["api", "repos", "create"]:
            return self.create_repo(req)
        if m == "POST" and s == ["api", "validate-yaml"]:
            return self.validate_yaml(req)
        if m == "GET" and s == ["api", "whoami-v2"]:
            return self.whoami(req)
        if len(s) >= 4 and s[:2] == ["api", "models"]:
            repo_id, rest = f"{s[2]}/{s[3]}", s[4:]
            if m == "GET" and not rest:
                return self.repo_info(req, repo_id, "main")
            if m == "GET" and len(rest) == 2 and rest[0] == "revision":
                return self.repo_info(req, repo_id, rest[1])
            if m == "GET" and len(rest) >= 2 and rest[0] == "tree":
                return self.tree(req, repo_id, rest[1], "/".join(rest[2:]))
            if m == "POST" and len(rest) == 2 and rest[0] == "preupload":
                return self.preupload(req, repo_id, rest[1])
            if m == "POST" and len(rest) == 2 and rest[0] == "commit":
                return self.commit(req, repo_id, rest[1])
            if m == "POST" and len(rest) == 2 and rest[0] == "branch":
                return self.create_branch(req, repo_id, rest[1])
        if m == "POST" and len(s) == 6 and s[1].endswith(".git") and s[2:] == ["info", "lfs", "objects", "batch"]:
            return self.lfs_batch(req, f"{s[0]}/{s[1][:-4]}")
        if m == "PUT" and len(s) == 2 and s[0] == "lfs-upload":
            return self.lfs_upload(req, s[1])
        if m in ("GET", "HEAD") and len(s) >= 5 and s[2] == "resolve":
            return self.resolve(req, f"{s[0]}/{s[1]}", s[3], "/".join(s[4:]))
        raise HubError(404, f"No route for {m} /{'/'.join(s)}")

    @staticmethod
    def whoami(req: Request) -> Response:
        if req.user is None:
            raise HubError(401, "Invalid username or password.")
        return Response.of_json({"type": "user", "name": req.user, "orgs": [],
                                 "auth": {"type": "access_token", "accessToken": {"role": "write"}}})

    # -- repos and branches ------------------------------------------------------------------------------------

    def create_repo(self, req: Request) -> Response:
        payload = req.json()
        namespace = payload.get("organization") or req.user
        repo_id = f"{namespace}/{payload['name']}"
        self.state.require_namespace(req, repo_id)
        if payload.get("type", "model") != "model":
            raise HubError(400, "This server only holds model repos")
        if repo_id in self.state.repos:
            # The Hub names the existing repo, and the client reads that URL when asked to tolerate it.
            raise HubError(409, "You already created this model repo", extra={"url": f"{self.endpoint}/{repo_id}"})
        private = payload.get("visibility") == "private" or bool(payload.get("private"))
        repo = Repo(repo_id, private)
        self.state.repos[repo_id] = repo
        self.state.new_commit(repo, "main", "initial commit", {".gitattributes": Blob(GITATTRIBUTES, lfs=False)})
        return Response.of_json({"url": f"{self.endpoint}/{repo_id}", "name": repo_id})

    def create_branch(self, req: Request, repo_id: str, branch: str) -> Response:
        repo = self.state.writable_repo(req, repo_id)
        if branch in repo.branches:
            raise HubError(409, f"Reference already exists: refs/heads/{branch}")
        start = self.state.commit_at(repo, (req.json() or {}).get("startingPoint") or "main")
        repo.branches[branch] = start.oid
        return Response.of_json({})

    def repo_info(self, req: Request, repo_id: str, revision: str) -> Response:
        repo = self.state.readable_repo(req, repo_id)
        commit = self.state.commit_at(repo, revision)
        return Response.of_json({
            "id": repo_id, "author": repo_id.split("/")[0], "sha": commit.oid, "private": repo.private,
            "gated": False, "disabled": False, "lastModified": "2026-11-30T00:00:00.000Z", "tags": [],
            "siblings": [{"rfilename": path} for path in sorted(commit.files)],
        })

    def tree(self, req: Request, repo_id: str, revision: str, prefix: str) -> Response:
        repo = self.state.readable_repo(req, repo_id)
        commit = self.state.commit_at(repo, revision)
        recursive = req.query.get("recursive", ["false"])[0].lower() in ("1", "true")
        return Response.of_json(_tree_entries(commit, prefix, recursive))

    @staticmethod
    def validate_yaml(req: Request) -> Response:
        try:
            ModelCard(req.json()["content"], ignore_metadata_errors=False)
        except ValueError as e:
            return Response.of_json({"errors": [{"message": str(e)}], "warnings": []}, status=400)
        return Response.of_json({"errors": [], "warnings": []})

    # -- uploads -----------------------------------------------------------------------------------------------

    def preupload(self, req: Request, repo_id: str, revision: str) -> Response:
        repo = self.state.writable_repo(req, repo_id)
        commit = self.state.commit_at(repo, revision)
        answers = []
        for item in req.json()["files"]:
            path = item["path"]
            lfs = _is_lfs(path, item["size"], base64.b64decode(item["sample"]))
            remote = commit.files.get(path)
            # The client compares this oid with its own (sha256 for LFS, git oid otherwise) to skip unchanged files.
            oid = None if remote is None else (remote.sha256 if lfs else remote.git_oid)
            answers.append({"path": path, "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False,
                            "oid": oid})
        return Response.of_json({"files": answers})

    def lfs_batch(self, req: Request, repo_id: str) -> Response:
        self.state.writable_repo(req, repo_id)
        payload = req.json()
        if payload.get("operation") != "upload":
            raise HubError(400, "Only LFS uploads go through the batch API here")
        objects = []
        for obj in payload["objects"]:
            answer = {"oid": obj["oid"], "size": obj["size"]}
            if obj["oid"] not in self.state.lfs_objects:
                # Like a presigned storage URL: the key in the path is the credential, no header is sent.
                key = secrets.token_hex(16)
                self.state.pending_uploads[key] = (obj["oid"], obj["size"])
                answer["authenticated"] = True
                answer["actions"] = {"upload": {"href": f"{self.endpoint}/lfs-upload/{key}"}}
            objects.append(answer)
        return Response.of_json({"transfer": "basic", "objects": objects})

    def lfs_upload(self, req: Request, key: str) -> Response:
        expected = self.state.pending_uploads.pop(key, None)
        if expected is None:
            raise HubError(403, "Unknown or used upload URL")
        oid, size = expected
        if len(req.body) != size or hashlib.sha256(req.body).hexdigest() != oid:
            raise HubError(400, f"Uploaded bytes do not match oid {oid} and size {size}")
        self.state.lfs_objects[oid] = req.body
        return Response(200, b"", {"ETag": f'"{oid}"'})

    def commit(self, req: Request, repo_id: str, branch: str) -> Response:
        repo = self.state.writable_repo(req, repo_id)
        if branch not in repo.branches:
            raise HubError(404, f"Invalid rev id: {branch}", "RevisionNotFound")
        lines = [json.loads(line) for line in req.body.splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            raise HubError(400, "The commit payload must start with a header line")
        header = lines[0]["value"]
        head = repo.commits[repo.branches[branch]]
        if header.get("parentCommit") and not head.oid.startswith(header["parentCommit"]):
            raise HubError(412, "A commit has happened since. Please refresh and try again.")
        files = dict(head.files)
        for line in lines[1:]:
            key, value = line["key"], line["value"]
            path = value["path"]
            if key == "file":
                files[path] = Blob(base64.b64decode(value["content"]), lfs=False)
            elif key == "lfsFile":
                data = self.state.lfs_objects.get(value["oid"])
                if data is None:
                    raise HubError(422, f"LFS object {value['oid']} of {path} was never uploaded")
                files[path] = Blob(data, lfs=True)
            elif key == "deletedFile":
                if files.pop(path, None) is None:
                    raise HubError(404, "A file with this name doesn't exist", "EntryNotFound")
            elif key == "deletedFolder":
                files = {p: b for p, b in files.items() if not p.startswith(path.rstrip("/") + "/")}
            else:
                raise HubError(400, f"Unknown commit operation {key!r}")
        commit = self.state.new_commit(repo, branch, header["summary"], files)
        return Response.of_json({"success": True, "commitOid": commit.oid, "pullRequestUrl": None,
                                 "commitUrl": f"{self.endpoint}/{repo_id}/commit/{commit.oid}"})

    # -- downloads ---------------------------------------------------------------------------------------------

    def resolve(self, req: Request, repo_id: str, revision: str, path: str) -> Response:
        repo = self.state.readable_repo(req, repo_id)
        commit = self.state.commit_at(repo, revision)
        blob = commit.files.get(path)
        if blob is None:
            raise HubError(404, "Entry not found", "EntryNotFound", commit=commit.oid)
        headers = {"X-Repo-Commit": commit.oid, "ETag": f'"{blob.etag}"', "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}
        if blob.lfs:
            headers["X-Linked-Etag"] = f'"{blob.sha256}"'
            headers["X-Linked-Size"] = str(len(blob.data))
        data, status = blob.data, 200
        match = re.fullmatch(r"bytes=(\d+)-(\d*)", req.headers.get("range", ""))
        if match:
            start = int(match.group(1))
            stop = int(match.group(2)) + 1 if match.group(2) else len(data)
            headers["Content-Range"] = f"bytes {start}-{stop - 1}/{len(data)}"
            data, status = data[start:stop], 206
        return Response(status, data, headers)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the real Hub; every answer carries a Content-Length
    server: "_Server"

    def setup(self) -> None:
        super().setup()
        self.server.track(self.connection, add=True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.track(self.connection, add=False)

    def log_message(self, format, *args) -> None:  # keep test output clean
        pass

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline().strip():  # trailers
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _handle(self) -> None:
        url = urlsplit(self.path)
        segments = [unquote(s) for s in url.path.strip("/").split("/")] if url.path.strip("/") else []
        body = self._body()
        hub = self.server.hub
        hub._log(self.command, url.path)
        auth = self.headers.get("Authorization", "")
        token = auth[len("Bearer "):] if auth.startswith("Bearer ") else None
        try:
            if token is not None and token not in hub.state.tokens:
                raise HubError(401, "Invalid credentials in Authorization header")
            req = Request(self.command, segments, parse_qs(url.query),
                          {k.lower(): v for k, v in self.headers.items()}, body,
                          hub.state.tokens.get(token) if token else None)
            with hub.state.lock:
                response = Routes(hub.state, hub.endpoint).dispatch(req)
                if hub.after_request is not None:
                    hub.after_request(self.command, url.path)
        except HubError as e:
            response = Response.of_json({"error": e.message, **e.extra}, status=e.status)
            response.headers["X-Error-Message"] = e.message
            if e.code:
                response.headers["X-Error-Code"] = e.code
            if e.commit:
                response.headers["X-Repo-Commit"] = e.commit
        self.send_response(response.status)
        for name, value in response.headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(response.body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(response.body)

    do_GET = do_HEAD = do_POST = do_PUT = _handle


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, hub: "LoopbackHub"):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.hub = hub
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()

    def track(self, conn: socket.socket, *, add: bool) -> None:
        with self._connections_lock:
            (self._connections.add if add else self._connections.discard)(conn)

    def cut_connections(self) -> None:
        with self._connections_lock:
            for conn in self._connections:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class LoopbackHub:
    """A Hub-compatible server on ``127.0.0.1`` and an ephemeral port; a context manager that starts and stops it.

    Args:
        tokens (`dict[str, str]`): access token -> user name. A user may write to repos in its own namespace and
            read its own private repos; anyone may read public repos.
    """

    def __init__(self, tokens: dict[str, str]):
        self.state = HubState(tokens)
        self.requests: list[tuple[str, str]] = []
        self.after_request: Callable[[str, str], None] | None = None
        """Called with (method, path) after each successful request, before the answer is sent (to stage races)."""
        self._requests_lock = threading.Lock()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self.endpoint = ""

    def start(self) -> "LoopbackHub":
        self._server = _Server(self)
        host, port = self._server.server_address[:2]
        self.endpoint = f"http://{host}:{port}"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.02},
                                        name="loopback-hub", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop listening and cut open connections: afterwards every request fails to connect."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self._server.cut_connections()
        self._thread.join()
        self._server = None

    def __enter__(self) -> "LoopbackHub":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _log(self, method: str, path: str) -> None:
        with self._requests_lock:
            self.requests.append((method, path))

    # -- what tests inspect ------------------------------------------------------------------------------------

    def head(self, repo_id: str, branch: str = "main") -> str:
        """The commit oid a branch points at."""
        return self.state.repos[repo_id].branches[branch]

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        """Path -> content of every file at a revision."""
        commit = self.state.repos[repo_id].find_commit(revision)
        return {path: blob.data for path, blob in commit.files.items()}

    def commit_files(self, repo_id: str, files: dict[str, bytes], branch: str = "main") -> str:
        """Commit files straight into the store, as another client's push would; returns the new commit oid."""
        repo = self.state.repos[repo_id]
        merged = dict(repo.commits[repo.branches[branch]].files)
        merged.update({path: Blob(data, lfs=_is_lfs(path, len(data), data[:512])) for path, data in files.items()})
        return self.state.new_commit(repo, branch, "direct commit", merged).oid

    def commit_count(self, repo_id: str) -> int:
        return len(self.state.repos[repo_id].commits)

    def is_private(self, repo_id: str) -> bool:
        return self.state.repos[repo_id].private
