"""Checkpoint conversion: safetensors to .szt and back, and end-to-end verification of .szt checkpoints.

- `convert`: a ``.safetensors`` file, sharded index or model folder to szformat, streaming and atomic.
- `decompress`: the inverse, bit for bit, ``__metadata__`` included.
- `repack`: a .szt checkpoint between its in-memory and at-rest forms, payloads kept as they are.
- `verify`: headers, checksums and every tensor of a .szt file, index or folder.
"""

from .convert import convert
from .decompress import decompress
from .repack import repack
from .report import ConversionReport, TensorRecord
from .verify import Problem, VerifyReport, verify

__all__ = ["ConversionReport", "Problem", "TensorRecord", "VerifyReport", "convert", "decompress", "repack", "verify"]
