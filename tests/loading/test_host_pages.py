"""Huge pages for decoded tensors: exactly the 2 MiB pages inside a tensor are advised, nothing outside it, and the
tensors a CPU load returns (new, or the caller's ``out``) are advised before they are written; by default unless a
balloon device reports free pages to the host, whatever the machine with ``SZFORMAT_HUGE_PAGES=1``, never with
``0``. Then populated: exactly the pages inside a tensor faulted in, by each unit of a load for the output it
writes, memory in use left alone, never with ``SZFORMAT_POPULATE=0``."""

from __future__ import annotations

import mmap
import sys
from pathlib import Path

import pytest
import torch

from szformat import load_file, safe_open, save_file
from szformat.codec.codebook import Codebook
from szformat.loading import host_pages

HUGE = host_pages.HUGE_PAGE_BYTES
READ_SETTING = host_pages._madvise.__wrapped__
"""The module's lookup of libc's madvise without its cache: it reads ``SZFORMAT_HUGE_PAGES`` at every call."""


def _flags(address: int) -> set[str] | None:
    """The VmFlags of the mapping of this process that holds ``address`` (``None``: no /proc/self/smaps)."""
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split(" ", 1)[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return set(line.split()[1:])
    return None


def _advised(address: int) -> bool:
    flags = _flags(address)
    if flags is None:
        pytest.skip("no /proc/self/smaps")
    return "hg" in flags


def _turned(monkeypatch: pytest.MonkeyPatch, setting: str | None) -> None:
    """Set ``SZFORMAT_HUGE_PAGES`` (``None``: unset) and have the module read it again."""
    if setting is None:
        monkeypatch.delenv("SZFORMAT_HUGE_PAGES", raising=False)
    else:
        monkeypatch.setenv("SZFORMAT_HUGE_PAGES", setting)
    monkeypatch.setattr(host_pages, "_madvise", READ_SETTING)


@pytest.fixture
def advice_works(monkeypatch: pytest.MonkeyPatch) -> None:
    _turned(monkeypatch, "1")
    probe = torch.empty(3 * HUGE, dtype=torch.uint8)
    if host_pages.advise_huge_pages(probe) == 0:
        pytest.skip(f"no MADV_HUGEPAGE here ({sys.platform}, or transparent huge pages compiled out)")


def test_advises_exactly_the_aligned_pages_inside(advice_works: None) -> None:
    whole = torch.frombuffer(mmap.mmap(-1, 8 * HUGE), dtype=torch.uint8)  # a mapping of its own, never advised
    base = -(-whole.data_ptr() // HUGE) * HUGE - whole.data_ptr()  # offset of the first aligned page
    inner = whole[base + 100: base + 100 + 3 * HUGE]  # starts past an aligned page, ends before one
    assert host_pages.advise_huge_pages(inner) == 2 * HUGE
    first = whole.data_ptr() + base + HUGE
    assert _advised(first) and _advised(first + 2 * HUGE - 1)
    assert not _advised(first - 1) and not _advised(first + 2 * HUGE)  # the bytes around are not the tensor's


def _balloon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reporting: bool | None) -> None:
    """A machine with no balloon device (``None``), or one whose balloon negotiated free page reporting or not."""
    drivers = tmp_path / "virtio_balloon"
    if reporting is not None:
        (drivers / "virtio7").mkdir(parents=True)
        (drivers / "virtio7" / "features").write_text(("01100" + ("1" if reporting else "0")).ljust(64, "0") + "\n")
    monkeypatch.setattr(host_pages, "BALLOON_FEATURES", str(drivers / "*" / "features"))


@pytest.mark.parametrize("reporting, advised", [(None, True), (False, True), (True, False)])
def test_by_default_advised_unless_free_pages_are_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            advice_works: None, reporting, advised) -> None:
    """A balloon device that reports free pages hands its host the blocks huge pages are made of: no advice there."""
    _balloon(tmp_path, monkeypatch, reporting)
    assert host_pages.reports_free_pages() is bool(reporting)
    for setting in (None, "yes"):  # unset, or a value that is neither 0 nor 1
        _turned(monkeypatch, setting)
        tensor = torch.frombuffer(mmap.mmap(-1, 4 * HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS),
                                  dtype=torch.uint8)  # a mapping of its own, never advised
        assert (host_pages.advise_huge_pages(tensor) > 0) is advised
        assert _advised(-(-tensor.data_ptr() // HUGE) * HUGE) is advised


@pytest.mark.parametrize("reporting", [False, True])
def test_a_balloon_whose_features_cannot_be_read_is_passed_over(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 reporting: bool) -> None:
    """A device whose ``features`` cannot be read (here a directory) neither reports nor hides another's report."""
    _balloon(tmp_path, monkeypatch, reporting)
    (tmp_path / "virtio_balloon" / "virtio3" / "features").mkdir(parents=True)
    assert host_pages.reports_free_pages() is reporting


@pytest.mark.parametrize("reporting", [False, True])
@pytest.mark.parametrize("setting, advised", [("0", False), ("1", True)])
def test_the_setting_wins_over_the_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, advice_works: None,
                                           reporting: bool, setting: str, advised: bool) -> None:
    _balloon(tmp_path, monkeypatch, reporting)
    _turned(monkeypatch, setting)
    tensor = torch.frombuffer(mmap.mmap(-1, 4 * HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=torch.uint8)
    assert (host_pages.advise_huge_pages(tensor) > 0) is advised
    assert _advised(-(-tensor.data_ptr() // HUGE) * HUGE) is advised


def test_nothing_to_advise() -> None:
    assert host_pages.advise_huge_pages(torch.empty(HUGE // 2, dtype=torch.uint8)) == 0  # no whole aligned page
    assert host_pages.advise_huge_pages(torch.empty(4, HUGE, dtype=torch.uint8)[:, : HUGE // 2]) == 0  # strided
    assert host_pages.advise_huge_pages(torch.empty(4 * HUGE, dtype=torch.uint8, device="meta")) == 0


def test_empty_is_torch_empty_advised(advice_works: None) -> None:
    tensor = host_pages.empty((3, HUGE), torch.bfloat16)
    assert tensor.shape == (3, HUGE) and tensor.dtype == torch.bfloat16 and tensor.is_contiguous()
    assert _advised(-(-tensor.data_ptr() // HUGE) * HUGE)


def _checkpoint(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    tensors = {"big": (torch.randn(3 * HUGE // 2 + 7, generator=gen) * 0.02).to(torch.bfloat16),
               "raw": torch.randn(HUGE, generator=gen)}  # stored raw: 8 MiB of float32
    path = tmp_path / "model.szt"
    save_file(tensors, path)
    return path, tensors


def test_loaded_tensors_are_advised(tmp_path: Path, advice_works: None) -> None:
    path, tensors = _checkpoint(tmp_path)
    loaded = load_file(path)
    for name, tensor in loaded.items():
        assert torch.equal(tensor.view(torch.uint8), tensors[name].view(torch.uint8)), name
        assert _advised(-(-tensor.data_ptr() // HUGE) * HUGE), name
    with safe_open(path, framework="pt") as f:
        rows = f.get_slice("big")[6: 3 * HUGE // 2]  # over 4 MiB: a whole aligned 2 MiB page inside, always
        assert torch.equal(rows.view(torch.int16), tensors["big"][6: 3 * HUGE // 2].view(torch.int16))
        assert _advised(-(-rows.data_ptr() // HUGE) * HUGE)


def test_caller_outputs_are_advised(tmp_path: Path, advice_works: None) -> None:
    from szformat.format.reader import SztFile
    from szformat.loading.host_reader import HostReader

    path, tensors = _checkpoint(tmp_path)
    maps = [mmap.mmap(-1, t.numel() * t.element_size()) for t in tensors.values()]  # mappings never advised
    outs = [torch.frombuffer(m, dtype=t.dtype).view(t.shape) for m, t in zip(maps, tensors.values())]
    assert not any(_advised(-(-t.data_ptr() // HUGE) * HUGE) for t in outs)
    with SztFile(path) as file:
        HostReader(file, verify=True).tensors(["big", "raw"], outs)
    for out, name in zip(outs, ("big", "raw")):
        assert torch.equal(out.view(torch.uint8), tensors[name].view(torch.uint8))
        assert _advised(-(-out.data_ptr() // HUGE) * HUGE), name


PAGE = mmap.PAGESIZE


def _private_mapping(pages: int) -> torch.Tensor:
    """A mapping of its own (no page of it in memory yet), as a flat uint8 tensor."""
    return torch.frombuffer(mmap.mmap(-1, pages * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS),
                            dtype=torch.uint8)


def _resident(tensor: torch.Tensor) -> list[bool]:
    """Whether each page of a page-aligned tensor's bytes is in memory (``mincore``)."""
    import ctypes

    pages = -(-tensor.numel() // PAGE)
    vector = ctypes.create_string_buffer(pages)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    assert libc.mincore(tensor.data_ptr(), pages * PAGE, vector) == 0, ctypes.get_errno()
    return [bool(b & 1) for b in vector.raw]


@pytest.fixture
def populating(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pages are populated here (Linux 5.14 and later), ``SZFORMAT_POPULATE`` unset."""
    monkeypatch.delenv("SZFORMAT_POPULATE", raising=False)
    monkeypatch.setattr(host_pages, "_populating", host_pages._populating.__wrapped__)
    if host_pages._populating() is None:
        pytest.skip(f"no MADV_POPULATE_WRITE here ({sys.platform}, or a Linux older than 5.14)")


def test_populates_exactly_the_pages_inside(populating: None) -> None:
    whole = _private_mapping(64)
    inner = whole[PAGE + 100: 40 * PAGE - 100]  # from inside page 1 to inside page 39
    assert not any(_resident(whole))
    assert host_pages.populate(inner)
    assert _resident(whole) == [False] * 2 + [True] * 37 + [False] * 25  # pages 2-38: the tensor's alone
    assert not whole.any()  # populated, never written


def test_memory_in_use_is_left_alone(populating: None) -> None:
    """Memory whose first page is in memory (what a process reuses) is not walked again."""
    whole = _private_mapping(32)
    whole[:PAGE].fill_(7)
    assert not host_pages.populate(whole)
    assert _resident(whole) == [True] + [False] * 31


def test_populating_turned_off(monkeypatch: pytest.MonkeyPatch, populating: None) -> None:
    monkeypatch.setenv("SZFORMAT_POPULATE", "0")
    assert host_pages._populating() is None
    whole = _private_mapping(32)
    assert not host_pages.populate(whole)
    assert not any(_resident(whole))


def test_nothing_to_populate(populating: None) -> None:
    small = _private_mapping(64)[: host_pages.POPULATE_MIN_BYTES - 1]
    assert not host_pages.populate(small) and not any(_resident(small))
    strided = _private_mapping(64).view(32, 2 * PAGE)[:, :PAGE]
    assert not host_pages.populate(strided)
    assert not host_pages.populate(torch.empty(1 << 20, dtype=torch.uint8, device="meta"))


def test_the_batched_decode_populates_as_populate_does(populating: None) -> None:
    """The C call that decodes a load's small tensors together populates each output itself, by
    :func:`host_pages.populate`'s rule: the pages inside an output of ``populated_size()`` bytes or more, before
    anything is written, unless the first of them is in memory. Seen on an output whose escape streams are refused:
    populated, never written."""
    from szformat.codec import cpu

    if not cpu.native_kernels():
        pytest.skip("the C kernels are not built here")
    n = 20 * PAGE  # elements: 40 pages of output
    foreign = Codebook(dec_lut=(250,) + (0,) * 15, n_used=1, coverage=0.0)  # every element escapes
    payload, layout, codebook = cpu.encode(torch.ones(n, dtype=torch.bfloat16), foreign)
    broken = bytearray(payload.numpy().tobytes())  # the first escape's local position past its chunk
    broken[layout.off_cid + 4 * layout.n_esc: layout.off_cid + 4 * layout.n_esc + 2] = (1024).to_bytes(2, "little")
    size = host_pages.populated_size()
    assert 0 < size <= 2 * n
    for populate, first_written, resident in [(size, False, [False] + [True] * 39 + [False]),
                                              (0, False, [False] * 41),
                                              (size, True, [False, True] + [False] * 39)]:
        whole = _private_mapping(41)
        if first_written:  # the output's first whole page
            whole[PAGE: 2 * PAGE].fill_(0)
        out = whole[100: 100 + 2 * n].view(torch.bfloat16)  # from inside page 0 to inside page 40
        [(_, _, error)] = cpu.decode_payloads([(bytes(broken), layout, codebook, out)], checksums=False,
                                              populate=populate)
        assert error is not None
        assert _resident(whole) == resident, (populate, first_written)
        assert not whole.any()  # read last: reading maps the pages it reads


def _spans_populated(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, bool]]:
    """Every call of :func:`host_pages.populate` from now on, as ``(first byte, end, whether it populated)``."""
    calls: list[tuple[int, int, bool]] = []
    real = host_pages.populate

    def spy(tensor: torch.Tensor) -> bool:
        done = real(tensor)
        calls.append((tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size(), done))
        return done

    monkeypatch.setattr(host_pages, "populate", spy)
    return calls


def _covered(tensor: torch.Tensor, spans: list[tuple[int, int, bool]], *, populated: bool = False) -> bool:
    """Whether ``spans`` (those that populated, with ``populated``) cover every byte of ``tensor``."""
    begin = tensor.data_ptr()
    end = begin + tensor.numel() * tensor.element_size()
    for lo, hi, done in sorted(spans):
        if lo <= begin < hi and (done or not populated):
            begin = hi
    return begin >= end


def test_loads_populate_each_range_in_the_thread_that_writes_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 populating: None) -> None:
    from szformat.loading import host_decode

    path, tensors = _checkpoint(tmp_path)
    monkeypatch.setattr(host_decode, "RANGE_ELEMENTS", 1 << 20)  # "big" in four ranges
    monkeypatch.setattr(host_decode, "_batched", lambda entry, checked: False)  # Python's ranges (the C call's: above)
    spans = _spans_populated(monkeypatch)
    loaded = load_file(path)
    for name, tensor in loaded.items():
        assert torch.equal(tensor.view(torch.uint8), tensors[name].view(torch.uint8)), name
        assert _covered(tensor, spans), name
    big = loaded["big"].data_ptr()
    ranges = [hi - lo for lo, hi, _ in spans if big <= lo < big + loaded["big"].numel() * 2]
    assert len(ranges) == 4 and max(ranges) <= 2 << 20  # a range each, not the whole tensor up front


@pytest.mark.parametrize("at_rest", [None, "zstd"])  # at rest, the raw tensor is stored as byte planes
def test_caller_outputs_and_slices_are_populated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, populating: None,
                                                 at_rest: str | None) -> None:
    from szformat.format.reader import SztFile
    from szformat.loading import host_decode
    from szformat.loading.host_reader import HostReader

    path, tensors = _checkpoint(tmp_path)
    monkeypatch.setattr(host_decode, "_batched", lambda entry, checked: False)  # Python's ranges (the C call's: above)
    if at_rest:
        save_file(tensors, path, at_rest=at_rest)
    spans = _spans_populated(monkeypatch)
    count = 100_000  # rows of each 1-D tensor: 200 and 400 KB, more than POPULATE_MIN_BYTES
    outs = [_private_mapping(-(-t.numel() * t.element_size() // PAGE))[: t.numel() * t.element_size()]
            .view(t.dtype).view(t.shape) for t in tensors.values()]
    with SztFile(path) as file:
        reader = HostReader(file, verify=True)
        reader.tensors(["big", "raw"], outs)
        rows = [_private_mapping(-(-count * t.element_size() // PAGE))[: count * t.element_size()].view(t.dtype)
                for t in tensors.values()]
        for name, out in zip(("big", "raw"), rows):
            reader.rows(file.entry(name), 1000, 1000 + count, out)
    for name, out, part in zip(("big", "raw"), outs, rows):
        assert torch.equal(out.view(torch.uint8), tensors[name].view(torch.uint8)), name
        assert torch.equal(part.view(torch.uint8), tensors[name][1000: 1000 + count].view(torch.uint8)), name
        assert _covered(out, spans, populated=True) and _covered(part, spans, populated=True), name


def test_columns_copied_out_of_whole_rows_are_populated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        populating: None) -> None:
    """A row-parallel shard with an odd column bound (whole rows decoded, the columns copied out) into a target
    nothing wrote, as vLLM's parameters."""
    from szformat.format.reader import SztFile
    from szformat.integrations.deferred import DecodeCounter, DeferredTensor
    from szformat.loading.host_reader import HostReader

    weight = (torch.randn(512, 200, generator=torch.Generator().manual_seed(5)) * 0.02).to(torch.bfloat16)
    path = tmp_path / "model.szt"
    save_file({"w": weight}, path)
    spans = _spans_populated(monkeypatch)
    with SztFile(path) as file:
        shard = DeferredTensor(HostReader(file, verify=True), file.entry("w"), DecodeCounter()).narrow(1, 3, 148)
        target = _private_mapping(-(-512 * 148 * 2 // PAGE))[: 512 * 148 * 2].view(torch.bfloat16).view(512, 148)
        target.copy_(shard)
    assert torch.equal(target.view(torch.int16), weight[:, 3:151].contiguous().view(torch.int16))
    assert _covered(target, spans, populated=True)


def test_a_kernel_without_populate_leaves_the_pages_to_fault(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Linux older than 5.14 refuses the advice (EINVAL), even for no pages; another system has no C library to
    ask: either way nothing is populated and the tensor's writes fault as they would have."""

    class OldKernel:
        calls: list[int] = []

        def madvise(self, address: int, length: int, advice: int) -> int:
            self.calls.append(advice)
            return -1

        def mincore(self, address: int, length: int, vector) -> int:
            raise AssertionError("nothing to ask once the advice is refused")

    monkeypatch.delenv("SZFORMAT_POPULATE", raising=False)
    monkeypatch.setattr(host_pages, "_populating", host_pages._populating.__wrapped__)
    monkeypatch.setattr(host_pages, "_libc", OldKernel)
    whole = _private_mapping(32)
    assert not host_pages.populate(whole)
    assert OldKernel.calls == [host_pages.MADV_POPULATE_WRITE]  # asked once, with no pages, whether it is known
    monkeypatch.setattr(host_pages, "_libc", lambda: None)
    assert not host_pages.populate(whole)
    assert not any(_resident(whole))
