"""Check on a CUDA GPU that every device-loading path gives tensors bit-identical to the safetensors original.

    python -m bench.checks.load_gpu --minilm .data/minilm-bf16.safetensors --work /tmp/szload \
        [--synthetic-gb 4.2] [--at-rest]

Builds the checkpoints (MiniLM as one file and as two shards, and a synthetic BF16 checkpoint of LLM-like shapes
whose values are MiniLM's weights tiled, so the exponent statistics are real ones), converts them on the GPU, then
loads each through every path and compares every tensor with ``safetensors.torch.load_file(..., device="cuda")``
of the original, bit for bit. Paths: ``load_file`` with the registered page cache, with staged reads, with small
slots (many packed and streamed transfers), with the host-decode route; ``safe_open(...).get_tensor`` one tensor at a
time; the sharded index; the staging-pool decoder (both routes); the slot decoder. With ``--at-rest`` each
checkpoint is also repacked into its at-rest form (.szt 1.1) and checked through the same paths, but the slot
decoder, which takes a descriptor of stored bytes (refused for a tensor stored at rest, by design). Exits 1 on any
mismatch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file as st_load_file
from safetensors.torch import save_file as st_save_file

import szformat
from szformat.convert import convert, repack
from szformat.errors import ChecksumMismatchError
from szformat.format.at_rest import DEFAULT_FRAME_SIZE, DEFAULT_LEVEL
from szformat.format.reader import SztFile
from szformat.loading import (
    DeviceLoader,
    SlotDecoder,
    StagingConfig,
    StagingPoolDecoder,
)

DEVICE = torch.device("cuda")
AT_REST = ", at rest"
"""Suffix of the name of a checkpoint's at-rest copy (:func:`at_rest_copy`)."""
SHAPES = {"hidden": 4096, "inter": 11008, "vocab": 32000}
"""Synthetic checkpoint shapes (a 7B-class decoder's)."""


@dataclass(frozen=True)
class Checkpoint:
    name: str
    safetensors: Path
    szt: Path
    raw_bytes: int
    stored_bytes: int
    tensors: int


def _sizes(szt: Path) -> tuple[int, int, int, int]:
    """Raw bytes, stored bytes, tensor count, and the largest raw tensor of a .szt file or folder."""
    raw = stored = count = largest = 0
    for path in _files(szt):
        with SztFile(path) as f:
            for e in f.entries.values():
                raw, stored, count = raw + e.raw_length, stored + e.length, count + 1
                largest = max(largest, e.raw_length)
    return raw, stored, count, largest


def llama_shapes(target_bytes: int) -> dict[str, tuple[int, ...]]:
    """The BF16 tensors of a 7B-class decoder (:data:`SHAPES`) with as many layers as make about ``target_bytes``:
    embedding, attention and MLP matrices and norms of each layer, final norm, LM head, in file order."""
    hidden, inter, vocab = SHAPES["hidden"], SHAPES["inter"], SHAPES["vocab"]
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    layer_bytes = 2 * (4 * hidden * hidden + 3 * hidden * inter + 2 * hidden)
    layers = max(1, round((target_bytes - 2 * 2 * vocab * hidden) / layer_bytes))
    for i in range(layers):
        p = f"model.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[p + f"self_attn.{proj}.weight"] = (hidden, hidden)
        shapes[p + "mlp.gate_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.up_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, inter)
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def at_rest_copy(ckpt: Checkpoint, frame_size: int = DEFAULT_FRAME_SIZE) -> Checkpoint:
    """``ckpt`` repacked into its at-rest form (frames of ``frame_size``) beside it (once), as a checkpoint of its
    own."""
    suffix = ".szt" if ckpt.szt.is_file() else ""
    size = "" if frame_size == DEFAULT_FRAME_SIZE else f"-{frame_size >> 10}k"
    target = ckpt.szt.with_name(ckpt.szt.name.removesuffix(".szt") + "-at-rest" + size + suffix)
    if not target.exists():
        repack(ckpt.szt, target, at_rest=DEFAULT_LEVEL, frame_size=frame_size)
        os.sync()
    return replace(ckpt, name=ckpt.name + AT_REST, szt=target, stored_bytes=_sizes(target)[1])


def synthetic_tensors(source: dict[str, torch.Tensor], target_bytes: int, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """:func:`llama_shapes` filled with the 2-D weights of ``source`` (matrices) or its LayerNorm weights (norms),
    tiled from a random start, on the GPU."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.cat([t.reshape(-1) for t in source.values() if t.dtype == torch.bfloat16 and t.dim() == 2]).to(DEVICE)
    norms = torch.cat([t for name, t in source.items() if "LayerNorm.weight" in name]).to(DEVICE)

    def tiled(values: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        n = math.prod(shape)
        start = int(torch.randint(values.numel(), (1,), generator=gen))
        reps = -(-(n + start) // values.numel())
        return values.repeat(reps)[start: start + n].reshape(shape).clone()

    shapes = llama_shapes(target_bytes)
    return {name: tiled(pool if len(shape) == 2 else norms, shape) for name, shape in shapes.items()}


def gaussian_tensors(target_bytes: int, dtype: torch.dtype, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """:func:`llama_shapes` of about ``target_bytes`` in ``dtype``, filled with ``randn * 0.02`` (norms: ones plus
    noise) cast from FP32: what an FP32, FP16 or FP8 checkpoint's exponents and mantissas look like."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    shapes = llama_shapes(target_bytes * 2 // itemsize)  # its sizes count BF16 bytes
    return {name: ((torch.randn(shape, generator=gen, device=DEVICE) * 0.02) + (len(shape) == 1)).to(dtype)
            for name, shape in shapes.items()}


def prepare(minilm: Path | None, work: Path, synthetic_gb: float, *, device: str = "cuda",
            dtype: str = "BF16") -> list[Checkpoint]:
    """Write and convert the checkpoints (on the GPU) unless ``work`` already holds them; the synthetic one in
    ``dtype`` (BF16: MiniLM's weights tiled; other dtypes: :func:`gaussian_tensors`). Without ``minilm`` only a
    synthetic checkpoint of another dtype is made."""
    work.mkdir(parents=True, exist_ok=True)
    if minilm is None and dtype == "BF16":
        raise ValueError("the BF16 checkpoints are made from MiniLM's weights: give its BF16 model.safetensors")
    source = st_load_file(minilm) if minilm is not None else {}
    made = []

    def add(name: str, st: Path, szt: Path, build: Callable[[], None]) -> None:
        if not szt.exists():
            started = time.perf_counter()
            build()
            print(f"prepared {name} in {time.perf_counter() - started:.1f} s", flush=True)
        made.append(Checkpoint(name, st, szt, *_sizes(szt)[:3]))

    def minilm_single() -> None:
        convert(minilm, work / "minilm.szt", device=device)

    def minilm_sharded() -> None:
        folder = work / "minilm-sharded-st"
        folder.mkdir(exist_ok=True)
        names = list(source)
        half = len(names) // 2
        shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
        for shard, keys in shards.items():
            st_save_file({k: source[k] for k in keys}, folder / shard)
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {k: s for s, keys in shards.items() for k in keys}}))
        convert(folder, work / "minilm-sharded", device=device)

    stem = "synthetic" if dtype == "BF16" else f"synthetic-{dtype}"

    def synthetic() -> None:
        tensors = synthetic_tensors(source, int(synthetic_gb * 1e9)) if dtype == "BF16" else \
            gaussian_tensors(int(synthetic_gb * 1e9), szformat.format.constants.DTYPES[dtype][0])
        st_save_file({k: v.cpu() for k, v in tensors.items()}, work / f"{stem}.safetensors")
        del tensors
        convert(work / f"{stem}.safetensors", work / f"{stem}.szt", device=device)

    if minilm is not None:
        add("MiniLM-L6 BF16", minilm, work / "minilm.szt", minilm_single)
        add("MiniLM-L6 BF16, 2 shards", minilm, work / "minilm-sharded", minilm_sharded)
    if synthetic_gb > 0:
        add(f"synthetic {dtype} {synthetic_gb:g} GB", work / f"{stem}.safetensors", work / f"{stem}.szt", synthetic)
    os.sync()  # written pages are clean before anything is timed
    return made


# -- the paths --------------------------------------------------------------------------------------------------


def via_load_file(**kwargs) -> Callable[[Path], dict[str, torch.Tensor]]:
    return lambda szt: szformat.load_file(szt, device="cuda", **kwargs)


def via_loader(staging: StagingConfig, route: str = "gpu") -> Callable[[Path], dict[str, torch.Tensor]]:
    """Through a DeviceLoader directly, so that a transport the driver refuses fails instead of falling back."""

    def load(szt: Path) -> dict[str, torch.Tensor]:
        with DeviceLoader("cuda", route=route, staging=staging) as loader:
            return {k: v for file in _files(szt) for k, v in _load_one(loader, file).items()}

    return load


def _files(szt: Path) -> list[Path]:
    return sorted(szt.glob("*.szt")) if szt.is_dir() else [szt]


def _load_one(loader: DeviceLoader, path: Path) -> dict[str, torch.Tensor]:
    with SztFile(path) as f:
        return loader.load(f)


def via_safe_open(szt: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in _files(szt):
        with szformat.safe_open(path, framework="pt", device="cuda") as f:
            for name in f.keys():
                out[name] = f.get_tensor(name)
    return out


def via_staging_pool(route: str) -> Callable[[Path], dict[str, torch.Tensor]]:
    """Groups of tensors staged into a pool of 96 MiB slots (or the largest tensor's size) and uploaded into one
    device buffer per group."""

    def load(szt: Path) -> dict[str, torch.Tensor]:
        largest = max(_sizes(path)[3] for path in _files(szt))
        pool = StagingPoolDecoder(max(96 << 20, largest + 256), 2, route=route)
        stream = torch.cuda.Stream()
        out = {}
        for path in _files(szt):
            with SztFile(path) as f:
                pending = list(f.entries.values())
                while pending:
                    pool.begin_upload()
                    group = []
                    while pending and pool.packed_bytes + pending[0].raw_length + 256 <= pool.size_bytes:
                        group.append(pool.stage(f, pending.pop(0).name))
                    if not group:
                        raise RuntimeError(f"{pending[0].name} does not fit a staging slot")
                    dest = torch.empty(pool.packed_bytes, dtype=torch.uint8, device=DEVICE)
                    done = pool.upload(dest, stream)
                    torch.cuda.current_stream().wait_event(done)
                    for e in group:
                        entry = f.entry(e.name)
                        dtype = szformat.format.constants.DTYPES[entry.dtype][0]
                        out[e.name] = dest[e.offset: e.offset + e.raw_length].view(dtype).reshape(entry.shape)
        torch.cuda.synchronize()
        return out

    return load


def via_slot_decoder(szt: Path) -> dict[str, torch.Tensor]:
    """The native-transport pattern: the payload DMA'd into a raw-sized slot on a stream, expanded there."""
    decoder = SlotDecoder("cuda")
    stream = torch.cuda.Stream()
    out = {}
    for path in _files(szt):
        with SztFile(path) as f:
            for name in f.entries:
                d = f.descriptor(name)
                pinned = f.payload(name).pin_memory()
                slot = torch.empty(max(d.raw_length, d.length), dtype=torch.uint8, device=DEVICE)
                with torch.cuda.stream(stream):
                    slot[: d.length].copy_(pinned, non_blocking=True)
                ready = decoder.expand(slot, d, stream)
                torch.cuda.current_stream().wait_event(ready)
                dtype = szformat.format.constants.DTYPES[d.dtype][0]
                out[name] = slot[: d.raw_length].view(dtype).reshape(d.shape)
    torch.cuda.synchronize()
    return out


PATHS: dict[str, Callable[[Path], dict[str, torch.Tensor]]] = {
    "load_file (defaults)": via_load_file(),
    "load_file, verify off": via_load_file(verify=False),
    "registered page cache": via_loader(StagingConfig(transport="registered")),
    "staged reads, 8 threads": via_loader(StagingConfig(transport="staged", threads=8)),
    "staged, 64 MiB x 4 slots": via_loader(StagingConfig(slot_bytes=64 << 20, slots=4, transport="staged")),
    "small slots (1 MiB x 3)": via_loader(StagingConfig(slot_bytes=1 << 20, slots=3, transport="staged")),
    "host-decode route": via_load_file(route="cpu"),
    "safe_open.get_tensor": via_safe_open,
    "staging pool, GPU expand": via_staging_pool("gpu"),
    "staging pool, CPU decode": via_staging_pool("cpu"),
    "slot decoder": via_slot_decoder,
}
SHARDED_PATHS = {"load_file (index)": lambda d: szformat.load_file(d / "model.szt.index.json", device="cuda"),
                 "load_file (folder)": via_load_file()}


def compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """Names whose dtype, shape or bytes differ (and names missing on either side)."""
    bad = sorted(set(got) ^ set(want))
    for name in set(got) & set(want):
        a, b = got[name], want[name]
        if a.device.type != "cuda" or a.dtype != b.dtype or a.shape != b.shape or not torch.equal(
                a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
            bad.append(name)
    return bad


def corrupted_copy_is_refused(ckpt: Checkpoint, work: Path) -> dict:
    """A copy of the checkpoint with one bit flipped inside its largest payload: the default load must raise
    ChecksumMismatchError naming that tensor (the check rides along with the reads), and a load with
    ``verify=False`` must still run."""
    with SztFile(ckpt.szt) as f:
        entry = max(f.entries.values(), key=lambda e: e.length)
    data = bytearray(ckpt.szt.read_bytes())
    data[entry.offset + entry.length - 5] ^= 0x10
    bad = work / "corrupted.szt"
    bad.write_bytes(bytes(data))
    problems = []
    try:
        szformat.load_file(bad, device="cuda")
        problems.append("no error")
    except ChecksumMismatchError as e:
        if e.tensor != entry.name:
            problems.append(f"error names {e.tensor}")
    try:
        szformat.load_file(bad, device="cuda", verify=False)
    except Exception as e:  # a flipped bit in the payload must not stop an unverified load
        problems.append(f"verify=False raised {type(e).__name__}: {e}")
    bad.unlink()
    print(f"{ckpt.name:<28} {'corrupted copy refused':<28} {'ok' if not problems else problems}", flush=True)
    return {"checkpoint": ckpt.name, "path": "corrupted copy refused", "tensors": 1, "mismatches": len(problems),
            "first": problems[0] if problems else "", "error": "", "seconds": 0.0}


def check(checkpoints: list[Checkpoint], skip_slow_on_large: bool = True) -> list[dict]:
    rows = []
    for ckpt in checkpoints:
        want = st_load_file(ckpt.safetensors, device="cuda")
        sharded = ckpt.szt.is_dir()
        paths = SHARDED_PATHS if sharded else PATHS
        for label, load in paths.items():
            if skip_slow_on_large and ckpt.raw_bytes > 1e9 and label in ("safe_open.get_tensor", "slot decoder"):
                continue  # one synchronous call per tensor: covered on MiniLM
            if label == "slot decoder" and ckpt.name.endswith(AT_REST):
                continue  # descriptors of tensors stored at rest are refused
            started = time.perf_counter()
            try:
                bad = compare(load(ckpt.szt), want)
                error = ""
            except Exception as e:  # report and go on: one broken path must not hide the others
                bad, error = ["<raised>"], f"{type(e).__name__}: {e}"
            seconds = time.perf_counter() - started
            rows.append({"checkpoint": ckpt.name, "path": label, "tensors": ckpt.tensors, "mismatches": len(bad),
                         "first": bad[0] if bad else "", "error": error, "seconds": round(seconds, 3)})
            print(f"{ckpt.name:<28} {label:<28} {'ok' if not bad else 'MISMATCH ' + str(bad[:3])} {error}",
                  flush=True)
            torch.cuda.empty_cache()
        del want
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minilm", type=Path, required=True, help="MiniLM-L6 BF16 model.safetensors")
    parser.add_argument("--work", type=Path, default=Path("/tmp/szload"))
    parser.add_argument("--synthetic-gb", type=float, default=4.2)
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--at-rest", action="store_true", help="check each checkpoint in its at-rest form too")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    checkpoints = prepare(args.minilm, args.work, args.synthetic_gb)
    if args.at_rest:
        checkpoints += [at_rest_copy(c) for c in checkpoints]
    rows = check(checkpoints) + [corrupted_copy_is_refused(checkpoints[0], args.work)]
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    failed = [r for r in rows if r["mismatches"]]
    print(f"\n{len(rows) - len(failed)}/{len(rows)} path checks bit-exact")
    for r in failed:
        print(f"FAILED {r['checkpoint']} / {r['path']}: {r['mismatches']} tensor(s), first {r['first']} {r['error']}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
