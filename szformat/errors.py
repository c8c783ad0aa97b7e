"""Every exception szformat raises.

One root, :class:`SzformatError`, so callers can catch everything the package raises in one clause; each subclass
also inherits the builtin exception callers already catch for that kind of failure (``ValueError`` for malformed
input, ``OSError`` for I/O). Every message names the file and the tensor it is about, when they are known.
"""

from __future__ import annotations

import errno
import os
import reprlib

__all__ = [
    "SzformatError",
    "FormatError",
    "HeaderError",
    "HeaderTooLargeError",
    "TruncatedFileError",
    "ReadError",
    "InvalidOffsetError",
    "UnsupportedVersionError",
    "UnknownEncodingError",
    "PayloadError",
    "ChecksumMismatchError",
    "TensorAllocationError",
    "ShardIndexError",
    "ConversionError",
    "RoundTripError",
    "WriteError",
    "OutputExistsError",
    "DecodeRouteError",
    "BindingError",
    "InvalidArgumentError",
    "CheckpointNotFoundError",
    "TensorNotFoundError",
    "ClosedFileError",
    "CLIError",
    "HubReferenceError",
    "HubCheckpointNotFoundError",
    "PushError",
    "HubRequestError",
    "HubOfflineError",
    "ModelFolderError",
    "UnknownArchitectureError",
    "CheckpointMismatchError",
    "MissingDependencyError",
]


class SzformatError(Exception):
    """Root of every szformat error. ``path`` and ``tensor`` say which file and tensor it is about."""

    def __init__(self, message: str, *, path: str | os.PathLike | None = None, tensor: str | None = None):
        self.reason = message
        self.path = os.fspath(path) if path is not None else None
        self.tensor = tensor
        super().__init__(self._format())

    def _format(self) -> str:
        where = []
        if self.path is not None:
            where.append(f"file {self.path!r}")
        if self.tensor is not None:
            where.append(f"tensor {self.tensor!r}")
        return f"{', '.join(where)}: {self.reason}" if where else self.reason

    def with_context(self, *, path: str | os.PathLike | None = None, tensor: str | None = None) -> "SzformatError":
        """Fill in the file and tensor where the raising layer did not know them; returns ``self``."""
        if self.path is None and path is not None:
            self.path = os.fspath(path)
        if self.tensor is None and tensor is not None:
            self.tensor = tensor
        self.args = (self._format(),)
        return self


_SHORT_REPR = reprlib.Repr()
_SHORT_REPR.maxlevel, _SHORT_REPR.maxlist, _SHORT_REPR.maxdict = 3, 8, 6
_SHORT_REPR.maxstring = _SHORT_REPR.maxother = 80


def short_repr(value: object) -> str:
    """``repr(value)`` cut to a few dozen characters and 3 levels, for messages about values read from a file.

    A hostile file can hold a value nested a thousand levels deep (the builtin ``repr`` would raise
    ``RecursionError``) or megabytes long (the message would be too).
    """
    return _SHORT_REPR.repr(value)


LISTED = 10
"""How many names a message lists per problem before it says how many more there are."""


def listing(items: list[str], separator: str = ", ") -> str:
    """The first :data:`LISTED` of ``items``, joined, and how many more there are: a message that names every
    mismatch of a large model would run to pages."""
    shown = separator.join(items[:LISTED])
    hidden = len(items) - LISTED
    return f"{shown}{separator}... and {hidden} more" if hidden > 0 else shown


def first_line(error: BaseException) -> str:
    """An error's message cut to its first line (its type's name when it has none), for one-line messages."""
    message = str(error).strip()
    return message.splitlines()[0] if message else type(error).__name__


# ARGUMENTS AND FILES

class InvalidArgumentError(SzformatError, ValueError):
    """Raised when an argument is not one szformat takes: a framework other than ``"pt"``, an unknown offload
    route, a device a route cannot compute on."""


class CheckpointNotFoundError(SzformatError, FileNotFoundError):
    """Raised when a local path names no file or folder; ``errno``, ``strerror`` and ``filename`` are set as the
    ``FileNotFoundError`` a caller catches today has them."""

    def __init__(self, message: str, *, path: str | os.PathLike | None = None, tensor: str | None = None):
        super().__init__(message, path=path, tensor=tensor)
        self.errno, self.strerror, self.filename = errno.ENOENT, os.strerror(errno.ENOENT), self.path

    def __str__(self) -> str:  # OSError would format errno, strerror and filename instead
        return self.args[0] if self.args else ""


class TensorNotFoundError(SzformatError, KeyError):
    """Raised when a file holds no tensor of the name asked for."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.args[0] if self.args else ""


class ClosedFileError(SzformatError, ValueError):
    """Raised when an open file is used after ``close()`` (as Python's own files raise ``ValueError``)."""


# FILE FORMAT ERRORS


class FormatError(SzformatError, ValueError):
    """Raised when a file is not a valid .szt file."""


class HeaderError(FormatError):
    """Raised when the header cannot be parsed or a field in it is missing, mistyped or inconsistent."""


class HeaderTooLargeError(HeaderError):
    """Raised when the preamble announces a header larger than the hard cap."""


class TruncatedFileError(FormatError):
    """Raised when the file ends before the bytes the preamble or the header promise."""


class ReadError(SzformatError, OSError):
    """Raised when a file's bytes cannot be read through its mapping although the file still holds them: its disk
    failed to deliver a page."""


class InvalidOffsetError(FormatError):
    """Raised when a payload leaves the file, overlaps another, is misaligned or leaves unexplained bytes."""


class UnsupportedVersionError(FormatError):
    """Raised when a file needs a format version or feature flag this reader does not implement."""


class UnknownEncodingError(FormatError):
    """Raised when a tensor's encoding name is not in the registry of this reader."""


class PayloadError(FormatError):
    """Raised when a SplitZip payload is internally inconsistent (escape stream, lengths, codebook)."""


class ChecksumMismatchError(FormatError):
    """Raised when stored bytes or decoded bytes do not match the checksum recorded in the header."""


class TensorAllocationError(SzformatError, MemoryError):
    """The memory to read a tensor into could not be allocated (the file is valid; the machine is too small)."""


class ShardIndexError(FormatError):
    """Raised when a sharded-checkpoint index (``*.index.json``) is malformed, names a shard outside its folder or
    one that is missing, or maps a tensor to a shard that does not hold it."""


# CONVERSION AND WRITING ERRORS


class ConversionError(SzformatError, ValueError):
    """Raised when an input cannot be converted (malformed safetensors file, no weight file, unsupported dtype,
    an output overlapping the input)."""


class RoundTripError(ConversionError):
    """Raised when a tensor does not decode bit for bit to its source before it is written."""


class RoundTripMismatch(ValueError):
    """Raised by the codec when a payload does not decode bit for bit to its source tensor; the writer, which knows
    the file and the tensor, reports it as :class:`RoundTripError`."""


class WriteError(SzformatError, OSError):
    """Raised when an output cannot be written; no partial output is left behind."""


class OutputExistsError(WriteError, FileExistsError):
    """Raised when an output exists and may not be replaced (``overwrite`` is off), found before writing or at the
    end, when another writer created it first."""

    def __init__(self, path: str | os.PathLike, *, option: str = "overwrite=True"):
        super().__init__(f"exists; pass {option} to replace it", path=path)
        self.errno, self.strerror, self.filename = errno.EEXIST, os.strerror(errno.EEXIST), os.fspath(path)

    def __str__(self) -> str:  # OSError would format errno, strerror and filename instead of the message
        return self.args[0]


# LOADING ERRORS


class DecodeRouteError(SzformatError, RuntimeError):
    """Raised when a requested decode route (device, Triton, staging pool size) cannot serve the request."""


class BindingError(SzformatError, KeyError):
    """Raised when module parameters and .szt entries do not match by name or shape."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.args[0] if self.args else ""


# HUGGING FACE HUB


class HubReferenceError(SzformatError, ValueError):
    """Raised when a Hub reference (``hf://...`` or ``repo_id=``/``filename=``/``revision=``) is malformed or
    contradicts itself."""


class HubCheckpointNotFoundError(SzformatError, FileNotFoundError):
    """Raised when a Hub repo reference names no file and the repo holds neither a sharded index nor ``model.szt``."""


class PushError(SzformatError, ValueError):
    """Raised when a path cannot be pushed as a checkpoint (no .szt file, an index naming a shard that is absent),
    or when no token, or a token of another namespace, is at hand for the push."""


class HubRequestError(SzformatError, OSError):
    """Raised by the command line when the Hub cannot be reached or refuses a request; the message is one line. (The
    library lets huggingface_hub's own errors through, but for :class:`HubOfflineError`.)"""


class HubOfflineError(HubRequestError, FileNotFoundError):
    """Raised when a file must come from the Hub, is not in the local cache, and the Hub cannot be asked: it does
    not answer (found out in one quick connection, not a minute of retries) or ``HF_HUB_OFFLINE`` /
    ``local_files_only`` forbid asking."""


# MODELS AND PIPELINES (transformers, diffusers)


class ModelFolderError(SzformatError, ValueError):
    """Raised when a folder or repo cannot be loaded as a model or pipeline: no ``config.json`` or
    ``model_index.json``, no .szt weights (a safetensors folder: the message points to ``szconvert``), or a pipeline
    component named in ``model_index.json`` that is absent."""


class UnknownArchitectureError(ModelFolderError):
    """Raised when a config names a model type or class that the installed transformers or diffusers does not
    know, or that the requested auto class cannot build."""


class CheckpointMismatchError(SzformatError, ValueError):
    """Raised when the tensors of a checkpoint do not fit the model its config builds (shapes, names); the message
    lists every one."""


class MissingDependencyError(SzformatError, ImportError):
    """Raised when an optional integration is used without its package (``pip install 'szformat[transformers]'``)."""


# COMMAND LINE


class CLIError(SzformatError):
    """Raised for a wrong command line; the message says what to do instead."""
