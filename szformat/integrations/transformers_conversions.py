"""transformers' checkpoint conversions, applied to a converted checkpoint: renames where names are matched, weight
converters (per-expert MoE tensors fused into one, a fused projection split in three...) on the decoded tensors.

A converted folder keeps the names of the checkpoint it came from, and Hub checkpoints keep the names they were
published with: legacy ones (``LayerNorm.gamma``), an older layout of a model (ViT's
``encoder.layer.N.attention.attention.query``), or one tensor per expert (Mixtral's
``block_sparse_moe.experts.N.w1.weight``) where the model now holds all experts in one (``mlp.experts.gate_up_proj``).
transformers 5 converts them as it loads; so does this module, with transformers' own tables and operations
(``get_model_conversion_mapping``, ``rename_source_key``, each ``WeightConverter``'s operations), so every model
transformers converts is converted alike. transformers 4 has no such machinery: names are fixed as it fixes them
(``_fix_state_dict_key_on_load``, ``key_mapping``, a VLM's ``_checkpoint_conversion_mapping``).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointMismatchError, first_line

__all__ = ["WeightConversion", "checkpoint_conversions"]


@dataclass
class WeightConversion:
    """Checkpoint entries one of transformers' weight converters turns into module tensors, and the tensors it gives:
    names and shapes found before anything is decoded, by running the converter on ``meta`` tensors."""

    converter: Any
    """transformers' ``WeightConverter``, a copy of its own (transformers collects the tensors into it)."""
    layer_name: str
    """The module name transformers files the conversion under: its first target."""
    sources: dict[str, list[str]]
    """Source pattern -> checkpoint entries it matched, in transformers' order (experts by number)."""
    dtype: torch.dtype
    """The dtype of the module tensor: transformers casts the entries to it before converting them."""
    model: Any
    targets: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Module name -> shape of each tensor the conversion gives."""

    @property
    def entries(self) -> list[str]:
        return [name for names in self.sources.values() for name in names]

    def apply(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Take this conversion's entries out of ``tensors`` (decoded, on their device) and return its module tensors
        on that device. Stacking and concatenation (every MoE fusion) write each entry into the fused tensor and drop
        it at once: the fused tensor is the one copy made; other operations are transformers' own."""
        layout = _fused_layout(self.converter.operations)
        if layout is not None and len(self.targets) == 1:
            return self._fuse(tensors, *layout)
        collected = {pattern: [tensors.pop(name).to(self.dtype) for name in names]
                     for pattern, names in self.sources.items()}
        return self._convert(collected)

    def find_targets(self, entries: Mapping[str, Any]) -> None:
        """Fill ``targets`` by converting ``meta`` tensors of the entries' shapes."""
        collected = {pattern: [torch.empty(tuple(entries[name].shape), dtype=self.dtype, device="meta")
                               for name in names] for pattern, names in self.sources.items()}
        self.targets = {name: tuple(tensor.shape) for name, tensor in self._convert(collected).items()}

    def _convert(self, collected: dict[str, list[torch.Tensor]]) -> dict[str, torch.Tensor]:
        """transformers' operations on the collected tensors (which they consume), results under module names."""
        for pattern, tensors in collected.items():
            self.converter.collected_tensors[pattern] = tensors
        collected.clear()
        converted = self.converter.convert(self.layer_name, model=self.model, config=self.model.config)
        return {name: value[0] if isinstance(value, list) else value for name, value in converted.items()}

    def _fuse(self, tensors: dict[str, torch.Tensor], stack_dim: int | None, cat_dim: int | None
              ) -> dict[str, torch.Tensor]:
        """The one target of a stack (``MergeModulelist``) of each pattern's entries, then a concatenation
        (``Concatenate``) of the patterns in the converter's order, written entry by entry into place."""
        (target, shape), = self.targets.items()
        fused = torch.empty(shape, dtype=self.dtype, device=tensors[self.entries[0]].device)
        stack_dim = None if stack_dim is None else stack_dim % fused.dim()
        cat_dim = None if cat_dim is None else cat_dim % fused.dim()
        offset = 0
        for pattern in self.converter.source_patterns:  # the order Concatenate joins them in
            names = self.sources.get(pattern, [])
            if stack_dim is not None and names:  # the pattern's stack: a slab of the fused tensor
                stacked = list(tensors[names[0]].shape)
                stacked.insert(stack_dim, len(names))
                width = 0 if cat_dim is None else stacked[cat_dim]
                slab = fused if cat_dim is None else fused.narrow(cat_dim, offset, width)
                for index, name in enumerate(names):
                    slab.select(stack_dim, index).copy_(tensors.pop(name))
                offset += width
                continue
            for name in names:  # no stack: each entry is a slab of its own
                width = tensors[name].shape[cat_dim]
                fused.narrow(cat_dim, offset, width).copy_(tensors.pop(name))
                offset += width
        return {target: fused}


def checkpoint_conversions(model, expected: Mapping[str, torch.Tensor], entries: Mapping[str, Any],
                           key_mapping: Mapping[str, str] | None, folder: Path
                           ) -> tuple[Callable[[str], str], list[WeightConversion]]:
    """How transformers would load ``entries`` into ``model`` (built on ``meta``; ``expected`` is its
    ``state_dict``): the module name of each entry it renames (or leaves), and the conversions of the others.

    The base-model prefix is added or removed where only that fits (a checkpoint of ``AutoModel`` in
    ``AutoModelForX``, and back); ``key_mapping`` (regex -> replacement) applies first, as in transformers.

    Raises:
        CheckpointMismatchError: transformers' operations refuse the entries of a conversion (an expert missing...).
    """
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key
    except ImportError:  # transformers 4
        return _fixed_names(model, expected, key_mapping), []
    transforms = get_model_conversion_mapping(model, dict(key_mapping) if key_mapping else None)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    converter_of = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    prefix = model.base_model_prefix
    renamed: dict[str, str] = {}
    conversions: dict[str, WeightConversion] = {}
    for name in sorted(entries, key=dot_natural_key):  # transformers' order: renames may depend on it, experts do
        target, pattern = rename_source_key(name, renamings, converters, prefix, expected)
        if target not in expected and name in expected:  # a name that needed no renaming, as transformers decides
            target, pattern = rename_source_key(name, [], [], prefix, expected)
        if pattern is None or target not in expected:
            renamed[name] = target
            continue
        if target not in conversions:
            conversions[target] = WeightConversion(copy.deepcopy(converter_of[pattern]), target, {},
                                                   expected[target].dtype, model)
        conversions[target].sources.setdefault(pattern, []).append(name)
    for conversion in conversions.values():
        try:
            conversion.find_targets(entries)
        except Exception as e:  # transformers' operations raise what torch raises
            raise CheckpointMismatchError(f"transformers cannot convert the {len(conversion.entries)} checkpoint "
                                          f"entries it matched for {conversion.layer_name} (the first: "
                                          f"{conversion.entries[0]}): {first_line(e)}", path=folder) from None
    model._weight_conversions = [t for t in transforms if t.was_used()]  # save_pretrained writes the names back
    return renamed.__getitem__, list(conversions.values())


def _fused_layout(operations: list[Any]) -> tuple[int | None, int | None] | None:
    """(stack dim, concatenation dim) when the operations only stack each pattern's entries and concatenate the
    results (either or both, as in every MoE fusion); ``None`` for any other operation."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    kinds = [type(op) for op in operations]
    if kinds == [MergeModulelist]:
        return operations[0].dim, None
    if kinds == [MergeModulelist, Concatenate]:
        return operations[0].dim, operations[1].dim
    if kinds == [Concatenate]:
        return None, operations[0].dim
    return None


def _fixed_names(model, expected: Mapping[str, torch.Tensor], key_mapping: Mapping[str, str] | None
                 ) -> Callable[[str], str]:
    """transformers 4's renaming: the model's legacy fixes (``LayerNorm.gamma`` -> ``LayerNorm.weight``...), then
    the first ``key_mapping`` pattern that matches (by default a VLM's ``_checkpoint_conversion_mapping``), then the
    base-model prefix added or removed where only that fits."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    if key_mapping is None and _is_vlm(model):
        key_mapping = getattr(model, "_checkpoint_conversion_mapping", None)
    patterns = [(re.compile(pattern), replacement) for pattern, replacement in (key_mapping or {}).items()]
    fix = model._fix_state_dict_key_on_load  # transformers >= 4.50, the floor

    def rename(name: str) -> str:
        name = fix(name)[0]
        for pattern, replacement in patterns:
            name, replaced = pattern.subn(replacement, name)
            if replaced:
                break
        if name in expected or not prefix:
            return name
        if name.startswith(prefix + ".") and name[len(prefix) + 1:] in expected:
            return name[len(prefix) + 1:]
        if f"{prefix}.{name}" in expected:
            return f"{prefix}.{name}"
        return name

    return rename


def _is_vlm(model) -> bool:
    """Whether transformers 4 loads this class with its ``_checkpoint_conversion_mapping`` by default (its ``VLMS``
    list of class-name parts)."""
    try:
        from transformers.modeling_utils import VLMS
    except ImportError:
        return bool(getattr(model, "_checkpoint_conversion_mapping", None))
    return any(part in type(model).__name__.lower() for part in VLMS)
