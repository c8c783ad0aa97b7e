"""The resident route (``load_into_offloader(route="resident")``) against the plain BF16 model on the same device.

    python -m bench.resident --work /tmp/szresident [--device cuda] [--models llm,dit] [--reps 5] [--tiny]

Models, random weights (``randn * 0.02``, BF16) saved as safetensors and converted with ``szformat.convert``:

* ``llm``: a Llama-shaped causal LM (hidden 2048, 16 layers, vocab 32000: 2.28 GB), timed on a prefill of
  ``--prefill`` tokens and ``--decode`` greedy decode steps at batch 1 (``generate`` with its KV cache);
* ``dit``: the SD3-medium-shaped 4.1 GB DiT of ``bench/offload.py`` at 1024x1024 (128x128 latents), batch 1,
  one forward.

Each row runs the plain model (loaded from safetensors onto the device) and the resident route, all loaded together,
forward by forward in ``--reps`` rounds after an untimed warm-up round (the first forward of any model pays for lazy
set-up), and checks the outputs (logits, generated tokens, the DiT's sample) bit for bit before any time is
reported. Two more resident rows expand two consecutive blocks at once (``num_blocks_per_group=2``), and keep two
slots to expand the next group ahead on a side stream (the default expands each block in place, just before it runs,
in one slot). On CUDA two more resident rows split the cost: without CUDA graphs (every expansion launched), and
with a slot per group (after the warm-up nothing is expanded again: what remains is the hooks' own cost and the
weights' placement in slots); and the plain model with a pre-forward hook that does nothing on each block (what
PyTorch's hook calls cost alone). Reported: median time, the ratio to the plain model, and on CUDA the device-memory
peak of each (weights + activations) and the route's own figures (compressed weights, arena, plain tensors).
``--tiny`` shrinks every model so the whole script runs on a CPU in seconds: that is how the CI-side test runs it.

``--df11`` adds DFloat11 0.5.0 on the same LM (CUDA, ``pip install dfloat11==0.5.0``): the plain model's weights
compressed by its own ``compress_model`` (once, into ``<work>/llm...-df11``), loaded by ``DFloat11Model`` (a
pre-forward hook per block decodes the block's Huffman-coded weights), timed in the same rounds, its device-memory
peak beside the others, its outputs compared (a difference is reported on its rows, not fatal). Its compressor is a
Python loop (about 0.3 us per weight): ``--llm-layers`` and ``--llm-vocab`` shrink the LM for every row.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path
from typing import Any

import torch

import szformat
from szformat.convert import convert
from szformat.convert.report import format_bytes

from .common import round_order

LLM = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
           num_key_value_heads=8, max_position_embeddings=4096, tie_word_embeddings=False)
LLM_DEFAULT = dict(LLM)
LLM_TINY = dict(LLM, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2)
DIT = dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
           num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048,
           out_channels=16, pos_embed_max_size=192)
DIT_TINY = dict(DIT, sample_size=16, num_layers=3, num_attention_heads=2, joint_attention_dim=64,
                caption_projection_dim=128, pooled_projection_dim=32, pos_embed_max_size=32)


def build(kind: str, tiny: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "llm":
        import transformers

        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**(LLM_TINY if tiny else LLM)))
    else:
        from diffusers import SD3Transformer2DModel

        model = SD3Transformer2DModel(**(DIT_TINY if tiny else DIT))
    model = model.to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).mul_(0.02))
    return model.eval()


def prepare(kind: str, work: Path, tiny: bool) -> tuple[Path, Path]:
    """The model folder (``save_pretrained``, BF16) and its szconvert twin, made once per ``work`` folder."""
    shape = "" if kind != "llm" or tiny or LLM == LLM_DEFAULT else f"-{LLM['num_hidden_layers']}x{LLM['vocab_size']}"
    folder = work / f"{kind}{'-tiny' if tiny else ''}{shape}"
    converted = folder.with_name(folder.name + "-szt")
    if not converted.exists():
        build(kind, tiny).save_pretrained(folder)
        convert(folder, converted, overwrite=True, device="cuda" if torch.cuda.is_available() else "cpu")
    return folder, converted


def load_plain(kind: str, folder: Path, device: torch.device) -> torch.nn.Module:
    """The model as its library loads it from safetensors, moved to ``device``."""
    if kind == "llm":
        import transformers

        return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(device).eval()
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel.from_pretrained(folder, torch_dtype=torch.bfloat16).to(device).eval()


def load_resident(kind: str, converted: Path, device: torch.device, tiny: bool, graphs: bool = True,
                  slots: str = "default", blocks_per_group: int = 1):
    """The model with ``route="resident"`` (its expansions replayed as CUDA graphs or launched each time; ``slots``
    as :func:`options` takes them; ``blocks_per_group`` consecutive blocks expanded together): returns the model
    and the route's handle."""
    chosen = options(kind, tiny, graphs, slots)
    if blocks_per_group > 1:
        chosen["num_blocks_per_group"] = blocks_per_group
    if kind == "llm":
        from szformat import transformers as szt

        model = szt.from_pretrained(converted, device=device, offload="resident", offload_options=chosen)
        return model, model.szformat_offload
    from diffusers import SD3Transformer2DModel

    with torch.device("meta"):
        model = SD3Transformer2DModel(**(DIT_TINY if tiny else DIT)).to(torch.bfloat16).eval()
    return model, szformat.load_into_offloader(converted, model, route="resident", device=device, **chosen)


def options(kind: str, tiny: bool, graphs: bool = True, slots: str = "default") -> dict[str, int]:
    """The route's defaults, but for the tiny models, whose every tensor is under the sizes that make a group;
    ``slots``: ``"default"`` (one slot, each group expanded in place just before it runs), ``"ahead"`` (two slots,
    the next group expanded on a side stream) or ``"per group"`` (a slot for every block and leaf group: the layers,
    plus a few)."""
    chosen: dict[str, int] = {"graphs": graphs, **({"min_tensor_bytes": 0, "min_leaf_bytes": 0} if tiny else {})}
    if slots == "ahead":
        chosen["slots"] = 2
    elif slots == "per group":
        chosen["slots"] = ((LLM_TINY if tiny else LLM) if kind == "llm" else (DIT_TINY if tiny else DIT))[
            "num_hidden_layers" if kind == "llm" else "num_layers"] + 4
    return chosen


def inputs_for(kind: str, tiny: bool, device: torch.device, args) -> dict:
    g = torch.Generator().manual_seed(7)
    if kind == "llm":
        vocab = (LLM_TINY if tiny else LLM)["vocab_size"]
        return {"input_ids": torch.randint(0, vocab, (1, 16 if tiny else args.prefill), generator=g).to(device)}
    cfg = DIT_TINY if tiny else DIT
    bf16 = lambda *size: torch.randn(*size, generator=g).to(torch.bfloat16).to(device)  # noqa: E731
    return dict(hidden_states=bf16(1, 16, cfg["sample_size"], cfg["sample_size"]),
                encoder_hidden_states=bf16(1, 77, cfg["joint_attention_dim"]),
                pooled_projections=bf16(1, cfg["pooled_projection_dim"]), timestep=torch.tensor([500.0]).to(device))


def phases(kind: str, model: torch.nn.Module, inputs: dict, tiny: bool, args) -> dict[str, Any]:
    """What is timed, by name: the DiT's forward, or the LM's prefill and its greedy decode steps; each returns its
    outputs."""
    steps = 4 if tiny else args.decode
    if kind == "dit":
        return {"forward": lambda: [model(**inputs).sample]}
    return {"prefill": lambda: [model(**inputs).logits],
            f"prefill + {steps} decode steps": lambda: [
                model.generate(**inputs, max_new_tokens=steps, min_new_tokens=steps, do_sample=False)]}


def inputs_device(inputs: dict) -> torch.device:
    return next(v for v in inputs.values() if isinstance(v, torch.Tensor)).device


EMPTY_HOOKS = "plain, hooks that do nothing"
AHEAD = "resident, two slots, the next group ahead on a side stream"
PAIRS = "resident, two blocks per group (num_blocks_per_group=2)"
DF11 = "DFloat11 0.5.0 (Huffman-coded on the device, a pre-forward hook per block)"
DF11_LLAMA = {r"model\.embed_tokens": [], r"lm_head": [], r"model\.layers\.\d+": [
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
    "mlp.down_proj"]}
"""DFloat11's ``pattern_dict`` for a Llama: the embedding, the head and every linear layer of each decoder layer (as
its published Llama checkpoints are compressed), each layer decoded by one hook."""


def df11_folder(folder: Path) -> Path:
    """The plain model's weights compressed by DFloat11's own ``compress_model`` beside it (once: its encoder is a
    Python loop, about 0.3 us per weight)."""
    target = folder.with_name(folder.name + "-df11")
    if not target.exists():
        from dfloat11.dfloat11 import compress_model

        partial = target.with_name(target.name + ".partial")
        compress_model(load_plain("llm", folder, torch.device("cpu")), pattern_dict=DF11_LLAMA,
                       save_path=str(partial), save_single_file=False, check_correctness=False)
        partial.rename(target)
    return target


def load_df11(folder: Path, device: torch.device) -> torch.nn.Module:
    """The LM as DFloat11 loads it: its config's model built on the host as DFloat11 builds it (in BF16 from the
    config, so its rotary table stays FP32 as in the plain model: a ``.to(bfloat16)`` would round it and change the
    logits), the compressed weights and hooks put in, then moved to ``device``."""
    import transformers
    from dfloat11 import DFloat11Model

    config = transformers.AutoConfig.from_pretrained(folder)
    skeleton = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    return DFloat11Model.from_pretrained(str(df11_folder(folder)), device=str(device),
                                         bfloat16_model=skeleton).eval()


def empty_hooks(model: torch.nn.Module) -> None:
    """A pre-forward hook that does nothing on each of the route's blocks: what PyTorch's hook calls cost alone."""
    from szformat.offload.resident import find_blocks

    for block in find_blocks(model):
        block.register_forward_pre_hook(lambda module, args: None)


def load(kind: str, label: str, folder: Path, converted: Path, device: torch.device, tiny: bool):
    """Variant ``label`` of the model: ``(model, route handle or None)``."""
    if label == "plain":
        return load_plain(kind, folder, device), None
    if label == DF11:
        return load_df11(folder, device), None
    if label == EMPTY_HOOKS:
        model = load_plain(kind, folder, device)
        empty_hooks(model)
        return model, None
    slots = next((kind_ for kind_ in ("ahead", "per group") if kind_ in label), "default")
    return load_resident(kind, converted, device, tiny, graphs="no CUDA" not in label, slots=slots,
                         blocks_per_group=2 if label == PAIRS else 1)


def alone(kind: str, label: str, folder: Path, converted: Path, device: torch.device, inputs: dict, args
          ) -> tuple[int, dict[str, int] | None]:
    """Variant ``label`` loaded with nothing else on the device: its memory peak over its phases (0 off CUDA), and
    the route's counters."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    model, handle = load(kind, label, folder, converted, device, args.tiny)
    with torch.no_grad():
        for call in phases(kind, model, inputs, args.tiny, args).values():
            call()
    peak = 0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
    counters = None
    if handle is not None:
        counters = handle.counters()
        handle.close()
    return peak, counters


def measure(kind: str, args, device: torch.device) -> list[list[str]]:
    """Each variant loaded alone once (its device-memory peak over a forward), then all of them loaded together and
    timed in ``args.reps`` rounds, each round running every variant's phases once, in orders balanced over the
    rounds: a load's placement in memory and the device's clocks move a forward's time by up to 1.5x from one load
    to the next, so the variants are compared forward by forward, on the same loads."""
    folder, converted = prepare(kind, Path(args.work), args.tiny)
    inputs = inputs_for(kind, args.tiny, device, args)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    labels = ("plain", "resident", PAIRS, AHEAD, "resident, no CUDA graphs", "resident, a slot per group",
              EMPTY_HOOKS) if device.type == "cuda" else ("plain", "resident", PAIRS, AHEAD)
    if args.df11 and kind == "llm":
        labels += (DF11,)
    peaks: dict[str, int] = {}
    held: dict[str, int] = {}
    for label in labels[:2] + ((DF11,) if DF11 in labels else ()):
        peak, counters = alone(kind, label, folder, converted, device, inputs, args)
        peaks.update({label: peak} if device.type == "cuda" else {})
        held = counters or held
    gc.collect()
    loaded = {label: load(kind, label, folder, converted, device, args.tiny) for label in labels}
    samples: dict[str, dict[str, list[float]]] = {label: {} for label in labels}
    differs = set()
    with torch.no_grad():
        reference = [out for call in phases(kind, loaded["plain"][0], inputs, args.tiny, args).values()
                     for out in call()]
        for round_ in range(-1, args.reps):  # round -1: a warm-up of every variant, untimed
            for label in round_order(labels, round_):
                outputs = []
                for phase, call in phases(kind, loaded[label][0], inputs, args.tiny, args).items():
                    sync()
                    start = time.perf_counter()
                    outputs += call()
                    sync()
                    if round_ >= 0:
                        samples[label].setdefault(phase, []).append(time.perf_counter() - start)
                if not all(torch.equal(a, b) for a, b in zip(outputs, reference)):
                    if label != DF11:
                        raise SystemExit(f"{kind}: the {label} outputs differ from the plain model's: nothing is "
                                         "reported")
                    differs.add(label)  # a peer's: reported, and said
    for _, handle in loaded.values():
        if handle is not None:
            handle.close()
    rows = []
    for phase, plain_times in samples["plain"].items():
        plain = statistics.median(plain_times)
        for label in labels[1:]:
            resident = statistics.median(samples[label][phase])
            what = f"{phase} (ms)" + (label.removeprefix("resident") if label.startswith("resident") else f", {label}")
            what += ", OUTPUTS DIFFER from the plain model's" if label in differs else ""
            rows.append([kind, what, f"{plain * 1e3:.1f}", f"{resident * 1e3:.1f}", f"{resident / plain:.2f}"])
    for label in (label for label in ("resident", DF11) if label in peaks):
        rows.append([kind, "device memory peak" + ("" if label == "resident" else f", {label}"),
                     format_bytes(peaks["plain"]), format_bytes(peaks[label]), f"{peaks[label] / peaks['plain']:.2f}"])
    weights = held["resident_stored_bytes"] + held["arena_bytes"] + held["plain_bytes"]
    rows.append([kind, "weights: raw / compressed + arena + plain", format_bytes(held["raw_bytes"]),
                 format_bytes(weights), f"{weights / held['raw_bytes']:.2f}"])
    rows.append([kind, "of which compressed / arena / plain", "",
                 " / ".join(format_bytes(held[k]) for k in ("resident_stored_bytes", "arena_bytes", "plain_bytes")),
                 ""])
    return rows


def print_table(header: list[str], rows: list[list[str]], *, text: set[int]) -> None:
    """Columns padded to their widest cell: the columns ``text`` aligned left, the figures right."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(str(c).ljust(w) if i in text else str(c).rjust(w)
                        for i, (c, w) in enumerate(zip(row, widths))))


def device_busy_ms(prof: Any) -> tuple[float, int]:
    """Milliseconds in which at least one device kernel ran (the union of the kernels' intervals, so kernels that
    overlap on two streams count once), and how many kernels ran."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if getattr(e, "device_type", None) is not None and e.device_type.name == "CUDA")
    busy, reach = 0.0, float("-inf")
    for begin, end in spans:
        if end > reach:
            busy += end - max(begin, reach)
            reach = end
    return busy / 1e3, len(spans)


def profile(kind: str, args, device: torch.device) -> None:
    """Where a forward's time goes, the plain model beside the resident route, all loaded together: the forward's
    wall time (synchronized) and the host's time to issue it (until the call returns: where it is close to the wall
    time the forward is bound by the host, and every microsecond a hook takes is added to it), in rounds of
    balanced orders;
    then the route's hooks' own host time (expansions apart), and last, each variant under ``torch.profiler`` for
    the device's busy time (the union of its kernels; last, because the host issues kernels more slowly once a
    profiler has run). The plain model with hooks that do nothing on the same blocks says what PyTorch's hook calls
    cost alone."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from szformat.offload import resident

    folder, converted = prepare(kind, Path(args.work), args.tiny)
    inputs = inputs_for(kind, args.tiny, device, args)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    labels = ("plain", EMPTY_HOOKS, "resident", PAIRS, AHEAD)
    loaded = {label: load(kind, label, folder, converted, device, args.tiny) for label in labels}
    walls: dict[str, list[float]] = {label: [] for label in labels}
    issues: dict[str, list[float]] = {label: [] for label in labels}
    with torch.no_grad():
        for round_ in range(-1, args.reps):
            for label in round_order(labels, round_):
                sync()
                start = time.perf_counter()
                loaded[label][0](**inputs)
                issued = time.perf_counter()
                sync()
                if round_ >= 0:
                    walls[label].append(time.perf_counter() - start)
                    issues[label].append(issued - start)
        hooks = {label: _hooks_host_ms(resident._Arena, lambda: (loaded[label][0](**inputs), sync()), args.reps)
                 for label in ("resident", PAIRS, AHEAD)}
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        busy = {}
        for label in labels:
            with torch_profile(activities=activities) as prof:
                loaded[label][0](**inputs)
                sync()
            busy[label] = device_busy_ms(prof) if device.type == "cuda" else (0.0, 0)
    for _, handle in loaded.values():
        if handle is not None:
            handle.close()
    rows = [[label, f"{statistics.median(walls[label]) * 1e3:.1f}", f"{statistics.median(issues[label]) * 1e3:.1f}",
             f"{busy[label][0]:.1f}", str(busy[label][1]), hooks.get(label, "")] for label in labels]
    print(f"{kind}: where a forward's time goes (median of {args.reps}; device busy from one profiled forward)")
    print_table(["", "wall ms", "host issue ms", "device busy ms", "kernels", "the route's hooks on the host"], rows,
                text={0, 5})


def _hooks_host_ms(arena_class: type, forward: Any, reps: int) -> str:
    """The host time a forward spends in the route's group hooks (median over ``reps`` forwards), and the share of
    it that enqueues expansions."""
    spent = {"before": 0.0, "_expand": 0.0, "_expand_in_place": 0.0, "calls": 0}
    originals = {name: getattr(arena_class, name) for name in ("before", "_expand", "_expand_in_place")}

    def timed(name: str, real: Any) -> Any:
        def call(self, *args):
            start = time.perf_counter()
            real(self, *args)
            spent[name] += time.perf_counter() - start
            spent["calls"] += name == "before"
        return call

    samples = []
    try:
        for name, real in originals.items():
            setattr(arena_class, name, timed(name, real))
        for _ in range(reps):
            spent.update(before=0.0, _expand=0.0, _expand_in_place=0.0, calls=0)
            forward()
            samples.append(dict(spent))
    finally:
        for name, real in originals.items():
            setattr(arena_class, name, real)
    middle = sorted(samples, key=lambda s: s["before"])[len(samples) // 2]
    return (f"{middle['before'] * 1e3:.2f} ms over {middle['calls']} groups, of which expansions enqueued "
            f"{(middle['_expand'] + middle['_expand_in_place']) * 1e3:.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default="/tmp/szresident")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", default="llm,dit")
    parser.add_argument("--reps", type=int, default=5, help="timed rounds (each runs every variant once)")
    parser.add_argument("--prefill", type=int, default=2048)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--tiny", action="store_true", help="tiny models, for a CPU")
    parser.add_argument("--llm-layers", type=int, help="the LM's decoder layers (default 16)")
    parser.add_argument("--llm-vocab", type=int, help="the LM's vocabulary (default 32000)")
    parser.add_argument("--df11", action="store_true", help="a DFloat11 0.5.0 row for the LM (CUDA, dfloat11 "
                        "installed; its compressor takes about 0.3 us per weight: pick a smaller LM)")
    parser.add_argument("--output-alignment", type=int, help="elements each expanded weight starts at a multiple of "
                        "in its slot (the route's OUTPUT_ALIGNMENT): where GEMM kernels are chosen by alignment")
    parser.add_argument("--profile", action="store_true", help="profile one resident forward of each model instead")
    args = parser.parse_args(argv)
    LLM.update({key: value for key, value in (("num_hidden_layers", args.llm_layers), ("vocab_size", args.llm_vocab))
                if value})
    if args.output_alignment:
        from szformat.offload import resident
        resident.OUTPUT_ALIGNMENT = args.output_alignment
        print(f"weights start at multiples of {args.output_alignment} elements in their slots")
    Path(args.work).mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    if args.profile:
        for kind in args.models.split(","):
            profile(kind, args, device)
        return 0
    rows = []
    for kind in args.models.split(","):
        rows += measure(kind, args, device)
    print(f"device: {device}" + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""))
    print_table(["model", "what", "plain", "resident", "resident / plain"], rows, text={0, 1})
    print("outputs: bit-identical to the plain model on every row not marked otherwise")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
