"""The converter's mapped source: a covered mapping reads as zeros from the first page the file lost, on any thread,
instead of killing the process; the conversion then refuses the tensor it was reading, and leaves nothing behind."""

from __future__ import annotations

import importlib
import math
import mmap
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file as save_safetensors

from szformat._reused import ReusedBuffer
from szformat.codec import cpu
from szformat.codec.gate import encode_tensor
from szformat.convert import convert
from szformat.convert.pages import CoveredMapping
from szformat.convert.sources import read_safetensors_header
from szformat.errors import ConversionError
from support import bf16_weights, covers_mappings, listing

sources_module = importlib.import_module("szformat.convert.sources")

needs_covers = pytest.mark.skipif(not covers_mappings(), reason="mappings are not covered here (Linux, C kernels)")

PAGE = mmap.PAGESIZE

READ_AFTER_TRUNCATION = textwrap.dedent("""
    import mmap, os, sys, threading
    import numpy as np
    from szformat.convert.pages import CoveredMapping

    path, cover = sys.argv[1], sys.argv[2] == "cover"
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    covered = CoveredMapping.of(mapping) if cover else None
    end = 3 * mmap.PAGESIZE + 100
    os.truncate(path, end)  # pages 4 and on are lost (the rest of page 3 reads as zeros, as a file's tail does)
    data = np.frombuffer(mapping, dtype=np.uint8)
    sums = []
    reader = threading.Thread(target=lambda: sums.append(int(data[4 * mmap.PAGESIZE:].sum())))
    reader.start()
    reader.join()
    kept = bytes(data[:end]) == (bytes(range(256)) * (4 * mmap.PAGESIZE // 256))[:end]
    print(kept, sums, covered.lost)
    covered.close()
""")


def run_child(path: Path, mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", READ_AFTER_TRUNCATION, str(path), mode], capture_output=True,
                          text=True, timeout=120)


@needs_covers
def test_a_covered_mapping_reads_zeros_where_the_file_was_cut_and_says_so(tmp_path):
    """In a child process: uncovered, the read past the file's new end dies of SIGBUS (so the read does fault);
    covered, the pages kept read as the file's bytes, the lost ones as zeros, read on another thread, and the
    mapping says a page was lost."""
    path = tmp_path / "data.bin"
    path.write_bytes(bytes(range(256)) * (16 * PAGE // 256))
    uncovered = run_child(path, "none")
    assert uncovered.returncode == -signal.SIGBUS, uncovered.stderr
    path.write_bytes(bytes(range(256)) * (16 * PAGE // 256))
    covered = run_child(path, "cover")
    assert covered.returncode == 0, covered.stderr
    assert covered.stdout.split() == ["True", "[0]", "True"]


@needs_covers
def test_a_covered_mapping_nothing_lost_says_so_and_gives_its_slot_back(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(bytes(range(256)) * 64)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapping:
        covers = []
        while (cover := CoveredMapping.of(mapping)) is not None:  # every slot: the next one is refused
            covers.append(cover)
            assert len(covers) <= 1024
        assert covers and not any(c.lost for c in covers)
        covers.pop().close()
        again = CoveredMapping.of(mapping)  # the slot given back is taken again
        assert again is not None and bytes(mapping[:4]) == bytes(range(4))
        for c in [*covers, again]:
            c.close()
        again.close()  # twice: nothing happens


@needs_covers
def test_covering_refuses_writable_memory_and_slots_it_never_gave():
    native = cpu._native
    with pytest.raises(ValueError, match="read-only view"):
        native.cover_mapping(bytearray(PAGE))
    with pytest.raises(ValueError, match="is not a slot cover_mapping gave"):
        native.covered_faults(5000)
    with pytest.raises(ValueError, match="is not a slot cover_mapping gave"):
        native.uncover_mapping(-1)
    with pytest.raises(TypeError, match="takes 1 argument"):
        native.cover_mapping()


def truncate_while_encoding(monkeypatch, source: Path, name: str, cut: int) -> None:
    """Cut ``source`` to ``cut`` bytes while tensor ``name`` is encoded (between its exponent count and its payload),
    as another process might."""
    numel = {t.name: math.prod(t.shape) for t in read_safetensors_header(source).tensors}[name]
    real = cpu.payload_layout

    def payload_layout(histogram, codebook):
        if sum(histogram.tolist()) == numel:
            os.truncate(source, cut)
        return real(histogram, codebook)

    monkeypatch.setattr(cpu, "payload_layout", payload_layout)


@needs_covers
def test_a_source_cut_under_the_codec_is_refused_naming_the_tensor_and_nothing_is_written(tmp_path, monkeypatch):
    """The bytes of the tensor being encoded vanish under the codec, its CRC-32 thread and the check: no crash, one
    ConversionError naming the file and the tensor, no output."""
    source, target = tmp_path / "model.safetensors", tmp_path / "model.szt"
    save_safetensors({"a": bf16_weights((64, 64), seed=1), "big": bf16_weights((1024, 1024), seed=2),
                      "c": bf16_weights((64,), seed=3)}, source)
    header = read_safetensors_header(source)
    big = next(t for t in header.tensors if t.name == "big")
    truncate_while_encoding(monkeypatch, source, "big", header.data_start + big.begin + big.nbytes // 3)
    before = listing(tmp_path)
    with pytest.raises(ConversionError, match="the file changed while it was converted") as caught:
        convert(source, target)
    assert caught.value.tensor == "big" and str(source) in str(caught.value)
    assert listing(tmp_path) == before


@needs_covers
def test_a_raw_tensor_whose_bytes_were_lost_is_refused_not_written(tmp_path, monkeypatch):
    """A tensor stored as it is (F32) is written from the mapping: its lost bytes are never written as zeros."""
    source, target = tmp_path / "model.safetensors", tmp_path / "model.szt"
    save_safetensors({"a": bf16_weights((64, 64), seed=1), "f": torch.randn(512, 512)}, source)
    header = read_safetensors_header(source)
    f = next(t for t in header.tensors if t.name == "f")
    real = sources_module.SafetensorsSource.tensors

    def cut_before_f(self):
        for tensor, raw in real(self):
            if tensor.name == "f":
                os.truncate(source, header.data_start + f.begin + PAGE)
            yield tensor, raw

    monkeypatch.setattr(sources_module.SafetensorsSource, "tensors", cut_before_f)
    before = listing(tmp_path)
    with pytest.raises(ConversionError, match="the file changed while it was converted") as caught:
        convert(source, target)
    assert caught.value.tensor == "f" and listing(tmp_path) == before


def test_the_cpu_codec_encodes_into_the_buffer_it_is_given_and_grows_it():
    """A conversion's payloads share one block of memory: each payload is a view of the buffer, a larger tensor
    grows it, and the bytes are those encoded into new memory."""
    buffer = ReusedBuffer()
    large, small = bf16_weights((300, 301), seed=4), bf16_weights((1000,), seed=5)
    first = encode_tensor(large.view(torch.uint8).reshape(-1), "BF16", buffer=buffer).payload
    second = encode_tensor(small.view(torch.uint8).reshape(-1), "BF16", buffer=buffer).payload
    assert second.data_ptr() == first.data_ptr()  # the same memory again
    assert torch.equal(second, cpu.encode(small)[0])
    grown = encode_tensor(bf16_weights((700, 301), seed=6).view(torch.uint8).reshape(-1), "BF16", buffer=buffer)
    assert grown.payload.numel() > first.numel() and buffer.take(1).data_ptr() == grown.payload.data_ptr()


@needs_covers
def test_a_page_lost_without_the_file_changing_is_refused_too(tmp_path, monkeypatch):
    """A page the disk cannot read leaves the file's size and time as they were: the covered mapping's count alone
    says the bytes read were not the file's."""
    source, target = tmp_path / "model.safetensors", tmp_path / "model.szt"
    save_safetensors({"a": bf16_weights((64, 64), seed=1), "b": bf16_weights((64,), seed=2)}, source)
    monkeypatch.setattr(CoveredMapping, "lost", property(lambda self: True))
    with pytest.raises(ConversionError, match="the file changed while it was converted") as caught:
        convert(source, target)
    assert caught.value.tensor == read_safetensors_header(source).tensors[0].name and not target.exists()


def test_a_source_on_a_file_system_without_mappings_is_read_with_pread(tmp_path, monkeypatch):
    """Some file systems (FUSE mounts without mmap) refuse a mapping: the converter reads the file with pread
    instead, and the output is the same file."""
    source = tmp_path / "model.safetensors"
    save_safetensors({"a": bf16_weights((64, 64), seed=1), "f": torch.randn(100, 3)}, source)
    convert(source, tmp_path / "mapped.szt")

    def refuse(*args, **kwargs):
        raise OSError(19, "No such device")  # ENODEV: what mmap gives on a file system that cannot map

    monkeypatch.setattr(sources_module, "mmap", SimpleNamespace(mmap=refuse, ACCESS_READ=mmap.ACCESS_READ))
    convert(source, tmp_path / "read.szt")
    assert (tmp_path / "read.szt").read_bytes() == (tmp_path / "mapped.szt").read_bytes()
