"""End-to-end proof of ``szformat.load_into_offloader`` on a CUDA GPU: every route, against the same model loaded
from its original safetensors with and without offloading, outputs compared bit for bit.

Two models: the real all-MiniLM-L6-v2 (transformers ``BertModel``, weights cast to BF16, converted to .szt), and a
diffusers ``SD3Transformer2DModel`` built from a small config (a few blocks, seeded BF16 weights, saved as
safetensors and converted). Configurations run one after another in one process (the two ``vmm_fast`` ones in a
second process started through DDO's bootstrap), each measured from a baseline taken after the previous one was torn
down and every cache released:

=========================  =================================================================================
``gpu``                    no offloading: safetensors loaded, module moved to the GPU (the anchor)
``ddo-staging-st``         DDO ``vmm_runtime`` streaming from the original safetensors
``szt-staging``            ``load_into_offloader(route="staging")``: DDO ``vmm_runtime`` + szformat's pool
``szt-staging-cpu``        the same with the CPU decoder (as where Triton is absent)
``ddo-native-st``          DDO ``vmm_fast`` native transport from the original safetensors (DDO's bootstrap)
``szt-native``             ``load_into_offloader(route="native")`` (DDO's bootstrap)
``szt-group``              ``route="diffusers_group"``: diffusers group offloading fed by szformat
``szt-accelerate``         ``route="accelerate"``: accelerate's CPU-offload hooks fed by szformat
=========================  =================================================================================

DDO's resident budget is about two blocks, so forwards stream the blocks again (``vmm_runtime`` maps each block in
32 MiB pages and counts the budget in bytes, so MiniLM's six small blocks all stay resident under it).
Reported per configuration: setup time, warm forward time (median of 3 after one warm-up), host RSS over the
baseline (imports and CUDA start excluded) and the part of it that maps checkpoint files, GPU memory in use at peak over
the baseline (device-wide, sampled every 2 ms, so DDO's arena counts too), bytes the engine copied host to device
per forward (its own counter), and whether the output is bit-identical to ``gpu``.

Usage (on the GPU machine; see bench/RESULTS.md for the command that produced the figures)::

    python tools/offload_e2e.py --minilm .data/offload --out $OUT [--configs gpu,szt-staging,...]

``--minilm`` names a folder made beforehand from the BF16 MiniLM (``tools/fetch_minilm.py``): ``minilm-bf16.szt``
(``szconvert`` of its ``model.safetensors``), ``minilm-config.json`` and ``minilm-bf16.safetensors.sha256``. The
safetensors file is rebuilt from the .szt on the GPU machine and checked against that hash, so only the smaller file
travels.
"""

from __future__ import annotations

import sys

NATIVE_CONFIGS = ("ddo-native-st", "szt-native")
if __name__ == "__main__" and sys.argv[1:2] == ["batch"] and any(arg.endswith(NATIVE_CONFIGS) for arg in sys.argv):
    from ddo_vmm_bootstrap import ensure_vmm_fast_process  # DDO's vmm_fast must own CUDA from the first statement

    ensure_vmm_fast_process()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from procstatus import memory_status  # noqa: E402

CONFIGS = ("gpu", "szt-staging", "szt-staging-cpu", "ddo-staging-st", "szt-group", "szt-accelerate", "szt-native",
           "ddo-native-st")
MODELS = ("minilm", "dit")
DIT_CONFIG = dict(sample_size=32, patch_size=2, in_channels=16, num_layers=6, attention_head_dim=64,
                  num_attention_heads=8, joint_attention_dim=512, caption_projection_dim=512, pooled_projection_dim=256,
                  out_channels=16, pos_embed_max_size=64)
TIMED_FORWARDS = 3
NATIVE_RING_GB = 0.125
"""DDO's native transport ring (registered host memory): two 64 MiB windows, for DDO and szformat alike."""
GIB = 1024 ** 3


# -- the models --------------------------------------------------------------------------------------------------


def build_module(model: str, work: Path):
    """The module with freshly initialized weights (every configuration loads the checkpoint over them)."""
    import torch

    torch.manual_seed(1234)
    if model == "minilm":
        from transformers import BertConfig, BertModel

        config = BertConfig(**json.loads((work / "minilm" / "config.json").read_text()))
        return BertModel(config).to(torch.bfloat16).eval()
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel(**DIT_CONFIG).to(torch.bfloat16).eval()


def make_inputs(model: str, device):
    import torch

    gen = torch.Generator().manual_seed(7)
    if model == "minilm":
        ids = torch.randint(0, 30522, (8, 128), generator=gen)
        return dict(input_ids=ids.to(device), attention_mask=torch.ones_like(ids).to(device),
                    token_type_ids=torch.zeros_like(ids).to(device))
    bf16 = lambda *shape: torch.randn(*shape, generator=gen).to(torch.bfloat16).to(device)  # noqa: E731
    return dict(hidden_states=bf16(2, 16, 32, 32), encoder_hidden_states=bf16(2, 77, 512),
                pooled_projections=bf16(2, 256), timestep=torch.tensor([500.0, 250.0]).to(device))


def outputs_of(model: str, result) -> list:
    if model == "minilm":
        return [result.last_hidden_state, result.pooler_output]
    return [result.sample]


def block_list(model: str, module):
    return module.encoder.layer if model == "minilm" else module.transformer_blocks


def prepare(minilm_dir: Path, work: Path) -> dict[str, dict]:
    """Checkpoints in ``work``: MiniLM's safetensors rebuilt from its .szt (checked against the SHA-256 of the BF16
    file it was converted from), and the small DiT built, saved and converted."""
    import torch
    from safetensors.torch import save_file

    from szformat.convert.convert import convert
    from szformat.convert.decompress import decompress

    facts = {}
    folder = work / "minilm"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text((minilm_dir / "minilm-config.json").read_text())
    (folder / "model.szt").write_bytes((minilm_dir / "minilm-bf16.szt").read_bytes())
    decompress(folder / "model.szt", folder / "model.safetensors", overwrite=True)
    expected = (minilm_dir / "minilm-bf16.safetensors.sha256").read_text().split()[0]
    actual = hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
    if actual != expected:
        raise SystemExit(f"MiniLM safetensors rebuilt from .szt differs from the BF16 original: {actual}")
    facts["minilm"] = {"safetensors_sha256": actual}

    folder = work / "dit"
    folder.mkdir(parents=True, exist_ok=True)
    module = build_module("dit", work)
    gen = torch.Generator().manual_seed(42)
    with torch.no_grad():
        for tensor in module.state_dict().values():  # trained-like values everywhere (no zero-initialized layers)
            if tensor.dtype == torch.bfloat16:
                tensor.copy_((torch.randn(tensor.shape, generator=gen) * 0.02).to(torch.bfloat16))
    save_file({k: v.contiguous() for k, v in module.state_dict().items()}, folder / "model.safetensors")
    convert(folder / "model.safetensors", folder / "model.szt", overwrite=True)
    facts["dit"] = {"config": DIT_CONFIG}
    for model in MODELS:
        st, szt = work / model / "model.safetensors", work / model / "model.szt"
        facts[model].update(safetensors_bytes=st.stat().st_size, szt_bytes=szt.stat().st_size)
    return facts


# -- measuring -------------------------------------------------------------------------------------------------------


def checkpoint_mapping_rss() -> int:
    """Resident bytes of this process's mappings of .szt/.safetensors files (weights kept as file pages)."""
    total, counting = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                counting = len(head) >= 6 and head[-1].endswith((".szt", ".safetensors"))
            elif counting and line.startswith("Rss:"):
                total += int(head[1]) * 1024
    return total


class DevicePeak:
    """Device-wide memory in use (total - free), sampled on a thread: DDO's arena is outside PyTorch's allocator."""

    def __init__(self, device):
        import torch

        self._torch, self._device = torch, device
        free, self.total = torch.cuda.mem_get_info(device)
        self.base = self.total - free
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            free, _ = self._torch.cuda.mem_get_info(self._device)
            self.peak = max(self.peak, self.total - free)
            time.sleep(0.002)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak - self.base


# -- the configurations (batch processes) ---------------------------------------------------------------------------


def budgets(model: str, module, route: str) -> dict[str, float]:
    """DDO budgets: about two blocks resident (so weights stream every forward), one block per staging slot.

    ``vmm_runtime`` (staging) maps each block in 32 MiB pages, ``vmm_fast`` (native) in 2 MiB pages; the native
    transport ring is :data:`NATIVE_RING_GB`.
    """
    import torch

    block = max(sum(m.weight.numel() * m.weight.element_size() for m in item.modules()
                    if isinstance(m, torch.nn.Linear)) for item in block_list(model, module))
    page = (2 << 20) if route == "native" else (32 << 20)
    resident = 2.5 * (-(-block // page) * page) / GIB
    staging = NATIVE_RING_GB if route == "native" else 1.25 * block / GIB
    return {"vmm_resident_weight_budget_gb": resident, "vmm_staging_buffer_gb": staging}


def move_leftovers(module, device, streamed) -> None:
    """What szformat does for tensors DDO does not stream, done for the DDO-from-safetensors baselines: every tensor
    DDO left on the CPU goes to the device (DDO would run e.g. BERT's embedding table on the CPU otherwise)."""
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.device.type == "cpu" and not streamed(tensor):
            tensor.data = tensor.data.to(device)


def setup_config(config: str, model: str, module, work: Path, device):
    """Install ``config`` on ``module``; returns (transfer counter: () -> bytes so far, setup bytes, extra facts,
    teardown)."""
    from safetensors.torch import load_file

    st, szt = work / model / "model.safetensors", work / model / "model.szt"
    if config == "gpu":
        module.load_state_dict(load_file(st), strict=False)
        module.to(device)
        raw = sum(t.numel() * t.element_size() for t in module.state_dict().values())
        return (lambda: 0), raw, {}, (lambda: None)
    if config.startswith("ddo-"):
        import diffusers_dynamic_offloader as ddo
        from szformat.offload.routes import DDO_LIBRARY_ENV, detect_environment

        os.environ.setdefault(DDO_LIBRARY_ENV, detect_environment().native_library)
        from diffusers_dynamic_offloader.dynamic_offload import _attach_safetensor_file_slices

        module.load_state_dict(load_file(st), strict=False, assign=True)
        bound, available = _attach_safetensor_file_slices(module, [st])
        native = config == "ddo-native-st"
        backend = ddo.resolve_dynamic_offload_backend("vmm", "auto" if native else "nvme_baseline")
        settings = dict(budgets(model, module, "native" if native else "staging"), execution_device=str(device))
        if native:
            settings.update(vmm_native_transport=True)
        result = ddo.enable_offload(module, config=backend.build_config(**settings), route="dynamic_offload",
                                    use_environment=False, execution_device=device)
        hook = result.hook
        if native:
            streamed_ptrs = set(hook._vmm_fast_adapter._address_bindings)
            counter = lambda: int(hook._vmm_fast_store.runtime_stats().get("native_transport_read_bytes", 0))  # noqa
        else:
            sources = {s.data_ptr() for _, pairs in hook._vmm_arena._native.packed_source_groups() for _, s in pairs}
            streamed_ptrs = sources
            counter = lambda: int(hook._vmm_arena.stats.copied_bytes)  # noqa: E731
        before = sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()]
                     if t.device.type == "cpu" and t.data_ptr() not in streamed_ptrs)
        move_leftovers(module, device, lambda t: t.data_ptr() in streamed_ptrs)
        return counter, before, {"slices_bound": bound, "slices_available": available}, \
            lambda: ddo.remove_dynamic_offload(module)

    import szformat
    from szformat.offload import detect_environment

    route = {"szt-staging": "staging", "szt-staging-cpu": "staging", "szt-native": "native",
             "szt-group": "diffusers_group", "szt-accelerate": "accelerate"}[config]
    env = detect_environment()
    options = budgets(model, module, route) if route in ("staging", "native") else {}
    if config == "szt-staging-cpu":
        env = dataclasses.replace(env, triton_available=False)
    if route == "diffusers_group" and model == "minilm":
        options = {"block_modules": ["encoder"]}  # BERT's blocks sit one level down
    offloaded = szformat.load_into_offloader(szt, module, route=route, device=device, environment=env, **options)
    facts = {"route": offloaded.route.name, "decoder": offloaded.route.decoder, "reason": offloaded.route.reason}
    return (lambda: offloaded.counters()["h2d_bytes"]), offloaded.setup_bytes, facts, offloaded.close


def preload() -> None:
    """Import and warm up everything the configurations use, so their timings and memory exclude it."""
    import accelerate  # noqa: F401
    import diffusers_dynamic_offloader  # noqa: F401
    import torch
    import transformers  # noqa: F401
    from diffusers import SD3Transformer2DModel  # noqa: F401
    from transformers import BertModel  # noqa: F401

    import szformat.offload.accelerate_hooks  # noqa: F401
    import szformat.offload.ddo_install  # noqa: F401
    import szformat.offload.group_offload  # noqa: F401

    device = torch.device("cuda", 0)
    x = torch.randn(64, 64, 64, device=device, dtype=torch.bfloat16)
    torch.nn.functional.scaled_dot_product_attention(x[None], x[None], x[None])
    torch.nn.functional.linear(x, x[0])
    torch.cuda.synchronize(device)


def release_caches() -> None:
    import gc

    import torch

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    getattr(torch._C, "_host_emptyCache", lambda: None)()  # cached pinned blocks would stay resident


def run_config(model: str, config: str, work: Path) -> dict:
    import torch

    device = torch.device("cuda", 0)
    release_caches()
    base = memory_status()
    peak = DevicePeak(device)
    started = time.perf_counter()
    module = build_module(model, work)
    counter, setup_bytes, facts, teardown = setup_config(config, model, module, work, device)
    torch.cuda.synchronize(device)
    setup_s = time.perf_counter() - started
    inputs = make_inputs(model, device)
    with torch.no_grad():
        started = time.perf_counter()
        outputs = outputs_of(model, module(**inputs))
        torch.cuda.synchronize(device)
        first_s = time.perf_counter() - started
        moved_before = counter()
        times = []
        for _ in range(TIMED_FORWARDS):
            started = time.perf_counter()
            outputs = outputs_of(model, module(**inputs))
            torch.cuda.synchronize(device)
            times.append(time.perf_counter() - started)
        moved = (counter() - moved_before) / TIMED_FORWARDS
    gpu_peak = peak.stop()
    now = memory_status()
    mapped = checkpoint_mapping_rss()
    digest = hashlib.sha256()
    for output in outputs:
        digest.update(output.detach().contiguous().view(torch.int16).cpu().numpy().tobytes())
    torch.save([o.detach().cpu() for o in outputs], work / f"{model}-{config}.pt")
    teardown()
    return {"model": model, "config": config, "setup_s": setup_s, "first_forward_s": first_s,
            "forward_s": statistics.median(times), "forward_all_s": times, "h2d_bytes_per_forward": moved,
            "setup_h2d_bytes": setup_bytes, "gpu_peak_bytes": gpu_peak,
            "rss_bytes": now["VmRSS"] - base["VmRSS"], "rss_anon_bytes": now["RssAnon"] - base["RssAnon"],
            "rss_file_bytes": now["RssFile"] - base["RssFile"], "checkpoint_mapping_rss_bytes": mapped,
            "output_sha256": digest.hexdigest(), **facts}


def run_batch(work: Path, result_path: Path, jobs: list[str]) -> None:
    """Run ``model:config`` jobs one after another in this process, appending each result (or failure) to
    ``result_path`` as soon as it is known."""
    import traceback

    preload()
    done = []
    for job in jobs:
        model, config = job.split(":")
        try:
            done.append(run_config(model, config, work))
        except Exception:
            done.append({"model": model, "config": config, "error": traceback.format_exc()[-4000:]})
            print(f"FAILED {job}:\n{done[-1]['error'][-2500:]}", flush=True)
        else:
            print(f"ok {job}: {done[-1]['forward_s'] * 1e3:.1f} ms/forward", flush=True)
        result_path.write_text(json.dumps(done, indent=1))


# -- the driver (parent process) ---------------------------------------------------------------------------------


def run_all(args) -> None:
    out = Path(args.out)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    facts = prepare(Path(args.minilm), work)
    facts["versions"] = versions()
    print(json.dumps(facts), flush=True)
    jobs = [f"{model}:{config}" for model in args.models.split(",") for config in args.configs.split(",")]
    results = []
    for kind, batch in (("native", [j for j in jobs if j.endswith(NATIVE_CONFIGS)]),
                        ("host", [j for j in jobs if not j.endswith(NATIVE_CONFIGS)])):
        if not batch:
            continue
        result_path = work / f"batch-{kind}.json"
        process = subprocess.run([sys.executable, __file__, "batch", str(work), str(result_path), *batch],
                                 timeout=args.batch_timeout)
        if result_path.exists():
            results += json.loads(result_path.read_text())
        if process.returncode != 0:
            print(f"batch {kind} exited with {process.returncode}", flush=True)
        ok = [r for r in results if "error" not in r]
        compare(ok)
        (out / "offload_e2e.md").write_text(render(ok, facts))
        (out / "offload_e2e.json").write_text(json.dumps({"facts": facts, "results": results}, indent=1))
    print(render([r for r in results if "error" not in r], facts))


def compare(results: list[dict]) -> None:
    """Mark each result bit-identical (or not) to its model's ``gpu`` anchor."""
    for model in MODELS:
        anchor = next((r for r in results if r["model"] == model and r["config"] == "gpu"), None)
        for result in results:
            if result["model"] == model:
                result["identical_to_gpu"] = anchor is not None and result["output_sha256"] == anchor["output_sha256"]


def versions() -> dict[str, str | None]:
    import importlib.metadata

    names = ("torch", "triton", "transformers", "diffusers", "accelerate", "diffusers-dynamic-offloader",
             "ddo-vmm-allocator", "cuda-bindings", "cuda-core")
    found = {}
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def render(results: list[dict], facts: dict) -> str:
    mib = lambda n: f"{n / 2**20:.1f}"  # noqa: E731
    lines = []
    for model in MODELS:
        rows = [r for r in results if r["model"] == model]
        if not rows:
            continue
        f = facts[model]
        lines += [f"\n{model}: safetensors {mib(f['safetensors_bytes'])} MiB, .szt {mib(f['szt_bytes'])} MiB "
                  f"({f['szt_bytes'] / f['safetensors_bytes']:.3f})\n",
                  "| config | route / decoder | bit-identical | setup s | fwd ms (warm) | 1st fwd ms | H2D MiB/fwd "
                  "| setup H2D MiB | host RSS MiB | ckpt file RSS MiB | GPU peak MiB |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            route = f"{r.get('route', '-')} / {r.get('decoder', '-')}"
            lines.append(f"| {r['config']} | {route} | {'yes' if r['identical_to_gpu'] else 'NO'} | "
                         f"{r['setup_s']:.2f} | {r['forward_s'] * 1e3:.1f} | {r['first_forward_s'] * 1e3:.1f} | "
                         f"{mib(r['h2d_bytes_per_forward'])} | {mib(r['setup_h2d_bytes'])} | {mib(r['rss_bytes'])} | "
                         f"{mib(r['checkpoint_mapping_rss_bytes'])} | {mib(r['gpu_peak_bytes'])} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    if sys.argv[1:2] == ["batch"]:
        run_batch(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minilm", required=True, help="folder with minilm-bf16.szt, minilm-config.json and "
                                                        "minilm-bf16.safetensors.sha256")
    parser.add_argument("--out", required=True, help="where the table and the JSON go")
    parser.add_argument("--work", default="/tmp/offload_e2e", help="scratch folder for checkpoints and outputs")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--batch-timeout", type=float, default=300)
    run_all(parser.parse_args())


if __name__ == "__main__":
    main()
