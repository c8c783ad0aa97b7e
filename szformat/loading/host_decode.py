"""Decode tensors of an open .szt file into CPU memory: independent threads, one intra-op thread each, checksums
taken while the bytes are in cache.

What ``load_file(...)`` and ``safe_open(...).get_tensor`` run on the CPU. Three choices, each measured with
``tools/bench_cpu.py`` (``bench/RESULTS.md``):

- **Ranges on independent threads.** Every tensor is cut into ranges of :data:`RANGE_ELEMENTS` (a small tensor is
  one range); up to ``threads`` threads, the caller's included, each take the next range until none is left, and
  each runs its PyTorch ops on one intra-op thread. PyTorch's own intra-op threads fork and join around every op,
  and when another process holds a core every join waits for a descheduled thread: a 2 GB decode went from 2.1 s
  to 11.7 s with two busy processes on 2 cores. Here a descheduled thread only holds back the range it is on, so a
  load never runs slower than on one thread, whatever else runs.
- **Checksums in cache.** Each range's stored bytes are checksummed just before they are decoded, its decoded bytes
  just after (:meth:`PayloadDecoder.decode_checked`), and the pieces' CRC-32s are joined at the end: separate passes
  over the stored and the decoded bytes read both from memory again, which cost a quarter of the load.
- **Outputs allocated up front, first written by the threads**, so their page faults are taken in parallel too.

A tensor's CRC-32s are compared once all its ranges are decoded; a mismatch raises and no tensor is returned.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from ..checksum import crc32, crc32_join, tensor_crc32
from ..codec.cpu import PayloadDecoder, RangeChecksums, one_intra_op_thread
from ..errors import ChecksumMismatchError, PayloadError
from ..format.constants import ENCODING_RAW
from ..format.header import TensorEntry
from ..format.reader import SztFile

__all__ = ["RANGE_ELEMENTS", "decode_entries"]

RANGE_ELEMENTS = 1 << 19
"""Elements decoded per range: 1 MiB of BF16 out, 0.75 MiB in, so a range's bytes are still in the core's 2 MiB L2
cache when they are checksummed; and enough work (about 0.3 ms) that taking a range costs little."""

RAW_RANGE_BYTES = 2 * RANGE_ELEMENTS
"""Bytes copied per range of a tensor stored raw."""


@dataclass
class _Job:
    """One tensor: where its bytes are, where they go, and the checksums of its ranges once decoded."""

    entry: TensorEntry
    dtype: torch.dtype
    payload: torch.Tensor
    out: torch.Tensor  # flat: bfloat16 for SplitZip, uint8 for raw
    decoder: PayloadDecoder | None
    checked: bool  # take checksums while decoding
    ranges: list[tuple[int, int]]
    sums: list[RangeChecksums | int | None] = field(default_factory=list)

    def run(self, k: int) -> None:
        start, stop = self.ranges[k]
        out = self.out[start:stop]
        if self.decoder is None:
            out.copy_(self.payload[start:stop])
            self.sums[k] = crc32(out.numpy()) if self.checked else None
        elif self.checked:
            self.sums[k] = self.decoder.decode_checked(start, stop, out)
        else:
            self.decoder.decode(start, stop, out)


def decode_entries(file: SztFile, entries: Sequence[TensorEntry], *, check_stored: Sequence[bool],
                   check_decoded: bool, threads: int | None = None) -> list[torch.Tensor]:
    """The tensors ``entries`` of ``file``, decoded into new CPU tensors of their dtype and shape.

    Args:
        file (`SztFile`): the open file.
        entries (sequence of `TensorEntry`): tensors of ``file``, in the order to return them.
        check_stored (sequence of `bool`): per entry, whether to check the CRC-32 of its stored bytes.
        check_decoded (`bool`): whether to check the CRC-32 of every SplitZip tensor's decoded bytes.
        threads (`int`, *optional*): threads to decode on, the caller's included; by default PyTorch's intra-op
            thread count (``torch.get_num_threads()``), at most the host's cores.

    Raises:
        ChecksumMismatchError: stored or decoded bytes differ from their checksums.
        PayloadError: an escape stream is inconsistent (and the stored bytes match their checksum, if checked).
    """
    jobs = [_job(file, entry, stored, check_decoded) for entry, stored in zip(entries, check_stored)]
    units = [(job, k) for job in jobs for k in range(len(job.ranges))]
    threads = max(1, min(threads or torch.get_num_threads(), os.cpu_count() or 1, len(units)))
    _run(units, threads)
    for job, stored in zip(jobs, check_stored):
        _check(file.path, job, stored, check_decoded)
    return [job.out.view(job.dtype).reshape(job.entry.shape) for job in jobs]


def _job(file: SztFile, entry: TensorEntry, check_stored: bool, check_decoded: bool) -> _Job:
    dtype = entry.torch_dtype(file.path)
    payload = file.payload(entry.name)
    if entry.encoding == ENCODING_RAW:
        size, step, decoder = entry.length, RAW_RANGE_BYTES, None
        out = torch.empty(size, dtype=torch.uint8)
    else:
        try:
            decoder = PayloadDecoder(payload, entry.layout, entry.codebook)
        except ValueError as e:
            if check_stored:  # corrupt bytes are reported as such, whatever they broke
                _compare(tensor_crc32(payload), entry.crc32, "stored bytes", file.path, entry.name)
            raise PayloadError(str(e), path=file.path, tensor=entry.name) from None
        size, step = entry.layout.n, RANGE_ELEMENTS
        out = torch.empty(size, dtype=torch.bfloat16)
    ranges = [(start, min(start + step, size)) for start in range(0, size, step)] or [(0, 0)]
    checked = check_stored or (check_decoded and decoder is not None)
    return _Job(entry, dtype, payload, out, decoder, checked, ranges, [None] * len(ranges))


def _run(units: list[tuple[_Job, int]], threads: int) -> None:
    """Run every unit on ``threads`` threads (the caller's and ``threads - 1`` started here), each taking the next
    unit until none is left; the first error stops them all and is raised here.

    The caller's thread drops to one intra-op thread before the others start, so they start with one too (with
    OpenMP a new thread takes the last value set) and nothing they do changes the caller's setting.
    """
    lock = threading.Lock()
    cursor = iter(range(len(units)))
    errors: list[BaseException] = []

    def work() -> None:
        try:
            with one_intra_op_thread():
                while not errors:
                    with lock:
                        i = next(cursor, None)
                    if i is None:
                        return
                    job, k = units[i]
                    job.run(k)
        except BaseException as e:  # noqa: BLE001 - handed to the caller, which raises it
            errors.append(e)

    with one_intra_op_thread():
        helpers = [threading.Thread(target=work, name="szformat-decode", daemon=True) for _ in range(threads - 1)]
        for helper in helpers:
            helper.start()
        work()
        for helper in helpers:
            helper.join()
    if errors:
        raise errors[0]


def _check(path: Path, job: _Job, check_stored: bool, check_decoded: bool) -> None:
    entry = job.entry
    if job.decoder is None:
        if check_stored:
            _compare(crc32_join(zip(job.sums, (stop - start for start, stop in job.ranges))), entry.crc32,
                     "stored bytes", path, entry.name)
        return
    sums = [(start, stop, s) for (start, stop), s in zip(job.ranges, job.sums)]
    if check_stored:
        _compare(job.decoder.stored_crc(sums), entry.crc32, "stored bytes", path, entry.name)
    if check_decoded:
        _compare(crc32_join((s.raw, 2 * (stop - start)) for start, stop, s in sums), entry.raw_crc32,
                 "decoded bytes", path, entry.name)


def _compare(actual: int, expected: int, what: str, path: Path, tensor: str) -> None:
    if actual != expected:
        raise ChecksumMismatchError(f"CRC-32 of the {what} is {actual:#010x}, the header records {expected:#010x}",
                                    path=path, tensor=tensor)
