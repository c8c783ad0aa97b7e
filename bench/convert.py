"""Peak memory and throughput of ``szconvert`` on a checkpoint of real size, beside plain-copy anchors.

Generates (once) a BF16 safetensors file with the tensor shapes of TinyLlama-1.1B (2.2 GB; its largest tensors are
the 131 MB embedding and LM head) and weights drawn like trained ones (``randn * 0.02``; norms ``1 + randn *
0.05``), streamed to disk tensor by tensor. Then each step runs in a fresh interpreter, which reports its own peak
resident set (``ru_maxrss``) and wall time:

- ``import``: the interpreter with torch and szformat imported, nothing done (the floor of every other row);
- ``safetensors load+save``: ``safetensors.torch.load_file`` then ``save_file`` of the same file (the anchor: what
  a naive converter holding the whole model costs);
- ``file copy``: ``shutil.copyfile`` (the I/O anchor);
- ``convert``, ``verify``, ``decompress``: szformat's converter, verifier and inverse converter; then the same
  three for the at-rest form (``convert --at-rest zstd``).

"MB/cpu-s" divides by the step's CPU time (user + system, every thread): on a machine other jobs share, what the
step costs a core, where wall time also counts their turns.

The source file is read once before the runs, and the ``.szt`` outputs before each row (large outputs are written
with direct I/O, past the page cache), so every row starts with what it reads in the page cache; a step's outputs
are removed before each of its runs (:data:`WRITES`) and once no later row reads them (:data:`DONE_WITH`).

``--source`` converts another BF16 safetensors file instead (MiniLM's, for its mix of small tensors), and
``--repeats`` runs each step that many times and reports the medians.

Usage::

    python -m bench.convert [--dir /tmp/szbench] [--keep] [--source model.safetensors] [--repeats 1]
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from szformat.convert.safetensors_writer import SafetensorsWriter

VOCAB, HIDDEN, INTERMEDIATE, LAYERS, KV = 32000, 2048, 5632, 22, 256


def tinyllama_shapes() -> list[tuple[str, tuple[int, ...]]]:
    shapes = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        shapes += [(f"{p}.input_layernorm.weight", (HIDDEN,)),
                   (f"{p}.self_attn.q_proj.weight", (HIDDEN, HIDDEN)),
                   (f"{p}.self_attn.k_proj.weight", (KV, HIDDEN)),
                   (f"{p}.self_attn.v_proj.weight", (KV, HIDDEN)),
                   (f"{p}.self_attn.o_proj.weight", (HIDDEN, HIDDEN)),
                   (f"{p}.post_attention_layernorm.weight", (HIDDEN,)),
                   (f"{p}.mlp.gate_proj.weight", (INTERMEDIATE, HIDDEN)),
                   (f"{p}.mlp.up_proj.weight", (INTERMEDIATE, HIDDEN)),
                   (f"{p}.mlp.down_proj.weight", (HIDDEN, INTERMEDIATE))]
    return shapes + [("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB, HIDDEN))]


def generate(path: Path) -> None:
    """Stream a TinyLlama-shaped BF16 checkpoint to ``path`` (deterministic: seeded per tensor)."""
    shapes = tinyllama_shapes()
    with SafetensorsWriter(path, [(name, "BF16", shape) for name, shape in shapes], {"format": "pt"}) as writer:
        for index, (name, shape) in enumerate(shapes):
            g = torch.Generator().manual_seed(index)
            n = torch.Size(shape).numel()
            rows = torch.empty(n, dtype=torch.bfloat16)
            for start in range(0, n, 1 << 22):  # float32 temporaries of 16 MB at most
                stop = min(start + (1 << 22), n)
                values = torch.randn(stop - start, generator=g)
                rows[start:stop] = 1 + values * 0.05 if len(shape) == 1 else values * 0.02
            writer.write(rows.view(torch.uint8))


STEP = """
import json, re, resource, sys, time
import torch, szformat, szformat.convert
src, out = {src!r}, {out!r}
def cpu():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime
start, start_cpu = time.perf_counter(), cpu()
{body}
seconds, cpu_seconds = time.perf_counter() - start, cpu() - start_cpu
peak_kb = int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1))
print(json.dumps({{"seconds": seconds, "cpu_seconds": cpu_seconds, "peak_rss": peak_kb * 1024}}))
"""
"""One measured step. The peak is VmHWM, the high-water mark of this process image's resident set: ``ru_maxrss``
would also count the parent's resident set at the fork (Linux carries it across ``exec``)."""

STEPS = {
    "import": "pass",
    "safetensors load+save": "from safetensors.torch import load_file, save_file\n"
                             "save_file(load_file(src), out + '/copy.safetensors', metadata={'format': 'pt'})",
    "file copy": "import shutil; shutil.copyfile(src, out + '/copy.bin')",
    "convert": "szformat.convert.convert(src, out + '/model.szt', overwrite=True)",
    "verify": "assert szformat.convert.verify(out + '/model.szt').ok",
    "decompress": "szformat.convert.decompress(out + '/model.szt', out + '/back.safetensors', overwrite=True)",
    "convert --at-rest zstd": "szformat.convert.convert(src, out + '/rest.szt', at_rest=1, overwrite=True)",
    "verify (at rest)": "assert szformat.convert.verify(out + '/rest.szt').ok",
    "decompress (at rest)": "szformat.convert.decompress(out + '/rest.szt', out + '/back-rest.safetensors', "
                            "overwrite=True)",
}


WRITES = {
    "safetensors load+save": ("copy.safetensors",),
    "file copy": ("copy.bin",),
    "convert": ("model.szt",),
    "decompress": ("back.safetensors",),
    "convert --at-rest zstd": ("rest.szt",),
    "decompress (at rest)": ("back-rest.safetensors",),
}
"""What each step writes, removed before each of its runs: a run over the last one's output would also time the
removal of the old file (its page cache freed by the rename over it: 9 ms of a 130 ms conversion of MiniLM in one
profile on the 2-core VM)."""


DONE_WITH = {
    "safetensors load+save": WRITES["safetensors load+save"],
    "file copy": WRITES["file copy"],
    "decompress": WRITES["decompress"] + WRITES["convert"],
    "decompress (at rest)": WRITES["decompress (at rest)"] + WRITES["convert --at-rest zstd"],
}
"""Outputs no later step reads (a step's own, and the .szt file the last step reading it read): checked (a decompressed file against the source, a .szt file's size) and removed
once their step is done, unless ``--keep``, so every step runs with the same files in the page cache: the source
and its own outputs. (Left in place, 10 GB of earlier outputs filled the 24 GB build VM's memory, and the later
steps' writes went to pages the kernel had to reclaim first: the at-rest conversion, sixth, took 3-4 s of system
time where it took about 1 s run on its own.)"""


def check_and_remove(name: str, src: Path, out: Path, keep: bool) -> list[str]:
    """What the outputs ``name`` leaves say (see :data:`DONE_WITH`); removes them unless ``keep``."""
    size, lines = src.stat().st_size, []
    for file in DONE_WITH.get(name, ()):
        path = out / file
        if file.startswith("back"):
            lines.append(f"{file} byte-identical to the source: {filecmp.cmp(path, src, shallow=False)}")
        elif file.endswith(".szt"):
            lines.append(f"{file}: {path.stat().st_size / 1e9:.3f} GB (ratio {path.stat().st_size / size:.4f})")
        if not keep:
            path.unlink()
    return lines


def warm(path: Path) -> None:
    """Read ``path`` once, so that it is in the page cache."""
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


def run_step(body: str, src: Path, out: Path) -> dict:
    code = STEP.format(src=str(src), out=str(out), body=body)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/szbench"))
    parser.add_argument("--keep", action="store_true", help="keep the outputs (the source is always kept)")
    parser.add_argument("--source", type=Path, help="a BF16 safetensors file to convert instead of the generated one")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each step, median reported (default 1)")
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    src = args.source or args.dir / "tinyllama-shapes-bf16.safetensors"
    if not src.exists():
        print(f"generating {src} ...", flush=True)
        generate(src)
    size = src.stat().st_size
    warm(src)
    out = args.dir / "out"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()

    largest = "" if args.source else f", largest tensor {VOCAB * HIDDEN * 2 / 1e6:.0f} MB"
    print(f"source: {src.name}, {size / 1e9:.2f} GB{largest}; torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}, median of {args.repeats}")
    print(f"{'step':<24}{'seconds':>9}{'MB/s':>9}{'MB/cpu-s':>10}{'peak RSS MB':>13}{'% of file':>11}")
    checks = []
    for name, body in STEPS.items():
        runs = []
        for _ in range(args.repeats):
            for file in WRITES.get(name, ()):
                (out / file).unlink(missing_ok=True)
            for stored in out.glob("*.szt"):
                warm(stored)
            runs.append(run_step(body, src, out))
        result = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        rate = size / 1e6 / result["seconds"] if name != "import" else float("nan")
        cpu_rate = size / 1e6 / result["cpu_seconds"] if name != "import" else float("nan")
        rss = result["peak_rss"]
        print(f"{name:<24}{result['seconds']:>9.2f}{rate:>9.1f}{cpu_rate:>10.1f}{rss / 1e6:>13.0f}"
              f"{100 * rss / size:>10.1f}%", flush=True)
        checks += check_and_remove(name, src, out, args.keep)
    print("\n".join(checks))
    if not args.keep:
        shutil.rmtree(out)


if __name__ == "__main__":
    main()
