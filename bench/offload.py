"""End-to-end proof of ``szformat.load_into_offloader`` on a CUDA GPU: every route, against the same model loaded
from its original safetensors with and without offloading, outputs compared bit for bit.

Models (``--models``):

=============  ========================================================================================================
``minilm``     the real all-MiniLM-L6-v2 (transformers ``BertModel``, weights cast to BF16, converted to .szt)
``dit``        a diffusers ``SD3Transformer2DModel`` from a small config (6 blocks of 19 MB, width 512)
``dit-large``  the SD3-medium-shaped ``SD3Transformer2DModel`` (24 blocks, 24 heads of 64, joint attention width
               4096): 4.08 GB of BF16 weights, built on the ``meta`` device so that every configuration only pays for
               loading the checkpoint
=============  ========================================================================================================

The DiTs get seeded ``randn * 0.02`` BF16 weights, drawn on the GPU, saved as safetensors and converted with
``szformat.convert.convert`` on the GPU. Configurations run one after another in one process (the two ``vmm_fast``
ones in a second process started through DDO's bootstrap), each measured from a baseline taken after the previous one
was torn down and every cache released:

=====================  =================================================================================
``gpu``                no offloading: safetensors loaded, module moved to the GPU (the anchor)
``ddo-staging-st``     DDO ``vmm_runtime`` streaming from the original safetensors
``szt-staging``        ``load_into_offloader(route="staging")``: DDO ``vmm_runtime`` + szformat's pool
``szt-staging-cpu``    the same with the CPU decoder (as where Triton is absent)
``ddo-native-st``      DDO ``vmm_fast`` native transport from the original safetensors (DDO's bootstrap)
``szt-native``         ``load_into_offloader(route="native")`` (DDO's bootstrap)
``szt-group``          ``route="diffusers_group"``: diffusers group offloading fed by szformat
``szt-accelerate``     ``route="accelerate"``: accelerate's CPU-offload hooks fed by szformat
``szt-resident``       ``route="resident"``: weights compressed in device memory, expanded per block
``st-group``           diffusers ``apply_group_offloading`` on the safetensors-loaded model, szformat's options
``st-group-stream``    the same with ``use_stream=True, non_blocking=True`` (pinned copies, next group prefetched)
``st-accelerate``      ``accelerate.cpu_offload`` on the safetensors-loaded model
=====================  =================================================================================

DDO's resident budget is about two and a half blocks (a tenth of the large DiT's weights), so forwards stream the
blocks again (``vmm_runtime`` maps each block in 32 MiB pages and counts the budget in bytes, so MiniLM's six small
blocks all stay resident under it). Reported per configuration: setup time, warm forward time (median of
``--forwards`` after one warm-up), host RSS over the baseline (imports and CUDA start excluded) and the part of it that
maps checkpoint files, GPU memory in use at peak over the baseline (device-wide, sampled every 2 ms, so DDO's arena
counts too), bytes copied host to device per forward, and whether the output is bit-identical to ``gpu``. The bytes
come from the engine's own counter (DDO's, or the route's ``OffloadedModel.counters()["h2d_bytes"]``); diffusers and
accelerate count nothing, so for the ``st-`` anchors they are the bytes of the tensors the engine keeps off the device,
all of which it moves every forward (marked ``*``).

The floor of an offloaded forward, per model: the bytes the blocks stream (their raw bytes less the resident budget)
at the stored/raw ratio of the block tensors in the .szt file, over the pinned host-to-device rate measured in the same
run (a 1 GiB pinned copy), plus the no-offload forward time (``gpu``); the same for the raw bytes is the floor of any
uncompressed route. Each row is shown against that floor and against DDO ``vmm_fast`` and ``vmm_runtime`` from
safetensors.

Usage (on the GPU machine; see bench/RESULTS.md for the commands that produced the figures)::

    python -m bench.offload --minilm .data/offload --out $OUT [--models minilm,dit] [--configs gpu,...]
    python -m bench.offload --models dit-large --out $OUT --forwards 5

``--minilm`` (needed for the ``minilm`` model only) names a folder made beforehand from the BF16 MiniLM
(``tools/fetch_minilm.py``): ``minilm-bf16.szt`` (``szconvert`` of its ``model.safetensors``), ``minilm-config.json``
and ``minilm-bf16.safetensors.sha256``. The safetensors file is rebuilt from the .szt on the GPU machine and checked
against that hash, so only the smaller file travels.
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

# by its package's name, not relatively: DDO's bootstrap starts the native batch again by this file's path
from bench.common import memory_status  # noqa: E402

CONFIGS = ("gpu", "szt-resident", "szt-staging", "szt-staging-cpu", "ddo-staging-st", "szt-group", "szt-accelerate",
           "st-group", "st-group-stream", "st-accelerate", "szt-native", "ddo-native-st")
DERIVED_H2D_CONFIGS = ("st-group", "st-group-stream", "st-accelerate")
"""Anchors whose engine counts no bytes: theirs are the bytes of the tensors kept off the device, times forwards."""
MODELS = ("minilm", "dit", "dit-large")
DIT_CONFIGS = {
    "dit": dict(sample_size=32, patch_size=2, in_channels=16, num_layers=6, attention_head_dim=64,
                num_attention_heads=8, joint_attention_dim=512, caption_projection_dim=512, pooled_projection_dim=256,
                out_channels=16, pos_embed_max_size=64),
    "dit-large": dict(sample_size=64, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
                      num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                      pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=96),
}
DIT_INPUTS = {"dit": dict(side=32, text_width=512, pooled_width=256),
              "dit-large": dict(side=64, text_width=4096, pooled_width=2048)}
"""Batch 2 of ``side`` x ``side`` latents and 77 text tokens."""
BUILT_ON_META = ("dit-large",)
"""Models built without weights: every configuration loads (or binds) the whole checkpoint, so nothing is lost."""
BLOCK_PREFIX = {"minilm": "encoder.layer.", "dit": "transformer_blocks.", "dit-large": "transformer_blocks."}
"""Where the streamed blocks' tensors are, for the floor."""
TIMED_FORWARDS = 3
NATIVE_RING_GB = 0.125
"""DDO's native transport ring (registered host memory): two 64 MiB windows, for DDO and szformat alike."""
GIB = 1024 ** 3


# -- the models --------------------------------------------------------------------------------------------------


def build_module(model: str, work: Path):
    """The module, freshly initialized (or without weights, for :data:`BUILT_ON_META`): every configuration loads
    the checkpoint over it."""
    import torch

    torch.manual_seed(1234)
    if model == "minilm":
        from transformers import BertConfig, BertModel

        config = BertConfig(**json.loads((work / "minilm" / "config.json").read_text()))
        return BertModel(config).to(torch.bfloat16).eval()
    from diffusers import SD3Transformer2DModel

    with torch.device("meta" if model in BUILT_ON_META else "cpu"):
        module = SD3Transformer2DModel(**DIT_CONFIGS[model])
    return module.to(torch.bfloat16).eval()


def load_safetensors(module, path: Path) -> None:
    """The checkpoint's tensors become the module's own (``assign``: a module built on ``meta`` takes them too)."""
    from safetensors.torch import load_file

    module.load_state_dict(load_file(path), strict=False, assign=True)


def make_inputs(model: str, device):
    import torch

    gen = torch.Generator().manual_seed(7)
    if model == "minilm":
        ids = torch.randint(0, 30522, (8, 128), generator=gen)
        return dict(input_ids=ids.to(device), attention_mask=torch.ones_like(ids).to(device),
                    token_type_ids=torch.zeros_like(ids).to(device))
    shape = DIT_INPUTS[model]
    bf16 = lambda *size: torch.randn(*size, generator=gen).to(torch.bfloat16).to(device)  # noqa: E731
    return dict(hidden_states=bf16(2, 16, shape["side"], shape["side"]),
                encoder_hidden_states=bf16(2, 77, shape["text_width"]),
                pooled_projections=bf16(2, shape["pooled_width"]), timestep=torch.tensor([500.0, 250.0]).to(device))


def outputs_of(model: str, result) -> list:
    if model == "minilm":
        return [result.last_hidden_state, result.pooler_output]
    return [result.sample]


def block_list(model: str, module):
    return module.encoder.layer if model == "minilm" else module.transformer_blocks


def prepare(minilm_dir: Path | None, work: Path, models: list[str]) -> dict[str, dict]:
    """Checkpoints in ``work`` and the facts the floor needs: MiniLM's safetensors rebuilt from its .szt (checked
    against the SHA-256 of the BF16 file it was converted from), the DiTs built, saved and converted on the GPU; the
    pinned host-to-device rate of this machine."""
    import torch
    from bench.common import pinned_h2d_gbps

    from szformat.convert.decompress import decompress

    facts = {}
    for model in models:
        folder = work / model
        folder.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        if model == "minilm":
            (folder / "config.json").write_text((minilm_dir / "minilm-config.json").read_text())
            (folder / "model.szt").write_bytes((minilm_dir / "minilm-bf16.szt").read_bytes())
            decompress(folder / "model.szt", folder / "model.safetensors", overwrite=True)
            expected = (minilm_dir / "minilm-bf16.safetensors.sha256").read_text().split()[0]
            actual = hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
            if actual != expected:
                raise SystemExit(f"MiniLM safetensors rebuilt from .szt differs from the BF16 original: {actual}")
            facts[model] = {"safetensors_sha256": actual}
        else:
            save_seeded_dit(model, folder, torch.device("cuda", 0))
            facts[model] = {"config": DIT_CONFIGS[model], "inputs": DIT_INPUTS[model]}
        facts[model].update(checkpoint_facts(model, work), prepare_s=time.perf_counter() - started)
        print(f"prepared {model} in {facts[model]['prepare_s']:.1f} s", flush=True)
    facts["pinned_h2d_gbps"] = pinned_h2d_gbps(GIB, reps=5, device=torch.device("cuda", 0))
    release_caches()
    os.sync()  # written pages are clean before anything is timed
    return facts


def save_seeded_dit(model: str, folder: Path, device) -> None:
    """Seeded ``randn * 0.02`` BF16 values for every tensor (no zero-initialized layers), drawn on ``device``, saved
    as ``model.safetensors`` and converted on ``device`` to ``model.szt``."""
    import torch
    from safetensors.torch import save_file

    from szformat.convert.convert import convert

    gen = torch.Generator(device).manual_seed(42)
    tensors = {}
    for name, tensor in build_module(model, folder.parent).state_dict().items():
        if tensor.dtype != torch.bfloat16:
            raise SystemExit(f"{model}: {name} is {tensor.dtype}; the seeded checkpoint holds BF16 tensors only")
        tensors[name] = (torch.randn(tensor.shape, generator=gen, device=device) * 0.02).to(torch.bfloat16).cpu()
    save_file(tensors, folder / "model.safetensors")
    del tensors
    convert(folder / "model.safetensors", folder / "model.szt", overwrite=True, device=device.type)


def checkpoint_facts(model: str, work: Path) -> dict:
    """File sizes, the blocks' raw and stored bytes (from the .szt header), and DDO's resident budget."""
    from szformat.format.reader import SztFile

    st, szt = work / model / "model.safetensors", work / model / "model.szt"
    with SztFile(szt) as f:
        entries = list(f.entries.values())
    blocks = [e for e in entries if e.name.startswith(BLOCK_PREFIX[model])]
    module = build_module(model, work)
    resident = max(budgets(model, module, route)["vmm_resident_weight_budget_gb"] for route in ("native", "staging"))
    raw = sum(e.raw_length for e in entries)
    return {"safetensors_bytes": st.stat().st_size, "szt_bytes": szt.stat().st_size, "raw_bytes": raw,
            "block_raw_bytes": sum(e.raw_length for e in blocks), "block_stored_bytes": sum(e.length for e in blocks),
            "resident_budget_bytes": int(resident * GIB), "resident_share": resident * GIB / raw}


def offload_floor(block_raw_bytes: int, block_stored_bytes: int, resident_budget_bytes: int, h2d_gbps: float,
                  forward_s: float) -> dict[str, float]:
    """The least time an offloaded forward can take on this link, compressed and raw.

    The blocks' raw bytes beyond the resident budget must cross PCIe every forward; stored compressed, they cross at
    the blocks' stored/raw ratio. Each floor is those bytes at the pinned host-to-device rate plus the forward
    itself without offloading (copies and compute could overlap at best, but the forward never gets shorter).
    """
    if block_raw_bytes <= 0 or h2d_gbps <= 0:
        raise ValueError(f"the floor needs streamed bytes and a copy rate, got {block_raw_bytes} B at {h2d_gbps} GB/s")
    raw = max(0, block_raw_bytes - resident_budget_bytes)
    stored = raw * block_stored_bytes / block_raw_bytes
    return {"raw_bytes_per_forward": raw, "stored_bytes_per_forward": stored,
            "floor_s": stored / (h2d_gbps * 1e9) + forward_s, "raw_floor_s": raw / (h2d_gbps * 1e9) + forward_s}


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
    """Install ``config`` on ``module``; returns (transfer counters: () -> {"h2d_bytes": bytes so far, ...}, setup
    bytes, extra facts, teardown)."""
    st, szt = work / model / "model.safetensors", work / model / "model.szt"
    if config == "gpu":
        load_safetensors(module, st)
        module.to(device)
        raw = sum(t.numel() * t.element_size() for t in module.state_dict().values())
        return (lambda: {"h2d_bytes": 0}), raw, {}, (lambda: None)
    if config.startswith("st-"):
        load_safetensors(module, st)
        return setup_plain_engine(config, model, module, device)
    if config.startswith("ddo-"):
        import diffusers_dynamic_offloader as ddo

        from szformat.offload.routes import DDO_LIBRARY_ENV, detect_environment

        os.environ.setdefault(DDO_LIBRARY_ENV, detect_environment().native_library)
        from diffusers_dynamic_offloader.dynamic_offload import (
            _attach_safetensor_file_slices,
        )

        load_safetensors(module, st)
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
            counter = lambda: {"h2d_bytes": int(  # noqa: E731
                hook._vmm_fast_store.runtime_stats().get("native_transport_read_bytes", 0))}
        else:
            sources = {s.data_ptr() for _, pairs in hook._vmm_arena._native.packed_source_groups() for _, s in pairs}
            streamed_ptrs = sources
            counter = lambda: {"h2d_bytes": int(hook._vmm_arena.stats.copied_bytes)}  # noqa: E731
        before = sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()]
                     if t.device.type == "cpu" and t.data_ptr() not in streamed_ptrs)
        move_leftovers(module, device, lambda t: t.data_ptr() in streamed_ptrs)
        return counter, before, {"slices_bound": bound, "slices_available": available}, \
            lambda: ddo.remove_dynamic_offload(module)

    import szformat
    from szformat.offload import detect_environment

    route = {"szt-staging": "staging", "szt-staging-cpu": "staging", "szt-native": "native",
             "szt-group": "diffusers_group", "szt-accelerate": "accelerate", "szt-resident": "resident"}[config]
    env = detect_environment()
    options = budgets(model, module, route) if route in ("staging", "native") else {}
    if config == "szt-staging-cpu":
        env = dataclasses.replace(env, triton_available=False)
    if route == "diffusers_group" and model == "minilm":
        options = {"block_modules": ["encoder"]}  # BERT's blocks sit one level down
    offloaded = szformat.load_into_offloader(szt, module, route=route, device=device, environment=env, **options)
    facts = {"route": offloaded.route.name, "decoder": offloaded.route.decoder, "reason": offloaded.route.reason}
    return lambda: route_counters(offloaded), offloaded.setup_bytes, facts, offloaded.close


def route_counters(offloaded) -> dict[str, int]:
    """The route's own counters (``h2d_bytes``: what it moved host to device while running, and its details), the
    numeric ones; a route without ``h2d_bytes`` gets -1 there, shown as unknown instead of failing the run."""
    counters = {key: int(value) for key, value in offloaded.counters().items() if isinstance(value, (int, float))}
    counters.setdefault("h2d_bytes", -1)
    return counters


def setup_plain_engine(config: str, model: str, module, device):
    """diffusers group offloading or accelerate's CPU offload, as a user applies them to a model loaded from its
    safetensors. Neither counts the bytes it moves: both move every tensor they keep off the device at every forward,
    so the counter is those bytes times the forwards run (a forward pre-hook counts them)."""
    import torch

    if config == "st-accelerate":
        from accelerate import cpu_offload
        from accelerate.hooks import remove_hook_from_module

        cpu_offload(module, execution_device=device)
        teardown = lambda: remove_hook_from_module(module, recurse=True)  # noqa: E731
    else:
        from diffusers.hooks import apply_group_offloading

        from szformat.offload.group_offload import OPTIONS

        options = dict(OPTIONS)
        if model == "minilm":
            options["block_modules"] = ["encoder"]  # BERT's blocks sit one level down
        if config == "st-group-stream":
            options.update(use_stream=True, non_blocking=True)
        apply_group_offloading(module, onload_device=device, offload_device=torch.device("cpu"), **options)
        teardown = lambda: None  # noqa: E731  (the hooks go with the module)
    tensors = [*module.parameters(), *module.buffers()]
    off_device = sum(t.numel() * t.element_size() for t in tensors if t.device.type != "cuda")
    on_device = sum(t.numel() * t.element_size() for t in tensors if t.device.type == "cuda")
    forwards = []
    handle = module.register_forward_pre_hook(lambda *_: forwards.append(1))

    def remove() -> None:
        handle.remove()
        teardown()

    return (lambda: {"h2d_bytes": len(forwards) * off_device}), on_device, {"off_device_bytes": off_device}, remove


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


def run_config(model: str, config: str, work: Path, forwards: int) -> dict:
    import torch

    device = torch.device("cuda", 0)
    release_caches()
    base = memory_status()
    peak = DevicePeak(device)
    started = time.perf_counter()
    module = build_module(model, work)
    counters, setup_bytes, facts, teardown = setup_config(config, model, module, work, device)
    torch.cuda.synchronize(device)
    setup_s = time.perf_counter() - started
    inputs = make_inputs(model, device)
    with torch.no_grad():
        started = time.perf_counter()
        outputs = outputs_of(model, module(**inputs))
        torch.cuda.synchronize(device)
        first_s = time.perf_counter() - started
        before = counters()
        times = []
        for _ in range(forwards):
            started = time.perf_counter()
            outputs = outputs_of(model, module(**inputs))
            torch.cuda.synchronize(device)
            times.append(time.perf_counter() - started)
        after = counters()
    per_forward = {key: (after[key] - before.get(key, 0)) / forwards for key in after}
    moved = per_forward["h2d_bytes"] if after["h2d_bytes"] >= 0 else None
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
            "counters_per_forward": per_forward, "setup_h2d_bytes": setup_bytes, "gpu_peak_bytes": gpu_peak,
            "rss_bytes": now["VmRSS"] - base["VmRSS"], "rss_anon_bytes": now["RssAnon"] - base["RssAnon"],
            "rss_file_bytes": now["RssFile"] - base["RssFile"], "checkpoint_mapping_rss_bytes": mapped,
            "output_sha256": digest.hexdigest(), **facts}


def run_batch(work: Path, result_path: Path, forwards: int, jobs: list[str]) -> None:
    """Run ``model:config`` jobs one after another in this process, appending each result (or failure) to
    ``result_path`` as soon as it is known."""
    import traceback

    preload()
    done = []
    for job in jobs:
        model, config = job.split(":")
        try:
            done.append(run_config(model, config, work, forwards))
        except Exception:
            done.append({"model": model, "config": config, "error": traceback.format_exc()[-4000:]})
            print(f"FAILED {job}:\n{done[-1]['error'][-2500:]}", flush=True)
        else:
            moved = done[-1]["h2d_bytes_per_forward"]
            print(f"ok {job}: {done[-1]['forward_s'] * 1e3:.1f} ms/forward, "
                  f"{'?' if moved is None else f'{moved / 2**20:.1f}'} MiB H2D/forward", flush=True)
        result_path.write_text(json.dumps(done, indent=1))


# -- the driver (parent process) ---------------------------------------------------------------------------------


def run_all(args) -> None:
    out = Path(args.out)
    work = Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    models, configs = args.models.split(","), args.configs.split(",")
    facts = prepare(Path(args.minilm) if args.minilm else None, work, models)
    facts["versions"] = versions()
    facts["forwards"] = args.forwards
    print(json.dumps(facts), flush=True)
    jobs = [f"{model}:{config}" for model in models for config in configs]
    results = []
    for kind, batch in (("native", [j for j in jobs if j.endswith(NATIVE_CONFIGS)]),
                        ("host", [j for j in jobs if not j.endswith(NATIVE_CONFIGS)])):
        if not batch:
            continue
        result_path = work / f"batch-{kind}.json"
        result_path.unlink(missing_ok=True)
        command = [sys.executable, "-m", __spec__.name, "batch", str(work), str(result_path), str(args.forwards),
                   *batch]
        try:
            returncode = subprocess.run(command, timeout=args.batch_timeout).returncode
        except subprocess.TimeoutExpired:
            returncode = f"a timeout ({args.batch_timeout:g} s; the jobs after the last result did not run)"
        if result_path.exists():
            results += json.loads(result_path.read_text())
        if returncode != 0:
            print(f"batch {kind} exited with {returncode}", flush=True)
        table = render(results, facts, models)
        (out / "offload_e2e.md").write_text(table)
        (out / "offload_e2e.json").write_text(json.dumps({"facts": facts, "results": results}, indent=1))
    print(table)


def annotate(results: list[dict], facts: dict, models: list[str]) -> dict[str, dict]:
    """Mark each result bit-identical (or not) to its model's ``gpu`` anchor and give its time against the floor
    and against DDO from safetensors (``x_floor``, ``x_raw_floor``, ``x_vmm_fast``, ``x_vmm_runtime``: this row's
    forward time over theirs); returns each model's floor (where its ``gpu`` row and the copy rate are known)."""
    floors = {}
    for model in models:
        rows = {r["config"]: r for r in results if r["model"] == model and "error" not in r}
        anchor = rows.get("gpu")
        if anchor is not None and facts.get("pinned_h2d_gbps"):
            f = facts[model]
            floors[model] = offload_floor(f["block_raw_bytes"], f["block_stored_bytes"], f["resident_budget_bytes"],
                                          facts["pinned_h2d_gbps"], anchor["forward_s"])
        for row in rows.values():
            row["identical_to_gpu"] = anchor is not None and row["output_sha256"] == anchor["output_sha256"]
            if model in floors:
                row["x_floor"] = row["forward_s"] / floors[model]["floor_s"]
                row["x_raw_floor"] = row["forward_s"] / floors[model]["raw_floor_s"]
            for key, config in (("x_vmm_fast", "ddo-native-st"), ("x_vmm_runtime", "ddo-staging-st")):
                if config in rows:
                    row[key] = row["forward_s"] / rows[config]["forward_s"]
    return floors


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


def render(results: list[dict], facts: dict, models: list[str]) -> str:
    """One markdown table per model, its floor above it and its failed configurations below it."""
    floors = annotate(results, facts, models)
    mib = lambda n: "?" if n is None else f"{n / 2**20:.1f}"  # noqa: E731
    times = lambda r, key: f"{r[key]:.2f}" if key in r else "-"  # noqa: E731
    lines = []
    for model in models:
        rows = [r for r in results if r["model"] == model]
        if not rows:
            continue
        f = facts[model]
        lines += [f"\n{model}: safetensors {mib(f['safetensors_bytes'])} MiB, .szt {mib(f['szt_bytes'])} MiB "
                  f"({f['szt_bytes'] / f['safetensors_bytes']:.3f}); DDO resident budget "
                  f"{mib(f['resident_budget_bytes'])} MiB ({f['resident_share']:.1%} of the weights)\n"]
        if model in floors:
            floor = floors[model]
            forward_ms = floor["floor_s"] * 1e3 - floor["stored_bytes_per_forward"] / facts["pinned_h2d_gbps"] / 1e6
            lines += [f"floor: {mib(floor['stored_bytes_per_forward'])} MiB stored per forward (blocks' "
                      f"{mib(floor['raw_bytes_per_forward'])} MiB raw beyond the resident budget) at the pinned "
                      f"host-to-device rate of this run, {facts['pinned_h2d_gbps']:.1f} GB/s, + the no-offload "
                      f"forward {forward_ms:.1f} ms = **{floor['floor_s'] * 1e3:.1f} ms** "
                      f"(uncompressed: {floor['raw_floor_s'] * 1e3:.1f} ms)\n"]
        lines += ["| config | route / decoder | bit-identical | setup s | fwd ms (warm) | 1st fwd ms | x floor "
                  "| x raw floor | x vmm_fast | x vmm_runtime | H2D MiB/fwd | setup H2D MiB | host RSS MiB "
                  "| ckpt file RSS MiB | GPU peak MiB |",
                  "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            if "error" in r:
                continue
            route = f"{r.get('route', '-')} / {r.get('decoder', '-')}"
            derived = "*" if r["config"] in DERIVED_H2D_CONFIGS else ""
            lines.append(f"| {r['config']} | {route} | {'yes' if r['identical_to_gpu'] else 'NO'} | "
                         f"{r['setup_s']:.2f} | {r['forward_s'] * 1e3:.1f} | {r['first_forward_s'] * 1e3:.1f} | "
                         f"{times(r, 'x_floor')} | {times(r, 'x_raw_floor')} | {times(r, 'x_vmm_fast')} | "
                         f"{times(r, 'x_vmm_runtime')} | {mib(r['h2d_bytes_per_forward'])}{derived} | "
                         f"{mib(r['setup_h2d_bytes'])} | {mib(r['rss_bytes'])} | "
                         f"{mib(r['checkpoint_mapping_rss_bytes'])} | {mib(r['gpu_peak_bytes'])} |")
        for r in rows:
            if "error" in r:
                last = r["error"].strip().splitlines()[-1] if r["error"].strip() else "?"
                lines.append(f"\n{r['config']} FAILED: {last}")
    lines.append("\n\\* bytes of the tensors the engine keeps off the device, all moved every forward (the engine "
                 "counts none)")
    return "\n".join(lines) + "\n"


def main() -> None:
    if sys.argv[1:2] == ["batch"]:
        run_batch(Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]), sys.argv[5:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="configurations: " + ", ".join(CONFIGS))
    parser.add_argument("--minilm", help="folder with minilm-bf16.szt, minilm-config.json and "
                                         "minilm-bf16.safetensors.sha256 (needed for the minilm model)")
    parser.add_argument("--out", required=True, help="where the table and the JSON go")
    parser.add_argument("--work", default="/tmp/offload_e2e", help="scratch folder for checkpoints and outputs")
    parser.add_argument("--models", default="minilm,dit", type=names_of(MODELS),
                        help=f"comma-separated, of {', '.join(MODELS)} (default: minilm,dit)")
    parser.add_argument("--configs", default=",".join(CONFIGS), type=names_of(CONFIGS),
                        help="comma-separated configurations (default: all)")
    parser.add_argument("--forwards", type=int, default=TIMED_FORWARDS,
                        help=f"timed warm forwards per configuration, after one warm-up (default {TIMED_FORWARDS})")
    parser.add_argument("--batch-timeout", type=float, default=300,
                        help="seconds each batch process may run (the results it wrote by then are kept)")
    args = parser.parse_args()
    if "minilm" in args.models.split(",") and not args.minilm:
        parser.error("the minilm model needs --minilm")
    if args.forwards < 1:
        parser.error("--forwards must be at least 1")
    run_all(args)


def names_of(known: tuple[str, ...]):
    """An argparse type: a comma-separated list of names, each one of ``known``."""

    def parse(value: str) -> str:
        unknown = [name for name in value.split(",") if name not in known]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown: {', '.join(unknown)} (known: {', '.join(known)})")
        return value

    return parse


if __name__ == "__main__":
    main()
