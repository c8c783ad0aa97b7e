"""Stand-ins shared by the tests: the device codec and inflater on the CPU (the loader and offloader tests run the
device pipelines there), streams that defer work as a GPU's do, and CPU encoders that write one wrong byte."""

from __future__ import annotations

import threading
from collections import deque

import torch
import zstandard

from szformat.codec import cpu as cpu_codec
from szformat.codec.layout import PayloadLayout
from szformat.loading.device_codec import HostCodec


class ReferenceCodec(HostCodec):
    """The device codec's contract, fulfilled by the CPU reference decoder: like the kernels, it flags escape streams
    that break a rule in ``errors`` when given (the reference refuses them; the kernels decode them as they stand)."""

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

    def wrong(bits, codebook, pk, sm, scratch):
        real(bits, codebook, pk, sm, scratch)
        pairs_left[0] -= pk.numel()
        if not pairs_left[0]:
            (pk if stream == "pk" else sm)[-1] ^= mask

    monkeypatch.setattr(cpu_codec, "_encode_pairs", wrong)
    return pairs_left



class CorruptingKernels:
    """The built C kernels, with ``encode_payload`` flipping the bits ``mask`` of one byte of what it wrote: the byte
    at ``offset_of(layout)`` of the payload's layout (a codec bug the whole-payload check must catch)."""

    def __init__(self, offset_of, mask: int):
        self.offset_of, self.mask = offset_of, mask

    def __getattr__(self, name):
        return getattr(cpu_codec.cpu_kernel.native, name)

    def encode_payload(self, bits, enc_lut, payload, n_esc, chunk_size):
        found = cpu_codec.cpu_kernel.native.encode_payload(bits, enc_lut, payload, n_esc, chunk_size)
        payload[self.offset_of(PayloadLayout(n=bits.size, n_esc=n_esc, chunk_size=chunk_size))] ^= self.mask
        return found


POISON = 0xA5

class FakeEvent:
    def __init__(self, stream: "FakeStream", position: int):
        self.stream = stream
        self.position = position


class FakeStream:
    def __init__(self, index: int, eager: bool):
        self.index = index
        self.eager = eager
        self.queue: deque = deque()
        self.enqueued = 0
        self.executed = 0


class FakeOps:
    """Streams that defer work like a GPU's. ``eager`` holds the creation indices of streams that run as soon as
    their waits allow (0 is the current stream, then the order of ``new_stream`` calls); the others run only when
    the host synchronizes on them or an eager stream waits on them. ``log`` records every step in host order."""

    device = torch.device("cpu")

    def __init__(self, eager: tuple[int, ...] = ()):
        self._eager = set(eager)
        self.streams = [FakeStream(0, 0 in self._eager)]
        self.log: list[tuple] = []
        self.lock = threading.RLock()  # the loop calls in from two threads, as it may on a real device
        self.allocated = 0
        self.reserved: list[tuple[int, int]] = []  # (bytes reserved, bytes allocated before)
        self.callers: list[str] = []
        """The thread that made each step of ``log``."""

    def new_stream(self) -> FakeStream:
        stream = FakeStream(len(self.streams), len(self.streams) in self._eager)
        self.streams.append(stream)
        return stream

    def current_stream(self) -> FakeStream:
        return self.streams[0]

    def _push(self, stream: FakeStream, op: tuple) -> None:
        stream.queue.append(op)
        stream.enqueued += 1
        if stream.eager:
            self._run(stream, stream.enqueued)

    def _note(self, step: tuple) -> None:
        self.log.append(step)
        self.callers.append(threading.current_thread().name)

    def enqueue(self, stream, work, label, current=None) -> None:
        with self.lock:
            self._note((label, stream.index))
            self._push(stream, ("work", work))

    def record(self, stream, into=None) -> FakeEvent:
        with self.lock:  # a new event each time: a wait keeps the point of the event it was given
            event = FakeEvent(stream, stream.enqueued)
            self._note(("record", stream.index, event))
            return event

    def wait(self, stream, event) -> None:
        with self.lock:
            self._note(("wait", stream.index, event))
            self._push(stream, ("wait", event))

    def synchronize(self, event) -> None:
        with self.lock:
            self._note(("sync", event))
            self._run(event.stream, event.position)

    def _run(self, stream: FakeStream, position: int) -> None:
        while stream.executed < position:
            kind, arg = stream.queue.popleft()
            stream.executed += 1
            if kind == "wait":
                self._run(arg.stream, arg.position)
            else:
                arg()

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.full((nbytes,), POISON, dtype=torch.uint8)

    def device_buffer(self, nbytes: int) -> torch.Tensor:
        with self.lock:
            self.allocated += nbytes
        return torch.full((nbytes,), POISON ^ 0xFF, dtype=torch.uint8)

    def reserve(self, nbytes: int) -> None:
        with self.lock:
            self.reserved.append((nbytes, self.allocated))
