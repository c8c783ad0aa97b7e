"""Outputs that appear whole or not at all: a temporary beside the target, fsynced and renamed over it at the end.

A failure, a full disk or Ctrl-C before the rename removes the temporary and leaves the target as it was. The
temporaries are named ``.<target name>.<writer>.tmp`` and created with the ordinary mode (the umask applies):
``tempfile.mkstemp`` would make a file only its owner can read, and the rename would carry that over to the output.

A writer killed outright (SIGKILL, a power cut) cannot remove its temporary, so ``<writer>`` says who wrote it: a
digest of the host name, the process id, the process's start time (where the system tells it: it tells a reused
process id from the writer) and a random part. The next writer to the same target removes the temporaries whose
writer ran on this host and is gone; a live writer's, or another host's (a shared folder), are never touched.

Publishing without replacing is one step too (:func:`rename_no_replace`): of two writers racing to create one
output, exactly one succeeds and the other gets :class:`~szformat.errors.OutputExistsError`.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import hashlib
import os
import re
import secrets
import shutil
import socket
import sys
from pathlib import Path
from typing import Callable, TypeVar

from ..errors import OutputExistsError, SzformatError, WriteError
from .direct_io import DirectAppender

__all__ = ["AtomicFile", "create_beside", "fsync_directory", "remove", "remove_stale_temporaries",
           "publish", "rename_no_replace", "temporary_name"]

T = TypeVar("T")

_TEMPORARY = re.compile(r"\.(?P<target>.+)\.(?P<host>[0-9a-f]{8})-(?P<pid>[0-9]+)-(?P<start>[0-9]+)-[0-9a-f]{12}"
                        r"\.tmp")
"""``.<target name>.<host digest>-<pid>-<start time>-<random>.tmp``"""


def temporary_name(target: Path) -> Path:
    """A fresh ``.<name>.<writer>.tmp`` path beside ``target`` (see the module's docstring)."""
    host, pid, start = _writer()
    return target.parent / f".{target.name}.{host}-{pid}-{start}-{secrets.token_hex(6)}.tmp"


def _writer() -> tuple[str, int, int]:
    """This process as a temporary's name records it: host digest, process id, start time (0 where unknown)."""
    pid = os.getpid()
    return _host_digest(), pid, _start_time(pid) or 0


@functools.lru_cache(maxsize=1)
def _host_digest() -> str:
    return hashlib.sha256(socket.gethostname().encode("utf-8", "surrogateescape")).hexdigest()[:8]


def _start_time(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (Linux ``/proc/<pid>/stat`` field 22); ``None`` when
    the process does not exist or the system does not say."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _writer_is_gone(host: str, pid: int, start: int) -> bool:
    """Whether the writer a temporary's name records is certainly no longer running. Unsure means no: another
    host's writer, a system where a process cannot be probed without affecting it (Windows)."""
    if host != _host_digest() or os.name != "posix" or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # it exists (another user's process)
    now = _start_time(pid)
    return start != 0 and now is not None and now != start  # the id now belongs to a later process


def remove_stale_temporaries(target: Path) -> list[Path]:
    """Remove the temporaries beside ``target`` left by writers to it that were killed; returns what went."""
    removed = []
    try:
        names = os.listdir(target.parent if str(target.parent) else ".")
    except OSError:
        return removed
    for name in names:
        match = _TEMPORARY.fullmatch(name)
        if match is None or match["target"] != target.name:
            continue
        if _writer_is_gone(match["host"], int(match["pid"]), int(match["start"])):
            remove(target.parent / name)
            removed.append(target.parent / name)
    return removed


def create_beside(target: Path, make: Callable[[Path], T], *, kind: str = "file") -> tuple[Path, T]:
    """Create a temporary ``kind`` beside ``target`` with ``make(path)``, which must fail if the path exists.

    Returns the path and what ``make`` returned.

    Raises:
        WriteError: nothing can be created there (a missing folder, no permission, no free name).
    """
    remove_stale_temporaries(target)
    for _ in range(100):
        tmp = temporary_name(target)
        try:
            return tmp, make(tmp)
        except FileExistsError:
            continue
        except OSError as e:
            raise WriteError(f"cannot create a temporary {kind} beside the output ({e.strerror or e})",
                             path=target) from e
    raise WriteError(f"cannot find a free temporary {kind} name beside the output", path=target)


def fsync_directory(directory: Path) -> None:
    """Make a rename durable where the platform allows opening a folder (not on Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


RENAME_NOREPLACE = 1
"""``renameat2`` flag (Linux >= 3.15): fail with EEXIST rather than replace the destination."""
AT_FDCWD = -100


@functools.lru_cache(maxsize=1)
def _renameat2() -> Callable[..., int] | None:
    """The C library's ``renameat2``, or ``None`` where there is none (not Linux, glibc < 2.28, musl < 1.2.1)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def rename_no_replace(src: Path, dst: Path) -> None:
    """Rename the file or folder ``src`` to ``dst`` in one step, unless ``dst`` exists (then FileExistsError).

    ``renameat2(RENAME_NOREPLACE)`` where the system and file system have it; else a file is hard-linked to ``dst``
    (which fails if it exists) and ``src`` unlinked, and a folder claims ``dst`` by creating it empty (which fails
    if it exists) and is renamed over that empty folder. On Windows a rename never replaces anything.
    """
    if os.name == "nt":
        os.rename(src, dst)
        return
    renameat2 = _renameat2()
    if renameat2 is not None:
        if renameat2(AT_FDCWD, os.fsencode(src), AT_FDCWD, os.fsencode(dst), RENAME_NOREPLACE) == 0:
            return
        code = ctypes.get_errno()
        if code not in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):  # anything but "not here"
            raise OSError(code, os.strerror(code), str(src), None, str(dst))
    if src.is_dir() and not src.is_symlink():
        os.mkdir(dst)
        try:
            os.rename(src, dst)
        except BaseException:
            os.rmdir(dst)
            raise
    else:
        os.link(src, dst, follow_symlinks=False)
        os.unlink(src)


def remove(path: Path) -> None:
    """Remove a temporary file or folder, whatever it holds."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


WRITE_PIECE = 1 << 20
"""Bytes per ``write`` call when appending a large buffer. On the 2-core build VM (Linux 6.18, ext4) the kernel's copy
into the page cache cost 3.4 s of system time over a 2.2 GB conversion when each payload (up to 98 MB) went in one
call, and 0.8-1.9 s in pieces of 1 MiB; 256 KiB and 4 MiB pieces did no better (``bench/convert.py``)."""


DIRECT_FROM_BYTES = 64 << 20
"""Size from which a file's appends bypass the page cache (:mod:`.direct_io`). A smaller output (an index, a small
model) is written through it: its page-cache copy (about 0.5 ms per MB on the build VM) costs less than the first
touch of the staging buffers (about 34 ms), and it is in cache when read right back. With 16 MiB, MiniLM's 34 MB
conversion took 166 against 130 ms of CPU."""


class AtomicFile:
    """A binary file written under a temporary name and renamed to ``target`` by :meth:`commit`: over what is there,
    or, with ``overwrite=False``, only if nothing is (else :class:`OutputExistsError`, and the temporary goes).

    Once it holds :data:`DIRECT_FROM_BYTES`, appends go through direct I/O where the file system allows it, and
    writes over earlier bytes wait for :meth:`commit`.

    Used as a context manager, leaving the block with an exception (``KeyboardInterrupt`` too) removes the
    temporary; a write error (a full disk) raises WriteError and removes it as well.

    Example:
        >>> with AtomicFile("out.bin") as f:  # doctest: +SKIP
        ...     f.write(b"data")
        ...     f.commit()
    """

    def __init__(self, target: str | os.PathLike, *, overwrite: bool = True):
        self.target = Path(target)
        self.overwrite = overwrite
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)  # read too: DirectAppender.start
        self.tmp, fd = create_beside(self.target, lambda p: os.open(p, flags, 0o666))
        self._file = os.fdopen(fd, "wb")
        self._direct: DirectAppender | None = None
        self._direct_refused = False
        self._patches: list[tuple[int, bytes]] = []  # writes over earlier bytes, made at commit in direct mode
        self._done = False

    def __enter__(self) -> "AtomicFile":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()

    def write(self, data, *, at: int | None = None) -> None:
        """Append ``data``; with ``at``, overwrite the bytes written earlier from that offset (a placeholder)."""
        try:
            if at is None:
                self._append(data)
            elif self._direct is not None:
                self._patches.append((at, bytes(data)))
            else:
                end = self._file.tell()
                self._file.seek(at)
                self._file.write(data)
                self._file.seek(end)
        except OSError as e:
            self.abort()
            raise WriteError(f"cannot write ({e.strerror or e}); nothing was left behind", path=self.target) from e

    def _append(self, data) -> None:
        """Append ``data`` (any contiguous buffer): through direct I/O once the file is large enough and the file
        system allows it, else in pieces of at most :data:`WRITE_PIECE` bytes."""
        view = memoryview(data)
        if self._direct is None and not self._direct_refused and self._file.tell() + view.nbytes >= DIRECT_FROM_BYTES:
            self._file.flush()
            self._direct = DirectAppender.start(self._file.fileno(), self._file.tell())
            self._direct_refused = self._direct is None
        if self._direct is not None:
            self._direct.append(view)
            return
        if view.nbytes <= WRITE_PIECE:
            self._file.write(view)
            return
        view = view.cast("B")
        for start in range(0, view.nbytes, WRITE_PIECE):
            self._file.write(view[start: start + WRITE_PIECE])

    def commit(self) -> Path:
        """Flush, fsync and rename the file into place, then fsync its folder."""
        try:
            self._file.flush()
            if self._direct is not None:
                self._direct.finish()
                self._direct.close()
                self._direct = None
                for at, data in self._patches:
                    os.pwrite(self._file.fileno(), data, at)
            os.fsync(self._file.fileno())
            self._file.close()
            self._move_into_place()
        except BaseException as e:
            self.abort()
            if isinstance(e, OSError) and not isinstance(e, (FileExistsError, SzformatError)):
                raise WriteError(f"cannot finish the file ({e.strerror or e})", path=self.target) from e
            raise
        self._done = True
        return self.target

    def abort(self) -> None:
        """Close and remove the temporary; the target is left as it was."""
        if self._done:
            return
        self._done = True
        if self._direct is not None:
            self._direct.close()
        try:
            self._file.close()
        except OSError:
            pass  # flushing bytes that are about to be removed failed again (a full disk); the file is closed anyway
        finally:
            self.tmp.unlink(missing_ok=True)

    def _move_into_place(self) -> None:
        """Replace the target, a file or nothing, in one step (or refuse to, without ``overwrite``)."""
        if self.overwrite:
            os.replace(self.tmp, self.target)
            published(self.target)
        else:
            publish(self.tmp, self.target)
        fsync_directory(self.target.parent)


PUBLISHED: list[Path] = []
"""Every output this process has put in place, in order (:func:`published`): a command interrupted after its
output was complete says so rather than that nothing was left."""


def published(target: Path) -> None:
    """Note that ``target`` is now in place, whole."""
    PUBLISHED.append(Path(target))


def publish(tmp: Path, target: Path, *, record: bool = True) -> None:
    """Rename ``tmp`` to ``target`` unless something is there already (and note it, with ``record``: not for the
    files of a folder output moved one by one, which is complete only once all are there).

    Raises:
        OutputExistsError: ``target`` exists (it may have appeared a moment ago: another writer won the race).
    """
    try:
        rename_no_replace(tmp, target)
    except FileExistsError:
        raise OutputExistsError(target) from None
    except OSError as e:
        if e.errno != errno.ENOTEMPTY:  # a folder's rename onto a folder that is not empty
            raise
        raise OutputExistsError(target) from None
    if record:
        published(target)
