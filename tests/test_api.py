"""``safe_open`` / ``load_file`` / ``save_file``: the safetensors-shaped API, bit for bit."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

import szformat.format.writer as writer_module
import szformat.loading.host_reader as host_reader
from szformat.codec import cpu as cpu_codec
from szformat import SzformatError, load_file, safe_open, save_file
from szformat.format.writer import tensor_bytes
from szformat.errors import ChecksumMismatchError, ConversionError, FormatError, PayloadError, RoundTripError
from szformat.format import constants as C
from szformat.format.reader import SztFile
from szformat.loading import host_decode

ROOT = Path(__file__).resolve().parents[1]


def bf16_weight(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=g) * 0.02).to(torch.bfloat16)


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A tensor of ``dtype`` holding random bit patterns (NaNs included for float types)."""
    g = torch.Generator().manual_seed(seed)
    count = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (count,), generator=g, dtype=torch.uint8)
    if dtype == torch.bool:
        raw &= 1
    return raw.view(dtype).reshape(shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(tensor_bytes(a), tensor_bytes(b))


EVERY_DTYPE = {f"t.{name.lower()}": random_bits((3, 5), dtype, seed=i)
               for i, (name, (dtype, _)) in enumerate(C.DTYPES.items()) if dtype is not None}

MODEL = {
    "weight": bf16_weight(300, 301, seed=1),
    "noise": random_bits((40, 50), torch.bfloat16, seed=2),
    "tiny": torch.tensor([1.0, 2.0], dtype=torch.bfloat16),
    "fp8": bf16_weight(64, 64, seed=3).float().to(torch.float8_e4m3fn),
    "bias": torch.linspace(-1, 1, 301),
    "empty": torch.zeros(0, 3, dtype=torch.bfloat16),
    "scalar": torch.tensor(7, dtype=torch.int64),
}


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / "model.szt"
    save_file(MODEL, path, metadata={"format": "pt", "source": "test"})
    return path


# ---------------------------------------------------------------------------------------------------------------
# save_file / load_file
# ---------------------------------------------------------------------------------------------------------------


def test_round_trip_of_every_dtype(tmp_path):
    path = tmp_path / "all.szt"
    save_file(EVERY_DTYPE, path)
    loaded = load_file(path)
    assert list(loaded) == list(EVERY_DTYPE)
    for name, t in EVERY_DTYPE.items():
        assert same_bits(loaded[name], t), name


def test_round_trip_of_a_model_and_its_encodings(model_file):
    loaded = load_file(model_file)
    for name, t in MODEL.items():
        assert same_bits(loaded[name], t), name
    with safe_open(model_file, framework="pt") as f:
        encodings = {name: (f.entry(name).encoding, f.entry(name).raw_reason) for name in f.keys()}
    assert encodings["weight"] == ("splitzip", None)
    assert encodings["noise"][0] == "raw" and encodings["noise"][1].startswith("coverage 0.")
    assert encodings["tiny"] == ("raw", "payload not smaller")
    assert encodings["fp8"] == ("raw", "FP8 would expand")
    assert encodings["bias"] == ("raw", "dtype F32 is not encoded")
    assert encodings["empty"] == ("raw", "empty")


def test_compressed_file_is_smaller_than_the_raw_bytes(tmp_path):
    path = tmp_path / "w.szt"
    weight = bf16_weight(512, 512, seed=4)
    save_file({"w": weight}, path)
    assert path.stat().st_size < 0.8 * weight.numel() * 2


def test_non_contiguous_and_offset_views_are_stored_by_value(tmp_path):
    base = bf16_weight(64, 128, seed=5)
    tensors = {"transposed": base.t(), "strided": base[::2, 1::3], "tail": base.reshape(-1)[17:1000]}
    save_file(tensors, tmp_path / "v.szt")
    loaded = load_file(tmp_path / "v.szt")
    for name, t in tensors.items():
        assert same_bits(loaded[name], t.contiguous()), name


def test_metadata_is_carried_through(tmp_path, model_file):
    with safe_open(model_file, framework="pt") as f:
        assert f.metadata() == {"format": "pt", "source": "test"}
    save_file({"a": torch.zeros(1)}, tmp_path / "none.szt")
    save_file({"a": torch.zeros(1)}, tmp_path / "empty.szt", metadata={})
    with safe_open(tmp_path / "none.szt", framework="pt") as f:
        assert f.metadata() is None
    with safe_open(tmp_path / "empty.szt", framework="pt") as f:
        assert f.metadata() == {}


@pytest.mark.parametrize("tensors, reason", [
    ({5: torch.zeros(1)}, "non-empty string"),
    ({"a\x00": torch.zeros(1)}, "NUL"),
    ({"a": [1.0]}, "value is a list, not a torch.Tensor"),
    ({"a": torch.zeros(2, dtype=torch.complex128)}, "dtype torch.complex128 cannot be stored"),
    ({"a": torch.zeros(2).to_sparse()}, "convert it with .to_dense() first"),
])
def test_save_file_refuses_bad_arguments_before_writing(tmp_path, tensors, reason):
    with pytest.raises(ConversionError, match=re.escape(reason)) as info:
        save_file(tensors, tmp_path / "m.szt")
    assert isinstance(info.value, ValueError) and "m.szt" in str(info.value)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("failure", [KeyboardInterrupt, RuntimeError, "round_trip"])
def test_save_file_is_atomic(tmp_path, monkeypatch, failure):
    path = tmp_path / "model.szt"
    path.write_bytes(b"the previous file")
    real = writer_module.encode_tensor
    calls = []

    def failing(raw, dtype, **kw):
        calls.append(dtype)
        if len(calls) == 3:  # after two tensors were written
            if failure == "round_trip":
                raise writer_module.RoundTripMismatch("SplitZip payload does not decode bit for bit")
            raise failure("interrupted")
        return real(raw, dtype, **kw)

    monkeypatch.setattr(writer_module, "encode_tensor", failing)
    expected = RoundTripError if failure == "round_trip" else failure
    with pytest.raises(expected) as info:
        save_file(MODEL, path)
    if failure == "round_trip":
        assert info.value.tensor == "tiny" and "model.szt" in str(info.value)
    assert len(calls) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.szt"]
    assert path.read_bytes() == b"the previous file"


def test_save_file_replaces_an_existing_file(tmp_path):
    path = tmp_path / "m.szt"
    save_file({"a": torch.zeros(3)}, path)
    save_file({"b": torch.ones(2)}, path)
    assert list(load_file(path)) == ["b"]


# ---------------------------------------------------------------------------------------------------------------
# safe_open
# ---------------------------------------------------------------------------------------------------------------


def test_safe_open_refuses_a_sharded_index_naming_it(tmp_path):
    index = tmp_path / "model.szt.index.json"
    index.write_text('{"weight_map": {}}')
    with pytest.raises(FormatError, match="is a sharded index; open one of its .szt files, or use load_file") as e:
        safe_open(index, framework="pt")
    assert e.value.path == str(index) and isinstance(e.value, ValueError)


def test_keys_are_in_file_order_and_entries_describe_the_tensors(model_file):
    with safe_open(model_file, framework="pt") as f:
        assert f.keys() == list(MODEL)
        for name, t in MODEL.items():
            e = f.entry(name)
            assert e.shape == tuple(t.shape) and e.dtype == C.TORCH_TO_DTYPE[t.dtype]
        with pytest.raises(KeyError, match="tensor 'missing': no such tensor in this file") as info:
            f.get_tensor("missing")
        assert isinstance(info.value, SzformatError) and info.value.tensor == "missing"


def test_framework_other_than_pytorch_is_refused(model_file):
    with pytest.raises(ValueError, match="framework 'np' is not supported"):
        safe_open(model_file, framework="np")


def test_descriptor_says_where_the_bytes_are(model_file):
    data = model_file.read_bytes()
    with safe_open(model_file, framework="pt") as f:
        d = f.descriptor("weight")
        e = f.entry("weight")
        assert (d.path, d.name, d.dtype, d.shape, d.encoding) == (model_file, "weight", "BF16", (300, 301), "splitzip")
        assert (d.offset, d.length, d.raw_length, d.layout, d.codebook) == (
            e.offset, e.length, e.raw_length, e.layout, e.codebook)
        assert d.offset % C.DEFAULT_ALIGNMENT == 0 and d.length == d.layout.comp_bytes
        assert d.crc32 == zlib.crc32(data[d.offset: d.offset + d.length])
        assert d.raw_crc32 == zlib.crc32(tensor_bytes(MODEL["weight"]).numpy())


def test_payload_is_a_zero_copy_view_of_the_mapping(model_file):
    data = model_file.read_bytes()
    with SztFile(model_file) as f:
        whole = torch.frombuffer(memoryview(f.buffer), dtype=torch.uint8)
        assert whole.numel() == len(data)
        for name in ("weight", "bias"):
            e = f.entry(name)
            view = f.payload(name)
            assert view.dtype == torch.uint8 and view.numel() == e.length
            assert view.data_ptr() == whole.data_ptr() + e.offset
            assert view.data_ptr() % C.DEFAULT_ALIGNMENT == 0  # page-aligned: mmap base + aligned offset
            assert bytes(view.numpy()) == data[e.offset: e.offset + e.length]
    del whole
    assert bytes(view.numpy()) == data[e.offset: e.offset + e.length]  # the view keeps the pages mapped
    with safe_open(model_file, framework="pt") as f:
        first, second = f.payload("weight"), f.payload("bias")
        assert second.data_ptr() - first.data_ptr() == f.entry("bias").offset - f.entry("weight").offset


def test_get_tensor_returns_independent_writable_tensors(model_file):
    with safe_open(model_file, framework="pt") as f:
        t = f.get_tensor("bias")
        t += 1
        assert same_bits(f.get_tensor("bias"), MODEL["bias"])


ROW_INDICES = [
    slice(None), slice(2, 5), slice(-3, None), slice(None, -290), slice(5, 2), slice(300, 400), slice(0, 0),
    slice(0, None, 7), slice(-10, None, 3), slice(1, 50, 2), 0, 299, -1, -300, (slice(1, 4), 2),
    (slice(1, 4), slice(5, -5, 2)), (3, slice(None, 4)), (-2, -1), ..., (..., 0), (), [0, 2, 2], None,
    (None, slice(1, 3)), torch.tensor([1, 0]), torch.tensor(4),
]


@pytest.mark.parametrize("verify", [True, False])  # without verify a slice reads only the bytes it decodes
@pytest.mark.parametrize("name", ["weight", "bias", "noise"])
@pytest.mark.parametrize("index", ROW_INDICES, ids=repr)
def test_get_slice_matches_indexing_the_whole_tensor(model_file, name, index, verify):
    full = MODEL[name]
    with safe_open(model_file, framework="pt", verify=verify) as f:
        sliced = f.get_slice(name)
        assert sliced.get_shape() == list(full.shape) and sliced.get_dtype() == C.TORCH_TO_DTYPE[full.dtype]
        try:
            want = full[index]
        except IndexError:
            with pytest.raises(IndexError):
                sliced[index]
            return
        assert same_bits(sliced[index], want.contiguous())


@pytest.mark.parametrize("index", [300, -301, slice(None, None, -1), (0, 301)])
def test_get_slice_refuses_what_torch_refuses(model_file, index):
    with pytest.raises((IndexError, ValueError)) as torch_refusal:
        MODEL["weight"][index]
    with safe_open(model_file, framework="pt") as f:
        with pytest.raises(type(torch_refusal.value)):
            f.get_slice("weight")[index]


def test_get_slice_of_scalars_and_empty_tensors(model_file):
    with safe_open(model_file, framework="pt") as f:
        scalar = f.get_slice("scalar")
        assert scalar.get_shape() == []
        assert same_bits(scalar[()], MODEL["scalar"]) and same_bits(scalar[...], MODEL["scalar"])
        with pytest.raises(IndexError):
            scalar[0]
        empty = f.get_slice("empty")
        assert same_bits(empty[:], MODEL["empty"]) and empty[:, 1].shape == (0,)


def test_get_slice_decodes_only_the_rows_it_needs(model_file, monkeypatch):
    ranges = []
    real = cpu_codec.PayloadDecoder.decode

    def spy(self, start, stop, out, **kwargs):
        ranges.append((start, stop))
        return real(self, start, stop, out, **kwargs)

    monkeypatch.setattr(cpu_codec.PayloadDecoder, "decode", spy)
    with safe_open(model_file, framework="pt") as f:
        rows = f.get_slice("weight")
        assert same_bits(rows[10:13], MODEL["weight"][10:13])
        assert same_bits(rows[-1], MODEL["weight"][-1])
        assert same_bits(rows[4:40:9], MODEL["weight"][4:40:9])
    assert ranges == [(10 * 301, 13 * 301), (299 * 301, 300 * 301), (4 * 301, 40 * 301)]


@pytest.mark.parametrize("route", ["mapped", "pread"])
def test_get_slice_without_verify_reads_only_the_bytes_of_its_rows(model_file, monkeypatch, route):
    """Copied out with ``pread``: the rows' ``pk`` and ``sm`` bytes and the escape streams. Through the mapping
    (the C kernels' guarded decode): the bytes around the streams are read, the rows' streams viewed."""
    if route == "mapped" and not host_decode.mapped_reads(False):
        pytest.skip("stored bytes are copied out with pread here")
    if route == "pread":
        monkeypatch.setattr(host_decode, "mapped_reads", lambda checked: False)
    reads, views = [], []
    real_read, real_mapped = SztFile.read, SztFile.mapped

    def read(self, name, start=0, stop=None, **kwargs):
        reads.append((name, start, stop))
        return real_read(self, name, start, stop, **kwargs)

    monkeypatch.setattr(SztFile, "read", read)
    monkeypatch.setattr(SztFile, "mapped", lambda self, name, a, b: views.append((name, a, b))
                        or real_mapped(self, name, a, b))
    with safe_open(model_file, framework="pt", verify=False) as f:
        e = f.entry("weight")
        assert same_bits(f.get_slice("weight")[10:13], MODEL["weight"][10:13])
        assert same_bits(f.get_slice("bias")[7:9], MODEL["bias"][7:9])
    layout = e.layout
    rows = [("weight", 10 * 301 // 2, (13 * 301 + 1) // 2),
            ("weight", layout.off_sm + 10 * 301, layout.off_sm + 13 * 301)]
    if route == "pread":
        assert (reads, views) == (rows + [("weight", layout.off_cid, layout.comp_bytes), ("bias", 7 * 4, 9 * 4)], [])
    else:
        assert reads == [("weight", layout.off_pk + layout.n_pairs, layout.off_sm),
                         ("weight", layout.off_sm + layout.n, e.length), ("bias", 7 * 4, 9 * 4)]
        assert views == rows


# ---------------------------------------------------------------------------------------------------------------
# verify
# ---------------------------------------------------------------------------------------------------------------


def _corrupt_sm_byte(source: Path, target: Path, element: int) -> None:
    """Copy a file, flipping the sign bit of one element of ``weight`` (in the ``sm`` stream)."""
    with safe_open(source, framework="pt") as f:
        e = f.entry("weight")
        at = e.offset + e.layout.off_sm + element
    data = bytearray(source.read_bytes())
    data[at] ^= 0x80
    target.write_bytes(bytes(data))


def test_verify_detects_corrupted_stored_bytes(model_file, tmp_path):
    bad = tmp_path / "bad.szt"
    _corrupt_sm_byte(model_file, bad, element=1234)
    with safe_open(bad, framework="pt") as f:
        assert same_bits(f.get_tensor("bias"), MODEL["bias"])  # other tensors still load
        with pytest.raises(ChecksumMismatchError, match="stored bytes") as info:
            f.get_tensor("weight")
        assert info.value.tensor == "weight" and "bad.szt" in str(info.value)
        with pytest.raises(ChecksumMismatchError):
            f.get_slice("weight")[0]
    with pytest.raises(SzformatError):
        load_file(bad)


@pytest.mark.parametrize("name, rows", [("weight", slice(200, 210)), ("weight", slice(299, 300)),
                                        ("bias", slice(0, 2)), ("bias", slice(300, 301))])
def test_a_slice_far_from_a_corrupted_byte_is_refused(model_file, tmp_path, monkeypatch, name, rows):
    """A part read checks its tensor's whole stored payload (the bytes outside the part read through a small
    buffer): a flipped byte far from the rows asked for is found, named, and no rows are returned."""
    from szformat.loading import host_reader

    monkeypatch.setattr(host_reader, "CHECK_PIECE", 256)  # many pieces, the corrupted one among the passing ones
    with safe_open(model_file, framework="pt") as f:
        e = f.entry(name)
        at = e.offset + (e.layout.off_sm + 1234 if name == "weight" else 5 * 4 + 1)  # row 4 / element 5
    data = bytearray(model_file.read_bytes())
    data[at] ^= 0x80
    bad = tmp_path / "bad.szt"
    bad.write_bytes(bytes(data))
    with safe_open(bad, framework="pt") as f:
        with pytest.raises(ChecksumMismatchError, match="stored bytes") as info:
            f.get_slice(name)[rows]
        assert info.value.tensor == name and "bad.szt" in str(info.value)
    with safe_open(bad, framework="pt", verify=False) as f:  # the rows themselves were intact
        assert same_bits(f.get_slice(name)[rows], MODEL[name][rows])


def test_verify_false_skips_checksums_but_not_structure(model_file, tmp_path):
    bad = tmp_path / "bad.szt"
    _corrupt_sm_byte(model_file, bad, element=1234)
    with safe_open(bad, framework="pt", verify=False) as f:
        got = f.get_tensor("weight").reshape(-1)
    want = MODEL["weight"].reshape(-1)
    differs = (got.view(torch.int16) != want.view(torch.int16)).nonzero().reshape(-1).tolist()
    assert differs == [1234] and got[1234] == -want[1234]

    broken = tmp_path / "broken.szt"
    sixteen_exponents_and_an_escape = [2.0 ** k for k in range(-8, 8)] * 100 + [1e30]
    save_file({"w": torch.tensor(sixteen_exponents_and_an_escape, dtype=torch.bfloat16)}, broken)
    with safe_open(broken, framework="pt") as f:
        e = f.entry("w")
    assert e.encoding == "splitzip" and e.layout.n_esc > 0
    data = bytearray(broken.read_bytes())
    data[e.offset + e.layout.off_cid] = 0x7F  # chunk id far out of range
    broken.write_bytes(bytes(data))
    with safe_open(broken, framework="pt", verify=False) as f:
        with pytest.raises(PayloadError, match="chunk id out of range"):
            f.get_tensor("w")


def test_stored_bytes_are_verified_once_per_open_file(model_file, monkeypatch):
    checked = []
    real = host_reader.check_crc

    def spy(*args, **kwargs):
        checked.append((kwargs["tensor"], kwargs["what"]))
        return real(*args, **kwargs)

    real_compare = host_decode.compare_crc

    def compare_spy(actual, expected, *, what, path, tensor):
        checked.append((tensor, what))
        return real_compare(actual, expected, what=what, path=path, tensor=tensor)

    real_payload = host_decode.check_decoded_payload

    def payload_spy(entry, stored, decoded, error, *, path, check_stored, check_decoded):
        checked.extend([(entry.name, "stored bytes")] * check_stored + [(entry.name, "decoded bytes")] * check_decoded)
        return real_payload(entry, stored, decoded, error, path=path, check_stored=check_stored,
                            check_decoded=check_decoded)

    monkeypatch.setattr(host_reader, "check_crc", spy)
    monkeypatch.setattr(host_reader, "compare_crc", compare_spy)  # a part read checks the whole payload as it goes
    monkeypatch.setattr(host_decode, "check_crc", spy)
    monkeypatch.setattr(host_decode, "compare_crc", compare_spy)
    monkeypatch.setattr(host_decode, "check_decoded_payload", payload_spy)  # small tensors decoded together
    with safe_open(model_file, framework="pt") as f:
        f.get_slice("weight")[0:2]
        f.get_slice("weight")[5]
        f.get_tensor("weight")
        f.get_tensor("bias")
        f.get_tensor("bias")
    assert checked == [("weight", "stored bytes"), ("weight", "decoded bytes"), ("bias", "stored bytes")]


# ---------------------------------------------------------------------------------------------------------------
# a file truncated by another process while it is read
# ---------------------------------------------------------------------------------------------------------------

TRUNCATE_WHILE_READING = """
import os, sys
import szformat, szformat.loading.host_decode as host_decode, szformat.loading.host_reader as host_reader
from szformat.errors import TruncatedFileError

path, how = sys.argv[1], sys.argv[2]


def truncating_first(real):
    def call(*args, **kwargs):  # as another process would, just before the stored bytes are read
        os.truncate(path, 4096)
        return real(*args, **kwargs)
    return call


host_reader.check_crc = truncating_first(host_reader.check_crc)  # reads the bytes it checks
host_decode.decode_payloads = truncating_first(host_decode.decode_payloads)  # small tensors read through the mapping
if hasattr(os, "preadv"):
    os.preadv = truncating_first(os.preadv)
try:
    if how == "load_file":
        szformat.load_file(path)
    else:
        with szformat.safe_open(path, framework="pt") as f:
            f.get_tensor("weight") if how == "get_tensor" else f.get_slice("weight")[100:200]
except TruncatedFileError as e:
    print(type(e).__name__, e.tensor)
"""


@pytest.mark.parametrize("how", ["get_tensor", "get_slice", "load_file"])
def test_a_file_truncated_while_it_is_read_is_an_error_not_a_signal(tmp_path, how):
    path = tmp_path / "model.szt"
    save_file({"weight": bf16_weight(1024, 1024, seed=5)}, path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", TRUNCATE_WHILE_READING, str(path), how], env=env,
                         capture_output=True, text=True, timeout=300)
    assert (run.returncode, run.stdout) == (0, "TruncatedFileError weight\n"), run.stderr  # SIGBUS: -7


TRUNCATE_UNDER_A_MAPPED_DECODE = """
import os, sys
import szformat
import szformat.loading.host_decode as host_decode
import szformat.loading.host_reader as host_reader
from szformat.codec.cpu import PayloadDecoder
from szformat.errors import ReadError, TruncatedFileError

path, how, verify, cut = sys.argv[1], sys.argv[2], sys.argv[3] == "verify", sys.argv[4] == "cut"


def failing_first(real):
    def call(*args, **kwargs):  # the file cut short by another process once the mapped reads start
        if cut:
            os.truncate(path, 4096)
            return real(*args, **kwargs)
        error = EOFError("a page could not be read")  # what the C calls raise where the disk fails
        error.item = 0  # the payload it was on, where the call took several
        raise error
    return call


host_decode.decode_payloads = failing_first(host_decode.decode_payloads)
PayloadDecoder.decode_range = failing_first(PayloadDecoder.decode_range)
PayloadDecoder.decode_columns = failing_first(PayloadDecoder.decode_columns)
host_reader.guarded_crc32 = failing_first(host_reader.guarded_crc32)
try:
    if how == "load_file":
        szformat.load_file(path, verify=verify)
    elif how == "columns":  # what a row-parallel rank of vLLM reads
        import torch
        from szformat.format.reader import SztFile
        from szformat.integrations.deferred import DecodeCounter, DeferredTensor
        with SztFile(path) as f:
            weight = DeferredTensor(host_reader.HostReader(f, verify=verify), f.entry("weight"), DecodeCounter())
            shard = weight.narrow(1, 512, 512)
            torch.empty(shard.shape, dtype=shard.dtype).copy_(shard)
    else:
        with szformat.safe_open(path, framework="pt", verify=verify) as f:
            f.get_slice("weight")[1000:1500]
except (TruncatedFileError, ReadError) as e:
    print(type(e).__name__, e.tensor, os.path.basename(e.path))
"""


@pytest.mark.parametrize("how", ["load_file", "get_slice", "columns"])
@pytest.mark.parametrize("verify", ["verify", "no verify"])
@pytest.mark.parametrize("cut", ["cut", "disk error"])
def test_reads_from_the_mapping_turn_a_lost_page_into_an_error_not_a_signal(tmp_path, how, verify, cut):
    """A tensor of several ranges (load_file: the C call that shares its units between its threads), rows of a tensor
    (get_slice, as a column-parallel rank reads them) or columns of its rows (a row-parallel rank) are decoded, and
    checksummed, straight from the file's mapping by C calls that catch SIGBUS: a file truncated meanwhile is a
    TruncatedFileError, a page the disk fails to deliver a ReadError (an OSError)."""
    if not host_decode.mapped_reads(verify == "verify"):
        pytest.skip("stored bytes are copied out with pread here")
    path = tmp_path / "model.szt"
    save_file({"weight": bf16_weight(2048, 1536, seed=6)}, path)  # 3 Mi elements: two ranges
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", TRUNCATE_UNDER_A_MAPPED_DECODE, str(path), how, verify, cut],
                         env=env, capture_output=True, text=True, timeout=300)
    error = "TruncatedFileError" if cut == "cut" else "ReadError"
    assert (run.returncode, run.stdout) == (0, f"{error} weight model.szt\n"), run.stderr  # SIGBUS: -7


TRUNCATE_UNDER_A_BATCHED_DECODE = """
import os, sys
import szformat
import szformat.loading.host_decode as host_decode
from szformat.errors import ReadError, TruncatedFileError
from szformat.format.reader import SztFile

path, cut = sys.argv[1], sys.argv[2] == "cut"
with SztFile(path) as f:
    third = f.entry("w2")
real = host_decode.decode_payloads


def failing(payloads, **kwargs):
    if cut:  # another process cuts the file inside the third tensor's payload once the call has its views
        os.truncate(path, third.offset + 4096)
        return real(payloads, **kwargs)
    error = EOFError("a page could not be read")  # what the C call raises where the disk fails, on the second
    error.item = 1
    raise error


host_decode.decode_payloads = failing
try:
    szformat.load_file(path)
except (TruncatedFileError, ReadError) as e:
    print(type(e).__name__, e.tensor, os.path.basename(e.path))
"""


@pytest.mark.parametrize("cut", ["cut", "disk error"])
def test_a_page_lost_under_a_batch_of_small_tensors_names_its_tensor(tmp_path, cut):
    """Small tensors decoded together by one guarded C call: a page the file lost meanwhile is TruncatedFileError,
    one the disk fails to deliver ReadError, each naming the tensor whose page it was, not the batch's first."""
    if not host_decode.mapped_reads(True):
        pytest.skip("stored bytes are copied out with pread here")
    path = tmp_path / "model.szt"
    save_file({f"w{k}": bf16_weight(256, 512, seed=k) for k in range(4)}, path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", TRUNCATE_UNDER_A_BATCHED_DECODE, str(path), cut],
                         env=env, capture_output=True, text=True, timeout=300)
    expected = "TruncatedFileError w2" if cut == "cut" else "ReadError w1"
    assert (run.returncode, run.stdout) == (0, f"{expected} model.szt\n"), run.stderr  # SIGBUS: -7


A_FAULT_OUTSIDE_THE_GUARD = """
import faulthandler, mmap, os, sys
import numpy as np
from szformat.codec import _native

if sys.argv[1] == "faulthandler":
    faulthandler.enable()
path = sys.argv[2]
with open(path, "wb") as f:
    f.write(bytes(3 << 20))
mapping = memoryview(mmap.mmap(os.open(path, os.O_RDONLY), 0, access=mmap.ACCESS_READ))
out, no_escapes = np.empty(1 << 20, np.int16), (np.zeros(0, np.int64), b"")
os.truncate(path, 4096)
for _ in range(2):
    try:
        _native.decode_range(mapping[: 1 << 19], mapping[1 << 20: 2 << 20], bytes(16), out, *no_escapes, False)
    except EOFError:
        print("caught", flush=True)
print(np.frombuffer(mapping[1 << 20:], np.uint8).sum())  # read outside a guarded call: the process ends
"""


@pytest.mark.parametrize("handler", ["faulthandler", "default"])
def test_the_fault_guard_catches_its_own_reads_only(tmp_path, handler):
    """The SIGBUS handler the guarded calls install catches faults inside them, and hands any other to what handled
    SIGBUS before (Python's faulthandler, or the default action): a crash stays a crash, and never loops."""
    pytest.importorskip("szformat.codec._native")
    if not cpu_codec._native or not cpu_codec._native.guards_mapped_reads():
        pytest.skip("no fault guard on this platform")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", A_FAULT_OUTSIDE_THE_GUARD, handler, str(tmp_path / "cut.bin")],
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.stdout == "caught\ncaught\n" and run.returncode == -7, (run.returncode, run.stdout, run.stderr)
    assert ("Fatal Python error: Bus error" in run.stderr) == (handler == "faulthandler")


def test_common_mistakes_raise_the_package_errors_callers_already_catch(tmp_path):
    """Each also subclasses the builtin a caller would catch (FileNotFoundError, ValueError, KeyError)."""
    from szformat.errors import CheckpointNotFoundError, ClosedFileError, InvalidArgumentError

    with pytest.raises(CheckpointNotFoundError, match="absent.szt': no such file") as missing:
        load_file(tmp_path / "absent.szt")
    assert isinstance(missing.value, FileNotFoundError)
    save_file({"w": torch.zeros(4, dtype=torch.bfloat16)}, tmp_path / "w.szt")
    with pytest.raises(InvalidArgumentError, match="framework 'np' is not supported; use 'pt'"):
        safe_open(tmp_path / "w.szt", framework="np")
    f = safe_open(tmp_path / "w.szt", framework="pt")
    f.close()
    with pytest.raises(ClosedFileError, match="the file is closed") as closed:
        f.get_tensor("w")
    assert isinstance(closed.value, ValueError)
    with pytest.raises(ConversionError, match="tensor 'w': tensor is on the meta device and holds no values"):
        save_file({"w": torch.empty(3, device="meta")}, tmp_path / "meta.szt")
    assert not (tmp_path / "meta.szt").exists()
