"""Generate (or check) the golden vectors of the .szt format in ``spec/vectors/``.

Each case is a small ``.safetensors`` source, written byte for byte by this script from integer bit patterns of a
SplitMix64 generator (no floating point, no library random stream that could change between versions), and the
``.szt`` file szformat's writer makes from it. ``SHA256SUMS`` and ``vectors.json`` record the expected hashes;
``vectors.json`` also lists each tensor's dtype, shape, encoding, escape count and the SHA-256 of its raw bytes.

Usage:
    python tools/make_vectors.py            # (re)write spec/vectors/
    python tools/make_vectors.py --check    # regenerate in a temporary folder and compare; exit 1 on a difference
    python tools/make_vectors.py --out DIR  # write (or with --check, compare) another folder
"""

from __future__ import annotations

import argparse
import hashlib
import json
import struct
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from szformat.api import load_file, safe_open, tensor_bytes, write_tensor  # noqa: E402
from szformat.format import constants as C  # noqa: E402
from szformat.format.writer import SztWriter  # noqa: E402

DEFAULT_OUT = ROOT / "spec" / "vectors"

# ---------------------------------------------------------------------------------------------------------------
# Deterministic bit patterns
# ---------------------------------------------------------------------------------------------------------------

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def splitmix64(seed: int, count: int) -> np.ndarray:
    """``count`` outputs of SplitMix64 started at ``seed`` (uint64): the same on every platform and version."""
    z = np.arange(1, count + 1, dtype=np.uint64) * _GOLDEN + np.uint64(seed)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def random_bytes(seed: int, count: int) -> bytes:
    return splitmix64(seed, -(-count // 8)).astype("<u8").tobytes()[:count]


def bf16_bits(seed: int, n: int, exponents: list[int], *, rare: tuple[int, ...] = (), rare_per_mille: int = 0,
              forced_rare: tuple[int, ...] = ()) -> bytes:
    """BF16 elements with random sign and mantissa and exponents drawn from ``exponents`` (repeats weigh more).

    About ``rare_per_mille`` elements per thousand, and those at ``forced_rare`` positions, take an exponent from
    ``rare`` instead: with 16 or more common exponents these are the escapes.
    """
    w = splitmix64(seed, n)
    table = np.array(exponents, dtype=np.uint64)
    exponent = table[(w >> np.uint64(8)) % np.uint64(len(exponents))]
    if rare:
        rare_table = np.array(rare, dtype=np.uint64)
        pick = rare_table[(w >> np.uint64(40)) % np.uint64(len(rare))]
        is_rare = (w >> np.uint64(24)) % np.uint64(1000) < np.uint64(rare_per_mille)
        is_rare[list(forced_rare)] = True
        exponent = np.where(is_rare, pick, exponent)
    return _bf16(w, exponent)


def round_robin_bf16(seed: int, n: int, exponents: list[int]) -> bytes:
    """BF16 elements whose exponents cycle through ``exponents``: equal counts, so the codebook tie rule decides."""
    return _bf16(splitmix64(seed, n), np.array(exponents, dtype=np.uint64)[np.arange(n) % len(exponents)])


def _bf16(w: np.ndarray, exponent: np.ndarray) -> bytes:
    """BF16 bytes with the given exponents, the sign from bit 0 of ``w`` and the mantissa from its bits 1..7."""
    bits = ((w & np.uint64(1)) << np.uint64(15)) | (exponent << np.uint64(7)) | ((w >> np.uint64(1)) & np.uint64(0x7F))
    return bits.astype("<u2").tobytes()


# ---------------------------------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------------------------------

WEIGHTS = [124] * 12 + [123] * 10 + [125] * 9 + [122] * 7 + [126] * 6 + [121] * 5 + [120] * 4 + [127] * 3 \
    + [119] * 2 + [118, 117, 116, 115, 128, 114, 129]
"""64 draws over 16 exponents with a bell-shaped weight, like a trained weight matrix's."""
ESCAPES = (0, 255, 1, 60, 200, 140)
"""Exponents outside the codebook: zero/subnormals, Inf/NaN (with payloads), tiny and huge values."""


@dataclass
class Tensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    raw: bytes


@dataclass
class Case:
    name: str
    description: str
    tensors: list[Tensor]
    metadata: dict[str, str] | None = None
    alignment: int = C.DEFAULT_ALIGNMENT
    expect: dict[str, str] = field(default_factory=dict)
    """tensor name -> expected encoding: checked when generating, so a case keeps covering what it says."""


def _sized(seed: int, dtype: str, shape: tuple[int, ...]) -> bytes:
    count = int(np.prod(shape, dtype=np.int64)) * C.itemsize(dtype)
    data = random_bytes(seed, count)
    return bytes(b & 1 for b in data) if dtype == "BOOL" else data


def cases() -> list[Case]:
    n_big = 40 * 103
    return [
        Case("bf16_escapes", "BF16 with escapes: zeros, subnormals, Inf/NaN payloads, in several chunks, "
             "at the first and the last element",
             [Tensor("layers.0.weight", "BF16", (40, 103),
                     bf16_bits(1, n_big, WEIGHTS, rare=ESCAPES, rare_per_mille=5, forced_rare=(0, 1023, 1024,
                                                                                             n_big - 1))),
              Tensor("layers.0.bias", "BF16", (256,), bf16_bits(2, 256, WEIGHTS, rare=ESCAPES, rare_per_mille=8))],
             expect={"layers.0.weight": "splitzip", "layers.0.bias": "splitzip"}),
        Case("bf16_odd", "odd element counts: padding nibble, an escape as the last (odd) element, fewer than 16 "
             "exponents with equal counts (the tie rule orders the codebook), and a tensor too small to compress",
             [Tensor("odd", "BF16", (3, 341), round_robin_bf16(3, 1023, [130, 120, 125, 110, 127])),
              Tensor("odd_escapes", "BF16", (2049,), bf16_bits(4, 2049, WEIGHTS, rare=ESCAPES, rare_per_mille=3,
                                                              forced_rare=(2048,))),
              Tensor("single", "BF16", (1,), bf16_bits(5, 1, [127]))],
             expect={"odd": "splitzip", "odd_escapes": "splitzip", "single": "raw"}),
        Case("all_raw", "every tensor raw: BF16 noise (low coverage), F32, and BF16 whose payload is not smaller",
             [Tensor("noise", "BF16", (64, 32), random_bytes(6, 64 * 32 * 2)),
              Tensor("f32", "F32", (17, 5), random_bytes(7, 17 * 5 * 4)),
              Tensor("tiny", "BF16", (3,), bf16_bits(8, 3, [127, 126]))],
             expect={"noise": "raw", "f32": "raw", "tiny": "raw"}),
        Case("mixed_dtypes", "one tensor of every dtype; only the BF16 one is compressed (FP8 stays raw)",
             [Tensor(f"t.{dtype.lower()}", dtype, shape, _sized(100 + i, dtype, shape)) for i, (dtype, shape) in
              enumerate([("F32", (8, 3)), ("F16", (11,)), ("F8_E4M3", (16,)), ("F8_E5M2", (5,)), ("F8_E8M0", (4,)),
                         ("I64", (4,)), ("BOOL", (9,)), ("U8", (13,)), ("I8", (6,)), ("I16", (3,)), ("U16", (3,)),
                         ("I32", (7,)), ("U32", (2,)), ("U64", (2,)), ("F64", (2,)), ("C64", (3,))])]
             + [Tensor("t.bf16", "BF16", (33, 64), bf16_bits(9, 33 * 64, WEIGHTS, rare=ESCAPES, rare_per_mille=2))],
             expect={"t.f8_e4m3": "raw", "t.bf16": "splitzip"}),
        Case("empty_scalar", "scalars, empty tensors between payloads, and an empty __metadata__",
             [Tensor("scalar_bf16", "BF16", (), bf16_bits(10, 1, [127])),
              Tensor("empty_bf16", "BF16", (0,), b""),
              Tensor("scalar_f32", "F32", (), random_bytes(11, 4)),
              Tensor("empty_2d", "F32", (0, 7), b""),
              Tensor("empty_rows", "I64", (3, 0), b""),
              Tensor("after_empty", "BF16", (2, 600), bf16_bits(12, 1200, WEIGHTS)),
              Tensor("scalar_bool", "BOOL", (), b"\x01"),
              Tensor("empty_last", "U8", (0,), b"")],
             metadata={}, expect={"empty_bf16": "raw", "after_empty": "splitzip"}),
        Case("metadata", "source __metadata__ carried through unchanged, non-ASCII included",
             [Tensor("model.embed", "BF16", (16, 64), bf16_bits(13, 1024, WEIGHTS)),
              Tensor("model.norm", "F16", (4,), random_bytes(14, 8))],
             metadata={"format": "pt", "note": "ünïcödé ✓ 模型", "empty": ""}, expect={"model.embed": "splitzip"}),
        Case("alignment_64", "a non-default alignment of 64: payloads at multiples of 64",
             [Tensor("a", "BF16", (300,), bf16_bits(15, 300, WEIGHTS, rare=ESCAPES, rare_per_mille=10)),
              Tensor("b", "U8", (5,), random_bytes(16, 5)),
              Tensor("c", "BF16", (7, 77), bf16_bits(17, 539, WEIGHTS))],
             alignment=64, expect={"a": "splitzip", "c": "splitzip"}),
        Case("no_tensors", "the smallest legal file: no tensors, the header right after the preamble",
             [], metadata={"format": "pt"}),
    ]


# ---------------------------------------------------------------------------------------------------------------
# safetensors, written and read by hand (the library's writer output differs between its versions)
# ---------------------------------------------------------------------------------------------------------------


def write_safetensors(path: Path, tensors: list[Tensor], metadata: dict[str, str] | None) -> None:
    """A safetensors file: ``__metadata__`` first, tensors in list order, header padded with spaces to 8 bytes."""
    header: dict = {} if metadata is None else {"__metadata__": metadata}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + len(t.raw)]}
        offset += len(t.raw)
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(t.raw for t in tensors))


def read_safetensors(path: Path) -> tuple[list[Tensor], dict[str, str] | None]:
    """Tensors of a safetensors file in data order, and its ``__metadata__``."""
    data = path.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8: 8 + size])
    metadata = header.pop("__metadata__", None)
    body = data[8 + size:]
    entries = sorted(header.items(), key=lambda item: item[1]["data_offsets"][0])
    tensors = [Tensor(name, e["dtype"], tuple(e["shape"]), body[e["data_offsets"][0]: e["data_offsets"][1]])
               for name, e in entries]
    return tensors, metadata


def convert(source: Path, target: Path, *, alignment: int = C.DEFAULT_ALIGNMENT) -> None:
    """The .szt file of a safetensors file: its tensors in data order, each through szformat's encoder and gate."""
    tensors, metadata = read_safetensors(source)
    with SztWriter(target, metadata=metadata, alignment=alignment) as writer:
        for t in tensors:
            raw = torch.frombuffer(bytearray(t.raw), dtype=torch.uint8) if t.raw else torch.empty(0, dtype=torch.uint8)
            write_tensor(writer, t.name, t.dtype, t.shape, raw)


# ---------------------------------------------------------------------------------------------------------------
# Generating and checking
# ---------------------------------------------------------------------------------------------------------------


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def generate(out: Path) -> None:
    """Write every case, ``vectors.json`` and ``SHA256SUMS`` into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    listing, files = [], [out / "vectors.json"]
    for case in cases():
        source, target = out / f"{case.name}.safetensors", out / f"{case.name}.szt"
        write_safetensors(source, case.tensors, case.metadata)
        convert(source, target, alignment=case.alignment)
        listing.append(_describe(case, source, target))
        files += [source, target]
    (out / "vectors.json").write_text(json.dumps({
        "format": "szt", "version": f"{C.VERSION_MAJOR}.{C.VERSION_MINOR}",
        "generator": "tools/make_vectors.py", "cases": listing}, indent=2, ensure_ascii=False) + "\n",
        encoding="utf-8")
    (out / "SHA256SUMS").write_text("".join(f"{sha256(p.read_bytes())}  {p.name}\n"
                                            for p in sorted(files, key=lambda p: p.name)))


def _describe(case: Case, source: Path, target: Path) -> dict:
    """The case's record in vectors.json; also checks that the file decodes to its source and covers its case."""
    decoded = load_file(target)
    tensors = []
    with safe_open(target, framework="pt") as f:
        assert f.metadata() == case.metadata, case.name
        assert f.keys() == [t.name for t in case.tensors], case.name
        for t in case.tensors:
            entry = f.entry(t.name)
            assert bytes(tensor_bytes(decoded[t.name]).numpy()) == t.raw, (case.name, t.name)
            assert case.expect.get(t.name, entry.encoding) == entry.encoding, (case.name, t.name, entry.encoding)
            tensors.append({
                "name": t.name, "dtype": t.dtype, "shape": list(t.shape), "encoding": entry.encoding,
                "n_esc": entry.layout.n_esc if entry.layout else None, "offset": entry.offset,
                "length": entry.length, "raw_sha256": sha256(t.raw)})
    return {
        "name": case.name, "description": case.description, "alignment": case.alignment,
        "metadata": case.metadata,
        "source": {"file": source.name, "sha256": sha256(source.read_bytes())},
        "szt": {"file": target.name, "sha256": sha256(target.read_bytes())},
        "tensors": tensors,
    }


def check(folder: Path) -> list[str]:
    """Differences between ``folder`` and freshly generated vectors (empty when they agree)."""
    problems = []
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp)
        generate(fresh)
        expected = {p.name for p in fresh.iterdir()}
        present = {p.name for p in folder.iterdir()} if folder.is_dir() else set()
        problems += [f"{name}: missing" for name in sorted(expected - present)]
        problems += [f"{name}: not a generated file" for name in sorted(present - expected)]
        for name in sorted(expected & present):
            if (folder / name).read_bytes() != (fresh / name).read_bytes():
                problems.append(f"{name}: differs from what the generator writes now")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="vectors folder (default: spec/vectors)")
    parser.add_argument("--check", action="store_true", help="compare the folder with fresh vectors; write nothing")
    args = parser.parse_args(argv)
    if args.check:
        problems = check(args.out)
        for problem in problems:
            print(f"{args.out}/{problem}", file=sys.stderr)
        print("golden vectors: " + (f"{len(problems)} difference(s)" if problems else "all match"))
        return 1 if problems else 0
    generate(args.out)
    print(f"wrote {len(cases())} cases to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
