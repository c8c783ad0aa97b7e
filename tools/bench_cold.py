"""Cold GPU loads of both forms of a checkpoint, interleaved call by call, beside the disk's own read rate.

    PYTHONPATH=. python tools/bench_cold.py --minilm .data/minilm-bf16.safetensors --work /tmp/szload \
        [--synthetic-gb 4.2] [--rounds 5] [--only REGEX] [--json cold.json]

A cold load reads its file from the disk, so a smaller file should load sooner: the at-rest form (.szt 1.1) should
beat the in-memory form by the bytes it saves. One cold call per path says little where the disk's rate wanders
from call to call, so here every path runs once per round, the page cache dropped before each call
(``/proc/sys/vm/drop_caches`` when writable, else ``posix_fadvise(DONTNEED)``), the order rotated each round, and
the medians are compared.

Beside the loads, in the same rounds, two anchors per file say what the disk gives: the whole file read cold into
host memory by the loader's own reader threads (``hostio.FileReader``: buffered ``preadv`` in pieces), and by
``O_DIRECT`` reads that bypass the page cache (16 threads, 8 MiB each). A load at its file's buffered-read time is
bound by the disk; one well above it is not.

The checkpoint is ``tools/gpu_load_check.py``'s synthetic one (converted on the GPU), repacked at rest beside it.
Every load is checked bit for bit against the in-memory form's warm load once, before the rounds.
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
from szformat.loading import hostio

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_load import drop_caches, resident_share, timed_call  # noqa: E402
from gpu_load_check import at_rest_copy, prepare  # noqa: E402

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minilm", type=Path, required=True, help="MiniLM-L6 BF16 model.safetensors")
    parser.add_argument("--work", type=Path, default=Path("/tmp/szload"))
    parser.add_argument("--synthetic-gb", type=float, default=4.2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", help="time only the paths whose label matches this regular expression (the "
                                           "in-memory form's load with verify on always runs: it is the anchor)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    ckpt = next(c for c in prepare(args.minilm, args.work, args.synthetic_gb) if c.name.startswith("synthetic"))
    at_rest = at_rest_copy(ckpt)
    files = {"in-memory": ckpt.szt, "at rest": at_rest.szt, "safetensors": ckpt.safetensors}
    sizes = {form: path.stat().st_size for form, path in files.items()}
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {os.cpu_count()} cores; files: "
          + ", ".join(f"{form} {size / 1e9:.3f} GB" for form, size in sizes.items()), flush=True)

    loads: dict[str, tuple[str, Callable[[], object]]] = {
        ANCHOR: ("in-memory", lambda: szformat.load_file(ckpt.szt, device="cuda")),
        "in-memory form, verify off": ("in-memory", lambda: szformat.load_file(ckpt.szt, device="cuda", verify=False)),
        "at rest, load_file (verify on)": ("at rest", lambda: szformat.load_file(at_rest.szt, device="cuda")),
        "at rest, verify off": ("at rest", lambda: szformat.load_file(at_rest.szt, device="cuda", verify=False)),
        "safetensors load_file": ("safetensors", lambda: st_load_file(ckpt.safetensors, device="cuda")),
    }
    reference = szformat.load_file(ckpt.szt, device="cuda")
    for label, (_, load) in loads.items():
        got = load()
        same = got.keys() == reference.keys() and all(
            torch.equal(got[k].view(-1).view(torch.uint8), reference[k].view(-1).view(torch.uint8)) for k in got)
        print(f"{label}: {'bit-identical' if same else 'DIFFERS'}", flush=True)
        if not same:
            return 1
        del got
    del reference

    buffer = torch.empty(max(sizes.values()), dtype=torch.uint8)
    buffer.fill_(0)  # its pages faulted in before any timing
    anchors = {f"{form} file, reader threads (no device)": (form, buffered_read(files[form], buffer))
               for form in ("in-memory", "at rest")}
    anchors |= {f"{form} file, O_DIRECT reads (no device)": (form, direct_read(files[form]))
                for form in ("in-memory", "at rest")}
    paths = {label: path for label, path in {**loads, **anchors}.items()
             if args.only is None or label == ANCHOR or re.search(args.only, label)}
    times: dict[str, list[float]] = {label: [] for label in paths}
    resident: list[float] = []
    labels = list(paths)
    for round_ in range(args.rounds):
        for label in labels[round_ % len(labels):] + labels[: round_ % len(labels)]:
            form, run = paths[label]
            drop_caches(list(files.values()))
            resident.append(resident_share([files[form]]))
            try:
                seconds, result = timed_call(run)
            except OSError as e:  # O_DIRECT refused by the file system
                print(f"{label}: {e}", flush=True)
                continue
            del result
            times[label].append(seconds)
            print(f"round {round_}: {label:<44} {seconds:7.3f} s", flush=True)

    anchor = statistics.median(times[ANCHOR])
    lines = [f"| cold, {args.rounds} interleaved rounds | file GB | median s | min-max | file GB/s | "
             "x in-memory load (verify on) |", "|---|---:|---:|---:|---:|---:|"]
    rows = []
    for label, ts in times.items():
        if not ts:
            continue
        form = paths[label][0]
        median = statistics.median(ts)
        rows.append({"path": label, "form": form, "file_bytes": sizes[form], "seconds": ts, "median": median})
        lines.append(f"| {label} | {sizes[form] / 1e9:.3f} | {median:.3f} | {min(ts):.3f}-{max(ts):.3f} | "
                     f"{sizes[form] / median / 1e9:.2f} | {anchor / median:.2f} |")
    print("\n" + "\n".join(lines))
    print(f"\nfile at rest / in memory: {sizes['at rest'] / sizes['in-memory']:.3f}; share of a file still resident "
          f"after each drop: at most {max(resident):.1%}")
    if args.json:
        args.json.write_text(json.dumps({"sizes": sizes, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
