"""Stand-ins shared by the tests: the device codec and inflater on the CPU (the loader and offloader tests run the
device pipelines there), and a CPU encoder that writes one wrong byte."""

from __future__ import annotations

import torch
import zstandard

from szformat.codec import cpu as cpu_codec


class ReferenceCodec:
    """The device codec's contract, fulfilled by the CPU reference decoder: like the kernels, it flags escape streams
    that break a rule in ``errors`` when given (the reference refuses them; the kernels decode them as they stand)."""

    def batch_tables(self, batches, device):
        return [list(entries) for entries in batches]

    def decode_batch(self, payloads, table, out, errors=None):
        for i, (layout, codebook, payload_offset, output_offset) in enumerate(table):
            self._decode(payloads[payload_offset: payload_offset + layout.comp_bytes], layout, codebook,
                         out[output_offset: output_offset + layout.n], None if errors is None else errors[i:i + 1])

    @staticmethod
    def _decode(payload, layout, codebook, out, errors):
        if errors is not None:
            try:
                cpu_codec.escape_positions(payload, layout)
            except ValueError:
                errors.fill_(1)
                return
        cpu_codec.decode(payload, layout, codebook, out=out)

    def decode_batch_at(self, payloads, table, base):
        storage = base.untyped_storage()
        span = storage.nbytes() // 2 - base.storage_offset()  # outputs lie anywhere in base's storage after it
        self.decode_batch(payloads, table, base.as_strided((span,), (1,), base.storage_offset()))

    def decode(self, payload, layout, codebook, out, errors=None):
        self._decode(payload, layout, codebook, out, errors)

    def new_scratch(self):
        return None

    def decode_in_place(self, buffer, layout, codebook, scratch, errors=None):
        stash = buffer[: layout.comp_bytes].clone()
        self._decode(stash, layout, codebook, buffer[: layout.raw_bytes].view(torch.bfloat16), errors)


class ZstdInflater:
    """The device inflater's contract, fulfilled by python-zstandard on CPU tensors. ``frames`` counts the frames
    it was handed; ``fail`` makes every frame fail, as a frame nvCOMP cannot inflate."""

    def __init__(self, fail: bool = False):
        self.frames = 0
        self.fail = fail
        self.released = 0

    def release(self):
        self.released += 1

    def inflate(self, source, plan, out, statuses):
        for i in range(plan.count):
            stored, stored_length, memory, memory_length = (int(column[i]) for column in (
                plan.stored, plan.stored_lengths, plan.memory, plan.memory_lengths))
            self.frames += 1
            if self.fail:
                statuses[i] = 1
                continue
            data = zstandard.ZstdDecompressor().decompress(bytes(source[stored: stored + stored_length].numpy()),
                                                          max_output_size=memory_length)
            if len(data) != memory_length:
                statuses[i] = 2
                continue
            out[memory: memory + memory_length] = torch.frombuffer(bytearray(data), dtype=torch.uint8)


def flip_in_last_slice(monkeypatch, n_pairs: int, stream: str, mask: int) -> list[int]:
    """Make the sliced CPU encoder write one wrong byte (``stream`` "pk" or "sm", its last byte XOR ``mask``) in
    the last slice of a tensor of ``n_pairs`` whole pairs only: a codec bug that the check, which decodes each slice
    as it is written, must catch however late. Returns the pairs left to encode (``[0]`` once all were)."""
    real = cpu_codec._encode_pairs
    pairs_left = [n_pairs]

    def wrong(bits, pk_table, pk, sm, scratch):
        real(bits, pk_table, pk, sm, scratch)
        pairs_left[0] -= pk.numel()
        if not pairs_left[0]:
            (pk if stream == "pk" else sm)[-1] ^= mask

    monkeypatch.setattr(cpu_codec, "_encode_pairs", wrong)
    return pairs_left
