"""Host time of each CUDA call a resident group's hooks make (``route="resident"``), one call at a time.

    python -m bench.hook_calls [--calls 20000]

A group's hooks run on the host between two blocks' kernels; where a forward is bound by the host (decoding at
batch 1, a DiT whose kernels are short) every microsecond they take is added to it. Each row is the median over 5
runs of ``--calls`` calls, in microseconds per call, beside a Python call that does nothing (the anchor).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable

import torch


def per_call_us(call: Callable[[], object], calls: int) -> float:
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        runs.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(runs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args(argv)
    device = torch.device("cuda", torch.cuda.current_device())
    side = torch.cuda.Stream(device)
    compute = torch.cuda.current_stream(device)
    reused = torch.cuda.Event(blocking=True)
    reused.record(side)
    slot = torch.empty(1 << 20, dtype=torch.bfloat16, device=device)
    parameter = torch.nn.Parameter(torch.empty(1024, 1024, dtype=torch.bfloat16, device=device), requires_grad=False)
    view = slot[: 1 << 20].view(1024, 1024)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        slot.add_(1)

    def new_event() -> None:
        torch.cuda.Event(blocking=True).record(side)

    def with_device_and_stream() -> None:
        with torch.cuda.device(device), torch.cuda.stream(side):
            pass

    def with_stream() -> None:
        with torch.cuda.stream(side):
            pass

    def set_stream_there_and_back() -> None:
        torch.cuda.set_stream(side)
        torch.cuda.set_stream(compute)

    def replay_on_side() -> None:
        with torch.cuda.stream(side):
            graph.replay()

    rows = [
        ("a Python call that does nothing (anchor)", lambda: None),
        ("torch.cuda.current_stream(device)", lambda: torch.cuda.current_stream(device)),
        ("a new blocking event, recorded", new_event),
        ("one event recorded again", lambda: reused.record(side)),
        ("stream.wait_event(event)", lambda: compute.wait_event(reused)),
        ("with torch.cuda.device(d), torch.cuda.stream(s)", with_device_and_stream),
        ("with torch.cuda.stream(s)", with_stream),
        ("torch.cuda.set_stream(s), then back", set_stream_there_and_back),
        ("a one-kernel CUDA graph replayed on a side stream", replay_on_side),
        ("parameter.data = view", lambda: setattr(parameter, "data", view)),
    ]
    print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    print("| call | us per call |\n| --- | ---: |")
    for label, call in rows:
        print(f"| {label} | {per_call_us(call, args.calls):.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
