"""What converting and decompressing share: find the checkpoint, name the output, show progress, write the output
atomically, and report every tensor written. Each direction supplies only how one weight file is rewritten."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

from ..format.header import TensorEntry
from .checkpoint import open_checkpoint, output_path, write_checkpoint
from .progress import progress_bar
from .report import ConversionReport, TensorRecord

TensorDone = Callable[[TensorEntry], None]
"""Called by a file writer after each tensor it wrote, with the tensor's .szt header entry."""

FileWriter = Callable[[Path, Path, TensorDone], None]
"""Rewrites one weight file: ``(source, destination, tensor_done)``; writes ``destination`` atomically."""


def run_pass(source: str | os.PathLike, target: str | os.PathLike | None, *, old_suffix: str, new_suffix: str,
             read_sizes: Callable[[Path], dict[str, int]], write_file: FileWriter, overwrite: bool, progress: bool,
             description: str, old_magic: bytes | None = None) -> ConversionReport:
    """Rewrite the checkpoint at ``source`` (weight files ending with ``old_suffix``, or a single file starting
    with ``old_magic``) into ``target``.

    ``read_sizes`` validates a weight file's header and returns the raw size of each tensor; every file is read
    that way before any output exists.
    """
    started = time.perf_counter()
    checkpoint = open_checkpoint(source, old_suffix, read_sizes, magic=old_magic)
    target = output_path(checkpoint.files, target, old_suffix, new_suffix)
    report = ConversionReport(output=target, files_copied=len(checkpoint.files.others),
                              left_out=list(checkpoint.files.left_out))
    with progress_bar(checkpoint.raw_bytes, enabled=progress, description=description) as bar:
        def write_weights(src: Path, dst: Path) -> None:
            name = src.relative_to(checkpoint.files.root).as_posix()

            def tensor_done(entry: TensorEntry) -> None:
                report.records.append(TensorRecord.from_entry(name, entry))
                bar.update(entry.raw_length)

            write_file(src, dst, tensor_done)
            report.files_written += 1
            report.source_file_bytes += src.stat().st_size
            report.output_file_bytes += dst.stat().st_size

        write_checkpoint(checkpoint, target, old_suffix=old_suffix, new_suffix=new_suffix,
                         write_weights=write_weights, overwrite=overwrite, kept=report.kept)
    report.seconds = time.perf_counter() - started
    return report
