"""Stand-ins shared by the loader and offloader tests, which run the device pipelines on the CPU."""

from __future__ import annotations

import torch

from szformat.codec import cpu as cpu_codec


class ReferenceCodec:
    """The device codec's contract, fulfilled by the CPU reference decoder."""

    def batch_tables(self, batches, device):
        return [list(entries) for entries in batches]

    def decode_batch(self, payloads, table, out):
        for layout, codebook, payload_offset, output_offset in table:
            cpu_codec.decode(payloads[payload_offset: payload_offset + layout.comp_bytes], layout, codebook,
                             out=out[output_offset: output_offset + layout.n])

    def decode_batch_at(self, payloads, table, base):
        storage = base.untyped_storage()
        span = storage.nbytes() // 2 - base.storage_offset()  # outputs lie anywhere in base's storage after it
        self.decode_batch(payloads, table, base.as_strided((span,), (1,), base.storage_offset()))

    def new_scratch(self):
        return None

    def decode_in_place(self, buffer, layout, codebook, scratch):
        stash = buffer[: layout.comp_bytes].clone()
        cpu_codec.decode(stash, layout, codebook, out=buffer[: layout.raw_bytes].view(torch.bfloat16))
