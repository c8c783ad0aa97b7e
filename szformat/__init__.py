"""szformat: lossless, GPU-fast checkpoints for BF16 models (.szt files)."""

from .api import load_file, safe_open, save_file
from .errors import SzformatError
from .offload import load_into_offloader

__version__ = "0.1.0"

__all__ = ["SzformatError", "load_file", "load_into_offloader", "safe_open", "save_file", "__version__"]
