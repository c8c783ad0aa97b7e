"""SplitZip on the GPU: Triton kernels that decode and encode bit for bit as :mod:`szformat.codec.cpu`.

Importing this package needs neither Triton nor a GPU; the first use of a function below imports Triton and raises
:class:`~szformat.errors.DecodeRouteError` if it is missing or older than :data:`MIN_TRITON`. :func:`is_available`
says beforehand, :func:`triton_missing` why not.

Decode (nothing waits on the host; everything is enqueued on ``stream``, the current stream by default):

* ``decode(payload, layout, codebook, *, out=None, stream=None) -> Tensor``: one payload (flat uint8 CUDA tensor)
  into a flat bfloat16 tensor (``out`` or a new one). Two launches: dense pass, then escapes (if any).
* ``decode_in_place(buffer, layout, codebook, *, scratch=None, stream=None) -> Tensor``: ``buffer`` is a uint8
  slot sized for the raw tensor whose leading ``layout.comp_bytes`` hold the payload; the payload is copied to a
  :class:`DecodeScratch` and the tensor expanded over the slot. Returns the bfloat16 view of the slot.
* ``build_batch_table(entries, *, device) -> BatchTable`` with ``entries`` of
  ``(layout, codebook, payload_offset, output_offset)`` (payload offsets: multiples of 16 bytes; output offsets:
  multiples of 8 elements), then ``decode_batch(payloads, table, *, out=None, stream=None) -> Tensor``: every tensor
  of the batch from one concatenated payload buffer into one bfloat16 output buffer, in at most two launches
  whatever the tensor count (``table.launches``). ``decode_batch_at(payloads, table, base, *, stream=None)`` does
  the same for outputs that are separate tensors of one address range (an offloading arena's weights): output
  offsets count elements from ``base``, the tensor at the lowest output.

Byte planes (the at-rest form of raw tensors, .szt 1.2):

* ``join_planes(planes, out, itemsize, frame_size, sign_last, *, stream=None)``: frames of byte planes (flat
  uint8, as the device inflater lays them out) joined into the elements ``out`` (flat uint8), in one launch.
* ``copy_ranges(source, out, sources, targets, lengths, max_length, *, stream=None)``: many byte ranges copied in
  one launch (the verbatim pieces of a transfer stored at rest).

Encode (one host synchronisation per tensor, to learn the codebook and ``n_esc`` that size the payload):

* ``encode(x, codebook=None, *, stream=None) -> (payload, layout, codebook)``: the same triple as
  :func:`szformat.codec.cpu.encode`, with ``payload`` on the GPU and byte-identical to the CPU encoder's.
* ``encode_to_host(x, codebook=None, *, device=None) -> (payload, layout, codebook)``: the same with the payload in
  host memory, for converters (a CPU ``x`` is copied to the GPU first).

Sizes are run-time arguments (one compilation serves every tensor), index arithmetic is 64-bit wherever a product
can pass 2**31, and any ``n`` works, 0 and odd sizes included. Under ``TRITON_INTERPRET=1`` the same kernels run on
CPU tensors, which is how the tests check them without a GPU.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Any

from ..._install import install_hint
from ..._versions import installed_version, parse_version

__all__ = [
    "BatchTable", "DecodeScratch", "MIN_TRITON", "build_batch_table", "decode", "decode_batch", "decode_batch_at",
    "decode_in_place", "encode", "encode_to_host", "is_available", "join_planes", "copy_ranges", "triton_missing",
]

MIN_TRITON = "3.2"
"""The oldest Triton the kernels run on (the ``gpu`` extra asks for it). torch 2.4 and 2.5 pin Triton 3.0 and 3.1,
whose interpreter loses a ``tl.constexpr`` argument on its way into the helpers the kernels call: with those the GPU
codec refuses, naming the version (the staging pool's and the offload routes' ``"auto"`` decode on the CPU)."""

_HOMES = {
    "decode": "_decode", "decode_in_place": "_decode", "DecodeScratch": "_decode",
    "BatchTable": "_batch", "build_batch_table": "_batch", "decode_batch": "_batch", "decode_batch_at": "_batch",
    "encode": "_encode", "encode_to_host": "_encode", "join_planes": "_planes", "copy_ranges": "_planes",
}


def interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1``: kernels then run on the CPU, on CPU tensors (for tests without a GPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_missing() -> str | None:
    """Why the kernels cannot run in this environment (Triton not installed, or older than :data:`MIN_TRITON`), or
    ``None``. Reads the installed version without importing Triton."""
    if importlib.util.find_spec("triton") is None:
        return f"Triton is not installed ({install_hint('gpu')})"
    version = installed_version("triton")
    try:
        too_old = version is not None and parse_version(version) < parse_version(MIN_TRITON)
    except ValueError:  # not a version number: taken as a build of its own
        too_old = False
    if too_old:  # (no version: another distribution provides the module, as pytorch-triton does)
        return (f"Triton {version} is older than {MIN_TRITON}, the oldest the GPU codec runs on (torch 2.6 and "
                f"later install a newer one; {install_hint('gpu')})")
    return None


def is_available() -> bool:
    """True when a Triton the kernels run on is installed (:func:`triton_missing`) and either a CUDA device is
    visible or the Triton interpreter is on."""
    if triton_missing() is not None:
        return False
    import torch

    return torch.cuda.is_available() or interpreting()


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{home}", __name__), name)
