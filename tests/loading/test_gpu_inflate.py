"""The device inflater's plumbing: frame plans, and the nvCOMP calls' arguments and failures.

nvCOMP runs only on CUDA, so on the CPU :class:`NvcompInflater` is driven through a stand-in library that records
what it is handed: the pointers and sizes of every frame, and a status to return. On a GPU with nvCOMP installed the
real library is asked to fail (an option out of range), and must be reported as the package's own error.
"""

import ctypes
import random
import sys
from collections import namedtuple

import pytest
import torch
import zstandard

from szformat.errors import DecodeRouteError
from szformat.format.at_rest import PlanesStage, Segment
from szformat.loading import gpu_inflate
from szformat.loading.gpu_inflate import NvcompInflater, frames_of, plan_frames, plane_frames_of


def test_frames_of_offsets_frames_and_merges_adjacent_verbatim_copies():
    segments = [Segment(0, 100, 0, 40, True), Segment(100, 60, 40, 60, False), Segment(160, 30, 100, 30, False),
                Segment(200, 8, 140, 8, False)]
    frames, copies = frames_of(segments, stored_base=1000, memory_base=5000)
    assert frames.tolist() == [[1000, 40, 5000, 100]]
    assert copies.tolist() == [[1040, 5100, 90], [1140, 5200, 8]]  # the third segment is not adjacent in memory


def test_plane_frames_of_lays_byte_planes_out_plane_after_plane():
    """A frame of byte planes becomes one zstd frame per compressed plane (stored shorter than the plane) and a copy
    per run of verbatim ones, each plane at its place in the frame's memory; the last frame is shorter."""
    stage = PlanesStage(4, "sign_last", 4096, (1024, 900, 1024, 52, 100, 100, 40, 100))
    frames, copies = plane_frames_of(stage, 4496, stored_base=10, memory_base=20)
    assert frames.tolist() == [[1034, 900, 1044, 1024], [2958, 52, 3092, 1024], [3210, 40, 4316, 100]]
    assert copies.tolist() == [[10, 20, 1024], [1934, 2068, 1024], [3010, 4116, 200], [3250, 4416, 100]]
    whole = PlanesStage(2, "bytes", 4096, (2048, 2048, 2048, 2048))
    assert plane_frames_of(whole, 8192, 0, 0)[0].shape == (0, 4)
    assert plane_frames_of(whole, 8192, 0, 0)[1].tolist() == [[0, 0, 8192]]  # all verbatim: one copy
    packed = PlanesStage(2, "bytes", 4096, (7, 9))
    assert plane_frames_of(packed, 4096, 0, 0)[1].shape == (0, 3)


@pytest.mark.parametrize("seed", [random.randrange(1 << 30) for _ in range(3)])
def test_plane_frames_of_matches_the_frames_of_the_planes_segments(seed):
    """The array form against a loop over the stage's own segments: every plane where the segments put it."""
    rng = random.Random(seed)
    itemsize, frame_size = rng.choice([1, 2, 4, 8]), rng.choice([4096, 8192])
    size = itemsize * rng.randrange(1, 6 * frame_size // itemsize)
    planes = []
    for start in range(0, size, frame_size):
        plane = min(frame_size, size - start) // itemsize
        planes += [plane if rng.random() < 0.4 else rng.randrange(1, plane) if plane > 1 else plane
                   for _ in range(itemsize)]
    stage = PlanesStage(itemsize, "bytes", frame_size, tuple(planes))
    expected_frames, expected_copies = [], []
    for s in stage.segments(size):
        plane, stored = s.memory_length // itemsize, 1000 + s.stored
        for j, length in enumerate(s.planes):
            memory = 7 + s.memory + j * plane
            if length < plane:
                expected_frames.append([stored, length, memory, plane])
            elif expected_copies and expected_copies[-1][0] + expected_copies[-1][2] == stored \
                    and expected_copies[-1][1] + expected_copies[-1][2] == memory:
                expected_copies[-1][2] += plane
            else:
                expected_copies.append([stored, memory, plane])
            stored += length
    frames, copies = plane_frames_of(stage, size, 1000, 7)
    assert frames.tolist() == expected_frames and copies.tolist() == expected_copies


def test_plan_frames_gives_each_call_its_own_part_of_one_table():
    calls = [[(0, 10, 0, 100), (10, 20, 100, 300)], [], [(5, 7, 9, 11)]]
    plans = plan_frames(calls, torch.device("cpu"))
    assert [p.count for p in plans] == [2, 0, 1]
    assert plans[0].stored.tolist() == [0, 10] and plans[0].memory_lengths.tolist() == [100, 300]
    assert plans[0].max_memory_length == 300 and plans[0].memory_bytes == 400
    assert plans[2].stored_lengths.tolist() == [7] and plans[2].memory.tolist() == [9]
    assert plans[1].max_memory_length == 0 and plans[1].memory_bytes == 0
    assert plans[0].stored.untyped_storage().data_ptr() == plans[2].stored.untyped_storage().data_ptr()


class FakeNvcomp:
    """nvCOMP's two batched zstd calls, as a stand-in: the scratch size it asks for, the status each call returns,
    and what the decompress call was handed. It "inflates" by reporting each frame's inflated size as
    ``short`` bytes less than asked for the frames listed in ``short_frames``."""

    def __init__(self, *, temp: int = 64, size_status: int = 0, call_status: int = 0, short_frames=()):
        self.temp, self.size_status, self.call_status, self.short_frames = temp, size_status, call_status, short_frames
        self.calls = []

    def nvcompBatchedZstdDecompressGetTempSize(self, count, max_length, options, size_ref, total, _):
        size_ref._obj.value = self.temp
        return self.size_status

    def nvcompBatchedZstdDecompressAsync(self, inputs, stored_lengths, memory_lengths, inflated, count, temp,
                                         temp_bytes, outputs, options, statuses, stream):
        read = lambda address: list((ctypes.c_int64 * count).from_address(address))  # noqa: E731
        self.calls.append({"inputs": read(inputs), "outputs": read(outputs), "stored": read(stored_lengths),
                           "temp_bytes": temp_bytes, "stream": stream})
        sizes = (ctypes.c_int64 * count).from_address(inflated)
        for i, length in enumerate(read(memory_lengths)):
            sizes[i] = length - (1 if i in self.short_frames else 0)
        return self.call_status


Stream = namedtuple("Stream", "cuda_stream")  # hashable, as torch's streams are


@pytest.fixture
def plan_and_buffers(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream(7))
    plan = plan_frames([[(0, 10, 0, 100), (16, 20, 100, 300)]], torch.device("cpu"))[0]
    source, out = torch.zeros(64, dtype=torch.uint8), torch.zeros(400, dtype=torch.uint8)
    return plan, source, out, torch.zeros(plan.count, dtype=torch.int32)


def test_the_inflater_hands_nvcomp_each_frames_addresses_and_flags_short_frames(plan_and_buffers):
    plan, source, out, statuses = plan_and_buffers
    lib = FakeNvcomp(temp=4096, short_frames={1})
    NvcompInflater(lib).inflate(source, plan, out, statuses)
    (call,) = lib.calls
    assert call["inputs"] == [source.data_ptr(), source.data_ptr() + 16]
    assert call["outputs"] == [out.data_ptr(), out.data_ptr() + 100]
    assert call["stored"] == [10, 20] and call["temp_bytes"] >= 4096 and call["stream"] == 7
    assert statuses.tolist() == [0, 1]


@pytest.mark.parametrize("failing", ["size_status", "call_status"])
def test_an_nvcomp_api_error_is_the_packages_error(plan_and_buffers, failing):
    plan, source, out, statuses = plan_and_buffers
    lib = FakeNvcomp(**{failing: 11})
    with pytest.raises(DecodeRouteError, match=r"nvCOMP .* 2 zstd frames \(status 11\)"):
        NvcompInflater(lib).inflate(source, plan, out, statuses)


def test_scratch_is_kept_per_stream_until_released(plan_and_buffers):
    plan, source, out, statuses = plan_and_buffers
    inflater = NvcompInflater(FakeNvcomp(temp=1000))
    inflater.inflate(source, plan, out, statuses)
    (scratch,) = inflater._temp.values()
    inflater.inflate(source, plan, out, statuses)
    assert list(inflater._temp.values()) == [scratch]  # reused, not grown
    inflater.release()
    assert not inflater._temp


@pytest.mark.skipif(not torch.cuda.is_available() or gpu_inflate.nvcomp_library() is None,
                    reason="needs CUDA and nvCOMP")
def test_nvcomp_itself_inflates_and_its_refusals_raise(monkeypatch):
    payload = torch.randint(0, 16, (3 << 20,), dtype=torch.uint8).numpy().tobytes()
    frames = [zstandard.ZstdCompressor(level=1, write_content_size=True).compress(payload[i: i + (1 << 20)])
              for i in range(0, len(payload), 1 << 20)]
    stored, memory, calls = 0, 0, []
    for frame in frames:
        calls.append((stored, len(frame), memory, 1 << 20))
        stored, memory = stored + len(frame), memory + (1 << 20)
    device = torch.device("cuda")
    source = torch.frombuffer(bytearray(b"".join(frames)), dtype=torch.uint8).to(device)
    plan = plan_frames([calls], device)[0]
    out = torch.zeros(len(payload), dtype=torch.uint8, device=device)
    statuses = torch.zeros(plan.count, dtype=torch.int32, device=device)
    inflater = gpu_inflate.nvcomp_inflater()
    inflater.inflate(source, plan, out, statuses)
    assert statuses.tolist() == [0] * plan.count
    assert bytes(out.cpu().numpy()) == payload
    inflater._options = gpu_inflate.DecompressOptions(99)  # no such backend: an out-of-range option
    with pytest.raises(DecodeRouteError, match=r"nvCOMP .* \(status 1\d\)"):
        inflater.inflate(source, plan, out, statuses)


def test_an_nvcomp_older_than_6_is_passed_over_with_a_warning(tmp_path, monkeypatch, caplog):
    """nvCOMP 5 names and types its zstd calls otherwise: its library is passed over (the readers inflate on the
    host) with a warning naming it, instead of an AttributeError when a load first asks for nvCOMP. Stand-in: a
    shared library that loads but has none of nvCOMP 6's calls (this package's C extension), where nvCOMP's wheel
    puts its library."""
    native = pytest.importorskip("szformat.codec._native")
    old = tmp_path / "nvidia" / "libnvcomp" / "lib64" / "libnvcomp.so.5"
    old.parent.mkdir(parents=True)
    old.symlink_to(native.__file__)
    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    monkeypatch.setattr(gpu_inflate, "_NVCOMP", False)
    with caplog.at_level("WARNING", logger=gpu_inflate.__name__):
        lib = gpu_inflate.nvcomp_library()
    assert lib is None or lib._name != str(old)  # a real nvCOMP 6 on the loader's path may still be found
    assert str(old) in caplog.text and "nvCOMP >= 6" in caplog.text
