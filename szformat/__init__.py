"""szformat: lossless, GPU-fast checkpoints for BF16 models (.szt files).

The API mirrors ``safetensors.torch`` (:func:`safe_open`, :func:`load_file`, :func:`save_file`) and
``huggingface_hub`` (:func:`push_to_hub`); :func:`load_into_offloader` hands a checkpoint to an offloading runtime
still compressed. The Hub and offloading parts are imported on first use, so ``import szformat`` stays light.
"""

from importlib import import_module
from typing import Any

from .api import load_file, safe_open, save_file
from .errors import SzformatError

__version__ = "0.1.0"

_LAZY = {"push_to_hub": ".hub", "load_into_offloader": ".offload"}

__all__ = ["SzformatError", "load_file", "load_into_offloader", "push_to_hub", "safe_open", "save_file",
           "__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
