"""The conversion driver: .safetensors (a file, a sharded index or a model folder) to .szt, streaming and atomic.

Tensors are read one at a time from a mapping of the source, encoded, decoded again and compared bit for bit with
the source (the CPU codec does it slice by slice as it encodes, ``codec/gate.py`` on other devices), then appended
to the output; the source pages are released after each tensor, so memory stays near the size of the largest
tensor. Every output appears whole or not at all. The same input always gives the same bytes: tensors keep the
source's data order, codebooks break ties deterministically, and nothing time- or machine-dependent is stored.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

from .._collector import collector_paused
from .._lazy import cpu_codec, torch
from .._reused import ReusedBuffer
from ..codec.gate import CodecBackend
from ..errors import ConversionError
from ..format import constants as C
from ..format.writer import SztWriter, write_tensor, writer_form
from .cast import CAST_TARGETS, cast_dtypes, cast_metadata, cast_to_bf16
from .device import codec_for
from .driver import TensorDone, run_pass
from .report import ConversionReport
from .sources import SUFFIX, SafetensorsHeader, SafetensorsSource, read_safetensors_header


def convert(source: str | os.PathLike, target: str | os.PathLike | None = None, *,
            device: str | torch.device = "cpu", backend: CodecBackend | None = None, overwrite: bool = False,
            alignment: int = C.DEFAULT_ALIGNMENT, cast: str | None = None, at_rest: int | None = None,
            progress: bool = False) -> ConversionReport:
    """Convert a safetensors checkpoint to szformat.

    Only BF16 tensors compress; every other tensor is stored as it is, bit for bit. For an F32 or F16 checkpoint,
    ``cast="bf16"`` casts its floating-point tensors to BF16 first: lossy, and only when asked.

    Args:
        source (`str` or `os.PathLike`): a ``.safetensors`` file, a ``*.safetensors.index.json`` sharded index, or
            a model folder (sub-folders included).
        target (`str` or `os.PathLike`, *optional*): for a single file, the ``.szt`` file or a folder to put it in
            (default: beside the source); else the output folder (required).
        device (`str` or `torch.device`, *optional*): where to encode: ``"cpu"`` (default) or ``"cuda"``; the
            bytes are the same.
        backend (*optional*): a codec object with ``encode(x)`` and ``decode(payload, layout, codebook)`` to use
            instead of the one ``device`` selects.
        overwrite (`bool`, *optional*): replace an existing output.
        alignment (`int`, *optional*): payload alignment of the .szt files (4096 by default).
        cast (`str`, *optional*): ``"bf16"`` casts every F16, F32 and F64 tensor to BF16 before encoding it,
            rounding to nearest even as ``tensor.to(torch.bfloat16)`` does. Lossy: the output holds the cast values
            (its checksums and ``verify`` cover those), and its ``__metadata__`` records the cast under
            ``"szformat.cast"``. Other dtypes are left as they are.
        at_rest (`int`, *optional*): a zstd level: write the at-rest form (format 1.1, smaller; inflated on load).
            ``None`` (default): the in-memory form.
        progress (`bool`, *optional*): show a progress bar on stderr.

    Returns:
        `ConversionReport`: every tensor written, with its encoding and sizes, and the wall time.

    Raises:
        FileNotFoundError: ``source`` does not exist.
        OutputExistsError: the output exists and ``overwrite`` is false (a ``FileExistsError``).
        ConversionError: an input is malformed or holds something .szt cannot store.
        ShardIndexError: an index is malformed, or names a shard or tensor that is not there (nothing is written).
        RoundTripError: a tensor did not decode bit for bit (nothing is written).
        WriteError: the output cannot be written (nothing is left behind).
        DecodeRouteError: ``device`` cannot encode (no CUDA, no Triton).

    Example:
        >>> convert("model.safetensors")  # writes model.szt  # doctest: +SKIP
        >>> convert("Llama-3.2-1B/", "Llama-3.2-1B-szt/", device="cuda")  # doctest: +SKIP
    """
    if cast not in (None, *CAST_TARGETS):
        raise ConversionError(f"cast={cast!r} is not supported; the one cast is 'bf16'", path=source)
    codec, device = (backend, torch.device(device)) if backend is not None else codec_for(device)
    cast_counts: Counter[str] = Counter()

    def stored_sizes(header: SafetensorsHeader) -> dict[str, int]:
        """Raw bytes of each tensor as it will be stored (a BF16 cast halves an F32 tensor)."""
        cast_from = cast_dtypes(header.tensors) if cast else set()
        return {t.name: t.nbytes // C.itemsize(t.dtype) * 2 if t.dtype in cast_from else t.nbytes
                for t in header.tensors}

    def read_sizes(path: Path) -> dict[str, int]:
        return stored_sizes(read_safetensors_header(path))

    payloads = ReusedBuffer()  # one for every file: its pages faulted in once, by the largest payload

    def write_file(src: Path, dst: Path, tensor_done: TensorDone) -> None:
        with SafetensorsSource(src) as reader:
            cast_from = cast_dtypes(reader.header.tensors) if cast else set()
            with SztWriter(dst, metadata=cast_metadata(reader.metadata, sorted(cast_from)), alignment=alignment,
                           overwrite=overwrite, raw_bytes=sum(stored_sizes(reader.header).values()),
                           **writer_form(at_rest)) as writer:
                for tensor, raw in reader.tensors():
                    dtype = tensor.dtype
                    with reader.reading(tensor):
                        if dtype in cast_from:
                            raw, dtype = cast_to_bf16(raw, dtype), "BF16"
                            cast_counts[tensor.dtype] += 1
                        entry = write_tensor(writer, tensor.name, dtype, tensor.shape, raw, backend=codec,
                                             device=device, buffer=payloads)
                    tensor_done(entry)

    # The codec's ops on one intra-op thread, and the CRC-32s on a thread of their own beside it (codec/gate.py):
    # sharing the cores with PyTorch's intra-op threads too made every elementwise op wait for a descheduled thread
    # (bench/convert.py: 2 cores, 11-13 s against 9 s). The collector paused throughout (_collector.py).
    with cpu_codec.one_intra_op_thread(), collector_paused():
        report = run_pass(source, target, old_suffix=SUFFIX, new_suffix=C.FILE_SUFFIX, read_sizes=read_sizes,
                          write_file=write_file, overwrite=overwrite, progress=progress, description="converting")
    report.cast_from = dict(sorted(cast_counts.items()))
    report.cast = cast
    report.at_rest = at_rest is not None
    return report
