"""Decode tensors of an open .szt file into CPU memory: independent threads, one intra-op thread each, checksums
taken while the bytes are in cache.

What ``load_file(...)`` and ``safe_open(...).get_tensor`` run on the CPU. Five choices, each measured with
``bench/cpu.py`` (``bench/RESULTS.md``):

- **Ranges on independent threads.** Every tensor is cut into ranges of :data:`RANGE_ELEMENTS` (a small tensor is
  one range); up to ``threads`` threads (at most one per :data:`THREAD_BYTES` of output), the caller's included
  (the others kept between calls for a moment: :mod:`.helper_threads`), each take the next range until none is
  left, and each runs its PyTorch ops on one intra-op thread. PyTorch's own intra-op threads fork and join around
  every op, and when another process holds a core every join waits for a descheduled thread: a 2 GB decode went
  from 2.1 s to 11.7 s with two busy processes on 2 cores. Here a descheduled thread only holds back the range it
  is on, so a load never runs slower than on one thread, whatever else runs. (The C call of the fourth choice deals
  its units to threads of its own the same way.)
- **Checksums in cache.** Each range's stored bytes are checksummed just before they are decoded, its decoded bytes
  just after (:meth:`PayloadDecoder.decode_checked`; with the C kernels block by block inside the decode call, while
  in the L1 cache), and the pieces' CRC-32s are joined at the end: separate passes over the stored and the decoded
  bytes read both from memory again (0.37 against 0.26 CPU-seconds per 2.2 GB; in the kernel, 0.16).
- **Reads by the threads, range by range.** Each range of a SplitZip tensor in the in-memory form is decoded
  straight from the file's mapping by one C call that catches the fault of a page the file no longer holds (another
  process truncated it), so that is a TruncatedFileError, never SIGBUS (:func:`mapped_reads`; copying the bytes out
  with ``pread`` first cost a load a sixth of its time). Where the C kernels cannot catch it, each range's stored
  bytes are read (``pread``, through :meth:`SztFile.read`) by the thread that decodes them, just before, into its
  scratch. A tensor stored raw is read straight into its output. A SplitZip payload stored at rest (format 1.1) is
  read whole and inflated first; a raw tensor stored as byte planes (1.2) is read whole and its ranges inflated by
  the threads, straight into its output.
- **The tensors of a file in one C call, on threads of its own.** Where the C kernels read through the mapping
  (:func:`mapped_reads`), every SplitZip tensor in the in-memory form is decoded by one guarded call
  (:class:`_Batch`, :func:`~szformat.codec.cpu.decode_payloads`) that starts its own threads, the GIL released: each
  thread takes the next tensor, or the next range of one of more than a million elements, and per tensor the call
  checksums its stored bytes, checks and patches its escapes, decodes it and checksums its output, with no Python
  between. Through Python's threads each range or batch cost Python holding the GIL, which the threads waited for:
  MiniLM stopped gaining past three threads (``bench/RESULTS.md``, "CPU loading"). Elsewhere a small SplitZip tensor
  is read whole into the thread's scratch (one ``pread``) and decoded by one call (:class:`_WholeJob`), a large one
  range by range.
- **Outputs allocated up front, first written by the threads**, so their page faults are taken in parallel too,
  and faulted in as huge pages where that pays (:mod:`.host_pages`).
  Tensors are taken in groups whose jobs fill about :data:`GROUP_BYTES` besides their outputs (inflated at-rest
  payloads, say), so those buffers never hold a whole checkpoint; the in-memory form is one group (each group ends
  with every thread waiting for its last range: seven groups of 2.2 GB took 188 ms on 16 threads, one 138 ms).

A tensor's CRC-32s are compared once all its ranges are decoded; a mismatch raises and no tensor is returned.
:func:`decode_windows` decodes one tensor the same way a window at a time into a buffer the caller reuses: what
``szconvert verify`` and ``decompress`` run on tensors too large to hold whole.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import torch

from .._lazy import at_rest
from .._reused import ReusedBuffer
from .._runs import runs_within
from ..checksum import crc32, crc32_join
from ..codec.cpu import PayloadDecoder, RangeChecksums, decode_payloads, native_kernels, one_intra_op_thread
from ..codec.cpu_kernel import checksums_in_kernel, native, worth_releasing
from ..errors import PayloadError
from ..format.constants import ENCODING_RAW
from ..format.header import TensorEntry
from ..format.payloads import allocation_errors, decode_entry, inflate_entry, payload_errors
from ..format.reader import SztFile, check_crc, check_decoded_payload, compare_crc
from . import host_pages
from .helper_threads import run_items

__all__ = ["RANGE_ELEMENTS", "around_streams_length", "decode_entries", "decode_windows", "mapped_reads",
           "mapped_streams", "read_around_streams", "spans_read", "windowed"]

RANGE_ELEMENTS = 1 << 23
"""Elements decoded per range: 16 MiB of BF16 out, 12 MiB in, a few ms of work, checksummed block by block inside
the decode call. Each range costs some Python holding the GIL, which the threads wait for one another to take: on
16 threads a 2.2 GB load took 192 ms in ranges of 2 Mi elements, 144 ms in 4 Mi, 131 ms in 8 Mi
(``bench/RESULTS.md``, "CPU loading")."""

MIN_RANGE_ELEMENTS = 1 << 20
"""The fewest elements a range is cut to where ranges of :data:`RANGE_ELEMENTS` would leave threads idle
(:func:`_plan`): 2 MiB of BF16 out, a few hundred microseconds of work against the tens of microseconds of Python
each range costs."""

WHOLE_ELEMENTS = 1 << 21
"""A SplitZip tensor of at most this many elements (and one range) is read whole into a thread's scratch and decoded
by one call (:class:`_WholeJob`); a larger one is decoded range by range from the file's mapping."""

RAW_RANGE_BYTES = 2 * RANGE_ELEMENTS
"""Bytes read per range of a tensor stored raw."""

SCRATCH_BYTES = WHOLE_ELEMENTS * 3 // 2 + 1
"""Bytes of each thread's scratch at first: a small tensor's whole payload (or, where ranges are copied out with
``pread``, a range's ``pk`` and ``sm`` bytes: it grows to hold them)."""

THREAD_BYTES = 16 << 20
"""Raw bytes a decoding thread of Python's is given at least: a load of fewer bytes runs its ranges on fewer threads.
Each range costs Python holding the GIL: MiniLM (45 MB) loaded in 39 ms on one thread of a 16-core host, 28 ms on
four and 42 ms on sixteen, when its tensors were decoded by Python's threads."""

CALL_BYTES = 1 << 30
"""Raw bytes of the tensors decoded by one C call on its own threads (:class:`_Batch`): the call holds the caller
until it returns, so a load of a large checkpoint takes several, between which an interrupt (Ctrl-C) is seen; each
costs its threads' start, tens of microseconds apiece."""

CALL_THREAD_BYTES = 1 << 20
"""Raw bytes each thread of a C call is given at least: starting a thread costs about as much as decoding a tenth of
this, so a file of a few small tensors is not spread over threads that would find nothing left to take."""

WINDOW_RANGE_ELEMENTS = 1 << 21
"""Elements per range of :func:`decode_windows` (4 MiB of BF16 out), and a window one range per thread: the window
is written and read back (checked, written out) while it is in the cache."""

GROUP_BYTES = 256 << 20
"""Bytes the jobs of the tensors decoded together may fill besides their outputs (:func:`_held_bytes`): at-rest
payloads inflated, and the like."""


@dataclass
class _Job:
    """One tensor: where its bytes come from, where they go, and the checksums of its ranges once decoded."""

    file: SztFile
    entry: TensorEntry
    out: torch.Tensor  # flat: bfloat16 for SplitZip, uint8 for raw
    decoder: PayloadDecoder | None  # None: stored raw
    reads: bool  # each range reads its own stored bytes (raw, or SplitZip in the in-memory form)
    checked: bool  # take checksums while decoding
    ranges: list[tuple[int, int]]
    planes: tuple[at_rest.StoredView, list[at_rest.Segment]] | None = None  # a raw tensor stored as byte planes
    origin: int = 0  # the element out[0] holds: a window's first (decode_windows), else 0
    sums: list[RangeChecksums | int | None] = field(init=False)  # per range, once it is done

    def __post_init__(self) -> None:
        self.sums = [None] * len(self.ranges)

    def run(self, k: int) -> None:
        with allocation_errors(self.file.path, self.entry.name):  # this thread's scratch, a raw tensor's ranges
            self._run(k)

    def _run(self, k: int) -> None:
        start, stop = self.ranges[k]
        out = self.out[start - self.origin: stop - self.origin]
        host_pages.populate(out)
        name = self.entry.name
        if self.decoder is None:
            if self.planes is None:
                self.file.read(name, start, stop, out=out)
            else:
                stored, pieces = self.planes
                with payload_errors(self.file.path, name):
                    at_rest.inflate_segments(stored, pieces, memoryview(out.numpy()), start=start,
                                             first=start // self.entry.at_rest.frame_size)
            self.sums[k] = crc32(out.numpy()) if self.checked else None
            return
        streams = None
        if self.reads:
            streams = (mapped_streams(self.file, self.entry, start, stop) if mapped_reads(self.checked)
                       else self._read_streams(start, stop))
        try:
            if self.checked:
                self.sums[k] = self.decoder.decode_checked(start, stop, out, streams=streams)
            else:
                self.decoder.decode(start, stop, out, streams=streams)
        except EOFError:  # a guarded C call could not read a page of the mapping
            raise self.file.mapped_read_error(name) from None

    def _read_streams(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A range's ``pk`` and ``sm`` bytes read into this thread's scratch, to be decoded from the cache."""
        (pk_lo, pk_hi), (sm_lo, sm_hi) = _stream_bytes(self.entry, start, stop)
        scratch = _range_scratch(pk_hi - pk_lo + sm_hi - sm_lo)
        streams = (scratch[: pk_hi - pk_lo], scratch[pk_hi - pk_lo: pk_hi - pk_lo + sm_hi - sm_lo])
        self.file.read(self.entry.name, pk_lo, pk_hi, out=streams[0])
        self.file.read(self.entry.name, sm_lo, sm_hi, out=streams[1])
        return streams


@dataclass
class _WholeJob:
    """A small SplitZip tensor in the in-memory form, where the C kernels are built but do not read through the
    file's mapping (:func:`mapped_reads`; else :class:`_Batch` takes it): its payload read by one call into the
    thread's scratch, its stored bytes' CRC-32 compared before anything decodes them, the payload decoded
    with its escapes by one call, and the decoded bytes' CRC-32 compared while they are in cache."""

    file: SztFile
    entry: TensorEntry
    out: torch.Tensor  # flat bfloat16
    check_stored: bool
    check_decoded: bool
    ranges: tuple[tuple[int, int], ...] = ((0, 0),)  # one unit of work

    def run(self, k: int) -> None:
        entry, path = self.entry, self.file.path
        with allocation_errors(path, entry.name):
            payload = self.file.read(entry.name, out=_range_scratch(entry.length))
        if self.check_stored:
            check_crc(payload, entry.crc32, what="stored bytes", path=path, tensor=entry.name)
        host_pages.populate(self.out)
        decode_entry(path, entry, payload, self.out)
        if self.check_decoded:
            check_crc(self.out.view(torch.uint8), entry.raw_crc32, what="decoded bytes", path=path, tensor=entry.name)


@dataclass
class _Batch:
    """SplitZip tensors of the in-memory form decoded straight from the file's mapping by one guarded C call on threads
    of its own (:func:`~szformat.codec.cpu.decode_payloads`): per tensor its stored bytes' CRC-32, its escape checks,
    its decode and its output's CRC-32, a tensor of more than a million elements in ranges the threads share, with no
    read into a scratch and no Python between them; on enough threads each drops the pages of the mapping it read
    from the page tables as it goes, where the close would unmap them all on one thread (19 ms of a 2.2 GB load that
    took 77-87 ms on 16 threads: ``bench/RESULTS.md``, "CPU loading"; ``cpu_kernel.worth_releasing``). Made straight
    from the entries, with none of a :class:`_Job`'s bookkeeping: through one job each, MiniLM's 102 small tensors
    cost 20 us of Python apiece, as much as their decode (``bench/RESULTS.md``, "CPU loading")."""

    file: SztFile
    entries: list[TensorEntry]
    given: list[torch.Tensor | None]  # per entry, the caller's output (flat uint8, :func:`_given_output`) or None
    check_stored: list[bool]
    check_decoded: bool
    outs: list[torch.Tensor] = field(default_factory=list)  # per entry, once run (:func:`_whole_outputs`)

    def run(self, threads: int) -> None:
        """Decode on up to ``threads`` threads, at most one per :data:`CALL_THREAD_BYTES` of output."""
        file, entries = self.file, self.entries
        self.outs = _whole_outputs(file, entries, self.given)
        payloads = [(stored, entry.layout, entry.codebook, out)
                    for stored, entry, out in zip(file.mapped_payloads(entries), entries, self.outs)]
        threads = min(threads, -(-sum(entry.raw_length for entry in entries) // CALL_THREAD_BYTES)) or 1
        release = worth_releasing(threads, sum(entry.length for entry in entries))
        try:
            results = decode_payloads(payloads, checksums=self.check_decoded or any(self.check_stored),
                                      populate=host_pages.populated_size(), threads=threads, release=release)
        except EOFError as e:
            raise file.mapped_read_error(entries[e.item].name) from None
        for entry, check_stored, (stored, decoded, error) in zip(entries, self.check_stored, results):
            check_decoded_payload(entry, stored, decoded, error, path=file.path, check_stored=check_stored,
                                  check_decoded=self.check_decoded)


def _batches(file: SztFile, entries: Sequence[TensorEntry], batched: Sequence[int],
             outs: Sequence[torch.Tensor | None] | None, check_stored: Sequence[bool],
             check_decoded: bool) -> list[tuple[list[int], _Batch]]:
    """The tensors ``batched`` (indices of ``entries``, :func:`_batched`), cut into :class:`_Batch` es of
    :data:`CALL_BYTES` of output, each with the indices it decodes; into ``outs`` (by index) where given, each
    checked to fit here (:func:`_given_output`), before any batch runs."""
    given = {i: _given_output(entries[i], outs[i]) for i in batched if outs is not None and outs[i] is not None}
    return [(run, _Batch(file, [entries[i] for i in run], [given.get(i) for i in run],
                         [check_stored[i] for i in run], check_decoded))
            for run in runs_within(batched, lambda i: entries[i].raw_length, CALL_BYTES)]


_thread_scratch = threading.local()
_CORES = os.cpu_count() or 1
"""The host's cores, read once: ``os.cpu_count()`` reads ``/sys`` at every call (6 us, a tenth of a small tensor's
load through vLLM's loader, which asks for each tensor alone)."""


def mapped_reads(checked: bool) -> bool:
    """Whether ranges of the in-memory form are decoded straight from the file's mapping: where the C kernels catch
    a fault on a mapped page (POSIX) and, for checked ranges, take the checksums themselves. Elsewhere each range is
    first copied out with ``pread``, the copy a load spends a sixth of its time on (``bench/RESULTS.md``, "CPU
    loading")."""
    return native_kernels() and native.guards_mapped_reads() and (not checked or checksums_in_kernel())


def mapped_streams(file: SztFile, entry: TensorEntry, start: int, stop: int) -> tuple[memoryview, memoryview]:
    """The ``pk`` and ``sm`` bytes of elements ``[start, stop)`` of a SplitZip tensor in the in-memory form, as
    views of the file's mapping: for the C kernels' guarded calls only (:func:`mapped_reads`)."""
    (pk_lo, pk_hi), (sm_lo, sm_hi) = _stream_bytes(entry, start, stop)
    return file.mapped(entry.name, pk_lo, pk_hi), file.mapped(entry.name, sm_lo, sm_hi)


def _stream_bytes(entry: TensorEntry, start: int, stop: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The stored byte ranges of the ``pk`` and ``sm`` bytes that decoding elements ``[start, stop)`` reads."""
    layout = entry.layout
    return ((layout.off_pk + start // 2, layout.off_pk + (stop + 1) // 2),
            (layout.off_sm + start, layout.off_sm + stop))


def read_around_streams(file: SztFile, entry: TensorEntry, into: torch.Tensor) -> torch.Tensor:
    """Read the stored bytes of a SplitZip tensor in the in-memory form that are not its ``pk`` and ``sm`` streams
    (the padding between them, the escape streams) one after the other into ``into`` (flat uint8 of
    :func:`around_streams_length` bytes) and return it: what its decoder checks and patches escapes from
    (:meth:`PayloadDecoder.around_streams`), while the streams are read range by range."""
    cursor = 0
    for lo, hi in _around_streams(entry):
        file.read(entry.name, lo, hi, out=into[cursor: cursor + hi - lo])
        cursor += hi - lo
    return into


def around_streams_length(entry: TensorEntry) -> int:
    """Bytes of a SplitZip tensor in the in-memory form around its ``pk`` and ``sm`` streams: a few kilobytes."""
    return sum(hi - lo for lo, hi in _around_streams(entry))


def spans_read(entry: TensorEntry, start: int, stop: int) -> list[tuple[int, int]]:
    """The stored byte ranges that decoding elements ``[start, stop)`` of a SplitZip tensor in the in-memory form
    from the mapping reads (:func:`mapped_streams`, :func:`read_around_streams`): what a check of them covers."""
    return [*_stream_bytes(entry, start, stop), *_around_streams(entry)]


def _around_streams(entry: TensorEntry) -> tuple[tuple[int, int], tuple[int, int]]:
    layout = entry.layout
    return (layout.off_pk + layout.n_pairs, layout.off_sm), (layout.off_sm + layout.n, entry.length)


def _range_scratch(nbytes: int) -> torch.Tensor:
    """This thread's buffer for one range's stored bytes or a small tensor's payload (:data:`SCRATCH_BYTES`): they
    are read into it and decoded from it while in the cache, instead of travelling through memory in a buffer of the
    whole payload, and it is made once per thread (fresh pages cost as much as the reads into them)."""
    buffer = getattr(_thread_scratch, "buffer", None)
    if buffer is None or buffer.numel() < nbytes:
        buffer = _thread_scratch.buffer = torch.empty(max(nbytes, SCRATCH_BYTES), dtype=torch.uint8)
    return buffer[:nbytes]


def decode_entries(file: SztFile, entries: Sequence[TensorEntry], *, check_stored: Sequence[bool],
                   check_decoded: bool, threads: int | None = None,
                   outs: Sequence[torch.Tensor | None] | None = None, as_bytes: bool = False) -> list[torch.Tensor]:
    """The tensors ``entries`` of ``file``, decoded into new CPU tensors of their dtype and shape (or into ``outs``).

    Args:
        file (`SztFile`): the open file.
        entries (sequence of `TensorEntry`): tensors of ``file``, in the order to return them.
        check_stored (sequence of `bool`): per entry, whether to check the CRC-32 of its stored bytes.
        check_decoded (`bool`): whether to check the CRC-32 of every SplitZip tensor's decoded bytes.
        threads (`int`, *optional*): threads to decode on, the caller's included; by default PyTorch's intra-op
            thread count (``torch.get_num_threads()``), at most the host's cores, and at most one per
            :data:`CALL_THREAD_BYTES` of raw bytes in the C call, one per :data:`THREAD_BYTES` on Python's ranges.
        outs (sequence of `torch.Tensor` or `None`, *optional*): per entry, a contiguous CPU tensor of its raw
            size to decode into (the parameter it is loaded into), or ``None`` for a new one.
        as_bytes (`bool`): return each tensor's raw bytes (flat uint8) instead, for a caller that writes or checks
            them: every dtype of the format then decodes, those this torch has no type for included.

    Raises:
        DecodeRouteError: this torch has no type for a tensor's dtype (unless ``as_bytes``), before any decode.
        ChecksumMismatchError: stored or decoded bytes differ from their checksums.
        PayloadError: an escape stream is inconsistent (and the stored bytes match their checksum, if checked).
    """
    dtypes = None if as_bytes else [entry.torch_dtype(file.path) for entry in entries]
    tensors: list[torch.Tensor] = []
    buffer = ReusedBuffer()
    call_threads = _thread_count(threads)
    threads, step = _plan(entries, call_threads)
    for group in _groups(entries):
        batched = [i for i in group if _batched(entries[i], check_stored[i] or check_decoded)]
        ranged = sorted(set(group) - set(batched))
        sizes = [_read_length(entries[i]) for i in ranged]
        with allocation_errors(file.path, entries[group[0]].name):
            payloads = iter(buffer.take(sum(sizes)).split(sizes))
        with one_intra_op_thread():  # a job's own copies (a payload at rest inflated, its verbatim streams) are many
            jobs = {i: _job(file, entries[i], check_stored[i], check_decoded, next(payloads),
                            None if outs is None else outs[i], step) for i in ranged}
        batches = _batches(file, entries, batched, outs, check_stored, check_decoded)
        units = [(job, k) for job in jobs.values() for k in range(len(job.ranges))]
        if units:
            _run(units, max(1, min(threads, len(units))))
        for _, batch in batches:
            batch.run(call_threads)
        decoded = {i: out for run, batch in batches for i, out in zip(run, batch.outs)}
        for i, job in jobs.items():
            if isinstance(job, _Job):  # a whole job compared its checksums as it ran
                _check(file.path, job, check_stored[i], check_decoded)
            decoded[i] = job.out
        tensors += [_returned(decoded[i], entries[i], None if dtypes is None else dtypes[i]) for i in group]
    return tensors


def _plan(entries: Sequence[TensorEntry], threads: int) -> tuple[int, int | None]:
    """The threads Python's ranges decode on, and the elements per range of the SplitZip tensors decoded range by
    range (``None``: :data:`RANGE_ELEMENTS`).

    Threads: ``threads`` (the caller's, :func:`_thread_count`), at most one per :data:`THREAD_BYTES` of output, since
    each range costs Python holding the GIL. Ranges: :data:`RANGE_ELEMENTS`. Except for a tensor decoded alone
    (``safe_open``'s ``get_tensor``, vLLM's loader, one tensor at a time), which takes every thread, a range each,
    ranges no shorter than :data:`MIN_RANGE_ELEMENTS` (a call of several tensors spreads its ranges over the
    threads already: halving them for MiniLM, whose embedding is half its elements, changed nothing measurable).
    """
    if len(entries) != 1 or not _ranged(entries[0]):
        return min(threads, -(-sum(e.raw_length for e in entries) // THREAD_BYTES)), None
    n = entries[0].layout.n
    share = -(-n // threads)
    step = min(RANGE_ELEMENTS, max(MIN_RANGE_ELEMENTS, share + share % 2))
    return min(threads, -(-n // step)), step


def _ranged(entry: TensorEntry) -> bool:
    """Whether a tensor is decoded range by range: SplitZip, and not taken whole (:func:`_whole`)."""
    return entry.encoding != ENCODING_RAW and not _whole(entry)


def _thread_count(asked: int | None) -> int:
    """The threads a decode runs on, the caller's included: ``asked``, by default PyTorch's intra-op thread count,
    at most the host's cores."""
    return min(asked or torch.get_num_threads(), _CORES)


def windowed(entry: TensorEntry) -> bool:
    """Whether :func:`decode_windows` decodes a tensor: a SplitZip tensor in the in-memory form, whose ranges read
    their own stored bytes (one stored at rest is inflated whole first, which a window does not bound; the bytes of
    a raw tensor need no decode, only their checksum)."""
    return entry.encoding != ENCODING_RAW and entry.at_rest is None


def decode_windows(file: SztFile, entry: TensorEntry, buffer: torch.Tensor, *,
                   threads: int | None = None) -> Iterator[torch.Tensor]:
    """Yield the raw bytes of a tensor :func:`windowed` says this takes, in order, a window at a time: each window
    decoded into ``buffer`` (flat uint8, at least 4 bytes) by its ranges on the threads, as :func:`decode_entries`
    decodes a tensor, and yielded as a flat uint8 view, valid until the next is asked for. Both CRC-32s are compared
    after the last window (the generator raises then, so a consumer writing an atomic output discards it); an
    escape stream that breaks a rule raises before the first.

    Raises:
        ChecksumMismatchError: stored or decoded bytes differ from their checksums.
        PayloadError: an escape stream is inconsistent (and the stored bytes match their checksum).
    """
    if not windowed(entry):
        raise ValueError(f"{entry.name}: only a SplitZip tensor in the in-memory form is decoded in windows")
    elements, room = entry.layout.n, buffer.numel() // 2
    threads = _thread_count(threads)
    step = min(WINDOW_RANGE_ELEMENTS, room) // 2 * 2  # even: a range of SplitZip pairs starts on a pair
    per_window = min(room // step, threads) * step if step else 0  # a range per thread: the window stays in cache
    if per_window == 0:
        raise ValueError(f"a window needs a buffer of at least 4 bytes, got {buffer.numel()}")
    payload = torch.empty(around_streams_length(entry), dtype=torch.uint8)
    with allocation_errors(file.path, entry.name):
        job = _new_job(file, entry, True, True, payload, buffer[: 2 * per_window], range_elements=step)
    per_range = per_window // step
    for window, first in enumerate(range(0, max(elements, 1), per_window)):  # an empty tensor: one empty window
        job.origin = first
        units = [(job, k) for k in range(window * per_range, min(len(job.ranges), (window + 1) * per_range))]
        _run(units, len(units))
        yield buffer[: 2 * (min(first + per_window, elements) - first)]
    _check(file.path, job, True, True)


def _groups(entries: Sequence[TensorEntry]) -> list[list[int]]:
    """Indices of ``entries`` in order, cut where the bytes their jobs hold (:func:`_held_bytes`) pass
    :data:`GROUP_BYTES`: each group ends with every thread waiting for the last of its ranges, so a checkpoint in the
    in-memory form, whose jobs hold next to nothing, is one group."""
    return runs_within(range(len(entries)), lambda i: _held_bytes(entries[i]), GROUP_BYTES)


def _held_bytes(entry: TensorEntry) -> int:
    """Memory a tensor's job fills besides its output while its group runs: the stored bytes of a tensor stored at
    rest (read whole) and what they inflate to; of a SplitZip tensor in the in-memory form read range by range,
    the bytes around its streams (padding, escape streams); nothing for a tensor stored raw (read into its output)
    or read whole into a thread's scratch."""
    if entry.at_rest is not None:
        return entry.length + (entry.memory_length if entry.encoding != ENCODING_RAW else 0)
    return _read_length(entry)


def _read_length(entry: TensorEntry) -> int:
    """Bytes of the group's buffer a tensor takes: the bytes around its streams when they are read range by range (a
    SplitZip payload in the in-memory form, unless it is read whole), else none."""
    return around_streams_length(entry) if _ranged(entry) and entry.at_rest is None else 0


def _whole(entry: TensorEntry) -> bool:
    """Whether a tensor is decoded by one :class:`_WholeJob`: a SplitZip payload of one range in the in-memory form
    that fits a thread's scratch, where the C kernels are built."""
    return (native_kernels() and entry.encoding != ENCODING_RAW and entry.at_rest is None
            and entry.layout.n <= min(RANGE_ELEMENTS, WHOLE_ELEMENTS) and entry.length <= SCRATCH_BYTES)


def _batched(entry: TensorEntry, checked: bool) -> bool:
    """Whether a tensor is decoded in a :class:`_Batch`: a SplitZip payload in the in-memory form, where the C kernels
    read through the mapping (:func:`mapped_reads`)."""
    return windowed(entry) and mapped_reads(checked)


def _given_output(entry: TensorEntry, out: torch.Tensor) -> torch.Tensor:
    """``out``, a tensor the caller decodes ``entry`` into, as flat uint8, once it is checked to fit."""
    if out.device.type != "cpu" or not out.is_contiguous() or out.numel() * out.element_size() != entry.raw_length:
        raise ValueError(f"{entry.name}: decoding into a tensor needs a contiguous CPU tensor of "
                         f"{entry.raw_length} bytes, got {tuple(out.shape)} {out.dtype} on {out.device}")
    out = out.reshape(-1).view(torch.uint8)
    host_pages.advise_huge_pages(out)
    return out


def _whole_outputs(file: SztFile, entries: Sequence[TensorEntry], given: Sequence[torch.Tensor | None]
                   ) -> list[torch.Tensor]:
    """Where a :class:`_Batch` decodes each of ``entries``: the output given (checked by :func:`_given_output`),
    as flat bfloat16, or a new bfloat16 tensor of the entry's shape, returned as it is (:func:`_returned`). A failed
    allocation names the tensor it was for; the check wraps the batch, not each tensor (a tenth of its output's
    cost)."""
    outs: list[torch.Tensor] = []
    try:
        for entry, out in zip(entries, given):
            outs.append(host_pages.empty(entry.shape, torch.bfloat16) if out is None else out.view(torch.bfloat16))
    except Exception:
        with allocation_errors(file.path, entries[len(outs)].name):
            raise
    return outs


def _returned(out: torch.Tensor, entry: TensorEntry, dtype: torch.dtype | None) -> torch.Tensor:
    """A decoded output as :func:`decode_entries` returns it: its raw bytes (flat uint8) where ``dtype`` is None,
    else of ``dtype`` and the entry's shape; the output itself where it is that already (the two views otherwise
    made cost a tenth of a small tensor's decode)."""
    if dtype is None:
        return out.reshape(-1).view(torch.uint8)
    if out.dtype == dtype and out.shape == entry.shape:
        return out
    return out.view(dtype).reshape(entry.shape)


def _job(file: SztFile, entry: TensorEntry, check_stored: bool, check_decoded: bool, payload: torch.Tensor,
         out: torch.Tensor | None = None, range_elements: int | None = None) -> _Job | _WholeJob:
    """A tensor's output, its ranges (of ``range_elements`` for the tensor :func:`_plan` cuts, else the defaults),
    and for SplitZip its decoder over a payload buffer: in the in-memory form the bytes around the streams (padding,
    escape streams) read now into ``payload`` (its part of the buffer the groups of one call share: fresh pages for
    every tensor cost as much as reading into them) and the streams left to the ranges; at rest, the stored bytes
    read whole, checked, and inflated."""
    if out is not None:
        out = _given_output(entry, out)
    with allocation_errors(file.path, entry.name):
        return _new_job(file, entry, check_stored, check_decoded, payload, out, range_elements=range_elements)


def _new_job(file: SztFile, entry: TensorEntry, check_stored: bool, check_decoded: bool,
             payload: torch.Tensor, into: torch.Tensor | None, *,
             range_elements: int | None = None) -> _Job | _WholeJob:
    """The job of :func:`_job`, decoding into ``into`` (flat uint8) when it is given. ``range_elements`` (a SplitZip
    tensor in the in-memory form, :func:`decode_windows`): ranges of that many elements instead of
    :data:`RANGE_ELEMENTS`, and a :class:`_Job` even for a tensor :func:`_whole` would take whole."""
    if _whole(entry) and range_elements is None:
        out = into.view(torch.bfloat16) if into is not None else host_pages.empty(entry.layout.n, torch.bfloat16)
        return _WholeJob(file, entry, out, check_stored, check_decoded)
    if entry.encoding == ENCODING_RAW and entry.at_rest is None:
        out = into if into is not None else host_pages.empty(entry.length, torch.uint8)
        return _Job(file, entry, out, None, True, check_stored, _ranges(entry.length, RAW_RANGE_BYTES))
    if entry.byte_planes:  # stored bytes checked whole, frames inflated range by range
        stored = file.read(entry.name)
        if check_stored:
            check_crc(stored, entry.crc32, what="stored bytes", path=file.path, tensor=entry.name)
        frame = entry.at_rest.frame_size
        out = into if into is not None else host_pages.empty(entry.raw_length, torch.uint8)
        return _Job(file, entry, out, None, False, check_decoded,
                    _ranges(entry.raw_length, -(-RAW_RANGE_BYTES // frame) * frame),
                    (at_rest.StoredView(stored), entry.segments()))
    layout, reads = entry.layout, entry.at_rest is None
    if reads:
        read_around_streams(file, entry, payload)
    else:
        stored = file.read(entry.name)
        if check_stored:
            check_crc(stored, entry.crc32, what="stored bytes", path=file.path, tensor=entry.name)
        payload = inflate_entry(file.path, entry, stored)
        del stored
    try:
        decoder = (PayloadDecoder.around_streams(payload, layout, entry.codebook) if reads
                   else PayloadDecoder(payload, layout, entry.codebook))
    except ValueError as e:
        if check_stored and reads:  # corrupt bytes are reported as such, whatever they broke
            check_crc(file.read(entry.name), entry.crc32, what="stored bytes", path=file.path, tensor=entry.name)
        raise PayloadError(str(e), path=file.path, tensor=entry.name) from None
    out = into.view(torch.bfloat16) if into is not None else host_pages.empty(layout.n, torch.bfloat16)
    return _Job(file, entry, out, decoder, reads, (check_stored and reads) or check_decoded,
                _ranges(layout.n, range_elements or RANGE_ELEMENTS))


def _ranges(size: int, step: int) -> list[tuple[int, int]]:
    return [(start, min(start + step, size)) for start in range(0, size, step)] or [(0, 0)]


def _run(units: list[tuple[_Job, int]], threads: int) -> None:
    """Run every unit on ``threads`` threads (the caller's and helpers, :mod:`.helper_threads`), each taking the next
    unit until none is left; the first error stops them all and is raised here."""
    run_items(len(units), lambda i: units[i][0].run(units[i][1]), threads)


def _check(path: Path, job: _Job, check_stored: bool, check_decoded: bool) -> None:
    """Compare a decoded tensor's joined CRC-32s with its header's (stored bytes read at rest: checked already)."""
    entry = job.entry
    if job.decoder is None:
        if job.checked:  # the stored bytes of a raw tensor read range by range, or the bytes its planes inflated to
            compare_crc(crc32_join(zip(job.sums, (stop - start for start, stop in job.ranges))),
                        entry.crc32 if job.reads else entry.raw_crc32,
                        what="stored bytes" if job.reads else "decoded bytes", path=path, tensor=entry.name)
        return
    sums = [(start, stop, s) for (start, stop), s in zip(job.ranges, job.sums)]
    if check_stored and job.reads:
        compare_crc(job.decoder.stored_crc(sums), entry.crc32, what="stored bytes", path=path, tensor=entry.name)
    if check_decoded:
        compare_crc(crc32_join((s.raw, 2 * (stop - start)) for start, stop, s in sums), entry.raw_crc32,
                    what="decoded bytes", path=path, tensor=entry.name)
