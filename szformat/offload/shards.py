"""The .szt files of one checkpoint, open together: every entry by name, and the file that holds it.

An offloader streams from whichever shard holds a tensor, so a sharded checkpoint is opened whole (every file
mapped, every header validated, every escape stream checked) before anything is bound, and stays open while the
runtime uses it.

A shard stored in the at-rest form (.szt 1.1) is inflated once, at opening, into its in-memory form in host memory
(a file in ``/dev/shm`` where there is one), which the routes then map, register and stream from as from any
in-memory file: the runtime's transfers and decodes stay as they are, and the zstd work is paid once, not per use.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from ..errors import FormatError
from ..format.header import TensorEntry
from ..format.forms import rewrite_form
from ..format.index import checkpoint_shards, open_shard
from ..format.reader import SztFile, check_escapes

__all__ = ["Checkpoint"]


class Checkpoint:
    """A .szt file, a sharded index (``*.szt.index.json``) or a converted model folder, opened.

    Args:
        path (`str` or `os.PathLike`): the file, index or folder.

    Raises:
        ShardIndexError: the index is not valid, or does not match what its shards hold.
        FormatError: a file is not valid .szt, or a tensor is held by two shards.
        PayloadError: an escape stream is out of range or out of order (the device kernels that decode it later
            check nothing; a few bytes per escape are read here, once).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.files: list[SztFile] = []
        self.entries: dict[str, TensorEntry] = {}
        self._file_of: dict[str, SztFile] = {}
        self._host_copies: list[Path] = []
        try:
            for shard in checkpoint_shards(path):
                file = open_shard(shard)
                if file.at_rest:
                    file = self._in_host_memory(file)
                self.files.append(file)
                for name in file.entries:
                    if name in self.entries:
                        raise FormatError("tensor appears in more than one shard", path=shard.path, tensor=name)
                    self.entries[name] = entry = file.entries[name]
                    self._file_of[name] = file
                    if entry.layout is not None and entry.layout.n_esc:
                        check_escapes(file.payload(name), entry.layout, path=shard.path, tensor=name)
        except BaseException:
            self.close()
            raise

    def _in_host_memory(self, file: SztFile) -> SztFile:
        """The in-memory form of an at-rest shard, written once into host memory and opened (``file`` is closed)."""
        base = Path("/dev/shm")
        folder = Path(tempfile.mkdtemp(prefix="szformat-", dir=base if base.is_dir() and os.access(base, os.W_OK)
                                       else None))
        self._host_copies.append(folder)
        with file:
            copy = rewrite_form(file, folder / file.path.name, at_rest=None)
        return SztFile(copy)

    def file(self, name: str) -> SztFile:
        """The open file that holds entry ``name``."""
        try:
            return self._file_of[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} is not in {self.path}") from None

    @property
    def stored_bytes(self) -> int:
        """Bytes of every payload as held (what stays in host memory: the in-memory form of at-rest shards)."""
        return sum(entry.length for entry in self.entries.values())

    @property
    def raw_bytes(self) -> int:
        """Bytes of every tensor once decoded."""
        return sum(entry.raw_length for entry in self.entries.values())

    def close(self) -> None:
        for file in self.files:
            file.close()
        for folder in self._host_copies:  # pages still mapped stay valid until unmapped
            shutil.rmtree(folder, ignore_errors=True)
        self._host_copies.clear()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
