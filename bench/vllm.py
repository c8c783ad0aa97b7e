"""vLLM's load time for ``--load-format szt`` against ``safetensors`` on the same checkpoint, in one run.

    python -m bench.vllm --work /tmp/szvllm [--size-mb 600] [--tp 1,2] [--rounds 2] [--verify-off] [--huge-pages]

A Llama-shaped checkpoint of about ``--size-mb`` of BF16 weights (random, ``randn * 0.02``), saved with
``save_pretrained`` and converted with ``szconvert``; each round starts one engine per (format, tensor-parallel
size), in orders balanced over the rounds, and reads from vLLM's own log the weight-loading phase ("Loading weights
took") and the time from the engine's start to ready (one greedy request answered), plus the peak RSS of every
process of the engine (``/proc``, sampled), and for szt on the CPU the share of the checkpoint's raw bytes each rank
decoded (its log line: a rank decodes only the rows vLLM's weight loaders keep). Runs unchanged on a CUDA machine
(vLLM picks its device). Medians are printed as a table, and each load phase's best round beside them: on a shared
or small machine another process only ever adds to a round's time, so the best is the steadier figure of the two
when rounds spread.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from .common import round_order

ENGINE = """
import json, sys
def main():
    from vllm import LLM, SamplingParams
    llm = LLM(model=sys.argv[1], load_format=sys.argv[2], skip_tokenizer_init=True, dtype="bfloat16",
              tensor_parallel_size=int(sys.argv[3]), max_model_len=128, enforce_eager=True,
              model_loader_extra_config=json.loads(sys.argv[4]))
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0, max_tokens=1))
    print("READY", flush=True)
if __name__ == "__main__":
    main()
"""
LOADING = re.compile(r"Loading weights took ([0-9.]+) seconds")
DECODED = re.compile(r"this rank decoded ([0-9.]+) MB of the checkpoint's ([0-9.]+) MB")


def prepare(work: Path, size_mb: int) -> tuple[Path, Path]:
    import torch
    import transformers

    from szformat.cli.main import main as szconvert

    folder = work / f"llama-{size_mb}mb"
    if not (folder.parent / (folder.name + "-szt")).exists():
        hidden = 1024
        layers = max(1, round((size_mb * 1e6 / 2 - 2 * 32000 * hidden) / (12 * hidden * hidden)))
        config = transformers.LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=4 * hidden,
                                          num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=4,
                                          max_position_embeddings=256, tie_word_embeddings=False)
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.02)
        model.save_pretrained(folder)
        del model
        assert szconvert([str(folder), str(folder) + "-szt", "--quiet", "--overwrite"]) == 0
    return folder, folder.parent / (folder.name + "-szt")


def peak_rss(pid: int, stop: threading.Event, out: list[int]) -> None:
    """The largest sum of VmRSS over ``pid`` and its descendants, sampled every 50 ms until ``stop``."""
    peak = 0
    while not stop.is_set():
        total = 0
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                status = (proc / "status").read_text()
                ppid = int(re.search(r"PPid:\s+(\d+)", status).group(1))
                if int(proc.name) == pid or ppid == pid or _descends(int(proc.name), pid):
                    total += int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) * 1024
            except (OSError, AttributeError, ValueError):
                continue
        peak = max(peak, total)
        stop.wait(0.05)
    out.append(peak)


def _descends(pid: int, ancestor: int) -> bool:
    for _ in range(8):
        try:
            pid = int(re.search(r"PPid:\s+(\d+)", Path(f"/proc/{pid}/status").read_text()).group(1))
        except (OSError, AttributeError):
            return False
        if pid == ancestor:
            return True
        if pid <= 1:
            return False
    return False


def start_engine(work: Path, model: Path, load_format: str, tp: int, extra: dict, env: dict[str, str]
                 ) -> dict[str, float]:
    script = work / "engine.py"
    script.write_text(ENGINE)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **env}
    if tp == 2:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    started = time.perf_counter()
    child = subprocess.Popen([sys.executable, str(script), str(model), load_format, str(tp), json.dumps(extra)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    stop, peaks = threading.Event(), []
    sampler = threading.Thread(target=peak_rss, args=(child.pid, stop, peaks))
    sampler.start()
    output = child.communicate(timeout=900)[0]
    ready = time.perf_counter() - started
    stop.set()
    sampler.join()
    if child.returncode != 0 or "READY" not in output:
        raise SystemExit(f"{load_format} tp={tp}: the engine failed:\n{output[-3000:]}")
    loads = [float(x) for x in LOADING.findall(output)]
    shares = [float(done) / float(total) for done, total in DECODED.findall(output) if float(total)]
    return {"ready_s": ready, "load_s": max(loads) if loads else float("nan"), "peak_rss": peaks[0],
            "decoded_share": max(shares) if shares else float("nan")}


def print_table(checkpoint: str, rounds: int, runs: list[tuple[str, int]],
                samples: dict[tuple[str, int], list[dict[str, float]]]) -> None:
    """Per (format, tensor-parallel size): the medians of its rounds, its best load phase, and both against
    safetensors' at the same size."""
    print(f"\ncheckpoint: {checkpoint}, median of {rounds} rounds")
    print(f"{'format':<16} {'tp':>3} {'load weights (s)':>17} {'start to ready (s)':>19} {'peak RSS (GB)':>14} "
          f"{'load / safetensors':>19} {'best load (s)':>14} {'best / safetensors':>19} {'decoded / rank':>15}")
    for label, tp in runs:
        med = {k: statistics.median(s[k] for s in samples[(label, tp)])
               for k in ("load_s", "ready_s", "peak_rss", "decoded_share")}
        best = min(s["load_s"] for s in samples[(label, tp)])
        anchor = [s["load_s"] for s in samples[("safetensors", tp)]]
        share = "" if math.isnan(med["decoded_share"]) else f"{med['decoded_share']:.2f}"
        print(f"{label:<16} {tp:>3} {med['load_s']:>17.2f} {med['ready_s']:>19.1f} {med['peak_rss'] / 1e9:>14.2f} "
              f"{med['load_s'] / statistics.median(anchor):>19.2f} {best:>14.2f} {best / min(anchor):>19.2f} "
              f"{share:>15}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default="/tmp/szvllm")
    parser.add_argument("--size-mb", type=int, default=600)
    parser.add_argument("--tp", default="1,2")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--verify-off", action="store_true", help="also szt with the loader's checksums off "
                        "(--model-loader-extra-config '{\"verify\": false}')")
    parser.add_argument("--huge-pages", action="store_true", help="also szt with the huge-page advice for the "
                        "parameters it decodes into forced on and off (SZFORMAT_HUGE_PAGES=1 and 0; by default it "
                        "depends on the machine)")
    args = parser.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    original, converted = prepare(work, args.size_mb)
    variants = {"safetensors": ("safetensors", {}, {}), "szt": ("szt", {}, {})}
    if args.verify_off:
        variants["szt, verify off"] = ("szt", {"verify": False}, {})
    if args.huge_pages:
        variants["szt, huge pages"] = ("szt", {}, {"SZFORMAT_HUGE_PAGES": "1"})
        variants["szt, 4K pages"] = ("szt", {}, {"SZFORMAT_HUGE_PAGES": "0"})
    runs = [(label, int(tp)) for tp in args.tp.split(",") for label in variants]
    samples: dict[tuple[str, int], list[dict[str, float]]] = {run: [] for run in runs}
    for r in range(args.rounds):
        for label, tp in round_order(runs, r):
            fmt, extra, env = variants[label]
            model = converted if fmt == "szt" else original
            samples[(label, tp)].append(start_engine(work, model, fmt, tp, extra, env))
            print(f"round {r + 1}: {label} tp={tp}: {samples[(label, tp)][-1]}", flush=True)
    print_table(original.name, args.rounds, runs, samples)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
