"""The implementation of :mod:`szformat.transformers` (``from_pretrained``): see that module for the user's view."""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from ..errors import DecodeRouteError, UnknownArchitectureError, first_line
from ..format import constants as C
from .model_folder import (Prefetch, PreparedModel, WeightPlan, checkpoint_entries, load_weights,
                           meta_tensors, parameters_on_meta, place_buffers, plan_weights, prefetched, prefetching,
                           refuse_mismatches, require, require_converted, resolve_model_folder, weights_in)
from ..offload.binding import module_tensor, tensor_owner
from .transformers_conversions import checkpoint_conversions

__all__ = ["from_pretrained"]

logger = logging.getLogger(__name__)

CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"


def from_pretrained(path_or_repo: str | os.PathLike, auto_class: Any = None, *, device: str | torch.device = "cpu",
                    offload: str | None = None, dtype: str | torch.dtype = "auto", variant: str | None = None,
                    revision: str | None = None, token: str | bool | None = None,
                    cache_dir: str | os.PathLike | None = None, local_files_only: bool = False,
                    output_loading_info: bool = False, ignore_mismatched_sizes: bool = False,
                    key_mapping: Mapping[str, str] | None = None, trust_remote_code: bool = False,
                    verify: bool = True, staging: Any = None, offload_options: Mapping[str, Any] | None = None,
                    **kwargs: Any) -> Any:
    """Load a transformers model from a converted folder or Hub repo.

    Args:
        path_or_repo (`str` or `os.PathLike`): a folder written by ``szconvert`` (``config.json`` and .szt weights,
            one file or shards with ``model.szt.index.json``), ``hf://namespace/name[@revision][/folder]``, or a
            plain repo id.
        auto_class (*optional*): what to build: an auto class (``AutoModelForCausalLM``, ``AutoModel``...) or a
            model class (``LlamaForCausalLM``); by default the class ``config.json`` names in ``architectures``.
        device (`str` or `torch.device`, *optional*, defaults to `"cpu"`): where the weights are decoded and stay.
        offload (`str`, *optional*): an offload route of :func:`szformat.load_into_offloader` (``"native"``,
            ``"staging"``, ``"diffusers_group"``, ``"accelerate"``, ``"auto"``): weights stay compressed in host
            memory and are expanded on their way to ``device`` (CUDA); the route's handle is
            ``model.szformat_offload`` (``close()`` it when done). A route feeds each tensor from one stored entry:
            a checkpoint whose tensors transformers converts (per-expert MoE weights fused) is refused.
        dtype (`str` or `torch.dtype`, *optional*, defaults to `"auto"`): ``"auto"`` keeps the config's dtype (else
            the checkpoint's); another dtype casts the weights on ``device``.
        variant (`str`, *optional*): load ``model.<variant>.szt`` (``"fp16"``...) instead of ``model.szt``.
        revision, token, cache_dir, local_files_only: for a Hub repo, as in ``huggingface_hub``.
        output_loading_info (`bool`, *optional*): also return ``{"missing_keys", "unexpected_keys",
            "mismatched_keys", "error_msgs"}``.
        ignore_mismatched_sizes (`bool`, *optional*): initialize tensors whose checkpoint shape differs (a new
            classification head) instead of refusing them.
        key_mapping (`Mapping[str, str]`, *optional*): regex -> replacement applied to checkpoint names first, as
            in transformers (before the renames and conversions transformers applies to the model's checkpoints).
        trust_remote_code (`bool`, *optional*): allow a config whose model code lives in the repo.
        verify (`bool`, *optional*), staging (*optional*): as in :func:`szformat.load_file`.
        offload_options (`Mapping`, *optional*): engine options for :func:`szformat.load_into_offloader`.
        kwargs: config attributes to override (``attn_implementation="sdpa"``...); the rest go to the model class.

    Returns:
        The model in eval mode (and the loading info with ``output_loading_info=True``).

    Raises:
        ModelFolderError: no ``config.json``, no .szt weights (a safetensors folder: convert it with szconvert).
        UnknownArchitectureError: transformers does not know the config's model type or class.
        CheckpointMismatchError: checkpoint shapes that do not fit the model (all listed, a fused tensor's as
            converted: an expert missing shows there); nothing of the load stays on the device then.
        DecodeRouteError: ``offload=`` with a checkpoint whose tensors transformers converts; nothing is decoded.
        MissingDependencyError: transformers (or accelerate) is not installed.

    Example:
        >>> from transformers import AutoModelForCausalLM  # doctest: +SKIP
        >>> model = szformat.transformers.from_pretrained("hf://user/model-szt", AutoModelForCausalLM,
        ...                                               device="cuda")  # doctest: +SKIP
    """
    if "torch_dtype" in kwargs:  # the name transformers used before 4.56
        dtype = kwargs.pop("torch_dtype")
    folder = resolve_model_folder(path_or_repo, revision=revision, token=token, cache_dir=cache_dir,
                                  local_files_only=local_files_only)
    with prefetching(device, verify=verify, staging=staging) as prefetch:
        prepared = prepare_model(folder, auto_class, dtype=dtype, variant=variant, key_mapping=key_mapping,
                                 ignore_mismatched_sizes=ignore_mismatched_sizes,
                                 trust_remote_code=trust_remote_code, offload=offload, prefetch=prefetch, **kwargs)
        model, info = finish_model(prepared, device=device, verify=verify, staging=staging,
                                   offload_options=offload_options)
    return (model, info) if output_loading_info else model


def prepare_model(folder: Path, auto_class: Any = None, *, dtype: str | torch.dtype = "auto",
                  variant: str | None = None, key_mapping: Mapping[str, str] | None = None,
                  ignore_mismatched_sizes: bool = False, trust_remote_code: bool = False,
                  offload: str | None = None, prefetch: Prefetch | None = None, **kwargs: Any) -> PreparedModel:
    """Read the config, build the model on ``meta`` and match the checkpoint to it (see `from_pretrained`), for
    the offload route ``offload`` if given; with ``prefetch`` and no route, the checkpoint's load starts first and
    runs meanwhile.

    Raises:
        ModelFolderError, UnknownArchitectureError, CheckpointMismatchError, DecodeRouteError: as `from_pretrained`.
    """
    transformers = require("transformers", "transformers")
    require("accelerate", "transformers")
    require_converted(folder, CONFIG_NAME, "transformers model folder")
    checkpoint = weights_in(folder, variant)
    with prefetched(prefetch, checkpoint, offload) as loading:
        auto_class = _named_class(transformers, auto_class, folder)
        config, model_kwargs = _load_config(transformers, auto_class, folder, trust_remote_code, kwargs)
        entries = checkpoint_entries(checkpoint)
        model = _build(transformers, auto_class, config, _resolve_dtype(dtype, config, entries), model_kwargs,
                       folder)
        expected = model.state_dict()
        rename, conversions = checkpoint_conversions(model, expected, entries, key_mapping, folder)
        plan = plan_weights(expected, entries, rename, conversions)
        if not ignore_mismatched_sizes:
            refuse_mismatches(plan, model, folder, strict=False)
        if offload is not None and plan.conversions:
            _refuse_converted_offload(plan, offload, folder)
    return PreparedModel(model, folder, checkpoint, plan, expected, loading, offload)


def finish_model(prepared: PreparedModel, *, device: str | torch.device = "cpu", verify: bool = True,
                 staging: Any = None, offload_options: Mapping[str, Any] | None = None) -> tuple[Any, dict[str, list]]:
    """Decode the weights of a prepared model onto ``device`` (or hand them to the offload route it was prepared
    for), tie, initialize what the checkpoint lacks, and report it; returns the model in eval mode and its loading
    info."""
    transformers = require("transformers", "transformers")
    model, folder, plan, offload = prepared.model, prepared.folder, prepared.plan, prepared.offload
    device = torch.device(device)
    if offload is None:
        load_weights(model, prepared.checkpoint, plan, prepared.expected, device=device, verify=verify,
                     staging=staging, loading=prepared.loading)
        model.tie_weights()
        fed: set[int] = set()
    else:
        model.tie_weights()
        fed = {id(module_tensor(model, name)) for name in plan.sources}
    place_buffers(model, device, skip=fed)
    initialized = _initialize_missing(transformers, model, device, skip=fed)
    if offload is not None:
        _offload(model, prepared.checkpoint, plan, offload, device, offload_options or {})
    model.eval()
    _load_generation_config(transformers, model, folder)
    info = _loading_info(model, plan, initialized)
    _log_report(model, folder, info)
    return model, info


def _named_class(transformers, auto_class: Any, folder: Path) -> Any:
    """``auto_class`` itself, or the transformers class it names (``"AutoModelForMaskedLM"``)."""
    if not isinstance(auto_class, str):
        return auto_class
    found = getattr(transformers, auto_class, None)
    if found is None:
        raise UnknownArchitectureError(f"transformers {transformers.__version__} has no class {auto_class!r}",
                                       path=folder)
    return found


def _load_config(transformers, model_class: Any, folder: Path, trust_remote_code: bool, kwargs: dict[str, Any]):
    """The folder's config with the overrides in ``kwargs`` applied; the rest of ``kwargs`` is for the model. Read
    by the model class's own config class where a model class is given, as its ``from_pretrained`` reads it (a
    pipeline's text encoder: an older ``AutoConfig`` does not know every model type a class reads), else by
    ``AutoConfig``."""
    config_class = getattr(model_class, "config_class", None)
    try:
        if config_class is not None:
            return config_class.from_pretrained(folder, return_unused_kwargs=True, **kwargs)
        return transformers.AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code,
                                                       return_unused_kwargs=True, **kwargs)
    except (ValueError, KeyError) as e:
        raise UnknownArchitectureError(f"transformers {transformers.__version__} cannot read {CONFIG_NAME} "
                                       f"({first_line(e)})", path=folder / CONFIG_NAME) from None


def _resolve_dtype(dtype: str | torch.dtype, config, entries) -> torch.dtype:
    """``"auto"``: the config's dtype, else the first floating dtype of the checkpoint, else float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        resolved = getattr(torch, str(dtype), None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"dtype must be 'auto', a torch.dtype or its name, got {dtype!r}")
        return resolved
    stated = getattr(config, _dtype_attribute(config), None)
    if isinstance(stated, str):
        stated = getattr(torch, stated, None)
    if isinstance(stated, torch.dtype):
        return stated
    for entry in entries.values():
        candidate = C.DTYPES.get(entry.dtype, (None,))[0]
        if candidate is not None and candidate.is_floating_point:
            return candidate
    return torch.float32


def _build(transformers, auto_class, config, dtype: torch.dtype, model_kwargs: dict[str, Any], folder: Path):
    """The model class built from ``config`` with parameters on ``meta``, in ``dtype``."""
    model_class = auto_class if auto_class is not None else _config_class(transformers, config, folder)
    _set_config_dtype(config, dtype)
    build = model_class._from_config if hasattr(model_class, "_from_config") else model_class.from_config
    try:
        with parameters_on_meta(dtype), _meta_parameters_left_uninitialized():
            return build(config, **model_kwargs)
    except ValueError as e:
        if "Unrecognized configuration class" in str(e):
            raise UnknownArchitectureError(f"{getattr(model_class, '__name__', model_class)} cannot build a "
                                           f"{type(config).__name__} ({first_line(e)})", path=folder) from None
        raise


@contextlib.contextmanager
def _meta_parameters_left_uninitialized() -> Iterator[None]:
    """Mark each parameter registered on ``meta`` with ``_is_hf_initialized``, the flag transformers sets on loaded
    weights, and have ``torch.nn.init`` honour it as ``post_init`` does (transformers >= 5): then neither the
    modules' own ``reset_parameters`` nor the model's ``_init_weights`` draws random values into tensors that hold
    none, which cost about a millisecond a tensor, most of the build. Buffers and every tensor without the flag are
    initialized as before; a tensor that later replaces a marked one (decoded, or initialized because the checkpoint
    lacks it) carries no flag. Older transformers have no such guard: nothing is marked (accelerate 1.0's
    ``init_empty_weights`` remakes a parameter from its ``__dict__``, where the flag would be an unknown argument)."""
    try:
        from transformers.initialization import guard_torch_init_functions as guard
    except ImportError:  # transformers < 5
        yield
        return
    register = torch.nn.Module.register_parameter

    def register_marked(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        register(module, name, param)
        registered = module._parameters.get(name)
        if registered is not None and registered.device.type == "meta":
            registered._is_hf_initialized = True

    torch.nn.Module.register_parameter = register_marked
    try:
        with guard():
            yield
    finally:
        torch.nn.Module.register_parameter = register


def _config_class(transformers, config, folder: Path):
    """The class the config's ``architectures`` names (``AutoModel`` when it names none)."""
    architectures = getattr(config, "architectures", None) or []
    if not architectures:
        return transformers.AutoModel
    model_class = getattr(transformers, architectures[0], None)
    if model_class is None:
        raise UnknownArchitectureError(f"transformers {transformers.__version__} has no class {architectures[0]!r} "
                                       f"(config.json 'architectures'); pass auto_class=", path=folder / CONFIG_NAME)
    return model_class


def _dtype_attribute(config) -> str:
    """The config attribute this transformers version reads the model dtype from: ``dtype`` since 4.56 (where
    ``torch_dtype`` became a deprecated alias), ``torch_dtype`` before."""
    return "dtype" if isinstance(getattr(type(config), "torch_dtype", None), property) else "torch_dtype"


def _set_config_dtype(config, dtype: torch.dtype) -> None:
    """Record the dtype the model is built in, where ``from_config`` reads it."""
    setattr(config, _dtype_attribute(config), dtype)


def _offload(model, checkpoint: Path, plan, route: str, device: torch.device, options: Mapping[str, Any]) -> None:
    """Hand the model to an offload route, which feeds every tensor the checkpoint holds from then on."""
    from ..offload import load_into_offloader

    entry_names = {target: source for target, source in plan.sources.items() if target != source}
    model.szformat_offload = load_into_offloader(checkpoint, model, route=route, device=device, strict=False,
                                                 entry_names=entry_names, **options)


def _refuse_converted_offload(plan: WeightPlan, route: str, folder: Path) -> None:
    """An offload route feeds each module tensor from one checkpoint entry, as stored: it cannot feed one that
    transformers builds from several (experts fused) or changes (split, permuted).

    Raises:
        DecodeRouteError: naming the first such tensor.
    """
    conversion = plan.conversions[0]
    target = next(iter(conversion.targets))
    raise DecodeRouteError(f"offload route {route!r} cannot feed a tensor that transformers converts from the "
                           f"checkpoint's ({len(conversion.entries)} entries, {conversion.entries[0]} ...; "
                           f"{sum(len(c.targets) for c in plan.conversions)} such tensors); load without offload=",
                           path=folder, tensor=target)


def _initialize_missing(transformers, model, device: torch.device, skip: set[int]) -> list[str]:
    """Give every tensor still on ``meta`` (after loading and tying) real memory on ``device`` and initialize it
    with its model's ``_init_weights``, as transformers does for weights a checkpoint lacks; returns their names.

    Tensors in ``skip`` (by ``id``: those an offload route feeds) are left alone."""
    names = [name for name in meta_tensors(model) if id(module_tensor(model, name)) not in skip]
    owners: dict[str, list[str]] = {}
    for name in names:
        module_name = name.rpartition(".")[0]
        module, key = tensor_owner(model, name)
        current = module_tensor(model, name)
        value = torch.empty_like(current, device=device)
        if isinstance(current, torch.nn.Parameter):
            module._parameters[key] = torch.nn.Parameter(value, requires_grad=current.requires_grad)
        else:
            module._buffers[key] = value
        owners.setdefault(module_name, []).append(key)
    with torch.no_grad():
        for module_name, keys in owners.items():
            module = model.get_submodule(module_name)
            kept = {key: tensor.detach().clone() for key, tensor in
                    [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
                    if key not in keys}
            _init_weights_of(transformers, model, module_name)(module)
            for key, value in kept.items():  # _init_weights resets a whole module; keep what was loaded
                getattr(module, key).copy_(value)
    if names:
        model.tie_weights()
    return names


def _init_weights_of(transformers, model, module_name: str):
    """The ``_init_weights`` of the innermost pretrained model that holds ``module_name`` (composite models give
    each sub-model its own)."""
    owner = current = model
    for part in module_name.split(".") if module_name else []:
        current = getattr(current, part)
        if isinstance(current, transformers.PreTrainedModel):
            owner = current
    return owner._init_weights


def _load_generation_config(transformers, model, folder: Path) -> None:
    """``generation_config.json`` of the folder, as transformers' own ``from_pretrained`` reads it."""
    model.config.name_or_path = str(folder)
    if (folder / GENERATION_CONFIG_NAME).is_file() and getattr(model, "can_generate", lambda: False)():
        model.generation_config = transformers.GenerationConfig.from_pretrained(folder)


def _loading_info(model, plan, initialized: list[str]) -> dict[str, list]:
    """transformers' loading info: missing (newly initialized), unexpected and mismatched keys, error messages."""
    ignore_missing = _patterns(getattr(model, "_keys_to_ignore_on_load_missing", None))
    ignore_unexpected = _patterns(getattr(model, "_keys_to_ignore_on_load_unexpected", None))
    non_persistent = {f"{prefix}.{key}" if prefix else key for prefix, module in model.named_modules()
                      for key in module._non_persistent_buffers_set}
    mismatched = {name for name, _, _ in plan.mismatched}
    return {
        "missing_keys": [n for n in initialized if n not in mismatched and not _matches(ignore_missing, n)],
        "unexpected_keys": [n for n in plan.unexpected if n not in non_persistent and not _matches(ignore_unexpected, n)
                            and not n.endswith("rotary_emb.inv_freq")],
        "mismatched_keys": list(plan.mismatched),
        "error_msgs": [],
    }


def _log_report(model, folder: Path, info: dict[str, list]) -> None:
    name = type(model).__name__
    if info["unexpected_keys"]:
        logger.warning("Some weights of the checkpoint at %s were not used when initializing %s: %s", folder, name,
                       info["unexpected_keys"])
    if info["missing_keys"]:
        logger.warning("Some weights of %s were not initialized from the checkpoint at %s and are newly "
                       "initialized: %s", name, folder, info["missing_keys"])
    if info["mismatched_keys"]:
        listed = ", ".join(f"{n}: found shape {list(s)} in the checkpoint and {list(e)} in the model instantiated"
                           for n, s, e in info["mismatched_keys"])
        logger.warning("Some weights of %s were not initialized from the checkpoint at %s and are newly "
                       "initialized because the shapes did not match: %s", name, folder, listed)


def _patterns(patterns) -> list[re.Pattern]:
    return [re.compile(p) for p in (patterns or [])]


def _matches(patterns: list[re.Pattern], name: str) -> bool:
    return any(p.search(name) for p in patterns)
