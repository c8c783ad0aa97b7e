"""GPU correctness checks: every GPU path against the CPU reference, bit for bit, on real and synthetic
checkpoints (``python -m bench.checks.<name>``, on a CUDA machine)."""
