"""The NEON kernels (``szformat/codec/_neon.h``) bit for bit against the PyTorch reference, run under an emulator.

No AArch64 machine runs these tests, so the kernels are compiled for AArch64 by the clang that the ``ziglang`` wheel
carries and run by Unicorn (the ``unicorn`` wheel: QEMU's CPU emulation as a library), instruction for instruction
as an AArch64 CPU runs them: the reference encodes random and real BF16 tensors (escapes, subnormals, NaN and Inf
payloads, odd sizes), the NEON encoder must give its ``pk`` and ``sm`` bytes, and the NEON decoder, with the
escapes patched as every decoder patches them, the source bits. Skipped where either wheel is missing; the
``test`` extra installs both. That _native.c compiles for AArch64 with the header included is checked here too.
"""

from __future__ import annotations

import os
import random
import re
import struct
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from szformat.codec import cpu

pytest.importorskip("ziglang", reason="no AArch64 compiler here (pip install ziglang)")
unicorn = pytest.importorskip("unicorn", reason="no AArch64 emulator here (pip install unicorn)")
from unicorn import arm64_const as A  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CODEC = ROOT / "szformat" / "codec"
TARGET = "aarch64-linux-musl"


def zig_cc(cache: Path, *args: str) -> None:
    """zig's clang for AArch64, its caches in ``cache`` (not the user's home)."""
    env = {**os.environ, "ZIG_GLOBAL_CACHE_DIR": str(cache / "global"), "ZIG_LOCAL_CACHE_DIR": str(cache / "local")}
    done = subprocess.run([sys.executable, "-m", "ziglang", "cc", "-target", TARGET, *args], capture_output=True,
                          text=True, env=env)
    assert done.returncode == 0, done.stderr


# ---------------------------------------------------------------------------------------------------------------
# The kernels, compiled for AArch64 and run by the emulator
# ---------------------------------------------------------------------------------------------------------------


WRAPPERS = """
#include "_neon.h"
ptrdiff_t decode(const uint8_t *pk, const uint8_t *sm, const uint8_t *lut, uint16_t *out, ptrdiff_t n_pairs)
{ return sz_decode_neon(pk, sm, lut, out, n_pairs); }
ptrdiff_t encode(const uint16_t *bits, const uint8_t *enc, uint8_t *pk, uint8_t *sm, ptrdiff_t n_pairs)
{ return sz_encode_neon(bits, enc, pk, sm, n_pairs); }
"""

CODE_BASE, DATA_BASE, DATA_SIZE, STACK_TOP, RETURN = 0x400000, 0x10000000, 1 << 24, 0x20000000, 0x30000000
PAGE = 1 << 12


def elf_image(path: Path) -> tuple[list[tuple[int, bytes, int]], dict[str, int]]:
    """The loadable segments ``(address, bytes, size in memory)`` and the function symbols of a static ELF64 file."""
    data = path.read_bytes()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, "not a little-endian ELF64 file"
    phoff, shoff = struct.unpack_from("<QQ", data, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, 0x36)
    segments = []
    for k in range(phnum):
        kind, _, offset, vaddr, _, filesz, memsz, _ = struct.unpack_from("<IIQQQQQQ", data, phoff + k * phentsize)
        if kind == 1:  # PT_LOAD
            segments.append((vaddr, data[offset: offset + filesz], memsz))
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + k * shentsize) for k in range(shnum)]
    symbols = {}
    for _, kind, _, _, offset, size, link, _, _, entsize in sections:
        if kind != 2:  # SHT_SYMTAB
            continue
        names = sections[link]
        for at in range(offset, offset + size, entsize):
            name, info, _, _, value, _ = struct.unpack_from("<IBBHQQ", data, at)
            if info & 0xF == 2:  # STT_FUNC
                end = data.index(b"\0", names[4] + name)
                symbols[data[names[4] + name: end].decode()] = value
    return segments, symbols


class Emulated:
    """The kernels' two entry points, called with NumPy arrays through the emulator (arguments in x0-x4, as the
    AArch64 procedure call standard passes them)."""

    def __init__(self, elf: Path):
        segments, self.symbols = elf_image(elf)
        self.uc = unicorn.Uc(unicorn.UC_ARCH_ARM64, unicorn.UC_MODE_ARM)
        for vaddr, data, memsz in segments:
            start, end = vaddr // PAGE * PAGE, -(-(vaddr + memsz) // PAGE) * PAGE
            self.uc.mem_map(start, end - start)
            self.uc.mem_write(vaddr, data)
        self.uc.mem_map(DATA_BASE, DATA_SIZE)
        self.uc.mem_map(STACK_TOP - (1 << 16), 1 << 16)
        self.uc.mem_map(RETURN, PAGE)
        self.uc.reg_write(A.UC_ARM64_REG_CPACR_EL1, 0x300000)  # the FP and SIMD registers in use (FPEN)

    def call(self, name: str, inputs: list[np.ndarray], outputs: list[tuple[int, np.dtype]], n_pairs: int
             ) -> tuple[int, list[np.ndarray]]:
        """``name(*inputs, *outputs, n_pairs)``: the pairs it returned and the outputs (``(count, dtype)`` each)."""
        at, addresses = DATA_BASE, []
        for array in inputs:
            self.uc.mem_write(at, np.ascontiguousarray(array).tobytes())
            addresses.append(at)
            at += -(-array.nbytes // 64) * 64
        for count, dtype in outputs:
            self.uc.mem_write(at, b"\xa5" * (count * np.dtype(dtype).itemsize))  # no zeros to hide a missed store
            addresses.append(at)
            at += -(-count * np.dtype(dtype).itemsize // 64) * 64
        assert at <= DATA_BASE + DATA_SIZE
        for k, address in enumerate(addresses + [n_pairs]):
            self.uc.reg_write(A.UC_ARM64_REG_X0 + k, address)
        self.uc.reg_write(A.UC_ARM64_REG_SP, STACK_TOP - 64)
        self.uc.reg_write(A.UC_ARM64_REG_LR, RETURN)
        self.uc.emu_start(self.symbols[name], RETURN)
        done = self.uc.reg_read(A.UC_ARM64_REG_X0)
        results = [np.frombuffer(bytes(self.uc.mem_read(address, count * np.dtype(dtype).itemsize)), dtype=dtype)
                   for address, (count, dtype) in zip(addresses[len(inputs):], outputs)]
        return done, results


@pytest.fixture(scope="module")
def neon(tmp_path_factory) -> Emulated:
    folder = tmp_path_factory.mktemp("neon")
    (folder / "wrappers.c").write_text(WRAPPERS)
    elf = folder / "kernels.elf"
    zig_cc(folder, "-O2", "-nostdlib", "-static", "-fno-stack-protector", "-Wl,-e,decode", f"-I{CODEC}",
           str(folder / "wrappers.c"), "-o", str(elf))
    return Emulated(elf)


# ---------------------------------------------------------------------------------------------------------------
# Tensors, and what the reference makes of them
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture
def rng() -> random.Random:
    seed = random.SystemRandom().randrange(2**32)
    print(f"seed={seed}")
    return random.Random(seed)


def tensors(rng: random.Random) -> list[torch.Tensor]:
    """BF16 tensors of odd and even sizes around the kernels' 32-element blocks: trained-like weights, weights with
    subnormals, NaN and Inf payloads and escapes, all-escape bit noise, and every exponent at once."""
    g = torch.Generator().manual_seed(rng.randrange(2**63))
    weights = torch.randn(4099, generator=g) * 0.02
    special = weights.clone()
    special[::97] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-40, -0.0, 3e38]).repeat(43)[:43]
    noise = torch.randint(-(1 << 15), 1 << 15, (2053,), generator=g, dtype=torch.int16).view(torch.bfloat16)
    every = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    cases = [weights.to(torch.bfloat16), special.to(torch.bfloat16), noise, every[torch.randperm(1 << 16, generator=g)]]
    sizes = [0, 1, 2, 31, 32, 33, 63, 64, 65, 1000, rng.randrange(1, 3000)]
    return cases + [cases[rng.randrange(3)][:n] for n in sizes]


def reference_streams(x: torch.Tensor):
    """The reference's payload of ``x``: its pk and sm bytes, escape positions and exponents, codebook."""
    payload, layout, codebook = cpu.encode(x)
    data = payload.numpy()
    pk = data[layout.off_pk: layout.off_pk + layout.n_pairs]
    sm = data[layout.off_sm: layout.off_sm + layout.n]
    positions = cpu.escape_positions(payload, layout).numpy()
    exponents = data[layout.off_ev: layout.off_ev + layout.n_esc]
    return pk, sm, positions, exponents, codebook


def code_table(codebook) -> np.ndarray:
    """The encoder's 256-entry table: each exponent's code, 16 for one without."""
    table = np.full(256, 16, dtype=np.uint8)
    for code, exponent in enumerate(codebook.dec_lut[: codebook.n_used]):
        table[exponent] = code
    return table


# ---------------------------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------------------------


def test_decode_gives_the_source_bits_with_escapes_patched(neon, rng):
    for x in tensors(rng):
        pk, sm, positions, exponents, codebook = reference_streams(x)
        n, n_pairs = x.numel(), x.numel() // 2
        lut = np.array(codebook.dec_lut, dtype=np.uint8)
        done, [out] = neon.call("decode", [pk, sm, lut], [(2 * n_pairs, np.uint16)], n_pairs)
        assert done == n_pairs // 16 * 16
        taken = 2 * done
        out = out[:taken].copy()
        inside = positions < taken
        out[positions[inside]] = (out[positions[inside]] & 0x807F) | (exponents[inside].astype(np.uint16) << 7)
        assert np.array_equal(out, x.view(torch.int16).numpy().view(np.uint16)[:taken]), n


def test_encode_gives_the_reference_streams(neon, rng):
    for x in tensors(rng):
        pk, sm, _, _, codebook = reference_streams(x)
        n_pairs = x.numel() // 2
        bits = x.view(torch.int16).numpy().view(np.uint16)
        done, [got_pk, got_sm] = neon.call("encode", [bits[: 2 * n_pairs], code_table(codebook)],
                                           [(n_pairs, np.uint8), (2 * n_pairs, np.uint8)], n_pairs)
        assert done == n_pairs // 16 * 16
        assert np.array_equal(got_pk[:done], pk[:done]) and np.array_equal(got_sm[: 2 * done], sm[: 2 * done])


def test_the_extension_compiles_for_aarch64_with_the_neon_kernels(tmp_path):
    """_native.c as setup.py builds it (-O3), for an AArch64 target: it compiles with no function left undeclared
    or unused (nothing x86-only leaks into that build), and its code holds ``tbl`` lookups, which only the NEON
    kernels make."""
    include = sysconfig.get_paths()["include"]
    zig_cc(tmp_path, "-O3", "-S", f"-I{include}", "-Werror=implicit-function-declaration", "-Werror=unused-function",
           str(CODEC / "_native.c"), "-o", str(tmp_path / "_native.s"))
    assert re.search(r"\btbl\s+v\d+\.16b", (tmp_path / "_native.s").read_text())
