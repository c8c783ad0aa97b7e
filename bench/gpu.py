"""Time the GPU codec on one GPU, next to the device-to-device copy ceiling measured in the same run.

    python -m bench.gpu [--safetensors model.safetensors] [--markdown results.md] [--planes-only]

Rates are raw BF16 bytes over time (CUDA events around each call, warm-up first, median of the repetitions, inputs
rotated among several buffer sets so that no repetition reads what the last one left in L2). The copy ceiling counts
bytes read plus bytes written; a decode moves ``comp_bytes + 2 n`` bytes, so its roofline is
``2 n / (comp_bytes + 2 n)`` of the copy rate (about 3.5 bytes per element for typical weights).

The Triton cache is pointed at an empty folder first, so the first call of each entry point includes compilation.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from typing import Callable, Iterator

os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="szformat-triton-cache-")

import torch  # noqa: E402

from szformat.codec import gpu  # noqa: E402

from .checks.codec_gpu import batch_layout, load_checkpoint  # noqa: E402

DEVICE = torch.device("cuda")
REPS = 30
ROWS: list[tuple[str, str, str]] = []  # (what, figure, note) for the final table


def report(what: str, figure: str, note: str = "") -> None:
    ROWS.append((what, figure, note))
    print(f"{what:<52} {figure:>14}  {note}", flush=True)


def median_ms(run: Callable[[int], None], reps: int = REPS, warmup: int = 3,
              before: Callable[[int], None] | None = None) -> float:
    """Median device time of ``run(i)``; ``before(i)`` runs untimed ahead of each repetition, on the same stream."""
    for i in range(warmup):
        if before:
            before(i)
        run(i)
    times = []
    for i in range(reps):
        if before:
            before(i)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run(i)
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in times)


def gbps(nbytes: float, ms: float) -> str:
    return f"{nbytes / ms / 1e6:,.0f} GB/s"


@contextlib.contextmanager
def tuned(**values: int) -> Iterator[None]:
    """Run with other tile shapes (a tuning sweep): ``values`` override the kernel modules' module-level settings,
    which are restored afterwards."""
    from szformat.codec.gpu import _batch, _decode, _encode

    saved = [(m, name, getattr(m, name)) for m in (_decode, _batch, _encode) for name in values if hasattr(m, name)]
    for m, name, _ in saved:
        setattr(m, name, values[name])
    try:
        yield
    finally:
        for m, name, value in saved:
            setattr(m, name, value)


def first_call_seconds(call: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    call()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def bench_compile() -> None:
    x = (torch.randn(100_001, device=DEVICE) * 0.02).to(torch.bfloat16)
    seconds = first_call_seconds(lambda: gpu.encode(x))
    payload, layout, codebook = gpu.encode(x)
    seconds_again = first_call_seconds(lambda: gpu.encode(x))
    report("first use: encode (compiles its kernels)", f"{seconds:.2f} s", f"then {seconds_again * 1e3:.2f} ms")
    seconds = first_call_seconds(lambda: gpu.decode(payload, layout, codebook))
    report("first use: decode (compile 2 kernels)", f"{seconds:.2f} s")
    table = gpu.build_batch_table([(layout, codebook, 0, 0)], device=DEVICE)
    seconds = first_call_seconds(lambda: gpu.decode_batch(payload, table))
    report("first use: decode_batch (compile 2 kernels)", f"{seconds:.2f} s")


def bench_copy(nbytes: int) -> float:
    sources = [torch.empty(nbytes, dtype=torch.uint8, device=DEVICE).fill_(i) for i in range(2)]
    targets = [torch.empty(nbytes, dtype=torch.uint8, device=DEVICE) for _ in range(2)]
    ms = median_ms(lambda i: targets[i % 2].copy_(sources[i % 2]))
    rate = 2 * nbytes / ms / 1e6
    report(f"device-to-device copy, {nbytes >> 20} MiB (read+write)", f"{rate:,.0f} GB/s", "the ceiling")
    return rate


def bench_single(n: int, copy_rate: float) -> None:
    sets = [(torch.randn(n, device=DEVICE) * 0.02).to(torch.bfloat16) for _ in range(2)]
    encoded = [gpu.encode(x) for x in sets]
    outs = [torch.empty(n, dtype=torch.bfloat16, device=DEVICE) for _ in range(2)]
    for (payload, layout, codebook), x, out in zip(encoded, sets, outs):
        assert torch.equal(gpu.decode(payload, layout, codebook, out=out).view(torch.int16), x.view(torch.int16))
    layout = encoded[0][1]
    roofline = copy_rate * 2 * n / (2 * n + layout.comp_bytes)
    size = f"{2 * n >> 20} MiB"
    report(f"decode roofline at the copy rate, {size}", f"{roofline:,.0f} GB/s",
           f"ratio {layout.comp_bytes / (2 * n):.3f}, {layout.n_esc} escapes")
    for rows, warps in ((512, 4), (512, 8), (1024, 8), (256, 4)):
        with tuned(ROWS=rows, DECODE_WARPS=warps):
            ms = median_ms(lambda i: gpu.decode(*encoded[i % 2], out=outs[i % 2]))
        report(f"decode {size}, ROWS={rows} warps={warps}", gbps(2 * n, ms), f"{ms * 1e3:.0f} us")

    slot = max(layout.raw_bytes, layout.comp_bytes)
    slots = [torch.empty(slot, dtype=torch.uint8, device=DEVICE) for _ in range(2)]
    scratch = gpu.DecodeScratch()
    ms = median_ms(lambda i: gpu.decode_in_place(slots[i % 2], *encoded[i % 2][1:], scratch=scratch),
                   before=lambda i: slots[i % 2][: encoded[i % 2][1].comp_bytes].copy_(encoded[i % 2][0]))
    report(f"in-place slot decode {size} (stash + decode)", gbps(2 * n, ms), f"{ms * 1e3:.0f} us")
    bench_scattered(f"{size}, one tensor", encoded, copy_rate)

    for settings in ({}, {"HISTOGRAM_WINDOW": 64}, {"HISTOGRAM_ROWS": 256}, {"HISTOGRAM_PROGRAMS_PER_SM": 4},
                     {"PACK_ROWS": 512}, {"PACK_WARPS": 4}):
        with tuned(**settings):
            ms = median_ms(lambda i: gpu.encode(sets[i % 2]))
            hist_ms = median_ms(lambda i: histogram_only(sets[i % 2]))
        label = ", ".join(f"{k}={v}" for k, v in settings.items()) or "defaults"
        report(f"encode {size} (1 host sync), {label}", gbps(2 * n, ms),
               f"{ms * 1e3:.0f} us, histogram pass {hist_ms * 1e3:.0f} us")


def bench_scattered(label: str, encoded: list[tuple], copy_rate: float, tensors_per_group: int = 1) -> None:
    """The offload routes' path: payloads in a staging buffer, each decoded into its own, separately allocated
    destination by one ``decode_batch_at`` (per group of ``tensors_per_group``); against a copy of the raw bytes."""
    groups = [encoded[i: i + tensors_per_group] for i in range(0, len(encoded), tensors_per_group)]
    prepared = []
    for group in groups:
        entries, offset = [], 0
        staging = torch.empty(sum(-(-l.comp_bytes // 16) * 16 for _, l, _ in group), dtype=torch.uint8,
                              device=DEVICE)
        outputs = [torch.empty(l.n, dtype=torch.bfloat16, device=DEVICE) for _, l, _ in group]
        base = min(outputs, key=torch.Tensor.data_ptr)
        for (payload, layout, codebook), out in zip(group, outputs):
            staging[offset: offset + layout.comp_bytes] = payload
            entries.append((layout, codebook, offset, (out.data_ptr() - base.data_ptr()) // 2))
            offset += -(-layout.comp_bytes // 16) * 16
        prepared.append((staging, gpu.build_batch_table(entries, device=DEVICE), base, outputs))
    staging, table, base, outputs = prepared[0]
    gpu.decode_batch_at(staging, table, base)
    for (payload, layout, codebook), out in zip(groups[0], outputs):
        assert torch.equal(out.view(torch.int16), gpu.decode(payload, layout, codebook).view(torch.int16))
    raw = sum(2 * l.n for group in groups[:1] for _, l, _ in group)
    ms = median_ms(lambda i: gpu.decode_batch_at(*prepared[i % len(prepared)][:3]))
    report(f"scattered decode out of staging (offload routes), {label}", gbps(raw, ms),
           f"{ms * 1e3:.0f} us, x {raw * 2 / ms / 1e6 / copy_rate:.2f} of a copy of the raw size")


def bench_join_planes(copy_rate: float, nbytes: int = 1 << 30) -> None:
    """The byte-plane join of a GPU load of a raw tensor at rest (.szt 1.2), FP32 and FP16 in 1 MiB frames (the
    writer's), against the copy ceiling: it reads and writes each byte once, as a copy does."""
    from szformat.codec import planes

    frame = 1 << 20
    for itemsize, dtype in ((4, torch.float32), (2, torch.float16)):
        x = (torch.randn(nbytes // itemsize, device=DEVICE) * 0.02).to(dtype)
        raw = x.view(torch.uint8).cpu().numpy()
        split = raw.copy()
        for start in range(0, raw.size, frame):
            planes.split_planes(memoryview(raw[start: start + frame]), memoryview(split[start: start + frame]),
                                itemsize, True)
        sources = [torch.from_numpy(split).to(DEVICE) for _ in range(2)]
        outs = [torch.empty(nbytes, dtype=torch.uint8, device=DEVICE) for _ in range(2)]
        gpu.join_planes(sources[0], outs[0], itemsize, frame, True)
        assert torch.equal(outs[0], x.view(torch.uint8)), "join_planes is not exact"
        ms = median_ms(lambda i: gpu.join_planes(sources[i % 2], outs[i % 2], itemsize, frame, True))
        rate = 2 * nbytes / ms / 1e6
        report(f"join byte planes, {str(dtype)[6:]}, {nbytes >> 20} MiB (read+write)", f"{rate:,.0f} GB/s",
               f"{rate / copy_rate:.2f} of the copy, {ms * 1e3:.0f} us")


def histogram_only(x: torch.Tensor) -> None:
    """The encoder's first pass alone, to split its time."""
    from szformat.codec.gpu import _encode

    hist = torch.zeros(256, dtype=torch.int64, device=DEVICE)
    bits = x.view(torch.int16)
    programs = min(_encode.program_slots(DEVICE, _encode.HISTOGRAM_PROGRAMS_PER_SM),
                   -(-bits.numel() // (_encode.HISTOGRAM_ROWS * 8)))
    _encode._histogram_kernel[(programs,)](bits, hist, bits.numel(), ROWS=_encode.HISTOGRAM_ROWS,
                                           WINDOW=_encode.HISTOGRAM_WINDOW, num_warps=8)


def bench_batch(name: str, tensors: list[torch.Tensor], copies: int) -> None:
    """A whole checkpoint in one batch; ``copies`` buffer sets rotate so that L2 holds none of the next inputs."""
    encoded = [gpu.encode(x.to(DEVICE)) for x in tensors]
    payloads, entries, out_elements = batch_layout(encoded)
    raw = sum(2 * x.numel() for x in tensors)
    comp = sum(l.comp_bytes for _, l, _ in encoded)
    sets = [(payloads.clone(), torch.empty(out_elements, dtype=torch.bfloat16, device=DEVICE)) for _ in range(copies)]
    table = gpu.build_batch_table(entries, device=DEVICE)
    gpu.decode_batch(sets[0][0], table, out=sets[0][1])
    for x, (layout, _, _, offset) in zip(tensors, entries):
        assert torch.equal(sets[0][1][offset: offset + layout.n].view(torch.int16), x.to(DEVICE).view(torch.int16))
    label = f"{name}: {len(tensors)} tensors, {raw / 1e6:,.1f} MB"
    launches = count_kernels(lambda: gpu.decode_batch(sets[0][0], table, out=sets[0][1]))
    report(f"{name}: kernel launches per checkpoint", f"{launches}", f"{len(tensors)} tensors (table says "
                                                                     f"{table.launches})")
    ms = median_ms(lambda i: gpu.decode_batch(sets[i % copies][0], table, out=sets[i % copies][1]))
    report(f"batched decode, {label}", gbps(raw, ms), f"{ms * 1e3:.0f} us, ratio {comp / raw:.3f}")
    graphs = []
    for payload_set, out_set in sets:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            gpu.decode_batch(payload_set, table, out=out_set)
        graphs.append(graph)
    ms = median_ms(lambda i: graphs[i % copies].replay())
    report(f"batched decode, {label}, graph replay", gbps(raw, ms), f"{ms * 1e3:.0f} us")


def count_kernels(call: Callable[[], object]) -> int | str:
    """Kernels one call launches, as the profiler sees them."""
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    except Exception as e:  # noqa: BLE001 - the profiler is optional here
        return f"n/a ({type(e).__name__})"


def llm_shaped(layers: int, hidden: int, ffn: int) -> list[torch.Tensor]:
    """Weights shaped like a decoder LLM's layers (generated on the GPU, std 0.02; norms near 1)."""
    tensors = []
    for _ in range(layers):
        tensors += [(torch.randn(hidden * hidden, device=DEVICE) * 0.02).bfloat16() for _ in range(4)]
        tensors += [(torch.randn(hidden * ffn, device=DEVICE) * 0.02).bfloat16() for _ in range(3)]
        tensors += [(1 + torch.randn(hidden, device=DEVICE) * 0.05).bfloat16() for _ in range(2)]
    return tensors


def bench_rest(args: argparse.Namespace, copy_rate: float) -> None:
    """Compilation, the decoders and the encoder."""
    bench_compile()
    bench_single(1 << 28, copy_rate)
    if args.safetensors:
        checkpoint = load_checkpoint(args.safetensors)
        name = os.path.splitext(os.path.basename(args.safetensors))[0]
        bench_batch(name, list(checkpoint.values()), copies=6)
    bench_batch("LLM-shaped, 4 layers", llm_shaped(4, 4096, 11008), copies=2)
    block = [gpu.encode(x) for x in llm_shaped(2, 4096, 11008) if x.numel() > 4096]  # two blocks of 7 weights
    bench_scattered("7B-shaped blocks of 7 weights", block, copy_rate, tensors_per_group=7)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--safetensors", help="a real checkpoint to decode whole, batched (FP32 rounded to BF16)")
    parser.add_argument("--markdown", help="also write the table here, as Markdown")
    parser.add_argument("--planes-only", action="store_true", help="time only the copy and the byte-plane join")
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(DEVICE)
    import triton

    print(f"device: {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, "
          f"triton {triton.__version__}", flush=True)
    copy_rate = bench_copy(1 << 30)
    bench_join_planes(copy_rate)
    if not args.planes_only:
        bench_rest(args, copy_rate)

    lines = ["| what | figure | note |", "| --- | ---: | --- |"] + [f"| {w} | {f} | {n} |" for w, f, n in ROWS]
    print("\n" + "\n".join(lines))
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
