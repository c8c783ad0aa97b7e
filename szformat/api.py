"""``safe_open``, ``load_file``, ``save_file``: the safetensors-shaped API over .szt files.

Reading is lazy: the file is mapped, the header validated, and a tensor is decoded only when asked for, into its
destination, from its stored bytes copied out of the file (``pread``) or read through the mapping by C calls that
catch the fault of a lost page: a file truncated meanwhile is an error, never SIGBUS.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ._lazy import LazyModule
from ._lazy import at_rest as at_rest_stage
from .errors import ConversionError, FormatError, InvalidArgumentError
from .format import constants as C
from .format.header import TensorEntry, validate_name
from .format.reader import PayloadDescriptor, SztFile
from .format.index import load_checkpoint
from .loading.host_decode import decode_entries
from .loading.host_reader import HostReader, TensorSlice
from .paths import resolve_path

if TYPE_CHECKING:
    from .loading.device_loader import StagingConfig

device_loading = LazyModule("szformat.loading.device_loader")
"""The device pipeline, imported by the first load onto a GPU: a CPU load never pays for it."""
writing = LazyModule("szformat.format.writer")
"""The writer, imported by the first save: a load never pays for it."""

__all__ = ["safe_open", "load_file", "save_file"]

class safe_open:
    """Open a .szt file for lazy reading, like ``safetensors.safe_open``.

    A file in the at-rest form (format 1.1) reads the same way: its zstd frames are inflated as tensors are read,
    and a slice inflates only the frames it covers.

    Args:
        filename (`str` or `os.PathLike`): the .szt file.
        framework (`str`): ``"pt"`` (the only framework).
        device (`str` or `torch.device`, *optional*): where tensors are returned; defaults to ``"cpu"``.
        verify (`bool`, *optional*): check CRC-32s (default). The stored bytes of a tensor are checked once per
            open file while a whole tensor is decoded (it is returned only if they match); a slice checks the
            blocks of them it reads (format 1.3), or in a file without block checksums all of them once, before it
            is decoded. A tensor read whole has its decoded bytes checked too. A slice is not:
            the decoded bytes' CRC-32 covers the whole tensor. Structural checks (offsets, escape streams) always
            run. CRC-32s catch accidental corruption, not deliberate edits (whoever edits a file can recompute them).
        route (`str`, *optional*): for a CUDA ``device``: ``"gpu"`` (default, via ``"auto"``) copies the stored bytes
            and decodes on the GPU (needs Triton); ``"cpu"`` decodes on the host and copies raw bytes.
        staging (`StagingConfig`, *optional*): for a CUDA ``device``: pinned slot size and count, reader threads,
            host transport (see :class:`szformat.loading.StagingConfig`).
        hub (*optional*): ``filename`` may be a Hub reference (``hf://user/repo/model.szt``), or a file of the repo
            named by ``repo_id``; ``revision``, ``token``, ``local_files_only`` and ``cache_dir`` are passed to
            ``huggingface_hub`` (see :func:`szformat.hub.resolve`).

    Example:
        >>> with safe_open("model.szt", framework="pt") as f:  # doctest: +SKIP
        ...     w = f.get_tensor("encoder.layer.0.attention.self.query.weight")
    """

    def __init__(self, filename: str | os.PathLike, framework: str = "pt", device: str | torch.device = "cpu", *,
                 verify: bool = True, route: str = "auto", staging: StagingConfig | None = None,
                 repo_id: str | None = None, revision: str | None = None, token: str | bool | None = None,
                 local_files_only: bool = False, cache_dir: str | os.PathLike | None = None):
        if framework not in ("pt", "torch", "pytorch"):
            raise InvalidArgumentError(f"framework {framework!r} is not supported; use 'pt'")
        filename = resolve_path(filename, repo_id=repo_id, revision=revision, token=token,
                                local_files_only=local_files_only, cache_dir=cache_dir)
        if Path(filename).name.endswith(C.INDEX_SUFFIX):
            raise FormatError("this is a sharded index; open one of its .szt files, or use load_file", path=filename)
        self.device = torch.device(device)
        self.verify = verify
        self._device_loader = (device_loading.DeviceLoader(self.device, route=route, staging=staging, verify=verify)
                               if self.device.type != "cpu" else None)
        try:
            self._file = SztFile(filename)
        except BaseException:
            if self._device_loader is not None:
                self._device_loader.close()
            raise
        self._host = HostReader(self._file, verify=verify)

    @property
    def path(self) -> Path:
        """The local .szt file (for a Hub reference, its copy in the Hugging Face cache)."""
        return self._file.path

    def __enter__(self) -> "safe_open":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Release the mapping, the read buffers and, for a CUDA ``device``, the staging memory and reader threads."""
        if self._device_loader is not None:
            self._device_loader.close()
        self._file.close()
        self._host.release()

    def keys(self) -> list[str]:
        """Tensor names in file order."""
        return list(self._file.entries)

    def metadata(self) -> dict[str, str] | None:
        """The source's ``__metadata__``, unchanged (``None`` when it had none)."""
        return self._file.metadata

    def entry(self, name: str) -> TensorEntry:
        """The header entry of ``name``: dtype, shape, encoding, where its bytes are and their checksums."""
        return self._file.entry(name)

    def descriptor(self, name: str) -> PayloadDescriptor:
        """Where the stored bytes of ``name`` are and how to expand them (for GPU transport routes)."""
        return self._file.descriptor(name)

    def payload(self, name: str) -> torch.Tensor:
        """Zero-copy uint8 view of the stored bytes of ``name``; valid while this file or the view is alive.

        Not checksummed: ``descriptor(name).crc32`` is there for routes that check the bytes where they land.
        """
        return self._file.payload(name)

    def get_tensor(self, name: str) -> torch.Tensor:
        """Tensor ``name``, decoded, on this file's ``device``.

        Raises:
            KeyError: the file holds no tensor ``name``.
            ChecksumMismatchError, PayloadError: its stored bytes are corrupt.
        """
        if self._device_loader is not None:
            return self._device_loader.load(self._file, [name])[name]
        return self._host.tensors([name])[0]

    def get_slice(self, name: str) -> "TensorSlice":
        """A lazy handle on tensor ``name``: indexing its first dimension decodes only the rows it covers.

        With ``verify`` the stored bytes a slice reads are checked before it is decoded (the blocks holding them,
        format 1.3; in a file without block checksums the whole payload, read once), but the decoded bytes' CRC-32
        cannot be: it covers the whole tensor. A payload edited with its stored CRC-32
        recomputed, or a codebook edited with the header's CRC-32 recomputed (no checksum but the decoded bytes'
        covers the codebook), then gives the values it decodes to, where :meth:`get_tensor` refuses it (the spec's
        checksum table says the same).
        """
        return TensorSlice(self._host, self._file.entry(name), self.device)


def load_file(filename: str | os.PathLike, device: str | torch.device = "cpu", *,
              verify: bool = True, route: str = "auto", staging: StagingConfig | None = None,
              repo_id: str | None = None, revision: str | None = None, token: str | bool | None = None,
              local_files_only: bool = False, cache_dir: str | os.PathLike | None = None) -> dict[str, torch.Tensor]:
    """Load every tensor of a checkpoint into a dict, like ``safetensors.torch.load_file``.

    ``filename`` is a .szt file, a sharded index (``model.szt.index.json``), a converted model folder, or a Hub
    reference to any of them (``hf://user/repo``; Hub keywords as for :class:`safe_open`). With a CUDA ``device``
    the stored bytes stream through a pinned staging ring and are decoded on the GPU (``route`` and ``staging`` as
    for :class:`safe_open`). On the CPU, tensors are decoded in ranges by ``torch.get_num_threads()`` threads
    (at most the host's cores), each running PyTorch on one intra-op thread.

    Example:
        >>> weights = load_file("hf://user/model-szt", device="cuda")  # doctest: +SKIP
    """
    path = resolve_path(filename, repo_id=repo_id, revision=revision, token=token,
                        local_files_only=local_files_only, cache_dir=cache_dir)
    if torch.device(device).type != "cpu":
        return device_loading.load_to_device(path, device, route=route, staging=staging, verify=verify)

    def load_shard(file: SztFile, names: list[str] | None) -> dict[str, torch.Tensor]:
        names = list(file.entries) if names is None else names
        entries = [file.entry(name) for name in names]
        tensors = decode_entries(file, entries, check_stored=[verify] * len(entries), check_decoded=verify)
        return dict(zip(names, tensors))

    return load_checkpoint(load_shard, path)


def save_file(tensors: dict[str, torch.Tensor], filename: str | os.PathLike, metadata: dict[str, str] | None = None,
              *, alignment: int = C.DEFAULT_ALIGNMENT, at_rest: str | None = None) -> None:
    """Save tensors to a .szt file, like ``safetensors.torch.save_file``.

    Each BF16 tensor is SplitZip-encoded when the coverage gate and size allow, checked bit for bit, then written;
    every other tensor is stored raw. The file appears atomically: on any error neither it nor a temporary file is
    left, and an existing file at ``filename`` is untouched.

    ``at_rest`` (``"zstd"`` or ``"zstd:LEVEL"``) writes the smaller at-rest form (format 1.1): the packed exponent
    codes (and large escape streams) of each SplitZip payload as zstd frames, payloads under 1 MiB packed at 16
    bytes, the header through zstd; readers inflate it on load. ``None`` (default) writes the in-memory form, which
    loads with no inflating.

    Raises:
        ConversionError: a name, value or dtype cannot be stored (checked before anything is written).
        RoundTripError: a tensor did not decode bit for bit to its source.
        WriteError: the file cannot be written.
    """
    try:
        level = at_rest_stage.parse_at_rest_option(at_rest)
    except ValueError as e:
        raise ConversionError(str(e), path=filename) from None
    items = list(tensors.items())
    for name, t in items:
        try:
            validate_name(name)
        except ValueError as e:
            raise ConversionError(str(e), path=filename) from None
        if not isinstance(t, torch.Tensor):
            raise ConversionError(f"value is a {type(t).__name__}, not a torch.Tensor", path=filename, tensor=name)
        if t.dtype not in C.TORCH_TO_DTYPE:
            raise ConversionError(f"dtype {t.dtype} cannot be stored in .szt (nor in safetensors)", path=filename,
                                  tensor=name)
        if t.device.type == "meta":
            raise ConversionError("tensor is on the meta device and holds no values; load or initialize it first",
                                  path=filename, tensor=name)
        if t.layout is not torch.strided:
            raise ConversionError(f"tensor is {t.layout}; convert it with .to_dense() first", path=filename,
                                  tensor=name)
    with writing.SztWriter(filename, metadata=metadata, alignment=alignment,
                           raw_bytes=sum(t.numel() * t.element_size() for _, t in items),
                           **writing.writer_form(level)) as writer:
        for name, t in items:
            writing.write_tensor(writer, name, C.TORCH_TO_DTYPE[t.dtype], tuple(t.shape), writing.tensor_bytes(t))
