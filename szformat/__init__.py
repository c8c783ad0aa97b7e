"""szformat: lossless, GPU-fast checkpoints for BF16 models (.szt files)."""

from .api import load_file, safe_open, save_file
from .errors import SzformatError

__version__ = "0.1.0"

__all__ = ["SzformatError", "load_file", "safe_open", "save_file", "__version__"]
