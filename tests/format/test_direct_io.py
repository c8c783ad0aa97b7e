"""Large outputs appended with direct I/O: the same bytes as through the page cache, whatever the file system says,
and a full disk or an interruption still leaves nothing behind."""

from __future__ import annotations

import errno
import os
import random
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file as save_safetensors

from szformat.convert import convert, decompress
from szformat.errors import WriteError
from szformat.format import atomic, direct_io
from szformat.format.atomic import AtomicFile

pytestmark = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="direct I/O is Linux's")

STAGING = 3 * direct_io.BLOCK


@pytest.fixture
def small_buffers(monkeypatch):
    """Direct appends from the 5,000th byte on, through staging buffers of three blocks: every path (the switch
    in the middle of a block, buffers handed over, a padded last block) on a small file."""
    monkeypatch.setattr(direct_io, "STAGING_BYTES", STAGING)
    monkeypatch.setattr(atomic, "DIRECT_FROM_BYTES", 5000)
    monkeypatch.delenv("SZFORMAT_DIRECT_IO", raising=False)


@pytest.fixture
def pwrites(monkeypatch):
    """Every ``os.pwrite``: whether its file was in direct mode, and how many bytes it was handed."""
    calls: list[tuple[bool, int]] = []
    real = os.pwrite

    def recorded(fd, data, offset):
        import fcntl

        calls.append((bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT), memoryview(data).nbytes))
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", recorded)
    return calls


def direct_io_works(folder: Path) -> bool:
    """Whether ``folder``'s file system takes an ``O_DIRECT`` write (tmpfs before Linux 6.6 does not)."""
    import mmap

    path = folder / "probe"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError:
        return False
    try:
        os.pwrite(fd, mmap.mmap(-1, direct_io.BLOCK), 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        path.unlink()


def write_pieces(path: Path, data: bytes, seed: int, *, patch: bytes = b"PATCH") -> bytes:
    """Append ``data`` in pieces of random sizes, overwrite its start with ``patch``, commit; the bytes expected."""
    rng = random.Random(seed)
    with AtomicFile(path) as f:
        pos = 0
        while pos < len(data):
            take = rng.choice([1, 7, 100, direct_io.BLOCK, STAGING - 1, STAGING + 5, 3 * STAGING])
            f.write(memoryview(data)[pos: pos + take])
            pos += take
        f.write(patch, at=0)
        f.commit()
    return patch + data[len(patch):]


@pytest.mark.parametrize("size", [5000, 5001, 2 * STAGING, 10 * STAGING + 123])
def test_direct_appends_give_the_bytes_written(tmp_path, small_buffers, pwrites, size):
    if not direct_io_works(tmp_path):
        pytest.skip(f"{tmp_path}'s file system refuses O_DIRECT: the fallback tests cover it")
    seed = random.randrange(1 << 30)
    data = random.Random(seed).randbytes(size)
    expected = write_pieces(tmp_path / "out.bin", data, seed)
    assert (tmp_path / "out.bin").read_bytes() == expected, f"seed {seed}"
    direct = [n for is_direct, n in pwrites if is_direct]
    assert direct and all(n % direct_io.BLOCK == 0 for n in direct)
    assert [p.name for p in tmp_path.iterdir()] == ["out.bin"]


def test_a_small_output_goes_through_the_page_cache(tmp_path, small_buffers, pwrites):
    expected = write_pieces(tmp_path / "out.bin", bytes(range(256)) * 19, 1)  # 4,864 bytes, under the 5,000
    assert (tmp_path / "out.bin").read_bytes() == expected
    assert not any(is_direct for is_direct, _ in pwrites)


def test_direct_io_can_be_turned_off(tmp_path, small_buffers, pwrites, monkeypatch):
    monkeypatch.setenv("SZFORMAT_DIRECT_IO", "0")
    data = random.Random(2).randbytes(5 * STAGING)
    expected = write_pieces(tmp_path / "out.bin", data, 2)
    assert (tmp_path / "out.bin").read_bytes() == expected
    assert not any(is_direct for is_direct, _ in pwrites)


def test_a_file_system_that_refuses_direct_io_gets_the_same_bytes(tmp_path, small_buffers, pwrites, monkeypatch):
    def refuse(fd, on):
        if on:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))

    monkeypatch.setattr(direct_io, "_set_direct", refuse)
    data = random.Random(3).randbytes(7 * STAGING + 11)
    expected = write_pieces(tmp_path / "out.bin", data, 3)
    assert (tmp_path / "out.bin").read_bytes() == expected
    assert not any(is_direct for is_direct, _ in pwrites)


def test_a_refused_direct_write_goes_through_the_page_cache(tmp_path, small_buffers, monkeypatch):
    """Some file systems take ``O_DIRECT`` at ``fcntl`` and refuse the write: it is written again without it."""
    import fcntl

    real, refused = os.pwrite, []

    def pwrite(fd, data, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(offset)
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    data = random.Random(4).randbytes(6 * STAGING + 3)
    expected = write_pieces(tmp_path / "out.bin", data, 4)
    assert (tmp_path / "out.bin").read_bytes() == expected
    assert len(refused) == 1  # the first refusal turns direct I/O off for the rest of the file


@pytest.mark.parametrize("budget", [0, STAGING, 4 * STAGING])
def test_a_full_disk_during_direct_writes_is_a_write_error_and_leaves_nothing(tmp_path, small_buffers, monkeypatch,
                                                                                budget):
    real, left = os.pwrite, [budget]

    def pwrite(fd, data, offset):
        size = memoryview(data).nbytes
        if size > left[0]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        left[0] -= size
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    target = tmp_path / "out.bin"
    target.write_bytes(b"the user's own")
    with pytest.raises(WriteError, match="No space left on device") as info:
        write_pieces(target, random.Random(5).randbytes(8 * STAGING), 5)
    assert isinstance(info.value, OSError)
    assert [p.name for p in tmp_path.iterdir()] == ["out.bin"] and target.read_bytes() == b"the user's own"
    assert not [t for t in threading.enumerate() if t.name.startswith("szformat-direct-io")]


def test_an_interruption_during_direct_writes_leaves_nothing(tmp_path, small_buffers):
    with pytest.raises(KeyboardInterrupt):
        with AtomicFile(tmp_path / "out.bin") as f:
            f.write(random.Random(6).randbytes(5 * STAGING + 9))
            raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []
    assert not [t for t in threading.enumerate() if t.name.startswith("szformat-direct-io")]


def test_convert_and_decompress_write_the_same_files_with_direct_io(tmp_path, small_buffers, monkeypatch):
    g = torch.Generator().manual_seed(random.randrange(1 << 30))
    tensors = {f"w{i}": (torch.randn(97, 131, generator=g) * 0.02).to(torch.bfloat16) for i in range(6)}
    tensors["f32"] = torch.randn(333, generator=g)
    save_safetensors(tensors, tmp_path / "m.safetensors")
    outputs = {}
    for mode in ("0", "1"):
        monkeypatch.setenv("SZFORMAT_DIRECT_IO", mode)
        for at_rest in (None, 3):
            szt = tmp_path / f"m-{mode}-{at_rest}.szt"
            convert(tmp_path / "m.safetensors", szt, at_rest=at_rest)
            decompress(szt, tmp_path / f"back-{mode}-{at_rest}.safetensors")
            outputs[mode, at_rest] = szt.read_bytes()
            back = (tmp_path / f"back-{mode}-{at_rest}.safetensors").read_bytes()
            assert back == (tmp_path / "m.safetensors").read_bytes()
    assert outputs["1", None] == outputs["0", None] and outputs["1", 3] == outputs["0", 3]


def test_staging_buffers_that_cannot_be_had_are_a_write_error_and_leave_nothing(tmp_path, small_buffers, monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

    if not direct_io_works(tmp_path):
        pytest.skip(f"{tmp_path}'s file system refuses O_DIRECT: no staging buffers are asked for")
    monkeypatch.setattr(direct_io.mmap, "mmap", refuse)
    with pytest.raises(WriteError, match="Cannot allocate memory"):
        write_pieces(tmp_path / "out.bin", random.Random(7).randbytes(3 * STAGING), 7)
    assert list(tmp_path.iterdir()) == []
