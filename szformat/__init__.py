"""szformat: lossless, GPU-fast checkpoints for BF16 models (.szt files).

The API mirrors ``safetensors.torch`` (:func:`safe_open`, :func:`load_file`, :func:`save_file`) and
``huggingface_hub`` (:func:`push_to_hub`); :func:`load_into_offloader` hands a checkpoint to an offloading runtime
still compressed; ``szformat.transformers`` and ``szformat.diffusers`` load converted models and pipelines whole.
Every function is imported on first use, so ``import szformat`` (and ``szconvert --help``) does not pay for importing
torch, Triton or huggingface_hub until something needs them.
"""

from importlib import import_module
from typing import Any

from ._lazy import attributes_on_first_use
from .errors import SzformatError

__version__ = "0.1.0"

_LAZY = {"load_file": ".api", "safe_open": ".api", "save_file": ".api", "push_to_hub": ".hub",
         "load_into_offloader": ".offload"}
_INTEGRATIONS = ("transformers", "diffusers")
"""``szformat.transformers.from_pretrained`` and ``szformat.diffusers.from_pretrained``: imported on first use."""

__all__ = ["SzformatError", "load_file", "load_into_offloader", "push_to_hub", "safe_open", "save_file",
           "__version__"]


_lazy_attribute, _lazy_names = attributes_on_first_use(__name__, _LAZY)


def __getattr__(name: str) -> Any:
    if name in _INTEGRATIONS:
        return import_module(f".{name}", __name__)  # the import binds it here too
    return _lazy_attribute(name)


def __dir__() -> list[str]:
    return sorted(set(_lazy_names()) | set(_INTEGRATIONS))
