"""GPU loads of both forms of a checkpoint (in memory, at rest), interleaved call by call, warm and cold, beside
the rate at which the host reads each file.

    python -m bench.forms --minilm .data/minilm-bf16.safetensors --work /tmp/szload \
        [--synthetic-gb 4.2] [--cache warm,cold] [--rounds 5] [--only REGEX] [--json forms.json]
    python -m bench.forms --dtype F32 --synthetic-gb 1 --work /tmp/szload   # byte planes at rest (1.2)
    python -m bench.forms --dtype F32 --synthetic-gb 1 --timeline --cache warm --rounds 3   # where the time goes
    python -m bench.forms --dtype F32 --synthetic-gb 1 --frame-kib 256 --cache warm        # smaller frames too
    python -m bench.forms --dtype F32 --synthetic-gb 1 --reader-threads 16 --cache warm    # more readers inflating

The at-rest form (.szt 1.1) has two goals: a warm load (page-cached file) within 1.1x of the in-memory form's, and a
cold load faster than the in-memory form's by the bytes it saves. Single calls say little where a VM's speeds wander
from call to call, so every path here runs once per round, in orders balanced over the rounds, and medians are
compared.
Warm: one untimed round first. Cold: the page cache dropped before each call (``/proc/sys/vm/drop_caches`` when
writable, else ``posix_fadvise(DONTNEED)``).

Beside the loads, in the same rounds, anchors say what the host gives: each file read whole into host memory by the
loader's own reader threads (``hostio.FileReader``: buffered ``preadv`` in pieces), and, cold, by ``O_DIRECT`` reads
that bypass the page cache (16 threads, 8 MiB each). A cold load at its file's read time is bound by the disk.

The checkpoint is ``bench/checks/load_gpu.py``'s synthetic one (converted on the GPU), repacked at rest beside it.
Every load is checked bit for bit against the safetensors original's once, before the rounds.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import re
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file as st_load_file

import szformat
from szformat.loading import device_loader, hostio
from szformat.loading.device_loader import StagingConfig

from .checks.load_gpu import Checkpoint, at_rest_copy, prepare  # noqa: E402
from .common import round_order  # noqa: E402
from .load import drop_caches, mismatches, print_summary, recorded, resident_share, timed_call  # noqa: E402

ANCHOR = "in-memory form, load_file (verify on)"
DIRECT_THREADS = 16
DIRECT_CHUNK = 8 << 20


def buffered_read(path: Path, buffer: torch.Tensor) -> Callable[[], object]:
    """The whole file read into ``buffer`` by the loader's reader threads, as a load reads it (no device)."""

    def run() -> object:
        size = path.stat().st_size
        threads = hostio.default_threads()
        with ThreadPoolExecutor(threads) as pool:
            reader = hostio.FileReader(path, pool, threads)
            try:
                reader.read_into(0, buffer[:size]).result()
            finally:
                reader.close()
        return None

    return run


def direct_read(path: Path) -> Callable[[], object]:
    """The whole file read with ``O_DIRECT`` (no page cache) by :data:`DIRECT_THREADS` threads."""

    def run() -> object:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            size = os.fstat(fd).st_size
            offsets = range(0, size, DIRECT_CHUNK)

            def worker(first: int) -> None:
                with mmap.mmap(-1, DIRECT_CHUNK) as buffer:  # page-aligned, as O_DIRECT needs
                    for offset in offsets[first::DIRECT_THREADS]:
                        os.preadv(fd, [buffer], offset)

            with ThreadPoolExecutor(DIRECT_THREADS) as pool:
                list(pool.map(worker, range(DIRECT_THREADS)))
        finally:
            os.close(fd)
        return None

    return run


def load_paths(ckpt: Checkpoint, at_rest: Checkpoint) -> dict[str, tuple[str, Callable[[], object]]]:
    """Label -> (form whose file it reads, the load)."""
    trusted = StagingConfig(device_inflate=True)  # nvCOMP inflates: the bench's own files
    return {
        ANCHOR: ("in-memory", lambda: szformat.load_file(ckpt.szt, device="cuda")),
        "in-memory form, verify off": ("in-memory", lambda: szformat.load_file(ckpt.szt, device="cuda", verify=False)),
        "at rest, load_file (verify on)": ("at rest", lambda: szformat.load_file(at_rest.szt, device="cuda",
                                                                                 staging=trusted)),
        "at rest, verify on, the readers inflate": ("at rest", lambda: szformat.load_file(at_rest.szt, device="cuda")),
        "at rest, verify off": ("at rest", lambda: szformat.load_file(at_rest.szt, device="cuda", verify=False,
                                                                      staging=trusted)),
        "safetensors load_file": ("safetensors", lambda: st_load_file(ckpt.safetensors, device="cuda")),
    }


def check_bits(loads: dict[str, tuple[str, Callable[[], object]]], reference: dict[str, torch.Tensor]) -> bool:
    """Whether every load gives ``reference`` bit for bit (names, dtypes, shapes, device, bytes); says so for each."""
    same_everywhere = True
    for label, (_, load) in loads.items():
        bad = mismatches(load(), reference)
        print(f"{label}: {'bit-identical' if not bad else 'DIFFERS: ' + ', '.join(bad[:5])}", flush=True)
        same_everywhere &= not bad
    return same_everywhere


def interleaved(paths: dict[str, tuple[str, Callable[[], object]]], files: dict[str, Path], rounds: int, cache: str
                ) -> dict[str, list[float]]:
    """Seconds of each path over ``rounds`` rounds, in orders balanced over the rounds; cold calls start from a
    dropped page cache, warm ones follow an untimed round."""
    times: dict[str, list[float]] = {label: [] for label in paths}
    labels = list(paths)
    for round_ in range(-1 if cache == "warm" else 0, rounds):
        for label in round_order(labels, round_):
            form, run = paths[label]
            if cache == "cold":
                drop_caches(list(files.values()))
                resident = resident_share([files[form]])
                if resident > 0.01:
                    print(f"{label}: {resident:.0%} of its file stayed resident", flush=True)
            try:
                seconds, result = timed_call(run)
            except OSError as e:  # O_DIRECT refused by the file system
                print(f"{label}: {e}", flush=True)
                continue
            del result
            if round_ >= 0:
                times[label].append(seconds)
                print(f"{cache} round {round_}: {label:<44} {seconds * 1e3:8.1f} ms", flush=True)
    return times


def markdown(times: dict[str, list[float]], forms: dict[str, str], sizes: dict[str, int], cache: str) -> str:
    anchor = statistics.median(times[ANCHOR])
    lines = [f"| {cache}, {len(times[ANCHOR])} interleaved rounds | file GB | median ms | min-max | file GB/s | "
             "x in-memory load (verify on) |", "|---|---:|---:|---:|---:|---:|"]
    for label, ts in times.items():
        if ts:
            median, size = statistics.median(ts), sizes[forms[label]]
            lines.append(f"| {label} | {size / 1e9:.3f} | {median * 1e3:.1f} | {min(ts) * 1e3:.0f}-"
                         f"{max(ts) * 1e3:.0f} | {size / median / 1e9:.2f} | {anchor / median:.2f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minilm", type=Path, help="MiniLM-L6 BF16 model.safetensors (needed for --dtype BF16)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/szload"))
    parser.add_argument("--synthetic-gb", type=float, default=4.2)
    parser.add_argument("--cache", default="warm,cold", help="warm, cold, or both (comma-separated)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", help="time only the paths whose label matches this regular expression (the "
                                           "in-memory form's load with verify on always runs: it is the anchor)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--timeline", nargs="?", const="", type=str, help="first, one recorded warm load of each "
                        "form (verify on): where its time goes, step by step (szformat.loading.timeline); given a "
                        "path, its spans are also written there as JSON")
    parser.add_argument("--frame-kib", type=int, action="append", default=[], help="also an at-rest copy in "
                        "frames of this many KiB (the default is 1024), loaded beside the others (repeatable)")
    parser.add_argument("--reader-threads", type=int, action="append", default=[], help="also the default at-rest "
                        "load (the reader threads inflate) with this many reader threads (the default is "
                        "min(12, cores)) (repeatable)")
    parser.add_argument("--dtype", default="BF16", choices=["BF16", "F32", "F16", "F8_E4M3"],
                        help="the synthetic checkpoint's dtype (not BF16: byte planes at rest, format 1.2)")
    args = parser.parse_args()

    ckpt = next(c for c in prepare(args.minilm, args.work, args.synthetic_gb, dtype=args.dtype)
                if c.name.startswith("synthetic"))
    at_rest = at_rest_copy(ckpt)
    files = {"in-memory": ckpt.szt, "at rest": at_rest.szt, "safetensors": ckpt.safetensors}
    framed = {f"at rest, {kib} KiB frames": at_rest_copy(ckpt, kib << 10) for kib in args.frame_kib}
    files.update({form: copy.szt for form, copy in framed.items()})
    sizes = {form: path.stat().st_size for form, path in files.items()}
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {os.cpu_count()} cores, nvCOMP "
          f"{'found' if device_loader.nvcomp_inflater() else 'absent'}; files: "
          + ", ".join(f"{form} {size / 1e9:.3f} GB" for form, size in sizes.items()), flush=True)
    loads = load_paths(ckpt, at_rest)
    loads.update({f"{form}, load_file (verify on)": (form, lambda path=c.szt: szformat.load_file(path, device="cuda"))
                  for form, c in framed.items()})
    loads.update({f"at rest, the readers inflate, {n} threads": ("at rest", lambda n=n: szformat.load_file(
        at_rest.szt, device="cuda", staging=StagingConfig(threads=n))) for n in args.reader_threads})
    if not check_bits(loads, st_load_file(ckpt.safetensors, device="cuda")):  # the tensors the files hold
        return 1

    if args.timeline is not None:
        spans = {}
        for label in (ANCHOR, "at rest, load_file (verify on)", *(f"{form}, load_file (verify on)" for form in framed)):
            summary, spans[label] = recorded(loads[label][1])
            print_summary(label, summary)
        if args.timeline:
            Path(args.timeline).write_text(json.dumps(spans))
    os.sync()  # no writeback of the files just written beside the timed calls
    buffer = torch.empty(max(sizes.values()), dtype=torch.uint8)
    buffer.fill_(0)  # its pages faulted in before any timing
    anchors = {f"{form} file, reader threads (no device)": (form, buffered_read(files[form], buffer))
               for form in ("in-memory", "at rest")}
    direct = {f"{form} file, O_DIRECT reads (no device)": (form, direct_read(files[form]))
              for form in ("in-memory", "at rest")}
    results = {}
    for cache in args.cache.split(","):
        paths = {label: path for label, path in {**loads, **anchors, **(direct if cache == "cold" else {})}.items()
                 if args.only is None or label == ANCHOR or re.search(args.only, label)}
        times = interleaved(paths, files, args.rounds, cache)
        results[cache] = times
        print("\n" + markdown(times, {label: form for label, (form, _) in paths.items()}, sizes, cache) + "\n")
    print(f"file at rest / in memory: {sizes['at rest'] / sizes['in-memory']:.3f}")
    if args.json:
        args.json.write_text(json.dumps({"sizes": sizes, "seconds": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
