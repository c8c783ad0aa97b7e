"""The implementation of :mod:`szformat.diffusers` (``from_pretrained``): see that module for the user's view."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .._versions import parse_version
from ..errors import ModelFolderError, UnknownArchitectureError
from ..format import constants as C
from .model_folder import (SAFETENSORS_SUFFIX, Prefetch, PreparedModel, checkpoint_entries, has_weights,
                           load_weights, parameters_on_meta, place_buffers, plan_weights, prefetched, prefetching,
                           refuse_mismatches, require, resolve_model_folder, weights_in)
from ..offload.binding import module_tensor, tensor_owner

__all__ = ["from_pretrained", "DENOISER_PREFIXES"]

logger = logging.getLogger(__name__)

MODEL_INDEX = "model_index.json"
MODEL_CONFIG = "config.json"
DENOISER_PREFIXES = ("transformer", "unet")
"""Components offloaded by default: the denoiser (``transformer``, ``transformer_2``, ``unet``...)."""


def from_pretrained(path_or_repo: str | os.PathLike, pipeline_class: Any = None, *,
                    device: str | torch.device = "cpu", offload: str | None = None,
                    offload_components: Iterable[str] | None = None, torch_dtype: torch.dtype | None = None,
                    variant: str | None = None,
                    revision: str | None = None, token: str | bool | None = None,
                    cache_dir: str | os.PathLike | None = None, local_files_only: bool = False,
                    verify: bool = True, staging: Any = None, offload_options: Mapping[str, Any] | None = None,
                    **kwargs: Any) -> Any:
    """Load a diffusers pipeline from a converted folder or Hub repo.

    Args:
        path_or_repo (`str` or `os.PathLike`): a pipeline folder written by ``szconvert`` (``model_index.json`` and
            one folder per component), ``hf://namespace/name[@revision]``, or a plain repo id.
        pipeline_class (*optional*): the pipeline class to assemble; by default ``DiffusionPipeline``, which takes
            the class ``model_index.json`` names.
        device (`str` or `torch.device`, *optional*, defaults to `"cpu"`): where the model components' weights are
            decoded and stay.
        offload (`str`, *optional*): an offload route of :func:`szformat.load_into_offloader` (``"native"``,
            ``"staging"``, ``"diffusers_group"``, ``"accelerate"``, ``"auto"``) for the components in
            ``offload_components``; their weights stay compressed in host memory and are expanded on their way to
            ``device`` (CUDA). The other components go to ``device``. Handles: ``pipe.szformat_offload[name]``.
        offload_components (`Iterable[str]`, *optional*): which components to offload; by default the denoiser
            (components named ``transformer*`` or ``unet*``).
        torch_dtype (`torch.dtype`, *optional*): as in diffusers: diffusers models are built in this dtype (float32
            when not given; modules a model keeps in float32 stay so), transformers models in this dtype (their
            config's when not given). Weights stored in another dtype are cast on ``device``.
        variant (`str`, *optional*): load each component's ``<name>.<variant>.szt`` (``"fp16"``...).
        revision, token, cache_dir, local_files_only: for a Hub repo, as in ``huggingface_hub``.
        verify (`bool`, *optional*), staging (*optional*): as in :func:`szformat.load_file`.
        offload_options (`Mapping`, *optional*): engine options for :func:`szformat.load_into_offloader`.
        kwargs: passed to ``pipeline_class.from_pretrained`` (components to use instead of the folder's, ...).

    Returns:
        The pipeline, its models in eval mode.

    Raises:
        ModelFolderError: no ``model_index.json``, a component folder missing, a component with safetensors
            weights (convert the pipeline with szconvert) or no .szt weights where its class needs them.
        UnknownArchitectureError: a component class the installed diffusers or transformers does not have.
        CheckpointMismatchError: a component's checkpoint does not fit its config (every name listed).
        MissingDependencyError: diffusers (or accelerate) is not installed.

    Example:
        >>> pipe = szformat.diffusers.from_pretrained("hf://user/pipeline-szt", device="cuda",
        ...                                           torch_dtype=torch.bfloat16)  # doctest: +SKIP
        >>> image = pipe("an astronaut riding a horse").images[0]  # doctest: +SKIP
    """
    diffusers = require("diffusers", "diffusers")
    require("accelerate", "diffusers")
    folder = resolve_model_folder(path_or_repo, revision=revision, token=token, cache_dir=cache_dir,
                                  local_files_only=local_files_only)
    components = _weighted_components(folder, skip=kwargs)
    offloaded = set(_offloaded(components, offload, offload_components))
    device = torch.device(device)
    prepared: dict[str, _TransformersComponent | _DiffusersComponent] = {}
    loaded: dict[str, Any] = {}
    handles: dict[str, Any] = {}
    with prefetching(device, verify=verify, staging=staging) as prefetch:
        try:
            for name, (library, class_name) in components.items():  # every component checked before any is used
                prepared[name] = _prepare(diffusers, folder / name, library, class_name, torch_dtype, variant,
                                          offload if name in offloaded else None, prefetch)
            for name, component in prepared.items():
                loaded[name], handle = component.finish(device=device, verify=verify, staging=staging,
                                                        offload_options=offload_options)
                if handle is not None:
                    handles[name] = handle
            pipeline_class = pipeline_class if pipeline_class is not None else diffusers.DiffusionPipeline
            pipe = pipeline_class.from_pretrained(folder, **loaded, **kwargs)  # the rest hold no weights
        except BaseException:
            for handle in handles.values():
                handle.close()
            for component in prepared.values():  # loads started for components never finished
                Prefetch.discard(component.loading)
            loaded.clear()  # what was decoded so far is released with the error, not held by its traceback
            raise
    if handles:
        pipe.szformat_offload = handles
    return pipe


def _weighted_components(folder: Path, skip: Mapping[str, Any]) -> dict[str, tuple[str, str]]:
    """Components of the pipeline with weights: name -> (library, class name). Checks every component folder.

    Raises:
        ModelFolderError: no model index, a missing component folder, safetensors where .szt is expected.
    """
    index_path = folder / MODEL_INDEX
    if not index_path.is_file():
        if (folder / MODEL_CONFIG).is_file():
            raise ModelFolderError(f"no {MODEL_INDEX}: this is a single model folder, not a pipeline; load it with "
                                   "szformat.transformers.from_pretrained, or pass the pipeline folder", path=folder)
        raise ModelFolderError(f"no {MODEL_INDEX} in the folder: not a diffusers pipeline", path=folder)
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFolderError(f"{MODEL_INDEX} is not valid JSON ({e})", path=index_path) from None
    if not isinstance(index, dict):
        raise ModelFolderError(f"{MODEL_INDEX} must be a JSON object", path=index_path)
    weighted: dict[str, tuple[str, str]] = {}
    unconverted = []
    for name, spec in index.items():
        if name.startswith("_") or name in skip or not isinstance(spec, list) or len(spec) != 2 or None in spec:
            continue
        sub = folder / name
        if not sub.is_dir():
            raise ModelFolderError(f"component {name!r} ({spec[1]}) named in {MODEL_INDEX} has no folder "
                                   f"{name}/; the pipeline is incomplete", path=folder)
        if has_weights(sub, C.FILE_SUFFIX):
            weighted[name] = (spec[0], spec[1])
        elif has_weights(sub, SAFETENSORS_SUFFIX):
            unconverted.append(name)
    if unconverted:
        raise ModelFolderError(f"component(s) {', '.join(unconverted)} hold safetensors weights, not .szt; convert "
                               f"the pipeline first: szconvert {folder} {folder}-szt", path=folder)
    if not weighted:
        raise ModelFolderError("no component holds .szt weights", path=folder)
    return weighted


def _offloaded(components: Mapping[str, tuple[str, str]], offload: str | None,
               chosen: Iterable[str] | None) -> list[str]:
    if offload is None:
        if chosen is not None:
            raise ValueError("offload_components= needs offload= (a route name)")
        return []
    names = list(chosen) if chosen is not None else [n for n in components if n.startswith(DENOISER_PREFIXES)]
    unknown = [n for n in names if n not in components]
    if unknown:
        raise ValueError(f"offload_components names {unknown}, which are not components with weights "
                         f"(those are: {sorted(components)})")
    return names


def _prepare(diffusers, folder: Path, library: str, class_name: str, torch_dtype: torch.dtype | None,
             variant: str | None, offload: str | None, prefetch: Prefetch | None):
    """Build one component on ``meta`` and match its checkpoint, for the offload route ``offload`` if given (with
    ``prefetch``, its load runs meanwhile)."""
    if library == "transformers":
        from . import transformers as szt

        transformers = require("transformers", "transformers")
        model_class = getattr(transformers, class_name, None)
        if model_class is None:
            raise UnknownArchitectureError(f"transformers has no class {class_name!r}", path=folder)
        # without a dtype, as transformers' own from_pretrained: the config's (5), float32 (4)
        default = "auto" if parse_version(transformers.__version__) >= parse_version("5.dev0") else torch.float32
        return _TransformersComponent(szt.prepare_model(folder, model_class, dtype=torch_dtype or default,
                                                        variant=variant, offload=offload, prefetch=prefetch))
    model_class = getattr(diffusers, class_name, None)
    if model_class is None or not issubclass(model_class, diffusers.ModelMixin):
        raise UnknownArchitectureError(f"{library}.{class_name} is not a diffusers model class this diffusers "
                                       f"{diffusers.__version__} has; it cannot load .szt weights", path=folder)
    return _DiffusersComponent.prepare(model_class, folder, torch_dtype, variant, offload, prefetch)


def _initialization_skipped() -> contextlib.AbstractContextManager:
    """diffusers' own ``no_init_weights`` where this diffusers has it (it builds models under it before loading):
    drawing random values into parameters on ``meta`` costs about 1 ms per call through PyTorch's reference
    decompositions, most of the time a large model takes to build. Older diffusers initialize, and so does this."""
    from diffusers.models import modeling_utils

    skip = getattr(modeling_utils, "no_init_weights", None)
    return skip() if skip is not None else contextlib.nullcontext()


def _cast_fed_buffers(model: torch.nn.Module, expected: Mapping[str, torch.Tensor], fed: Iterable[str]) -> None:
    """Give each buffer the checkpoint fills the dtype it loads in (``torch_dtype``). A model computes some buffers
    in float32 when built (SD3's ``pos_embed``); diffusers casts them with the weights, and an offload route binds
    a buffer only in its stored dtype."""
    for name in fed:
        module, key = tensor_owner(model, name)
        buffer = module._buffers.get(key)
        if buffer is not None and buffer.dtype != expected[name].dtype:
            module._buffers[key] = buffer.to(expected[name].dtype)


@dataclass
class _TransformersComponent:
    prepared: Any

    @property
    def loading(self) -> Future | None:
        return self.prepared.loading

    def finish(self, *, device, verify, staging, offload_options):
        from . import transformers as szt

        model, _ = szt.finish_model(self.prepared, device=device, verify=verify, staging=staging,
                                    offload_options=offload_options)
        return model, getattr(model, "szformat_offload", None)


class _DiffusersComponent(PreparedModel):
    @classmethod
    def prepare(cls, model_class, folder: Path, torch_dtype: torch.dtype | None, variant: str | None,
                offload: str | None = None, prefetch: Prefetch | None = None) -> "_DiffusersComponent":
        """Build as diffusers' ``from_pretrained`` does (default dtype ``torch_dtype``; the checkpoint's floating
        tensors, buffers included, cast to it, or to float32 in the modules the class keeps in float32); refuse
        missing names and shapes that do not fit, as it does."""
        if not (folder / MODEL_CONFIG).is_file():
            raise ModelFolderError(f"no {MODEL_CONFIG} in the component folder", path=folder)
        config = model_class.load_config(folder)
        checkpoint = weights_in(folder, variant)
        with prefetched(prefetch, checkpoint, offload) as loading:
            with parameters_on_meta(torch_dtype), _initialization_skipped():
                model = model_class.from_config(config)
            expected = model.state_dict()
            if torch_dtype is not None:  # every floating tensor of the checkpoint, buffers too, in torch_dtype
                keep_fp32 = model_class._keep_in_fp32_modules or []
                for name, tensor in expected.items():
                    if tensor.is_floating_point():
                        wanted = torch.float32 if any(m in name.split(".") for m in keep_fp32) else torch_dtype
                        expected[name] = torch.empty(tensor.shape, dtype=wanted, device="meta")
            plan = plan_weights(expected, checkpoint_entries(checkpoint))
            refuse_mismatches(plan, model, folder, strict=True)
        return cls(model, folder, checkpoint, plan, expected, loading, offload)

    def finish(self, *, device, verify, staging, offload_options):
        model = self.model
        handle = None
        if self.offload is None:
            load_weights(model, self.checkpoint, self.plan, self.expected, device=device, verify=verify,
                         staging=staging, loading=self.loading)
            place_buffers(model, device)
        else:
            from ..offload import load_into_offloader

            _cast_fed_buffers(model, self.expected, self.plan.sources)
            fed = {id(module_tensor(model, name)) for name in self.plan.sources}
            place_buffers(model, device, skip=fed)
            handle = load_into_offloader(self.checkpoint, model, route=self.offload, device=device,
                                         **(offload_options or {}))
            model.szformat_offload = handle
        if self.plan.unexpected:
            logger.warning("Some weights of the checkpoint at %s were not used when initializing %s: %s",
                           self.folder, type(model).__name__, self.plan.unexpected)
        model.register_to_config(_name_or_path=str(self.folder))
        model.eval()
        return model, handle
