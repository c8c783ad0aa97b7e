"""Check a .szt checkpoint end to end: headers, stored checksums, and every tensor decoded against its checksum.

Unlike loading, verification does not stop at the first problem: it reports every bad file, every bad tensor and
every index entry that points nowhere, so one run says everything that is wrong. It holds indexes to the rules
loading does (:func:`szformat.format.index.open_shard`): what ``load_file`` refuses, ``verify`` reports.

Where the C kernels are built, a file is checked by them alone, straight from its mapping, on threads of its own,
without importing torch (:func:`_problems_in_kernels`): torch's import (about a second) was most of what
``szconvert verify`` took for a small file, and each tensor is decoded a block at a time into a small buffer, never
into memory of its size. Files the kernels cannot take (a stage at rest, no kernels built here, a page that could
not be read) are decoded as ``load_file`` decodes them, on its threads.
"""

from __future__ import annotations

import os
import posixpath
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from .._lazy import torch
from ..codec import cpu_kernel
from ..errors import ShardIndexError, SzformatError
from ..format import constants as C
from ..format.index import SEVERAL_INDEXES, index_problems, read_index
from ..format.header import TensorEntry
from ..format.reader import SztFile, check_decoded_payload, compare_crc
from .checkpoint import find_files
from .expand import decode_group, decoded_together, group_buffer, raw_windows, tensor_groups
from .progress import progress_bar
from .report import format_bytes


BLOCKS_APART = "its block checksums (format 1.3) do not join to its crc32: reads of part of it would be refused"

THREAD_BYTES = 64 << 20
"""Raw bytes a thread of :func:`_problems_in_kernels` is given at least: a small file is checked on one thread,
whose start would cost more than it shares."""


@dataclass(frozen=True)
class Problem:
    """One thing wrong: in which file (relative to the checkpoint), which tensor if any, and what."""

    file: str
    tensor: str | None
    message: str

    def __str__(self) -> str:
        where = f"{self.file}: tensor {self.tensor!r}" if self.tensor is not None else self.file
        return f"{where}: {self.message}"


@dataclass
class VerifyReport:
    """What was checked and what is wrong; ``ok`` when nothing is."""

    files: int = 0
    """.szt files looked at, those that would not open included."""
    unreadable: int = 0
    """Of them, the ones that would not open (their tensors are not counted)."""
    tensors: int = 0
    raw_bytes: int = 0
    seconds: float = 0.0
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> list[str]:
        unreadable = f" ({self.unreadable} would not open)" if self.unreadable else ""
        checked = (f"{self.tensors} tensors ({format_bytes(self.raw_bytes)} raw) in {self.files} file(s)"
                   f"{unreadable}, {self.seconds:.2f} s")
        if self.ok:
            return [f"OK: {checked}"]
        return [f"FAILED: {len(self.problems)} problem(s) in {checked}"] + [f"  {p}" for p in self.problems]


def verify(path: str | os.PathLike, *, progress: bool = False, threads: int | None = None) -> VerifyReport:
    """Verify a .szt file (recognised by its magic bytes, whatever its name), a ``*.szt.index.json`` index with
    its shards, or a converted folder, on ``threads`` threads (by default ``OMP_NUM_THREADS``, as torch's, else one
    per CPU this process may run on).

    Returns:
        `VerifyReport`: the problems found (an empty list when every check passed).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ConversionError: ``path`` is no .szt checkpoint at all.
    """
    started = time.perf_counter()
    report = VerifyReport()
    try:
        files = find_files(path, C.FILE_SUFFIX, magic=C.MAGIC)
    except ShardIndexError as e:  # ``path`` is an index, and it is malformed: nothing else to check
        report.problems.append(Problem(Path(path).name, e.tensor, e.reason))
        report.seconds = time.perf_counter() - started
        return report
    sizes: dict[str, dict[str, int] | None] = {}  # None: the file does not open
    for rel in files.weights:
        try:
            with SztFile(files.root / rel) as szt:
                sizes[rel] = {e.name: e.raw_length for e in szt.entries.values()}
                report.problems += [Problem(rel, e.name, BLOCKS_APART) for e in szt.entries.values()
                                    if e.blocks is not None and e.blocks.joined(e.length) != e.crc32]
        except (SzformatError, OSError) as e:
            sizes[rel] = None
            report.unreadable += 1
            report.problems.append(Problem(rel, None, _reason(e)))
    report.files = len(files.weights)
    by_folder = defaultdict(list)
    for rel in files.indexes:
        by_folder[posixpath.dirname(rel)].append(posixpath.basename(rel))
    report.problems += [Problem(folder or ".", None, f"{SEVERAL_INDEXES} ({', '.join(names)})")
                        for folder, names in by_folder.items() if len(names) > 1]
    for rel in files.indexes:
        try:
            index = read_index(files.root / rel)
        except SzformatError as e:
            report.problems.append(Problem(rel, e.tensor, e.reason))
            continue
        report.problems += [Problem(rel, tensor, problem) for tensor, problem in index_problems(index, sizes, rel)]

    threads = threads or _cpus()
    readable = [rel for rel, tensors in sizes.items() if tensors is not None]
    total = sum(sum(sizes[rel].values()) for rel in readable)
    buffer = None  # made for the first file the kernels alone do not take
    with progress_bar(total, enabled=progress, description="verifying") as bar:
        for rel in readable:
            with SztFile(files.root / rel) as szt:
                entries = list(szt.entries.values())
                report.tensors += len(entries)
                report.raw_bytes += sum(e.raw_length for e in entries)
                found = _problems_in_kernels(szt, entries, threads)
                if found is not None:
                    report.problems += [Problem(rel, name, reason) for name, reason in found]
                    bar.update(sum(e.raw_length for e in entries))
                    continue
                buffer = group_buffer() if buffer is None else buffer
                for group in tensor_groups(entries):
                    if not decoded_together(group) or not _passes_together(szt, group, buffer):
                        report.problems += [Problem(rel, e.name, reason) for e in group
                                            if (reason := _checked_alone(szt, e, buffer)) is not None]
                    bar.update(sum(e.raw_length for e in group))
    report.seconds = time.perf_counter() - started
    return report


def _problems_in_kernels(szt: SztFile, entries: list[TensorEntry], threads: int) -> list[tuple[str, str]] | None:
    """Every tensor of an open file checked by the C kernels straight from its mapping, with no torch, on up to
    ``threads`` threads (one per :data:`THREAD_BYTES`), each taking its share of the tensors (:func:`_shares`) to one
    call that checks each SplitZip tensor's stored bytes, escape streams and decoded bytes, decoding it a block at a
    time into a buffer of its own (``check_payloads``: the decoded bytes are only checksummed, so they take no memory
    of the tensor's size), and one CRC-32 per raw tensor's stored bytes; ``(tensor, reason)`` for each that fails,
    in the file's order, with the reasons ``load_file`` gives.

    None where the kernels do not take the file: not built here (or without zlib-ng's CRC-32, or reads of a mapping
    they cannot guard), a tensor stored at rest, or a page that could not be read (the loader's path then says which
    tensor's). Escapes cost the check no memory of a tensor's size: it lists them a unit of a million elements at a
    time (``decode_payloads``' units), however many a forged file claims.
    """
    kernels = cpu_kernel.native
    if (kernels is None or not cpu_kernel.checksums_in_kernel() or not kernels.guards_mapped_reads()
            or any(e.at_rest is not None for e in entries)):
        return None
    shares = _shares(entries, min(threads, -(-sum(e.raw_length for e in entries) // THREAD_BYTES)))
    release = cpu_kernel.worth_releasing(len(shares), sum(e.length for e in entries))
    try:
        if len(shares) <= 1:
            found = [_problems_in_share(kernels, szt, share, release) for share in shares]
        else:
            with ThreadPoolExecutor(len(shares), thread_name_prefix="szformat-verify") as pool:
                found = list(pool.map(lambda share: _problems_in_share(kernels, szt, share, release), shares))
    except (EOFError, SzformatError):  # a page not read, a file that shrank: the loader's path names the tensor
        return None
    reasons = dict(pair for share in found for pair in share)
    return [(e.name, reasons[e.name]) for e in entries if e.name in reasons]


def _shares(entries: list[TensorEntry], count: int) -> list[list[TensorEntry]]:
    """``entries`` dealt to at most ``count`` shares of about equal raw bytes, the largest first, each to the share
    with the fewest bytes so far; empty shares left out."""
    shares: list[list[TensorEntry]] = [[] for _ in range(max(1, count))]
    loads = [0] * len(shares)
    for entry in sorted(entries, key=lambda e: -e.raw_length):
        lightest = loads.index(min(loads))
        shares[lightest].append(entry)
        loads[lightest] += entry.raw_length
    return [share for share in shares if share]


def _problems_in_share(kernels, szt: SztFile, entries: list[TensorEntry], release: bool) -> list[tuple[str, str]]:
    """``(tensor, reason)`` for each of ``entries`` that fails its checks (:func:`_problems_in_kernels`), the pages of
    the mapping read dropped as they are checked with ``release`` (``cpu_kernel.worth_releasing``). The views of the
    mapping live in this call only, so none holds it once it returns or its error is handled."""
    reasons = []
    splitzip = [e for e in entries if e.encoding != C.ENCODING_RAW]
    checked = cpu_kernel.check_payloads(kernels, [(stored, e.layout, e.codebook)
                                                  for stored, e in zip(szt.mapped_payloads(splitzip), splitzip)],
                                        release=release)
    for e, (stored_crc, decoded_crc, error) in zip(splitzip, checked):
        try:
            check_decoded_payload(e, stored_crc, decoded_crc, error, path=szt.path, check_stored=True,
                                  check_decoded=True)
        except SzformatError as bad:
            reasons.append((e.name, bad.reason))
    raw = [e for e in entries if e.encoding == C.ENCODING_RAW]
    for e, stored in zip(raw, szt.mapped_payloads(raw)):
        try:
            compare_crc(kernels.crc32(stored, 0), e.crc32, what="stored bytes", path=szt.path, tensor=e.name)
        except SzformatError as bad:
            reasons.append((e.name, bad.reason))
    return reasons


def _cpus() -> int:
    """The threads a check runs on by default, read without importing torch: ``OMP_NUM_THREADS`` where it is set to
    a count (as torch's own default honours it, and the loader's path runs on torch's count), else the CPUs this
    process may run on."""
    asked = os.environ.get("OMP_NUM_THREADS", "")
    if asked.isdigit() and int(asked) > 0:
        return int(asked)
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _passes_together(szt: SztFile, group: list[TensorEntry], buffer: torch.Tensor) -> bool:
    """Whether every tensor of a group passes every check, decoded together (:func:`decode_group`); where one does
    not, the caller checks each alone to say what is wrong."""
    try:
        decode_group(szt, group, buffer)
    except SzformatError:
        return False
    return True


def _checked_alone(szt: SztFile, entry: TensorEntry, buffer: torch.Tensor) -> str | None:
    """Check one tensor (its stored and decoded checksums, its escape streams) through ``buffer``
    (:func:`raw_windows`): the reason it fails, or None."""
    try:
        for _ in raw_windows(szt, entry, buffer):
            pass
    except SzformatError as e:
        return e.reason
    return None


def _reason(error: Exception) -> str:
    if isinstance(error, SzformatError):
        return error.reason
    return f"{error.strerror or error}" if isinstance(error, OSError) else str(error)
