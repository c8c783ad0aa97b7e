"""What a conversion did, tensor by tensor, and the short summary ``szconvert`` prints at the end."""

from __future__ import annotations

import re
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from ..format import constants as C
from ..format.header import TensorEntry
from .cast import CAST_DTYPES


CAST_HINT_SHARE = 0.1
"""The summary suggests ``--cast bf16`` when F16/F32/F64 tensors left as they are hold this share of the raw bytes or
more, or when nothing was compressed."""


@dataclass(frozen=True)
class TensorRecord:
    """One stored tensor: where it is, how it is stored, and how much it takes."""

    file: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    encoding: str
    raw_bytes: int
    stored_bytes: int
    coverage: float | None = None
    n_esc: int | None = None
    reason: str | None = None
    memory_bytes: int | None = None
    """Bytes of the payload once inflated, for a tensor stored at rest (1.1); ``None``: stored as it is loaded."""

    @classmethod
    def from_entry(cls, file: str, entry: TensorEntry) -> "TensorRecord":
        encoded = entry.encoding == C.ENCODING_SPLITZIP
        return cls(file=file, name=entry.name, dtype=entry.dtype, shape=entry.shape, encoding=entry.encoding,
                   raw_bytes=entry.raw_length, stored_bytes=entry.length,
                   coverage=entry.codebook.coverage if encoded and entry.codebook else None,
                   n_esc=entry.layout.n_esc if encoded and entry.layout else None, reason=entry.raw_reason,
                   memory_bytes=entry.memory_length if entry.at_rest is not None else None)

    @property
    def ratio(self) -> float:
        """Stored bytes over raw bytes (1.0 for empty tensors)."""
        return self.stored_bytes / self.raw_bytes if self.raw_bytes else 1.0


def reason_group(reason: str | None) -> str:
    """The reason a tensor is stored raw, without its tensor-specific figures, so that reasons can be counted."""
    if not reason:
        return "unknown"
    return re.sub(r"coverage \d+(\.\d+)?", "coverage", reason)


@dataclass
class ConversionReport:
    """The output, every tensor written, the sizes of the weight files read and written, the files copied and the
    wall time; ``summary()`` is what the command line prints."""

    output: Path | None = None
    records: list[TensorRecord] = field(default_factory=list)
    files_written: int = 0
    files_copied: int = 0
    seconds: float = 0.0
    source_file_bytes: int = 0
    """Sizes on disk of the weight files read (headers included; copied config files left out)."""
    output_file_bytes: int = 0
    """Sizes on disk of the weight files written: payloads, alignment padding and headers."""
    cast: str | None = None
    """The cast asked for (``"bf16"``), if any."""
    cast_from: dict[str, int] = field(default_factory=dict)
    """Source dtype -> number of tensors cast from it (their records show the cast dtype)."""
    left_out: list[tuple[str, str]] = field(default_factory=list)
    """Entries of the source folder not copied, and why (see :func:`szformat.paths.outside_the_folder`)."""
    at_rest: bool = False
    """Whether the output is the at-rest form (format 1.1)."""
    kept: list[str] = field(default_factory=list)
    """Files the output folder held already that the conversion did not write, left where they were."""

    @property
    def raw_bytes(self) -> int:
        return sum(r.raw_bytes for r in self.records)

    @property
    def stored_bytes(self) -> int:
        return sum(r.stored_bytes for r in self.records)

    @property
    def ratio(self) -> float:
        """The true size ratio: weight files written over weight files read, as they lie on disk. For a checkpoint
        of many small tensors it is well above `payload_ratio`: every payload starts on an aligned offset."""
        return self.output_file_bytes / self.source_file_bytes if self.source_file_bytes else 1.0

    @property
    def payload_ratio(self) -> float:
        """Stored over raw tensor bytes, without headers and alignment padding."""
        return self.stored_bytes / self.raw_bytes if self.raw_bytes else 1.0

    @property
    def encoded(self) -> list[TensorRecord]:
        return [r for r in self.records if r.encoding == C.ENCODING_SPLITZIP]

    @property
    def stored_raw(self) -> list[TensorRecord]:
        return [r for r in self.records if r.encoding == C.ENCODING_RAW]

    @property
    def megabytes_per_second(self) -> float:
        """Raw megabytes (10^6 bytes) processed per second of wall time."""
        return self.raw_bytes / 1e6 / self.seconds if self.seconds > 0 else float("inf")

    def raw_reasons(self) -> list[tuple[str, int, int]]:
        """``(reason, tensors, raw bytes)`` of the tensors stored raw, most tensors first."""
        count: Counter[str] = Counter()
        nbytes: defaultdict[str, int] = defaultdict(int)
        for r in self.stored_raw:
            group = reason_group(r.reason)
            count[group] += 1
            nbytes[group] += r.raw_bytes
        return [(group, n, nbytes[group]) for group, n in sorted(count.items(), key=lambda kv: (-kv[1], kv[0]))]

    def summary(self) -> list[str]:
        """The end report of a conversion: encoded vs raw tensors (and why), ratio, coverage, time, throughput."""
        encoded, raw = self.encoded, self.stored_raw
        lines = [
            f"Converted {len(self.records)} tensors in {self.files_written} file(s)"
            + (f", copied {self.files_copied} other file(s)" if self.files_copied else ""),
            f"  encoded   {len(encoded):>6} tensors  {format_bytes(sum(r.raw_bytes for r in encoded)):>10} -> "
            f"{format_bytes(sum(r.stored_bytes for r in encoded))}",
            f"  raw       {len(raw):>6} tensors  {format_bytes(sum(r.raw_bytes for r in raw)):>10}",
        ]
        lines += [f"    {n:>6} x {reason} ({format_bytes(nbytes)})" for reason, n, nbytes in self.raw_reasons()]
        lines += [f"  not copied: {name} ({why})" for name, why in self.left_out]
        if self.kept:
            lines.append(f"  kept      {len(self.kept)} file(s) already in the output folder: {', '.join(self.kept)}")
        lines.append(f"  on disk   {format_bytes(self.source_file_bytes)} -> {format_bytes(self.output_file_bytes)}: "
                     f"ratio {self.ratio:.4f} ({size_change(self.ratio)}; headers and alignment padding included)")
        lines.append(f"  payloads  {format_bytes(self.raw_bytes)} -> {format_bytes(self.stored_bytes)}: ratio "
                     f"{self.payload_ratio:.4f} (tensor bytes alone)")
        coverages = [r.coverage for r in encoded if r.coverage is not None]
        if coverages:
            lines.append(f"  coverage  min {min(coverages):.4f}, median {statistics.median(coverages):.4f} "
                         f"(Top-16 exponents, encoded tensors)")
        lines.append(f"  time      {self.seconds:.1f} s, {self.megabytes_per_second:.1f} MB/s of raw weights")
        return lines + self.form_hint()

    def form_hint(self) -> list[str]:
        """For a conversion to the in-memory form that padding made no smaller than it could be (small tensors
        each start on their own 4 KiB page): what the at-rest form gives instead."""
        if self.at_rest or not self.encoded or not self.source_file_bytes:
            return []
        padding = self.ratio - self.payload_ratio * self.raw_bytes / self.source_file_bytes
        if self.ratio < 1 and padding < PADDING_HINT_SHARE:
            return []
        return [f"  hint      {padding * 100:.1f} % of the source's size is page padding (each payload starts on a "
                "4 KiB page, for mmap and DMA);",
                "            --at-rest zstd packs payloads under 1 MiB at 16 bytes and zstd-codes the exponents: "
                "about 0.67 of raw BF16 on disk, inflated on load"]

    def dtype_notes(self) -> list[str]:
        """For a conversion's end report: what was cast, or, for floating-point tensors of the in-memory form that
        were not, that only BF16 compresses there and what to do (``--at-rest zstd``, exact; ``--cast``, lossy,
        which only ``szconvert`` itself takes). In the at-rest form every dtype is stored as byte planes."""
        if self.cast:
            if not self.cast_from:
                return [f"  cast      --cast {self.cast}: no {'/'.join(CAST_DTYPES)} tensor to cast"]
            return [f"  cast      {_dtype_counts(self.cast_from)} cast to BF16 (--cast {self.cast})",
                    "            lossy: the output is not bit-exact to the source; verify checks the cast values"]
        uncast = [r for r in self.stored_raw if r.dtype in CAST_DTYPES]
        uncast_bytes = sum(r.raw_bytes for r in uncast)
        if self.at_rest or not uncast or (self.encoded and uncast_bytes < CAST_HINT_SHARE * self.raw_bytes):
            return []  # a BF16 model's F32 norms are no reason to suggest another form or a lossy cast
        lines = [] if self.encoded else ["  nothing was compressed: in the in-memory form only BF16 tensors "
                                         "compress, and this checkpoint has none"]
        counts = Counter(r.dtype for r in uncast)
        return lines + [f"  note      only BF16 tensors compress in the in-memory form: {_dtype_counts(counts)} "
                        f"({format_bytes(uncast_bytes)}) stored as they are",
                        "            --at-rest zstd stores them exactly as byte planes (about 0.82-0.85 of raw, "
                        "inflated on load);",
                        "            --cast bf16 casts them to BF16 first (lossy: the output is then not bit-exact "
                        "to the source)"]

    def restored_summary(self) -> list[str]:
        """The end report of a decompression: tensors and files written, sizes, time, throughput."""
        copied = f", copied {self.files_copied} other file(s)" if self.files_copied else ""
        return [f"Decompressed {len(self.records)} tensors in {self.files_written} file(s){copied}",
                f"  {format_bytes(self.stored_bytes)} stored -> {format_bytes(self.raw_bytes)} raw in "
                f"{self.seconds:.1f} s, {self.megabytes_per_second:.1f} MB/s of raw weights"]


PADDING_HINT_SHARE = 0.01
"""Page padding above this share of the source's size earns the report's hint about the at-rest form."""


def _dtype_counts(counts: dict[str, int]) -> str:
    """``{"F16": 1, "F32": 12}`` -> ``'1 F16, 12 F32 tensor(s)'``."""
    return ", ".join(f"{n} {dtype}" for dtype, n in sorted(counts.items())) + " tensor(s)"


def size_change(ratio: float) -> str:
    """``0.75`` -> ``'25.0 % smaller'``, ``1.056`` -> ``'5.6 % larger'``, ``3.2`` -> ``'3.2 times as large'``."""
    if round(ratio, 3) == 1:
        return "the same size"
    if ratio >= 2:
        return f"{ratio:.1f} times as large"
    return f"{abs(1 - ratio) * 100:.1f} % {'smaller' if ratio < 1 else 'larger'}"


def format_bytes(n: int) -> str:
    """``1234567`` -> ``'1.23 MB'`` (decimal units, as the Hub shows sizes)."""
    value = float(n)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")


def format_table(headers: list[str], rows: list[list[str]], *, right: set[int] = frozenset()) -> list[str]:
    """Columns padded to their widest cell; columns whose index is in ``right`` are right-aligned."""
    widths = [max([len(h)] + [len(row[i]) for row in rows]) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return [line(headers).rstrip(), line(["-" * w for w in widths])] + [line(row).rstrip() for row in rows]
