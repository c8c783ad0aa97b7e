"""What reading stored bytes with ``pread`` costs the CPU loaders, against decoding straight from the mapping.

``safe_open``/``load_file`` on the CPU copy each tensor's stored bytes out of the file (``SztFile.read``), so a file
truncated by another process meanwhile is a ``TruncatedFileError`` rather than SIGBUS. The anchor in the same run
is the former path, rebuilt here from public pieces: the stored bytes taken as a zero-copy view of the mapping
(``safe_open.payload``), CRC-checked and decoded from there.

Rows, on a page-cached file, each the median (and best) of ``--repeats`` runs taken round-robin, in CPU time of
this process (user and system: the kernel's copy counts), which other work on a shared machine disturbs far less
than wall time; wall-time medians are printed beside them:

- ``load_file``: every tensor, both CRC-32s checked (the default), read / mapped;
- ``load_file verify=False``: the same without CRC-32s;
- ``get_tensor``: every tensor again from a file already open (stored bytes already checked once).

Checkpoints: all-MiniLM-L6-v2 in BF16 (``tools/fetch_minilm.py``; 45 MB raw) and a synthetic one of ``--synthetic-mb``
of BF16 weights in 64 MiB tensors (about 0.75 of that on disk). Every tensor of every path is compared bit for bit
with the source before anything is timed.

Usage::

    PYTHONPATH=. python tools/bench_reads.py [--synthetic-mb 640] [--repeats 5] [--threads 1] [--work /tmp/szreads]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file as load_safetensors

import szformat
from szformat.convert import convert
from szformat.codec import cpu
from szformat.format import constants as C
from szformat.format.reader import check_crc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fetch_minilm import default_dest  # noqa: E402

TENSOR_ELEMENTS = 32 << 20
"""Elements per synthetic tensor (64 MiB of BF16)."""


def mapped_tensor(f: szformat.safe_open, name: str, verify: bool, checked: set[str]) -> torch.Tensor:
    """The former ``get_tensor``: stored bytes as a view of the mapping, CRC-checked once, decoded from there."""
    entry = f.entry(name)
    payload = f.payload(name)
    if verify and name not in checked:
        check_crc(payload, entry.crc32, what="stored bytes", path=f.path, tensor=name)
        checked.add(name)
    dtype = entry.torch_dtype(f.path)
    if entry.encoding == C.ENCODING_RAW:
        return payload.clone().view(dtype).reshape(entry.shape)
    out = cpu.decode(payload, entry.layout, entry.codebook)
    if verify:
        check_crc(out.view(torch.uint8), entry.raw_crc32, what="decoded bytes", path=f.path, tensor=name)
    return out.reshape(entry.shape)


def mapped_load_file(path: Path, verify: bool) -> dict[str, torch.Tensor]:
    with szformat.safe_open(path, framework="pt", verify=verify) as f:
        checked: set[str] = set()
        return {name: mapped_tensor(f, name, verify, checked) for name in f.keys()}


def methods(path: Path) -> dict[str, Callable[[], object]]:
    """Each row's two callables: what the library does now ("read") and the former path ("mapped")."""
    opened = szformat.safe_open(path, framework="pt")
    names = opened.keys()
    for name in names:  # stored bytes checked once, as on a file used for a while
        opened.get_tensor(name)
    checked = set(names)
    return {
        "load_file | read": lambda: szformat.load_file(path),
        "load_file | mapped": lambda: mapped_load_file(path, True),
        "load_file verify=False | read": lambda: szformat.load_file(path, verify=False),
        "load_file verify=False | mapped": lambda: mapped_load_file(path, False),
        "get_tensor, file open | read": lambda: [opened.get_tensor(n) for n in names],
        "get_tensor, file open | mapped": lambda: [mapped_tensor(opened, n, True, checked) for n in names],
    }


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
        for k in a)


def bench(label: str, path: Path, source: dict[str, torch.Tensor], repeats: int) -> list[str]:
    table = methods(path)
    for key, run in table.items():
        got = run()
        got = got if isinstance(got, dict) else dict(zip(source, got))
        assert same_bits(got, source), f"{label}: {key} differs from the source"
    cpu_times: dict[str, list[float]] = {key: [] for key in table}
    wall_times: dict[str, list[float]] = {key: [] for key in table}
    for _ in range(repeats):
        for key, run in table.items():
            wall, cpu_time = time.perf_counter(), time.process_time()
            run()
            cpu_times[key].append(time.process_time() - cpu_time)
            wall_times[key].append(time.perf_counter() - wall)
    raw = sum(t.numel() * t.element_size() for t in source.values())
    lines = []
    for row in dict.fromkeys(key.split(" | ")[0] for key in table):
        read, mapped = cpu_times[f"{row} | read"], cpu_times[f"{row} | mapped"]
        walls = [statistics.median(wall_times[f"{row} | {how}"]) * 1e3 for how in ("read", "mapped")]
        lines.append(f"| {label} | {row} | {statistics.median(read) * 1e3:.1f} ({min(read) * 1e3:.1f}) | "
                     f"{statistics.median(mapped) * 1e3:.1f} ({min(mapped) * 1e3:.1f}) | "
                     f"{raw / statistics.median(read) / 1e9:.2f} / {raw / statistics.median(mapped) / 1e9:.2f} | "
                     f"**{statistics.median(read) / statistics.median(mapped):.2f}** | "
                     f"{walls[0]:.0f} / {walls[1]:.0f} |")
    return lines


def synthetic(mb: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    count = max(1, mb * 1_000_000 // (2 * TENSOR_ELEMENTS))
    return {f"layers.{i}.weight": (torch.randn(TENSOR_ELEMENTS, generator=g) * 0.02).to(torch.bfloat16)
                                  .reshape(-1, 4096) for i in range(count)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minilm", type=Path, default=default_dest() / "minilm-bf16" / "model.safetensors")
    parser.add_argument("--synthetic-mb", type=int, default=640, help="raw MB of the synthetic checkpoint")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--work", type=Path, default=Path("/tmp/szreads"))
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: on a busy "
                        "machine more threads make decoding slower, not faster)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    checkpoints = []
    minilm = args.work / "minilm.szt"
    convert(args.minilm, minilm, overwrite=True)
    checkpoints.append(("MiniLM-L6 BF16", minilm, load_safetensors(args.minilm)))
    tensors = synthetic(args.synthetic_mb)
    synth = args.work / "synthetic.szt"
    szformat.save_file(tensors, synth)
    checkpoints.append((f"synthetic {synth.stat().st_size / 1e6:.0f} MB", synth, tensors))

    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, {os.cpu_count()} cores, "
          f"{args.repeats} repeats; CPU ms median (best)")
    print("| checkpoint | call | read with pread, CPU ms | from the mapping, CPU ms | raw GB/s of CPU time read / "
          "mapped | read / mapped | wall ms read / mapped |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for label, path, source in checkpoints:
        for line in bench(label, path, source, args.repeats):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
