"""Serve .szt checkpoints with vLLM: ``--load-format szt`` (``LLM(model=..., load_format="szt")``).

Registered through the ``vllm.general_plugins`` entry point (the ``szformat[vllm]`` extra installs it with
szformat), which vLLM calls in every process it starts, so the engine, its workers and every tensor-parallel rank
know the format with no import in user code. ``MODEL`` is a converted folder (shards and ``model.szt.index.json``, the
configs and tokenizer beside them) or a Hub repo of one (``user/model-szt``; vLLM reads its config, szformat fetches
its .szt files, index and configs, and no other weights).

Each rank opens the files itself and streams their tensors, decoded where they go (CUDA: through the GPU load
pipeline, stored bytes over PCIe and expanded on the device, ``BATCH_BYTES`` of raw tensors at a time; CPU: as
:class:`~.deferred.DeferredTensor`, decoded by the CPU decoder when vLLM's weight loader copies them, straight into
the parameter and only the rows its rank keeps), into the model's own ``load_weights``: vLLM's name mapping, stacked
``qkv``/``gate_up`` projections, tensor-parallel narrowing and expert loaders stay vLLM's. Bad input fails the
start-up with szformat's one-line error naming the file and the tensor.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from .._runs import runs_within
from ..errors import InvalidArgumentError, ModelFolderError
from ..format import constants as C
from .deferred import DecodeCounter, DeferredTensor

__all__ = ["LOAD_FORMAT", "BATCH_BYTES", "EXTRA_CONFIG_KEYS", "register", "szt_weights", "verify_option"]

LOAD_FORMAT = "szt"
logger = logging.getLogger("vllm.model_executor.model_loader.szt")
"""Under vLLM's logger, so its configuration prints what this loader logs beside vLLM's own lines."""
BATCH_BYTES = 512 << 20
"""Raw bytes of tensors decoded together on a CUDA rank before they are handed to ``load_weights`` (one batched
load through the staging ring); the device holds at most this much beside the model while it loads."""


EXTRA_CONFIG_KEYS = ("verify",)
"""What ``--model-loader-extra-config`` may hold for this loader: ``{"verify": false}`` skips the CRC-32 checks of
the stored and decoded bytes (for files you trust: a rank of a tensor-parallel engine then reads only what it
decodes); the structural checks stay."""


def register() -> None:
    """The ``vllm.general_plugins`` entry point: make ``load_format="szt"`` known to this process's vLLM. vLLM
    calls it in every process it starts, whatever the load format, so under a vLLM older than 0.10.1 (no
    ``register_model_loader``) it warns and leaves the engine as it is rather than stop it."""
    from vllm.model_executor import model_loader

    register_model_loader = getattr(model_loader, "register_model_loader", None)
    if register_model_loader is None:
        import vllm

        logger.warning("szformat: vLLM %s cannot register a model loader (0.10.1 and later can): load_format=%r "
                       "is not available", getattr(vllm, "__version__", "?"), LOAD_FORMAT)
        return
    register_model_loader(LOAD_FORMAT)(_loader_class())


def szt_weights(path: str | os.PathLike, device: torch.device, *, verify: bool = True,
                batch_bytes: int = BATCH_BYTES, counter: DecodeCounter | None = None,
                files: contextlib.ExitStack | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint at ``path`` as ``(name, tensor)``, shard by shard, checksums checked as
    ``load_file`` checks them: on CUDA decoded on the device in batches of ``batch_bytes`` raw bytes; on the CPU as
    :class:`~.deferred.DeferredTensor`, decoded when used (the bytes decoded counted in ``counter``) while its file
    is open: until ``files`` closes, when given (a loader whose model may keep tensors to use after the last one is
    handed out), else until this iterator ends (a tensor used later raises ClosedFileError, naming the file)."""
    from ..format.index import checkpoint_shards, open_shard

    if device.type != "cuda":
        from ..loading.host_reader import HostReader

        counter = counter if counter is not None else DecodeCounter()
        with contextlib.ExitStack() as own:
            for shard in checkpoint_shards(path):
                file = (files if files is not None else own).enter_context(open_shard(shard))
                reader = HostReader(file, verify=verify)
                for name in (list(file.entries) if shard.names is None else shard.names):
                    entry = file.entry(name)
                    counter.handed_out += entry.raw_length
                    yield name, DeferredTensor(reader, entry, counter)
        return
    from ..loading.device_loader import DeviceLoader

    loader = DeviceLoader(device, verify=verify)
    try:
        for shard in checkpoint_shards(path):
            with open_shard(shard) as file:
                names = list(file.entries) if shard.names is None else shard.names
                for batch in runs_within(names, lambda name: file.entry(name).raw_length, batch_bytes):
                    yield from loader.load(file, batch).items()
                loader.release(file)
    finally:
        loader.close()


def verify_option(extra_config: object) -> bool:
    """The ``verify`` setting of vLLM's ``model_loader_extra_config`` (default on), refusing any other key or value
    by name, as vLLM's own loaders do."""
    if extra_config is None:
        return True
    if not isinstance(extra_config, dict):
        raise InvalidArgumentError(f"model_loader_extra_config must be a dict for load format {LOAD_FORMAT!r}, got "
                                   f"{type(extra_config).__name__}")
    unexpected = sorted(set(extra_config) - set(EXTRA_CONFIG_KEYS))
    if unexpected:
        raise InvalidArgumentError(f"unexpected model_loader_extra_config keys for load format {LOAD_FORMAT!r}: "
                                   f"{', '.join(map(str, unexpected))} (it takes {', '.join(EXTRA_CONFIG_KEYS)})")
    verify = extra_config.get("verify", True)
    if not isinstance(verify, bool):
        raise InvalidArgumentError(f"model_loader_extra_config 'verify' must be true or false, got {verify!r}")
    return verify


def local_checkpoint(model: str, revision: str | None = None, download_dir: str | None = None) -> Path:
    """The local folder of ``model``: itself, or its .szt files fetched from the Hub (only those, the index and
    the configs and tokenizer files)."""
    folder = Path(model)
    if folder.is_dir():
        if not any(folder.glob("*" + C.FILE_SUFFIX)):
            hint = (f" it holds safetensors weights: convert it with `szconvert {model} {model}-szt` and serve "
                    "that folder") if any(folder.glob("*.safetensors")) else ""
            raise ModelFolderError(f"--load-format szt needs .szt weights and this folder has none;{hint}",
                                   path=folder)
        return folder
    from ..hub import download_model_repo

    reference = model if model.startswith("hf://") else f"hf://{model}"
    return download_model_repo(reference, revision=revision, cache_dir=download_dir)


def _loader_class():
    """The loader class, defined once vLLM is importable (vLLM is imported only by the plugin's processes)."""
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    class SztModelLoader(BaseModelLoader):
        """vLLM model loader for .szt checkpoints (``load_format="szt"``)."""

        def __init__(self, load_config) -> None:
            super().__init__(load_config)
            self.verify = verify_option(load_config.model_loader_extra_config)

        def download_model(self, model_config) -> None:
            local_checkpoint(model_config.model, model_config.revision, self.load_config.download_dir)

        def load_weights(self, model: torch.nn.Module, model_config) -> None:
            started = time.perf_counter()
            folder = local_checkpoint(model_config.model, model_config.revision, self.load_config.download_dir)
            device = next((p.device for p in model.parameters()), torch.device("cpu"))
            counter = DecodeCounter()
            with contextlib.ExitStack() as files:  # open until the model has done with every tensor
                loaded = model.load_weights(szt_weights(folder, device, verify=self.verify, counter=counter,
                                                        files=files))
            logger.info("Loading weights took %.2f seconds", time.perf_counter() - started)  # as vLLM's loaders
            if device.type != "cuda":
                logger.info("szt: this rank decoded %.1f MB of the checkpoint's %.1f MB", counter.decoded / 1e6,
                            counter.handed_out / 1e6)
            if loaded is not None:
                missing = {name for name, _ in model.named_parameters()} - set(loaded)
                if missing:
                    raise ModelFolderError(f"the checkpoint does not fill {len(missing)} parameter(s) of "
                                           f"{type(model).__name__}: {', '.join(sorted(missing)[:5])}", path=folder)

    return SztModelLoader
