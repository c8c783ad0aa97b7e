"""Checkpoint tensors handed out before they are decoded, so that decoding writes where the weight goes.

vLLM's weight loaders take each checkpoint tensor, narrow it to the rows their rank keeps (column-parallel
projections, embeddings, output heads) and copy it into a parameter. A tensor decoded up front is written twice
(decoded into fresh memory, then copied) and whole on every rank. A :class:`DeferredTensor` has the checkpoint
tensor's shape and dtype on the ``meta`` device and no data: ``narrow`` along its first dimension gives another one
over fewer rows (and along the second of a matrix, over fewer columns: a row-parallel projection's shard), and
``dst.copy_(deferred)`` into a contiguous CPU tensor of its dtype and shape decodes those rows straight into ``dst``
(columns: only those columns decoded, straight from the file's mapping; where the codec cannot split a row there,
whole rows a block at a time through a scratch that stays in cache, the columns copied out). Any
other operation decodes it first (once; the result is kept) and runs on real data, so a loader that does something
else (a transpose, a cast, a concatenation) gets exactly what it would have got.

Checksums: a copy of the whole tensor checks the stored and the decoded bytes as ``load_file`` does; a copy of some
rows checks the stored bytes (read whole the first time) and decodes only those rows, whose bytes have no checksum
of their own. Nothing is decoded twice: the counters say how many raw bytes were decoded against the checkpoint's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map

from ..format.header import TensorEntry
from ..loading import host_pages
from ..loading.host_reader import HostReader, rows_per_block

__all__ = ["DeferredTensor", "DecodeCounter"]


class DecodeCounter:
    """Raw bytes decoded, and the raw bytes of the tensors handed out (counted by whoever hands them out)."""

    def __init__(self) -> None:
        self.decoded = 0
        self.handed_out = 0


_METADATA = frozenset({
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.nelement, torch.Tensor.element_size,
    torch.Tensor.stride, torch.Tensor.is_contiguous, torch.Tensor.is_floating_point, torch.Tensor.__len__,
    torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.ndim.__get__,
    torch.Tensor.requires_grad.__get__, torch.Tensor.layout.__get__,
})
"""Functions that read only a tensor's metadata: answered from the ``meta`` tensor, nothing decoded."""


class DeferredTensor(torch.Tensor):
    """Rows ``[start, stop)`` of the first dimension of checkpoint tensor ``entry`` (and, of a matrix, columns
    ``cols``), not decoded yet.

    Args:
        reader (`HostReader`): reads and decodes the tensor's file on the CPU (keeps it open).
        entry (`TensorEntry`): the tensor.
        counter (`DecodeCounter`): where the bytes decoded are counted.
    """

    _reader: HostReader
    _entry: TensorEntry
    _rows: tuple[int, int]
    _cols: tuple[int, int] | None
    _counter: DecodeCounter
    _value: torch.Tensor | None

    @staticmethod
    def __new__(cls, reader: HostReader, entry: TensorEntry, counter: DecodeCounter,
                rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None) -> "DeferredTensor":
        dtype = entry.torch_dtype(reader.file.path)
        rows = rows if rows is not None else (0, entry.shape[0] if entry.shape else 1)
        shape = (rows[1] - rows[0], *entry.shape[1:]) if entry.shape else ()
        if cols is not None:
            shape = (shape[0], cols[1] - cols[0])
        tensor = torch.Tensor._make_subclass(cls, torch.empty(shape, dtype=dtype, device="meta"))
        tensor._reader, tensor._entry, tensor._rows, tensor._cols = reader, entry, rows, cols
        tensor._counter, tensor._value = counter, None
        return tensor

    def __repr__(self) -> str:  # noqa: D105 - what a log line or an error message shows, without decoding
        return (f"DeferredTensor({self._entry.name!r}, rows={self._rows}, cols={self._cols}, "
                f"shape={tuple(self.shape)}, dtype={self.dtype})")

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func in (torch.Tensor.narrow, torch.narrow) and type(args[0]) is cls:
            narrowed = args[0]._narrow(*args[1:], **kwargs)
            if narrowed is not None:
                return narrowed
        if func is torch.Tensor.copy_ and len(args) == 2 and type(args[1]) is cls and args[1]._decode_into(args[0]):
            return args[0]
        args, kwargs = tree_map(_materialized, (args, kwargs))
        return func(*args, **kwargs)

    def _narrow(self, dim: int, start: int, length: int) -> "DeferredTensor | None":
        """Rows (``dim`` 0) or, of a matrix, columns (``dim`` 1) ``[start, start + length)`` of this one, when they
        lie inside it; ``None`` otherwise (it is decoded first, and torch narrows, or refuses, as it would)."""
        if not all(isinstance(x, int) for x in (dim, start, length)) or self._value is not None:
            return None
        ndim = len(self._entry.shape)
        dim = dim + ndim if dim < 0 else dim
        if ndim == 0 or dim not in ((0, 1) if ndim == 2 else (0,)) or not 0 <= start <= start + length:
            return None
        rows, cols = self._rows, self._cols if self._cols is not None else (0, self._entry.shape[-1])
        first, stop = (rows, cols)[dim]
        if start + length > stop - first:
            return None
        narrowed = (first + start, first + start + length)
        if dim == 0:
            return DeferredTensor(self._reader, self._entry, self._counter, narrowed, self._cols)
        return DeferredTensor(self._reader, self._entry, self._counter, rows, narrowed)

    def _decode_into(self, target: torch.Tensor) -> bool:
        """Decode straight into ``target`` where it is a contiguous CPU tensor of this one's dtype and shape."""
        with torch._C.DisableTorchFunctionSubclass():
            fits = (isinstance(target, torch.Tensor) and not isinstance(target, DeferredTensor)
                    and self._value is None and target.device.type == "cpu" and target.dtype == self.dtype
                    and target.shape == self.shape and target.is_contiguous() and not target.requires_grad)
        if not fits:
            return False
        self._decode(target)
        return True

    def _decode(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """These rows (and columns) decoded, into ``out`` when given (else a new tensor)."""
        entry, (start, stop) = self._entry, self._rows
        if self._cols is not None:
            return self._decode_columns(torch.empty(self.shape, dtype=self.dtype) if out is None else out)
        if not entry.shape or (start, stop) == (0, entry.shape[0]):
            (value,) = self._reader.tensors([entry.name], None if out is None else [out])
        else:
            value = self._reader.rows(entry, start, stop, out)
        self._counter.decoded += value.numel() * value.element_size()
        return value

    def _decode_columns(self, out: torch.Tensor) -> torch.Tensor:
        """Columns ``cols`` of these rows into ``out``: only those columns decoded where the codec can
        (:meth:`HostReader.columns`), else whole rows decoded a block at a time into a scratch that stays in cache
        and the columns copied out of it (no tensor of the whole matrix is made)."""
        (start, stop), (first, last) = self._rows, self._cols
        if self._reader.columns_decodable(self._entry, self._cols):
            self._reader.columns(self._entry, self._rows, self._cols, out)
            self._counter.decoded += out.numel() * out.element_size()
            return out
        host_pages.advise_huge_pages(out)  # written whole, block by block
        host_pages.populate(out)
        step = rows_per_block(self._entry)
        scratch = torch.empty(min(step, stop - start), self._entry.shape[1], dtype=self.dtype)
        for row in range(start, stop, step):
            block = scratch[: min(step, stop - row)]
            self._reader.rows(self._entry, row, row + block.shape[0], block)
            out[row - start: row - start + block.shape[0]].copy_(block[:, first:last])
            self._counter.decoded += block.numel() * block.element_size()
        return out

    def materialized(self) -> torch.Tensor:
        """These rows as a real CPU tensor (decoded the first time)."""
        if self._value is None:
            self._value = self._decode()
        return self._value


def _materialized(value: Any) -> Any:
    return value.materialized() if isinstance(value, DeferredTensor) else value
