"""The cyclic garbage collector paused while a checkpoint is read or converted (``szformat._collector``); a header's
parse alone: ``tests/format/test_container.py``."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

import szformat
from szformat import _collector
from szformat.errors import FormatError


def test_a_load_pauses_the_collector_and_resumes_it(tmp_path, monkeypatch, collector_on):
    path = tmp_path / "m.szt"
    szformat.save_file({"a": torch.randn(300, 7).bfloat16(), "b": torch.arange(5)}, path)
    seen = []
    decode = szformat.api.decode_entries
    monkeypatch.setattr(szformat.api, "decode_entries", lambda *a, **k: seen.append(gc.isenabled()) or decode(*a, **k))
    loaded = szformat.load_file(path)
    assert seen == [False] and gc.isenabled()
    assert torch.equal(loaded["b"], torch.arange(5))


def test_a_conversion_pauses_the_collector_and_resumes_it_even_when_it_fails(tmp_path, monkeypatch, collector_on):
    from safetensors.torch import save_file as save_safetensors

    import szformat.format.writer as writer_module
    from szformat.convert import convert
    from szformat.errors import ConversionError

    source = tmp_path / "m.safetensors"
    save_safetensors({"a": torch.randn(300, 7).bfloat16(), "b": torch.randn(30).bfloat16()}, source)
    seen = []
    encode = writer_module.encode_tensor
    monkeypatch.setattr(writer_module, "encode_tensor", lambda *a, **k: seen.append(gc.isenabled()) or encode(*a, **k))
    convert(source, tmp_path / "m.szt")
    assert seen == [False, False] and gc.isenabled()
    source.write_bytes(b"not a checkpoint at all")
    with pytest.raises(ConversionError):
        convert(source, tmp_path / "again.szt")
    assert gc.isenabled()


def test_a_collector_the_caller_disabled_stays_disabled(tmp_path, collector_on):
    path = tmp_path / "m.szt"
    szformat.save_file({"a": torch.randn(30).bfloat16()}, path)
    gc.disable()
    szformat.load_file(path)
    assert not gc.isenabled()


def test_the_collector_resumes_after_an_error(tmp_path, collector_on):
    path = tmp_path / "m.szt"
    path.write_bytes(b"not a checkpoint at all")
    with pytest.raises(FormatError):
        szformat.load_file(path)
    assert gc.isenabled()


def test_overlapping_loads_resume_the_collector_when_the_last_one_ends(collector_on):
    """Loads on two threads: the first to end leaves the collector paused for the other."""
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    states = {}

    def first():
        with _collector.collector_paused():
            first_in.set()
            second_in.wait(10)
        states["after first"] = gc.isenabled()
        first_out.set()

    def second():
        first_in.wait(10)
        with _collector.collector_paused():
            second_in.set()
            first_out.wait(10)
            states["inside second, first done"] = gc.isenabled()
        states["after second"] = gc.isenabled()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert states == {"after first": False, "inside second, first done": False, "after second": True}
