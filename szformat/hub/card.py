"""The model card (``README.md``) pushed beside a converted checkpoint.

The card is a pure function of the checkpoint, the repo and the options, with no date in it, so pushing the same
folder twice produces the same bytes and the second push commits nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from huggingface_hub import ModelCardData
from huggingface_hub.repocard import metadata_load

from ..errors import PushError
from ..format import constants as C
from ..format.reader import SztFile

CARRIED_METADATA = ("license", "license_name", "license_link")
"""Front-matter keys copied from the source model's card: a converted checkpoint keeps the license of its weights."""


@dataclass(frozen=True)
class CheckpointStats:
    """Sizes and tensor counts of the .szt files of one checkpoint."""

    files: int
    original_bytes: int
    """Sum of the tensors' raw byte lengths: the weights as the source safetensors stored them."""
    converted_bytes: int
    """Sum of the .szt file sizes, headers and alignment padding included."""
    tensors_encoded: int
    tensors_raw: int
    files_at_rest: int = 0
    """Files in the at-rest form (format 1.1 or 1.2: zstd frames, inflated on load)."""

    @property
    def ratio(self) -> float | None:
        """Converted over original size, ``None`` for a checkpoint without tensor bytes."""
        return self.converted_bytes / self.original_bytes if self.original_bytes else None


def checkpoint_stats(paths: Iterable[str | os.PathLike]) -> CheckpointStats:
    """Open each .szt file (validating its header) and add up sizes and encodings.

    Raises:
        FormatError (or a subclass): a file is not a valid .szt file.
    """
    files = original = converted = encoded = raw = at_rest = 0
    for path in paths:
        with SztFile(path) as szt:
            entries = list(szt.entries.values())
            at_rest += szt.at_rest
        files += 1
        converted += os.path.getsize(path)
        original += sum(e.raw_length for e in entries)
        encoded += sum(e.encoding == C.ENCODING_SPLITZIP for e in entries)
        raw += sum(e.encoding == C.ENCODING_RAW for e in entries)
    return CheckpointStats(files, original, converted, encoded, raw, at_rest)


def carried_metadata(source_card: str | os.PathLike | None) -> dict[str, str]:
    """The license fields of a source model card's front matter; empty when there is no card or no such field.

    Raises:
        PushError: the front matter is not a YAML mapping (the license it may state cannot be carried).
    """
    if source_card is None or not Path(source_card).is_file():
        return {}
    try:
        metadata = metadata_load(source_card) or {}
    except Exception as e:  # ValueError, or a YAML parser error whose class huggingface_hub does not re-export
        raise PushError(f"the model card's front matter cannot be parsed ({e}); fix it, or push with "
                        "model_card=False to upload it unchanged", path=source_card) from None
    return {key: metadata[key] for key in CARRIED_METADATA if isinstance(metadata.get(key), str)}


def render_model_card(*, repo_id: str, stats: CheckpointStats, load_ref: str, szformat_version: str,
                      base_model: str | None = None, carried: dict[str, str] | None = None,
                      integration: str | None = None, repo_ref: str | None = None) -> str:
    """The text of ``README.md``: YAML front matter, what the repo holds, a size table, and how to load it.

    Args:
        repo_id (`str`): the repo the card describes.
        stats (`CheckpointStats`): sizes and counts of its .szt files.
        load_ref (`str`): the ``hf://`` reference the loading example uses.
        szformat_version (`str`): the version that wrote the files.
        base_model (`str`, *optional*): repo id of the source model, when known.
        carried (`dict`, *optional*): front-matter fields carried from the source card (see `carried_metadata`).
        integration (`str`, *optional*): ``"transformers"`` (a model folder) or ``"diffusers"`` (a pipeline): the
            card then shows how to load the model or pipeline in one call, from ``repo_ref`` (the repo's reference).
    """
    data = ModelCardData(library_name="szformat", tags=["szt"], base_model=base_model, **(carried or {}))
    source = f" of [`{base_model}`](https://huggingface.co/{base_model})" if base_model else ""
    ratio = stats.ratio
    ratio_text = "n/a" if ratio is None else f"{ratio:.3f} ({(1 - ratio) * 100:.1f} % smaller)"
    return f"""---
{data.to_yaml()}
---

# {repo_id.split("/")[-1]}

This repository holds a lossless szformat conversion{source}: every tensor decodes bit for bit to the
original, from `.szt` files that are smaller than the source weights and fast to decode on the GPU.

## Size

| | |
|---|---:|
| Original size (tensor bytes) | {_size(stats.original_bytes)} |
| Converted size (`.szt` files) | {_size(stats.converted_bytes)} |
| Ratio | {ratio_text} |
| Tensors encoded (SplitZip) | {stats.tensors_encoded:,} |
| Tensors stored raw | {stats.tensors_raw:,} |
| `.szt` files | {stats.files:,} |
| Form | {_form_text(stats)} |
| szformat version | {szformat_version} |

## How to load
{_loading_section(load_ref, integration, repo_ref)}
Files come through the Hugging Face cache, so later loads (offline too, with `HF_HUB_OFFLINE=1`) read them from disk.
"""


def _form_text(stats: CheckpointStats) -> str:
    """Which form the files are in, and for the at-rest form how to get the one that loads with no inflating."""
    if not stats.files_at_rest:
        return "in memory (format 1.0): loads with no inflating"
    return ("at rest (format 1.1 or 1.2: zstd frames, inflated on load); `szconvert repack DIR OUT --at-rest none` "
            "writes the in-memory form once, for the fastest loads")


_ONE_CALL = {
    "transformers": ("import szformat.transformers",
                     'model = szformat.transformers.from_pretrained("{ref}", device="cuda")'),
    "diffusers": ("import torch, szformat.diffusers",
                  'pipe = szformat.diffusers.from_pretrained("{ref}", device="cuda", torch_dtype=torch.bfloat16)'),
}
"""Per integration: the import and the one call that loads the model or pipeline."""


def _loading_section(load_ref: str, integration: str | None, repo_ref: str | None) -> str:
    """Install and load lines: the model or pipeline in one call where an integration fits, the tensors always."""
    tensors = f"""
```python
import szformat

tensors = szformat.load_file("{load_ref}", device="cuda")
```
"""
    if integration not in _ONE_CALL:
        return f"""
```bash
pip install szformat
```
{tensors}"""
    imports, call = _ONE_CALL[integration]
    return f"""
```bash
pip install "szformat[{integration}]"
```

```python
{imports}

{call.format(ref=repo_ref)}
```

The tensors alone, as a dict:
{tensors}"""


def _size(n: int) -> str:
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit} ({n:,} bytes)"
    return f"{n:,} bytes"
