"""The GPU benchmarks' arithmetic and checks, run where no GPU is: the offload floor and the ratios against it and
against DDO (``bench/offload.py``), the peer loaders' bit-for-bit check, their comparison with the fastest peer
and a peer whose package is missing (``bench/load.py``, ``bench/common.py``), the 7B-class layout; the vLLM
benchmark's table (``bench/vllm.py``)."""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bench import common, forms, load, offload
from bench.checks import load_gpu


# -- the offload floor and the ratios -----------------------------------------------------------------------------


def test_offload_floor_streams_the_blocks_beyond_the_resident_budget_at_their_stored_ratio():
    e2e = offload
    floor = e2e.offload_floor(4_000_000_000, 3_000_000_000, 400_000_000, 55.0, 0.027)
    assert floor["raw_bytes_per_forward"] == 3_600_000_000
    assert floor["stored_bytes_per_forward"] == pytest.approx(2_700_000_000)
    assert floor["floor_s"] == pytest.approx(2.7 / 55 + 0.027)
    assert floor["raw_floor_s"] == pytest.approx(3.6 / 55 + 0.027)


def test_offload_floor_of_a_model_that_fits_the_budget_is_the_forward_itself():
    floor = offload.offload_floor(100, 75, 500, 55.0, 0.004)
    assert floor["stored_bytes_per_forward"] == 0
    assert floor["floor_s"] == floor["raw_floor_s"] == 0.004


@pytest.mark.parametrize("raw, rate", [(0, 55.0), (100, 0.0)])
def test_offload_floor_refuses_what_it_cannot_divide_by(raw, rate):
    with pytest.raises(ValueError, match="the floor needs"):
        offload.offload_floor(raw, 75, 0, rate, 0.004)


def _result(config: str, forward_ms: float, sha: str = "same", **extra) -> dict:
    return {"model": "dit-large", "config": config, "forward_s": forward_ms / 1e3, "output_sha256": sha,
            "setup_s": 1.0, "first_forward_s": 0.5, "h2d_bytes_per_forward": 2**30, "setup_h2d_bytes": 0,
            "rss_bytes": 0, "checkpoint_mapping_rss_bytes": 0, "gpu_peak_bytes": 0, **extra}


FACTS = {"pinned_h2d_gbps": 50.0,
         "dit-large": {"block_raw_bytes": 4_000_000_000, "block_stored_bytes": 3_000_000_000,
                       "resident_budget_bytes": 0, "resident_share": 0.12, "safetensors_bytes": 4_085_000_000,
                       "szt_bytes": 3_070_000_000}}


def test_annotate_marks_each_row_against_the_gpu_output_the_floor_and_ddo():
    e2e = offload
    results = [_result("gpu", 20.0), _result("ddo-native-st", 800.0), _result("ddo-staging-st", 3200.0),
               _result("szt-native", 400.0), _result("szt-staging", 100.0, sha="other"),
               {"model": "dit-large", "config": "st-accelerate", "error": "Traceback\nRuntimeError: boom"}]
    floors = e2e.annotate(results, FACTS, ["dit-large"])
    assert floors["dit-large"]["floor_s"] == pytest.approx(3.0 / 50 + 0.020)  # 80 ms
    rows = {r["config"]: r for r in results}
    assert rows["szt-native"]["identical_to_gpu"] and not rows["szt-staging"]["identical_to_gpu"]
    assert rows["szt-native"]["x_vmm_fast"] == pytest.approx(0.5)
    assert rows["szt-staging"]["x_vmm_runtime"] == pytest.approx(100 / 3200)
    assert rows["szt-staging"]["x_floor"] == pytest.approx(100 / 80)
    assert rows["szt-staging"]["x_raw_floor"] == pytest.approx(100 / (4000 / 50 + 20))
    assert "identical_to_gpu" not in rows["st-accelerate"]


def test_annotate_without_the_gpu_row_has_no_floor_and_nothing_identical():
    results = [_result("szt-native", 400.0), _result("ddo-native-st", 800.0)]
    assert offload.annotate(results, FACTS, ["dit-large"]) == {}
    assert not results[0]["identical_to_gpu"] and "x_floor" not in results[0]


def test_render_shows_the_floor_the_failures_and_the_derived_byte_counts():
    e2e = offload
    results = [_result("gpu", 20.0), _result("st-group", 900.0),
               {"model": "dit-large", "config": "szt-native", "error": "Traceback\nRuntimeError: boom"}]
    table = e2e.render(results, FACTS, ["dit-large"])
    assert "= **80.0 ms** (uncompressed: 100.0 ms)" in table
    assert "the no-offload forward 20.0 ms" in table
    assert "| st-group | - / - | yes |" in table and "| 1024.0* |" in table
    assert "szt-native FAILED: RuntimeError: boom" in table


def test_names_of_refuses_an_unknown_name():
    parse = offload.names_of(("gpu", "szt-native"))
    assert parse("gpu,szt-native") == "gpu,szt-native"
    with pytest.raises(argparse.ArgumentTypeError, match="unknown: szt-nat"):
        parse("gpu,szt-nat")


# -- peers --------------------------------------------------------------------------------------------------------


def _reference() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"a": (torch.randn(64, 32, generator=gen) * 0.02).to(torch.bfloat16),
            "b": torch.zeros(17, dtype=torch.bfloat16)}


def test_mismatches_are_bitwise_and_name_every_difference():
    bench = load
    reference = _reference()
    assert bench.mismatches({k: v.clone() for k, v in reference.items()}, reference) == []
    signed = {"a": reference["a"].clone(), "b": -reference["b"]}  # -0.0 == 0.0, but not bit for bit
    assert torch.equal(signed["b"], reference["b"]) and bench.mismatches(signed, reference) == ["b"]
    flipped = reference["a"].clone()
    flipped.view(torch.int16)[3, 5] ^= 1
    assert bench.mismatches({"a": flipped, "b": reference["b"]}, reference) == ["a"]
    assert bench.mismatches({"a": reference["a"].float(), "b": reference["b"]}, reference) == ["a"]
    assert bench.mismatches({"a": reference["a"].reshape(32, 64), "b": reference["b"]}, reference) == ["a"]
    assert bench.mismatches({"a": reference["a"], "c": reference["b"]}, reference) == ["b", "c"]


def _row(medium: str, loader: str, seconds: float, identical: bool = True) -> dict:
    return {"medium": medium, "loader": loader, "seconds": seconds, "status": "ok", "identical": identical,
            "gbps": 4.0 / seconds, "mismatches": []}


def test_szformat_is_measured_against_the_fastest_bit_identical_peer_of_its_medium():
    bench = load
    verify_off = "szformat load_file, verify off"
    rows = [_row("disk", "safetensors", 0.8), _row("disk", "instanttensor-buffered", 0.24),
            _row("disk", "runai", 0.1, identical=False), _row("disk", verify_off, 0.2),
            _row("tmpfs", "instanttensor", 0.17), _row("tmpfs", verify_off, 0.18),
            {"medium": "cold", "loader": "fastsafetensors", "status": "failed: OSError: no io_uring"},
            _row("cold", verify_off, 1.7)]
    bench.compare_to_peers(rows)
    assert rows[3]["vs_fastest_peer"] == pytest.approx(1.2) and rows[3]["fastest_peer"] == "instanttensor-buffered"
    assert rows[0]["vs_fastest_peer"] == pytest.approx(0.3)
    assert rows[5]["vs_fastest_peer"] == pytest.approx(0.17 / 0.18)
    assert "vs_fastest_peer" not in rows[7]  # no peer ran cold
    table = bench.peer_markdown(rows, {"runai-old": "import runai failed"})
    assert f"- disk: {verify_off} **1.20x** the fastest peer (instanttensor-buffered)" in table
    assert "| cold | fastsafetensors | | | | | | failed: OSError: no io_uring |" in table
    assert "skipped: import runai failed" in table
    assert "| NO |" in table  # the peer whose output differs is shown, and not counted as fastest


def test_a_peer_whose_package_does_not_import_is_skipped_with_the_reason(monkeypatch):
    peers = common
    monkeypatch.setitem(peers.PEERS, "missing", ("szformat_no_such_module", lambda path: {}))
    loaders, skipped = peers.available_peers(["safetensors", "missing"])
    assert list(loaders) == ["safetensors"]
    assert "ModuleNotFoundError" in skipped["missing"] and "szformat_no_such_module" in skipped["missing"]


def test_copy_to_tmpfs_says_why_not_where_there_is_none(tmp_path):
    assert load.copy_to_tmpfs([], tmp_path / "absent" / "peers") == f"no {tmp_path / 'absent'}"


def test_filesystem_reads_the_mount_table():
    assert load.filesystem(Path("/proc/self")) == "proc"


def test_llama_shapes_make_a_7b_class_checkpoint_of_the_size_asked():
    shapes = load_gpu.llama_shapes(4_000_000_000)
    total = sum(2 * math.prod(shape) for shape in shapes.values())
    assert 3.5e9 <= total <= 4.5e9
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (4096, 11008)
    assert shapes["model.embed_tokens.weight"] == shapes["lm_head.weight"] == (32000, 4096)
    assert list(shapes)[0] == "model.embed_tokens.weight" and list(shapes)[-1] == "lm_head.weight"


# -- the GIL clock of bench/at_rest.py ------------------------------------------------------------------------


def test_the_gil_clock_tells_time_holding_the_gil_from_time_in_calls_that_release_it():
    gil = common
    clock = gil.GilClock()
    clock.calibrate()
    sleep = clock.timed(time.sleep)  # as a call that releases the GIL

    def task() -> None:
        sleep(0.2)
        end = time.perf_counter() + 0.03
        while time.perf_counter() < end:  # Python, holding the GIL
            pass

    with gil.TimedPool(clock) as pool:
        pool.submit(task).result()
    sleep(0.1)  # not on the reader thread: not counted
    assert clock.tasks == 1 and clock.releases == 1
    assert 0.2 <= clock.released_seconds < 0.3
    assert 0.03 <= clock.held_seconds < 0.2


def test_the_gil_clock_counts_a_release_per_read_and_per_zstd_frame(tmp_path):
    gil = common
    from szformat.format import at_rest
    from szformat.format.reader import pread_exactly
    contents = [bytes([i]) * 5000 for i in range(3)]
    frames = [at_rest.compress_frame(c) for c in contents]
    (tmp_path / "frames").write_bytes(b"".join(frames))
    run = [at_rest.Segment(5000 * i, 5000, sum(map(len, frames[:i])), len(f), True) for i, f in enumerate(frames)]
    out = bytearray(15000)

    def task() -> None:
        stored = memoryview(bytearray(sum(map(len, frames))))
        with open(tmp_path / "frames", "rb") as f:
            pread_exactly(f.fileno(), stored, 0, path=tmp_path / "frames")
        at_rest._inflate_frames(stored, run, memoryview(out), at_rest.decompressor())

    clock = gil.GilClock()
    preadv = os.preadv
    with clock.installed(), gil.TimedPool(clock) as pool:
        pool.submit(task).result()
    assert bytes(out) == b"".join(contents)
    assert clock.tasks == 1 and clock.releases == 1 + 3
    assert os.preadv is preadv and at_rest.decompressor.__module__ == at_rest.__name__


# -- both forms, interleaved (bench/forms.py) ---------------------------------------------------------------


def test_the_file_readers_read_every_byte(tmp_path):

    path = tmp_path / "file.bin"
    path.write_bytes(os.urandom(3 * 4096 + 123))
    buffer = torch.zeros(path.stat().st_size + 10, dtype=torch.uint8)
    forms.buffered_read(path, buffer)()
    assert bytes(buffer[: path.stat().st_size].numpy()) == path.read_bytes()
    try:
        forms.direct_read(path)()  # the rate anchor: reads without a buffer to check, but must not fail midway
    except OSError as e:
        pytest.skip(f"O_DIRECT refused here: {e}")


def test_rounds_balance_the_order_and_a_warm_run_drops_its_first_round(monkeypatch):

    calls, dropped = [], []
    monkeypatch.setattr(forms, "timed_call", lambda run: (float(len(calls)), run()))
    monkeypatch.setattr(forms, "drop_caches", lambda files: dropped.append(len(calls)))
    monkeypatch.setattr(forms, "resident_share", lambda files: 0.0)
    paths = {label: ("in-memory", lambda label=label: calls.append(label)) for label in "abc"}
    warm = forms.interleaved(paths, {"in-memory": Path("x")}, 2, "warm")
    assert calls == list("bac" "abc" "bca") and not dropped  # round -1 is round 5 of the balanced orders
    assert warm == {"a": [3.0, 8.0], "b": [4.0, 6.0], "c": [5.0, 7.0]}
    calls.clear()
    cold = forms.interleaved(paths, {"in-memory": Path("x")}, 2, "cold")
    assert calls == list("abc" "bca") and dropped == [0, 1, 2, 3, 4, 5]
    assert cold["a"] == [0.0, 5.0]


# -- every benchmark runs from the checkout as ``python -m bench.<name>`` -------------------------------------------

BENCHMARKS = ("load", "offload", "forms", "from_pretrained", "at_rest", "dtypes", "cpu", "gpu", "convert",
              "resident", "checks.codec_gpu", "checks.load_gpu")
REPO_ROOT = Path(__file__).resolve().parents[2]


def _run_module(*args: str, timeout: float = 300, env: dict[str, str] | None = None):
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=timeout, env=None if env is None else {**os.environ, **env})


def test_every_benchmark_answers_help_without_a_gpu():
    for name in BENCHMARKS:
        done = _run_module(f"bench.{name}", "--help")
        assert done.returncode == 0, (name, done.stderr[-2000:])
        assert done.stdout.startswith("usage:"), name


OPTIONAL_PEERS = {"dfloat11", "fastsafetensors", "instanttensor", "runai_model_streamer", "zipnn", "cupy",
                  "ddo_vmm_bootstrap", "diffusers_dynamic_offloader", "accelerate", "diffusers", "vllm", "openai"}
"""What a benchmark imports only where it measures that peer or route (each says so when it is missing)."""


def test_every_import_in_the_benchmarks_names_a_module_that_exists():
    """Imports inside functions run only on the machine that takes that figure (often the lent GPU): a module
    renamed or moved must fail here, not after a device start. Relative imports must name a module of ``bench``,
    absolute ones an installed package, the standard library or a known optional peer."""
    import ast
    import importlib.util

    missing = []
    for path in sorted((REPO_ROOT / "bench").rglob("*.py")):
        package = ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts[:-1])
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:  # a module of bench, found whole
                names = [importlib.util.resolve_name("." * node.level + (node.module or ""), package)]
            elif isinstance(node, ast.ImportFrom):  # a package: its top level, found without importing it
                names = [node.module.split(".")[0]]
            elif isinstance(node, ast.Import):
                names = [alias.name.split(".")[0] for alias in node.names]
            else:
                continue
            for name in names:
                if name.split(".")[0] not in OPTIONAL_PEERS and importlib.util.find_spec(name) is None:
                    missing.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno}: {name}")
    assert not missing, missing


def test_the_offload_benchmark_also_runs_by_its_path_as_ddos_bootstrap_starts_it():
    """DDO's ``ensure_vmm_fast_process`` starts the native batch again with ``runpy.run_path``: no package then, so
    a relative import there fails the batch on the GPU machine only."""
    script = ("import runpy, sys; sys.argv = ['bench/offload.py', '--help']; "
              "runpy.run_path(sys.argv[0], run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.startswith("usage:"), done.stderr[-2000:]


def test_the_cpu_benchmark_runs_its_codec_and_first_load_sections_on_a_small_model(tmp_path):
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    save_file({"w": (torch.randn(256, 512, generator=g) * 0.02).to(torch.bfloat16),
               "b": torch.randn(512, generator=g).to(torch.bfloat16)}, tmp_path / "model.safetensors")
    done = _run_module("bench.cpu", "--model", str(tmp_path / "model.safetensors"), "--tile-mb", "1",
                       "--repeats", "1", "--sections", "codec,first", "--work", str(tmp_path / "work"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "GB/s" in done.stdout
    first = [line for line in done.stdout.splitlines() if line.startswith("|") and "| szt |" in line]
    assert len(first) == len({1, os.cpu_count() or 1}), done.stdout
    if os.path.exists("/proc/vmstat"):  # the memory events each run saw: three counts
        assert all(re.fullmatch(r"\d+ / \d+ / \d+", line.split("|")[-2].strip()) for line in first), done.stdout


def test_first_loads_run_their_children_with_bytecode_written(monkeypatch, tmp_path):
    """A machine that sets PYTHONDONTWRITEBYTECODE would have every fresh process compile szformat again (30-50 ms
    of a first MiniLM load): the children run without it, so the untimed round caches the bytecode."""
    from bench import cpu as bench_cpu

    environments = []

    def child(args, **kwargs):
        environments.append(kwargs.get("env"))
        return subprocess.CompletedProcess(args, 0, stdout="0.05 0.04 2\n", stderr="")

    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.setattr(bench_cpu.subprocess, "run", child)
    monkeypatch.setattr(bench_cpu, "read_through", lambda *paths: None)
    rows = bench_cpu.bench_first_loads("tiny", tmp_path / "a.safetensors", tmp_path / "a.szt", repeats=1)
    assert rows and environments and all(env is not None and "PYTHONDONTWRITEBYTECODE" not in env
                                         for env in environments)
    assert all(env["PATH"] == os.environ["PATH"] for env in environments)  # the rest of the environment kept


def test_first_loads_without_the_kernels_counters_print_dashes(monkeypatch, capsys):
    """Where ``/proc/vmstat`` cannot be read (not Linux) the memory events are absent, not zero: the table says so."""
    from bench import cpu as bench_cpu

    def unreadable(*args, **kwargs):
        raise FileNotFoundError("/proc/vmstat")

    monkeypatch.setattr(bench_cpu, "open", unreadable, raising=False)
    assert bench_cpu.memory_events() == {}
    bench_cpu.print_first_load_table([{"data": "MiniLM", "threads": 1, "loader": "szt", "median_s": 0.05,
                                       "best_s": 0.04, "load_s": 0.03, "vs_anchor": 0.8}])
    assert capsys.readouterr().out.splitlines()[-1].endswith("| - / - / - |")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc and its fault counts")
def test_pinned_glibc_thresholds_reuse_the_memory_a_freed_24_mib_buffer_held():
    """In a process of its own (the thresholds stay pinned): a 24 MiB buffer written, freed, made and written again
    faults no page in (left dynamic, glibc maps it anew most times here: 6,144 faults). Measured four times, the
    first two dropped: the first writes also start PyTorch's intra-op threads, whose own allocations made one of
    them fault in a new buffer in about half the processes, whichever of the two it was."""
    probe = (
        "import resource, torch\n"
        "from bench.cpu import pin_glibc_thresholds\n"
        "assert pin_glibc_thresholds()\n"
        "def faults(mib):\n"
        "    torch.empty(mib << 20, dtype=torch.uint8).fill_(1)\n"
        "    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
        "    torch.empty(mib << 20, dtype=torch.uint8).fill_(1)\n"
        "    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before\n"
        "print(faults(24), faults(24), faults(24), faults(24))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2]).stdout.split()
    assert [int(n) < 100 for n in out[2:]] == [True, True], out


def test_glibc_thresholds_are_left_alone_where_there_is_no_mallopt(monkeypatch):
    """Another C library (or none reachable through ctypes): nothing is pinned, and the benchmark says so."""
    import ctypes

    from bench import cpu as cpu_bench

    def no_library(name):
        raise OSError("no C library")

    monkeypatch.setattr(ctypes, "CDLL", no_library)
    assert cpu_bench.pin_glibc_thresholds() is False
    monkeypatch.setattr(ctypes, "CDLL", lambda name: object())  # a library without mallopt
    assert cpu_bench.pin_glibc_thresholds() is False


def test_the_cpu_benchmark_refuses_a_section_it_does_not_have(tmp_path):
    """A misspelt section is an error naming the sections, not a run that times nothing, and it comes before MiniLM
    is fetched (here into a folder that cannot be made, so a fetch would fail first)."""
    (tmp_path / "file").write_bytes(b"")
    done = _run_module("bench.cpu", "--sections", "load,frist",
                       env={"SZFORMAT_MINILM_DIR": str(tmp_path / "file" / "x")})
    assert done.returncode == 2 and "choose among codec, first, first-large, header, load, slices" in done.stderr


def test_the_cpu_benchmarks_header_section_times_both_parsers_against_safetensors(tmp_path, monkeypatch):
    """The header section opens each file through safetensors, szformat with the C check of plain entries and with
    the Python parser alone, once it has seen the two parsers agree; a parser that disagrees fails it."""
    import dataclasses

    from safetensors.torch import save_file

    import szformat
    from bench import cpu as bench_cpu
    from szformat.format import header as header_module

    g = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": (torch.randn(8, 8, generator=g) * 0.02).to(torch.bfloat16) for i in range(5)}
    save_file(tensors, tmp_path / "a.safetensors")
    szformat.save_file(tensors, tmp_path / "a.szt")
    files = [("tiny", tmp_path / "a.safetensors", tmp_path / "a.szt")]
    check = header_module._entries
    rows = bench_cpu.bench_headers(files, repeats=2)
    assert [r["method"] for r in rows] == ["safetensors safe_open (anchor)"] + \
        ["szformat SztFile, plain entries checked in C"] * (check is not None) + \
        ["szformat SztFile, Python parser alone"]
    assert all(r["tensors"] == 5 and 0 < r["best_s"] <= r["median_s"] for r in rows)
    assert header_module._entries is check
    if check is None:
        pytest.skip("the C extensions were not built here: one parser only")
    real = header_module._plain_entries
    monkeypatch.setattr(header_module, "_plain_entries",
                        lambda tensors: [e and dataclasses.replace(e, crc32=0) for e in real(tensors)])
    with pytest.raises(AssertionError, match="the two parsers disagree"):
        bench_cpu.bench_headers(files, repeats=1)


def test_the_cpu_benchmarks_slices_read_the_same_rows_through_each_reader(tmp_path):
    """The slices section checks szformat's rows against safetensors' bit for bit and times three readers on both
    parts; a reader giving other rows fails it."""
    from safetensors.torch import save_file

    import szformat
    from bench import cpu as bench_cpu

    g = torch.Generator().manual_seed(1)
    tensors = {"w": (torch.randn(600, 1024, generator=g) * 0.02).to(torch.bfloat16),
               "b": torch.randn(40, generator=g).to(torch.bfloat16)}
    save_file(tensors, tmp_path / "model.safetensors")
    szformat.save_file(tensors, tmp_path / "model.szt")
    rows = bench_cpu.bench_slices(tmp_path / "model.safetensors", tmp_path / "model.szt", 1)
    assert [(r["part"].split()[0], r["method"].split()[0]) for r in rows] == [
        (part, reader) for part in ("half", "16") for reader in ("safetensors", "szformat", "szformat")]
    assert rows[0]["mb"] == 2 * (300 * 1024 + 20) / 1e6 and rows[3]["mb"] == 2 * (16 * 1024 + 16) / 1e6
    tensors["w"][1, 3] += 1  # the .szt file now holds other rows than the safetensors file
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(AssertionError, match="get_slice of w is not bit-exact"):
        bench_cpu.bench_slices(tmp_path / "model.safetensors", tmp_path / "model.szt", 1)


def test_the_conversion_benchmark_runs_a_given_source_and_checks_the_round_trips(tmp_path):
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(1)
    source = tmp_path / "model.safetensors"
    save_file({"w": (torch.randn(300, 257, generator=g) * 0.02).to(torch.bfloat16)}, source)
    done = _run_module("bench.convert", "--dir", str(tmp_path / "work"), "--source", str(source), "--repeats", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "median of 2" in done.stdout and "largest tensor" not in done.stdout
    rows = [line.split()[0] for line in done.stdout.splitlines()[2:11]]
    assert rows == ["import", "safetensors", "file", "convert", "verify", "decompress", "convert", "verify",
                    "decompress"], done.stdout
    assert done.stdout.count("byte-identical to the source: True") == 2, done.stdout
    assert source.exists() and not (tmp_path / "work" / "out").exists()


def test_the_resident_benchmark_runs_tiny_models_on_the_cpu_and_checks_their_outputs(tmp_path):
    pytest.importorskip("transformers")  # the benchmark builds its models with them (the test extra installs both)
    pytest.importorskip("diffusers")
    done = _run_module("bench.resident", "--tiny", "--device", "cpu", "--reps", "2", "--work", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "outputs: bit-identical to the plain model on every row" in done.stdout
    assert "llm    prefill (ms)" in done.stdout and "dit    forward (ms)" in done.stdout


def test_the_device_busy_time_counts_overlapping_kernels_once():
    from types import SimpleNamespace

    from bench import resident

    def kernel(start, end, kind="CUDA"):
        return SimpleNamespace(time_range=SimpleNamespace(start=start, end=end),
                               device_type=SimpleNamespace(name=kind))

    events = [kernel(0, 100), kernel(50, 150), kernel(300, 400), kernel(310, 320), kernel(0, 900, "CPU")]
    busy_ms, kernels = resident.device_busy_ms(SimpleNamespace(events=lambda: events))
    assert (busy_ms, kernels) == (0.25, 4)


def test_the_dtypes_benchmark_measures_minilm_in_fp16():
    from tools import fetch_minilm
    if not (fetch_minilm.default_dest() / "minilm-fp32" / "model.safetensors").exists():
        pytest.skip("MiniLM's FP32 weights are not fetched (python tools/fetch_minilm.py)")
    done = _run_module("bench.dtypes", "--models", "MiniLM", "--dtypes", "F16", "--repeats", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    row = next(line for line in done.stdout.splitlines() if line.startswith("| MiniLM | F16 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    szt, baseline = float(cells[3]), float(cells[5])
    assert 0.8 < szt < 0.9 and abs(szt - baseline) < 0.01  # the FP16 planes: where the byte-plane baseline is


# -- the vLLM benchmark's table -------------------------------------------------------------------------------------


def test_vllm_table_sets_medians_and_best_rounds_against_safetensors_at_the_same_size(capsys):
    from bench import vllm

    def rounds(loads, share=float("nan")):
        return [{"load_s": x, "ready_s": 30.0, "peak_rss": 6e9, "decoded_share": share} for x in loads]

    runs = [("safetensors", 2), ("szt", 2), ("safetensors", 1), ("szt", 1)]
    samples = {("safetensors", 2): rounds([0.50, 0.40, 0.80]), ("szt", 2): rounds([0.60, 0.20, 0.44], 0.5),
               ("safetensors", 1): rounds([0.30, 0.30]), ("szt", 1): rounds([0.33, 0.27], 1.0)}
    vllm.print_table("llama", 3, runs, samples)
    rows = {(cells[0], int(cells[1])): cells[2:] for cells in
            (line.split() for line in capsys.readouterr().out.splitlines()[3:])}
    load, ready, rss, ratio, best, best_ratio = rows[("szt", 2)][:6]
    assert (float(load), float(ratio)) == (0.44, 0.88)  # median 0.44 against safetensors' 0.50
    assert (float(best), float(best_ratio)) == (0.20, 0.50)  # best 0.20 against safetensors' best 0.40
    assert rows[("szt", 2)][6] == "0.50" and len(rows[("safetensors", 2)]) == 6  # no decoded share for safetensors
    assert [float(x) for x in rows[("szt", 1)][3:6]] == [1.00, 0.27, 0.90]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6])
def test_round_orders_balance_who_runs_first_and_who_follows_whom(n):
    """Over a period of rounds each item runs first equally often, and each ordered pair of items is adjacent equally
    often (a plain rotation keeps "on" after "anchor" in all but one round in four)."""
    from collections import Counter

    items = [f"m{i}" for i in range(n)]
    period = n if n % 2 == 0 else 2 * n
    rounds = [common.round_order(items, r) for r in range(period)]
    assert all(sorted(r) == items for r in rounds)
    assert rounds == [common.round_order(items, r) for r in range(period, 2 * period)]
    assert set(Counter(r[0] for r in rounds).values()) == {period // n}
    pairs = Counter((a, b) for r in rounds for a, b in zip(r, r[1:]))
    assert len(pairs) == n * (n - 1) and len(set(pairs.values())) <= 1
    assert common.round_order([], 3) == []
