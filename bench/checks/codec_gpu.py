"""Check the GPU codec against the CPU reference on a real GPU, bit for bit, on large and awkward inputs.

Prints PASS or FAIL per case and exits 1 if any case fails. Every decode writes into a poisoned output, so an element
the kernels never wrote cannot pass. Inputs come from fresh seeds (printed, and settable with ``--seed``).

    python -m bench.checks.codec_gpu [--safetensors model.safetensors] [--seed N]

``--safetensors`` adds a real checkpoint: every floating-point tensor, as BF16, is encoded on the GPU and compared
byte for byte with the CPU encoder, then the whole checkpoint is decoded in one batch.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from typing import Callable

import torch

from szformat.codec import cpu, gpu
from szformat.codec.codebook import Codebook
from szformat.codec.layout import PayloadLayout

DEVICE = torch.device("cuda")
POISON = 0x7FA5  # a NaN: random weights never hold it; tensors up to 2**22 elements are checked with both poisons
SECOND_POISON = -0x5A5B

Encoded = tuple[torch.Tensor, PayloadLayout, Codebook]


# -- inputs ----------------------------------------------------------------------------------------------------------


def from_bits(b: torch.Tensor) -> torch.Tensor:
    return b.to(torch.int16).view(torch.bfloat16)


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1).view(torch.int16)


def weights(n: int, g: torch.Generator, scale: float = 0.02) -> torch.Tensor:
    return (torch.randn(n, generator=g) * scale).to(torch.bfloat16)


def all_patterns(g: torch.Generator, repeats: int = 1) -> torch.Tensor:
    patterns = torch.arange(-32768, 32768).repeat(repeats)
    return from_bits(patterns[torch.randperm(patterns.numel(), generator=g)])


def random_bits(n: int, g: torch.Generator) -> torch.Tensor:
    return from_bits(torch.randint(-32768, 32768, (n,), generator=g))


def with_specials(x: torch.Tensor, g: torch.Generator, count: int) -> torch.Tensor:
    special = torch.tensor([0x0000, -0x8000, 0x7F80, -0x0080, 0x7FC0, 0x7F81, 0x7FFF, -0x003F, -0x0001, 0x0001,
                            0x007F, -0x7FFF, -0x7F81], dtype=torch.int16)
    b = bits(x).clone()
    picks = special[torch.randint(0, len(special), (count,), generator=g)]
    b[torch.randint(0, b.numel(), (count,), generator=g)] = picks
    return from_bits(b)


def load_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """Every floating-point tensor of a safetensors file, as BF16 (FP32 sources rounded, as a converter would)."""
    from safetensors.torch import load_file

    return {name: t.to(torch.bfloat16).reshape(-1) for name, t in load_file(path).items() if t.is_floating_point()}


# -- checks ----------------------------------------------------------------------------------------------------------


def poisoned(n: int, poison: int = POISON) -> torch.Tensor:
    return from_bits(torch.full((n,), poison, dtype=torch.int16, device=DEVICE))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(bits(a).to(DEVICE), bits(b).to(DEVICE))


def check_tensor(x: torch.Tensor, codebook: Codebook | None = None, *, cpu_decode: bool = True) -> None:
    """CPU and GPU encoders agree byte for byte; each decoder decodes the other's payload (twice poisoned)."""
    payload, layout, codebook = cpu.encode(x, codebook)
    g_payload, g_layout, g_codebook = gpu.encode(x.to(DEVICE), codebook)
    assert (g_layout, g_codebook) == (layout, codebook), f"{g_layout} {g_codebook} != {layout} {codebook}"
    assert torch.equal(g_payload.cpu(), payload), "GPU payload bytes differ from the CPU encoder's"
    poisons = (POISON, SECOND_POISON) if layout.n <= 1 << 22 else (POISON,)
    for poison in poisons:
        out = gpu.decode(payload.to(DEVICE), layout, codebook, out=poisoned(layout.n, poison))
        assert same_bits(out, x), "GPU decode of the CPU payload differs"
    if cpu_decode:
        assert same_bits(cpu.decode(g_payload.cpu(), g_layout, g_codebook), x), "CPU decode of the GPU payload differs"


def check_in_place(tensors: list[torch.Tensor]) -> None:
    """Slot decode on a side stream, one scratch reused across tensors; nothing past each slot is touched."""
    scratch = gpu.DecodeScratch()
    stream = torch.cuda.Stream()
    for x in tensors:
        payload, layout, codebook = cpu.encode(x)
        slot = max(layout.raw_bytes, layout.comp_bytes)
        backing = torch.full((slot + 4096,), 0xA5, dtype=torch.uint8, device=DEVICE)
        backing[: layout.comp_bytes] = payload.to(DEVICE)
        stream.wait_stream(torch.cuda.current_stream())
        out = gpu.decode_in_place(backing[:slot], layout, codebook, scratch=scratch, stream=stream)
        torch.cuda.current_stream().wait_stream(stream)
        assert same_bits(out, x), f"in-place decode differs (n={layout.n})"
        assert bool((backing[slot:] == 0xA5).all()), "in-place decode wrote past its slot"


def batch_layout(encoded: list[Encoded]) -> tuple[torch.Tensor, list, int]:
    """One payload buffer holding every payload (16-byte aligned) and the batch entries; outputs 8-aligned, with a
    gap of 8 elements after each so that a stray write shows."""
    entries, pay_off, out_off = [], 0, 0
    for payload, layout, codebook in encoded:
        entries.append((layout, codebook, pay_off, out_off))
        pay_off += -(-layout.comp_bytes // 16) * 16
        out_off += -(-layout.n // 8) * 8 + 8
    payloads = torch.empty(pay_off, dtype=torch.uint8, device=encoded[0][0].device if encoded else None)
    for (payload, layout, _), (_, _, offset, _) in zip(encoded, entries):
        payloads[offset: offset + layout.comp_bytes] = payload
    return payloads, entries, out_off


def check_batch(tensors: list[torch.Tensor], encoded: list[Encoded] | None = None) -> str:
    encoded = encoded or [cpu.encode(x) for x in tensors]
    payloads, entries, out_elements = batch_layout(encoded)
    table = gpu.build_batch_table(entries, device=DEVICE)
    out = poisoned(out_elements)
    gpu.decode_batch(payloads.to(DEVICE), table, out=out)
    written = torch.zeros(out_elements, dtype=torch.bool, device=DEVICE)
    for x, (layout, _, _, offset) in zip(tensors, entries):
        assert same_bits(out[offset: offset + layout.n], x), f"batched decode differs (n={layout.n})"
        written[offset: offset + layout.n] = True
    assert bool((bits(out)[~written] == POISON).all()), "batched decode wrote outside its outputs"
    assert table.launches <= 2
    return f"{len(tensors)} tensors, {table.launches} launches"


def check_beyond_2gib(g: torch.Generator) -> str:
    """A tensor of more than 2**31 bytes: round trip on the GPU, escapes past 2**31 elements' worth of bytes placed
    where a direct computation puts them, and the CPU reference decoding the payload's last elements."""
    n = (1 << 30) + 4099  # 2 GiB + 8 KiB of BF16; its pk, sm and escape streams all reach past 2**31 bytes
    x = (torch.randn(n, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(g.initial_seed())) * 0.02)
    x = x.to(torch.bfloat16)
    x[-5000::37] = 1e30  # far outside the Top-16: escapes near the end
    payload, layout, codebook = gpu.encode(x)
    exponent = (bits(x).to(torch.int32) >> 7) & 0xFF
    in_codebook = torch.isin(exponent, torch.tensor(codebook.dec_lut[: codebook.n_used], device=DEVICE))
    expected = torch.nonzero(~in_codebook).reshape(-1)
    chunk = payload[layout.off_cid: layout.off_lpos].view(torch.int32).long()
    local = payload[layout.off_lpos: layout.off_lpos + 2 * layout.n_esc].view(torch.int16).long() & 0xFFFF
    assert torch.equal(chunk * layout.chunk_size + local, expected), "escape positions differ"
    out = gpu.decode(payload, layout, codebook, out=poisoned(n))
    assert same_bits(out, x), "round trip differs"
    tail = cpu.decode(payload.cpu(), layout, codebook, start=n - (1 << 20), stop=n)
    assert same_bits(tail, x[n - (1 << 20):]), "CPU decode of the GPU payload's tail differs"
    return f"n={n}, {layout.comp_bytes} payload bytes, {layout.n_esc} escapes"


# -- runner ----------------------------------------------------------------------------------------------------------


def run_case(name: str, check: Callable[[], str | None], failures: list[str]) -> None:
    start = time.perf_counter()
    try:
        detail = check()
        torch.cuda.synchronize()
        print(f"PASS  {name:<44} {time.perf_counter() - start:6.2f} s  {detail or ''}", flush=True)
    except Exception as e:  # noqa: BLE001 - a failing case is reported and the run goes on
        failures.append(name)
        print(f"FAIL  {name:<44} {type(e).__name__}: {e}", flush=True)
        traceback.print_exc()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--safetensors", help="a real checkpoint to check (FP32 tensors are rounded to BF16)")
    parser.add_argument("--seed", type=int, default=int.from_bytes(os.urandom(4), "little"))
    parser.add_argument("--skip-large", action="store_true", help="skip the tensor of more than 2 GiB")
    args = parser.parse_args()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, seed {args.seed}", flush=True)
    g = torch.Generator().manual_seed(args.seed)
    failures: list[str] = []

    run_case("random weights, n=2**26 + 7", lambda: check_tensor(weights((1 << 26) + 7, g)), failures)
    run_case("random weights, n=2**27 (scale 1)", lambda: check_tensor(weights(1 << 27, g, 1.0)), failures)
    run_case("all 65,536 patterns x16, shuffled", lambda: check_tensor(all_patterns(g, 16)), failures)
    run_case("NaN payloads, +-0, +-Inf, subnormals",
             lambda: check_tensor(with_specials(weights(1_000_003, g), g, 20_000)), failures)
    run_case("escape-heavy (random bits), n=10**7 + 1", lambda: check_tensor(random_bits(10**7 + 1, g)), failures)
    run_case("all-escape (given codebook)", lambda: check_tensor(
        weights(300_001, g), Codebook(dec_lut=tuple(range(200, 216)), n_used=16, coverage=0.0)), failures)
    run_case("fewer than 16 exponents", lambda: check_tensor(
        from_bits((torch.randint(118, 121, (99_999,), generator=g) << 7).to(torch.int16))), failures)
    sizes = [0, 1, 2, 3, 5, 7, 1023, 1024, 1025, 8191, 8192, 8193, 65537, 1_000_003]

    def odd_sizes() -> str:
        for n in sizes:
            check_tensor(weights(n, g))
        return f"n = {', '.join(map(str, sizes))}"

    run_case("odd and tiny sizes", odd_sizes, failures)
    run_case("in-place slot decode, side stream", lambda: check_in_place(
        [weights((1 << 24) + 3, g), random_bits(100_001, g), all_patterns(g), weights(1, g), weights(0, g)]), failures)
    mixed = [weights(int(n), g) for n in torch.randint(0, 70_000, (250,), generator=g)]
    mixed += [random_bits(30_001, g), all_patterns(g), weights(0, g), weights(1, g), weights(5_000_001, g)]
    run_case("batched decode, 255 mixed tensors", lambda: check_batch(mixed), failures)
    if not args.skip_large:
        run_case("tensor over 2 GiB (64-bit offsets)", lambda: check_beyond_2gib(g), failures)
    if args.safetensors:
        checkpoint = load_checkpoint(args.safetensors)

        def real_weights() -> str:
            encoded = []
            for name, x in checkpoint.items():
                payload, layout, codebook = gpu.encode(x.to(DEVICE))
                expected = cpu.encode(x)
                assert (layout, codebook) == expected[1:] and torch.equal(payload.cpu(), expected[0]), name
                encoded.append(expected)
            detail = check_batch(list(checkpoint.values()), encoded)
            raw = sum(x.numel() * 2 for x in checkpoint.values())
            comp = sum(layout.comp_bytes for _, layout, _ in encoded)
            return f"{detail}, {raw / 1e6:.1f} MB raw -> {comp / 1e6:.1f} MB ({comp / raw:.3f})"

        run_case(f"real checkpoint {os.path.basename(args.safetensors)}", real_weights, failures)

    print(f"{'FAILED: ' + ', '.join(failures) if failures else 'ALL PASSED'}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
