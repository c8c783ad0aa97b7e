"""Time ``szformat.transformers`` / ``szformat.diffusers`` ``from_pretrained`` against transformers' and diffusers'
own ``from_pretrained`` of the safetensors originals, in one run, and check the results bit for bit.

    python -m bench.from_pretrained --work /tmp/bench_fp [--models llm,moe,sd3] [--reps 3]
        [--no-cold] [--offload native,staging] [--json results.json]
    python -m bench.from_pretrained --work /tmp/bench_fp --profile cpu|cuda [--models moe] [--reps 5]

Models, built on the fly with seeded random BF16 weights (N(0, 0.02)), saved with ``save_pretrained`` and converted
with ``szformat.convert.convert`` (encoded on the GPU), once per ``--work`` folder:

``llm``  a Llama-shaped causal LM (hidden 2048, 16 layers, MLP 8192, vocab 32000, untied): 1.24 B parameters,
         2.5 GB of BF16, loaded as ``AutoModelForCausalLM``;
``moe``  a Mixtral-shaped causal LM (hidden 1024, 8 layers of 8 experts with MLP 2816, vocab 32000): 0.64 B
         parameters, 1.3 GB of BF16, saved as its Hub checkpoints are (one tensor per expert), which both loaders
         fuse into one tensor per layer and projection as they load it;
``sd3``  an SD3-medium-shaped pipeline: ``SD3Transformer2DModel`` (24 blocks of width 1536), the SD3 VAE, CLIP-L and
         CLIP-G text encoders with projection (no T5: the pipeline pads its place with zeros), letter-level CLIP
         tokenizers written here, a flow-matching scheduler; 5.6 GB of BF16.

Loaders: ``transformers`` (``from_pretrained(..., dtype=bfloat16, device_map="cuda")``), ``diffusers``
(``from_pretrained(..., torch_dtype=bfloat16, device_map="cuda")``), and ``szformat`` (``from_pretrained(...,
device="cuda")``). Warm: page cache warm, one untimed call each, then the median of ``--reps`` calls, the loaders
taking turns; cold: the page cache dropped
before one call (``/proc/sys/vm/drop_caches`` when writable, else ``posix_fadvise``). The time is from the call to a
model whose tensors are all on the GPU (``torch.cuda.synchronize``); the device's caching allocator is emptied
between calls. Correctness: every parameter and buffer of the szformat load equals the original's load (int16 views),
and so does the output (LLM logits of 4 x 128 tokens; a 2-step 256 x 256 pipeline call with a seeded generator).

``--offload native,staging`` (optional, needs diffusers-dynamic-offloader): the pipeline loaded with
``offload=ROUTE`` (its transformer behind DDO, the rest on the GPU) must produce the same image tensor as without
offloading. Each route runs in a child process (``native`` through DDO's bootstrap, which must own CUDA from the
first statement).

``--profile cpu|cuda``: where szformat's ``from_pretrained`` of the first of ``--models`` spends its time (first call,
warm median, transformers' or diffusers' own load on that device as the anchor, and one warm call under cProfile,
broken down by the calls the integration modules (``INTEGRATION_FILES``) make). On the CPU the decode is replaced by
empty tensors of the checkpoint's shapes (everything around it runs as on the GPU), and the model is built and
converted on the CPU when the ``--work`` folder lacks it.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and sys.argv[1:2] == ["offload-child"] and sys.argv[2:3] == ["native"]:
    from ddo_vmm_bootstrap import (
        ensure_vmm_fast_process,  # DDO's vmm_fast must own CUDA from the first statement
    )

    ensure_vmm_fast_process()

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

LLM = dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=16,
           num_key_value_heads=8, max_position_embeddings=4096, tie_word_embeddings=False)
SD3 = dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64, num_attention_heads=24,
           joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048, out_channels=16,
           pos_embed_max_size=192)
SD3_VAE = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=[128, 256, 512, 512],
               down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
               layers_per_block=2, use_quant_conv=False, use_post_quant_conv=False, scaling_factor=1.5305,
               shift_factor=0.0609)
CLIP_L = dict(hidden_size=768, intermediate_size=3072, num_attention_heads=12, num_hidden_layers=12, projection_dim=768)
CLIP_G = dict(hidden_size=1280, intermediate_size=5120, num_attention_heads=20, num_hidden_layers=32,
              projection_dim=1280)
MOE = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
           num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=4096,
           tie_word_embeddings=False)
TINY = {"llm": dict(LLM, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=256),
        "moe": dict(MOE, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, num_local_experts=4, vocab_size=256),
        "sd3": dict(SD3, num_layers=2, attention_head_dim=8, num_attention_heads=4, caption_projection_dim=32,
                    sample_size=32, pos_embed_max_size=32)}
CAUSAL_LMS = {"llm": ("LlamaConfig", "LlamaForCausalLM", LLM), "moe": ("MixtralConfig", "MixtralForCausalLM", MOE)}
"""Model name -> transformers config and model class, full-size config."""
PROMPT = "an astronaut riding a horse"
DEVICE = "cuda"


# -- building the models -----------------------------------------------------------------------------------------


def seeded_(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every floating parameter N(0, 0.02) in BF16 (norm weights 1), from one seed (drawn on the device, which is
    fast): the same model every run on one machine."""
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            values = torch.randn(p.shape, generator=generator, device=DEVICE) * 0.02
            p.copy_(torch.ones_like(values) if "norm" in name and name.endswith("weight") else values)
    return model.to(torch.bfloat16)


def tokenizer(folder: Path, max_length: int = 77):
    """A CLIP tokenizer over single letters: a prompt tokenizes without any download."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    vocab = {"<|startoftext|>": 0, "!": 1, "<|endoftext|>": 2}
    for i, letter in enumerate("abcdefghijklmnopqrstuvwxyz"):
        vocab[letter], vocab[letter + "</w>"] = 3 + 2 * i, 4 + 2 * i
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    return transformers.CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"),
                                      model_max_length=max_length, pad_token="!")


def build(model: str, folder: Path, tiny: bool) -> None:
    """Save the model's safetensors original to ``folder`` and its szformat twin to ``folder``-szt."""
    import transformers

    from szformat.convert import convert

    if model in CAUSAL_LMS:
        config_class, model_class, config = CAUSAL_LMS[model]
        config = getattr(transformers, config_class)(**(TINY[model] if tiny else config))
        seeded_(getattr(transformers, model_class)(config), 0).save_pretrained(folder)
    else:
        import diffusers  # a pipeline's only: a causal LM is built without it

        clip = lambda c, seed: seeded_(transformers.CLIPTextModelWithProjection(transformers.CLIPTextConfig(  # noqa
            vocab_size=49408, max_position_embeddings=77, **(dict(c, num_hidden_layers=1) if tiny else c))), seed)
        vae = diffusers.AutoencoderKL(**(dict(SD3_VAE, block_out_channels=[8, 8, 8, 8], norm_num_groups=4)
                                         if tiny else SD3_VAE))
        pipe = diffusers.StableDiffusion3Pipeline(
            transformer=seeded_(diffusers.SD3Transformer2DModel(**(TINY["sd3"] if tiny else SD3)), 1),
            vae=seeded_(vae, 2), text_encoder=clip(CLIP_L, 3), text_encoder_2=clip(CLIP_G, 4),
            tokenizer=tokenizer(folder.parent / "tok"), tokenizer_2=tokenizer(folder.parent / "tok"),
            text_encoder_3=None, tokenizer_3=None, scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0))
        pipe.save_pretrained(folder)
    convert(folder, Path(f"{folder}-szt"), device=DEVICE if DEVICE == "cuda" else "cpu")


# -- loading -----------------------------------------------------------------------------------------------------


def loaders(model: str) -> dict:
    """Loader name -> function(folder) returning the model or pipeline, every tensor on the device."""
    import transformers

    import szformat.transformers

    if model in CAUSAL_LMS:
        return {
            "transformers": lambda f: transformers.AutoModelForCausalLM.from_pretrained(
                f, dtype=torch.bfloat16, device_map=DEVICE),
            "szformat": lambda f: szformat.transformers.from_pretrained(f"{f}-szt", device=DEVICE),
        }
    import diffusers  # a pipeline's only, as in build

    import szformat.diffusers

    no_t5 = dict(text_encoder_3=None, tokenizer_3=None)  # saved as [null, null]: diffusers wants them named

    def diffusers_load(folder):
        """diffusers straight to the device (``device_map``) where this version can, else load and move."""
        try:
            return diffusers.DiffusionPipeline.from_pretrained(folder, torch_dtype=torch.bfloat16, device_map=DEVICE,
                                                               **no_t5)
        except (ValueError, NotImplementedError) as e:
            print(f"diffusers device_map={DEVICE!r} refused ({e}); timing from_pretrained + .to()", flush=True)
            return diffusers.DiffusionPipeline.from_pretrained(folder, torch_dtype=torch.bfloat16, **no_t5).to(DEVICE)

    return {
        "diffusers": diffusers_load,
        "szformat": lambda f: szformat.diffusers.from_pretrained(f"{f}-szt", device=DEVICE,
                                                                 torch_dtype=torch.bfloat16, **no_t5),
    }


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def release() -> None:
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def timed(load, folder: Path):
    release()
    start = time.perf_counter()
    loaded = load(folder)
    synchronize()
    return loaded, time.perf_counter() - start


def checkpoint_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.suffix in (".safetensors", ".szt"))


# -- correctness ---------------------------------------------------------------------------------------------------


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype in (torch.bfloat16, torch.float16) else t


def modules_of(model: str, loaded) -> dict[str, torch.nn.Module]:
    if model in CAUSAL_LMS:
        return {"model": loaded}
    return {name: getattr(loaded, name) for name in ("transformer", "vae", "text_encoder", "text_encoder_2")}


def differing_tensors(model: str, a, b) -> list[str]:
    """Names of parameters and buffers that differ in dtype, shape or bits between two loads."""
    bad = []
    for key, module in modules_of(model, a).items():
        other = modules_of(model, b)[key]
        ta = dict(module.named_parameters()) | dict(module.named_buffers())
        tb = dict(other.named_parameters()) | dict(other.named_buffers())
        bad += [f"{key}:{n}" for n in sorted(ta.keys() ^ tb.keys())]
        bad += [f"{key}:{n}" for n in ta.keys() & tb.keys() if not (
            ta[n].dtype == tb[n].dtype and ta[n].shape == tb[n].shape
            and torch.equal(bits(ta[n]).cpu(), bits(tb[n]).cpu()))]
    return bad


def output(model: str, loaded) -> torch.Tensor:
    with torch.no_grad():
        if model in CAUSAL_LMS:
            ids = torch.randint(0, loaded.config.vocab_size, (4, 128), generator=torch.Generator().manual_seed(0))
            return loaded(ids.to(DEVICE)).logits.cpu()
        generator = torch.Generator(device="cpu").manual_seed(0)
        return loaded(PROMPT, num_inference_steps=2, height=256, width=256, guidance_scale=1.0,
                      generator=generator, output_type="pt").images.cpu()


# -- the run ---------------------------------------------------------------------------------------------------------


def bench_model(model: str, work: Path, reps: int, cold: bool, tiny: bool) -> list[dict]:
    from .load import drop_caches, resident_share

    folder = work / model
    if not Path(f"{folder}-szt").is_dir():
        print(f"building {model} in {folder} ...", flush=True)
        build(model, folder, tiny)
    raw = sum(p.stat().st_size for p in checkpoint_files(folder))
    stored = sum(p.stat().st_size for p in checkpoint_files(Path(f"{folder}-szt")))
    rows = []
    loads = loaders(model)
    timings = {name: [] for name in loads}
    firsts = {name: timed(load, folder)[1] for name, load in loads.items()}
    for _ in range(reps):  # the loaders take turns, so that both meet the same state of the machine
        for name, load in loads.items():
            timings[name].append(timed(load, folder)[1])
    for name, load in loads.items():
        row = {"model": model, "loader": name, "bytes": raw, "szt_bytes": stored, "first_s": firsts[name],
               "warm_s": statistics.median(timings[name]), "warm_all_s": timings[name]}
        if cold:
            files = checkpoint_files(folder if name != "szformat" else Path(f"{folder}-szt"))
            how = drop_caches(files)
            row["cold_resident"] = resident_share(files)
            row["cold_s"], row["cold_how"] = timed(load, folder)[1], how
        rows.append(row)
        print(json.dumps(row), flush=True)
    anchor, ours = list(loads)
    a, b = loads[anchor](folder), loads[ours](folder)
    synchronize()
    differing = differing_tensors(model, a, b)
    out_a, out_b = output(model, a), output(model, b)
    same_output = out_a.shape == out_b.shape and torch.equal(bits(out_a), bits(out_b))
    if model == "sd3":
        torch.save(out_b, work / "sd3-image.pt")
    for row in rows:
        row.update(differing=differing[:10], n_differing=len(differing), same_output=same_output,
                   finite_output=bool(torch.isfinite(out_b.float()).all()))
    del a, b
    release()
    return rows


def offload_check(route: str, work: Path, budgets: dict) -> dict:
    """Child process: the pipeline with its transformer offloaded through ``route``; its image against the one saved
    by the unoffloaded run."""
    import szformat.diffusers

    start = time.perf_counter()
    pipe = szformat.diffusers.from_pretrained(work / "sd3-szt", device=DEVICE, torch_dtype=torch.bfloat16,
                                              offload=route, offload_options=budgets, text_encoder_3=None,
                                              tokenizer_3=None)
    setup = time.perf_counter() - start
    image = output("sd3", pipe)
    expected = torch.load(work / "sd3-image.pt")
    for handle in pipe.szformat_offload.values():
        handle.close()
    return {"route": route, "setup_s": setup, "same_image": bool(torch.equal(bits(image), bits(expected)))}


def offload_budgets(work: Path) -> dict:
    """DDO budgets: about two transformer blocks resident, so the blocks stream every forward."""
    block = sum(p.stat().st_size for p in (work / "sd3" / "transformer").glob("*.safetensors")) / SD3["num_layers"]
    return {"vmm_resident_weight_budget_gb": 2.5 * block / 1024 ** 3, "vmm_staging_buffer_gb": 1.25 * block / 1024 ** 3}


def table(rows: list[dict], offloads: list[dict]) -> str:
    lines = ["| model | loader | GB (safetensors / .szt) | warm s (median) | first s | cold s | x warm | x cold | "
             "tensors identical | output identical |", "|---|---|---|---:|---:|---:|---:|---:|---|---|"]
    anchors = {}
    for row in rows:
        anchors.setdefault(row["model"], row)
        base = anchors[row["model"]]
        cold = row.get("cold_s")
        speed_cold = f"{base['cold_s'] / cold:.2f}" if cold and base.get("cold_s") else "-"
        lines.append(f"| {row['model']} | {row['loader']} | {row['bytes'] / 1e9:.2f} / {row['szt_bytes'] / 1e9:.2f} | "
                     f"{row['warm_s']:.3f} | {row['first_s']:.3f} | {f'{cold:.3f}' if cold else '-'} | "
                     f"{base['warm_s'] / row['warm_s']:.2f} | {speed_cold} | "
                     f"{'yes' if not row['n_differing'] else row['n_differing']} | "
                     f"{'yes' if row['same_output'] else 'NO'}{'' if row['finite_output'] else ' (non-finite)'} |")
    for result in offloads:
        lines.append(f"\noffload={result['route']!r}: setup {result.get('setup_s', float('nan')):.2f} s, same image as "
                     f"without offloading: {result.get('same_image', result.get('error'))}")
    return "\n".join(lines)


# -- --profile ---------------------------------------------------------------------------------------------------

INTEGRATION_FILES = ("szformat/transformers.py", "szformat/transformers_conversions.py", "szformat/diffusers.py",
                     "szformat/model_folder.py")
"""The code around the decode: what ``--profile`` breaks down, by the calls it makes into everything else."""


_WRITTEN: list[torch.Tensor] = []
"""The host buffer :func:`empty_weights` hands out views of, written once (on the first call)."""


def empty_weights(checkpoint, *args, **kwargs) -> dict[str, torch.Tensor]:
    """Stands in for ``szformat.api.load_file`` with ``--profile cpu``: opens each shard as the load does (headers
    read and checked), and gives CPU tensors of its names, dtypes and shapes, so the time around the decode is
    measured alone (the CPU decode of these models takes most of a minute). They are views of one buffer written on
    the first call: reading them (a fusion of experts does) costs what reading decoded weights costs, where fresh
    ``torch.empty`` tensors would fault a page at a time."""
    from szformat.format import constants as C
    from szformat.integrations.model_folder import checkpoint_entries

    entries = checkpoint_entries(checkpoint)
    sizes = {name: -(-e.raw_length // 64) * 64 for name, e in entries.items()}
    if not _WRITTEN or _WRITTEN[0].numel() < sum(sizes.values()):
        _WRITTEN[:] = [torch.zeros(sum(sizes.values()), dtype=torch.uint8)]
    tensors, offset = {}, 0
    for name, e in entries.items():
        view = _WRITTEN[0][offset: offset + e.raw_length].view(C.DTYPES[e.dtype][0])
        tensors[name] = view.view(tuple(e.shape))
        offset += sizes[name]
    return tensors


def call_breakdown(profiler) -> list[tuple[str, float, int]]:
    """(call, cumulative seconds, calls) of each call the integration code makes into other code, and its own time:
    together the whole of ``from_pretrained`` (the profiler's overhead included)."""
    import pstats

    stats = pstats.Stats(profiler).stats
    ours = lambda key: key[0].replace(os.sep, "/").endswith(INTEGRATION_FILES)  # noqa: E731
    label = lambda key: f"{Path(key[0]).stem}.{key[2]}" if key[0] != "~" else key[2]  # noqa: E731
    rows = [(f"{label(caller)} -> {label(callee)}", cumulative, calls)
            for callee, (_, _, _, _, callers) in stats.items() if not ours(callee)
            for caller, (calls, _, _, cumulative) in callers.items() if ours(caller)]
    rows.append(("integration code itself", sum(s[2] for key, s in stats.items() if ours(key)), 0))
    return sorted(rows, key=lambda row: -row[1])


def profile(work: Path, model: str, reps: int, tiny: bool) -> str:
    """Where szformat's ``from_pretrained`` of ``model`` spends its time on ``DEVICE``: the first call
    (imports included), the warm median, transformers' own load of the safetensors original as the same-run anchor,
    and a cProfile breakdown of one warm call. On the CPU the decode is replaced by :func:`empty_weights`, so what
    is timed is everything around it, which runs there as on the GPU; on CUDA the decode is real. The decode alone
    (``load_file`` of each weight file) is timed beside it on CUDA."""
    import cProfile
    import pstats

    import szformat.api

    folder = work / model
    if not Path(f"{folder}-szt").is_dir():
        print(f"building {model} in {folder} ...", flush=True)
        build(model, folder, tiny)
    loads = loaders(model)
    anchor_name, anchor = next((name, load) for name, load in loads.items() if name != "szformat")
    ours = loads["szformat"]
    decode = szformat.api.load_file
    if DEVICE == "cpu":
        szformat.api.load_file = empty_weights
    try:
        first = timed(ours, folder)[1]
        warm = [timed(ours, folder)[1] for _ in range(reps)]
        release()
        profiler = cProfile.Profile()
        profiler.runcall(lambda: (ours(folder), synchronize()))
    finally:
        szformat.api.load_file = decode
    profiled = sum(s[2] for s in pstats.Stats(profiler).stats.values())
    anchored = [timed(anchor, folder)[1] for _ in range(reps + 1)][1:]
    stub = ", decode replaced by empty tensors" if DEVICE == "cpu" else ""
    lines = [f"szformat from_pretrained({model}, device={DEVICE!r}){stub}: first call {first * 1e3:.1f} ms, "
             f"warm median {statistics.median(warm) * 1e3:.1f} ms (all: {', '.join(f'{t * 1e3:.1f}' for t in warm)})",
             f"anchor, {anchor_name}' own from_pretrained of the safetensors original (bfloat16, device_map="
             f"{DEVICE!r}, weights read): warm median {statistics.median(anchored) * 1e3:.1f} ms"]
    if DEVICE != "cpu":  # the decode alone, with the same emptied caching allocator before each call
        weights = checkpoint_files(Path(f"{folder}-szt"))
        alone = [timed(lambda f: [szformat.api.load_file(p, device=DEVICE) for p in weights], folder)[1]
                 for _ in range(reps + 1)][1:]
        lines.append(f"szformat.load_file of its {len(weights)} weight files (device={DEVICE!r}) alone: warm median "
                     f"{statistics.median(alone) * 1e3:.1f} ms")
        from szformat.loading import timeline

        release()
        start = time.perf_counter()
        with timeline.recording() as record:
            [szformat.api.load_file(p, device=DEVICE) for p in weights]
            synchronize()
        lines.append(f"one more under the loader's timeline ({(time.perf_counter() - start) * 1e3:.1f} ms from the "
                     f"call): " + ", ".join(f"{key} {value:.1f}" for key, value in record.summary().items()))
        release()
        loader = cProfile.Profile()
        loader.runcall(lambda: ([szformat.api.load_file(p, device=DEVICE) for p in weights], synchronize()))
        lines += ["\none more under cProfile, by cumulative time (from Python 3.12 the profiler sees every "
                  "thread, so their times overlap):", "| call | ms | calls |",
                  "|---|---:|---:|"]
        ranked = sorted(pstats.Stats(loader).stats.items(), key=lambda item: -item[1][3])
        lines += [f"| {Path(key[0]).stem}.{key[2]} | {stat[3] * 1e3:.1f} | {stat[1]} |" for key, stat in ranked[:40]]
    lines += [f"\none warm call under cProfile ({profiled * 1e3:.1f} ms with the profiler's overhead):",
              "| call | ms | calls |", "|---|---:|---:|"]
    lines += [f"| {call} | {seconds * 1e3:.1f} | {calls or ''} |" for call, seconds, calls in call_breakdown(profiler)
              if seconds >= 0.0005]
    return "\n".join(lines)


def main() -> None:
    global DEVICE
    if sys.argv[1:2] == ["offload-child"]:
        route, work = sys.argv[2], Path(sys.argv[3])
        print("RESULT " + json.dumps(offload_check(route, work, offload_budgets(work))), flush=True)
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default="/tmp/bench_from_pretrained", help="where models are built and kept")
    parser.add_argument("--models", default="llm,sd3")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--no-cold", action="store_true")
    parser.add_argument("--offload", default="", help="routes to check on the pipeline (native,staging)")
    parser.add_argument("--json", help="write every row here")
    parser.add_argument("--tiny", action="store_true", help="tiny configs on the CPU: a smoke test of this tool")
    parser.add_argument("--profile", choices=("cpu", "cuda"),
                        help="break down the time of szformat's from_pretrained of the first of --models on this "
                             "device (cpu: the decode replaced by empty tensors, the model built on the CPU when "
                             "missing)")
    args = parser.parse_args()
    if args.tiny or args.profile == "cpu":
        DEVICE = "cpu"
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.profile:
        print(profile(work, args.models.split(",")[0], args.reps, args.tiny))
        return
    rows = []
    for model in args.models.split(","):
        rows += bench_model(model, work, args.reps, not args.no_cold and not args.tiny, args.tiny)
    offloads = []
    for route in filter(None, args.offload.split(",")):
        child = subprocess.run([sys.executable, "-m", __spec__.name, "offload-child", route, str(work)],
                               capture_output=True, text=True, timeout=900)
        found = [line[7:] for line in child.stdout.splitlines() if line.startswith("RESULT ")]
        offloads.append(json.loads(found[-1]) if found else {"route": route, "error": child.stderr[-2000:]})
    print(table(rows, offloads))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "offload": offloads}, indent=2))


if __name__ == "__main__":
    main()
