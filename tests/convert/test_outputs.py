"""Conversion under contention: two writers racing to one output, a run stopped by a signal, a writer killed
outright and the temporaries it leaves, a source written to while it is converted. Signals go to real ``szconvert``
processes, held mid-conversion by a wrapper that reports each tensor it starts and then waits a little, so a signal
lands while a temporary exists."""

from __future__ import annotations

import importlib
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file as save_safetensors

import szformat
from szformat.cli.main import main
from szformat.codec import cpu
from szformat.convert import convert, verify
from szformat.convert.sources import read_safetensors_header
from szformat.errors import ConversionError, OutputExistsError
from szformat.format import atomic
from szformat.format.atomic import remove_stale_temporaries, rename_no_replace, temporary_name
from support import METADATA, assert_same_tensors, listing, model_tensors, write_pipeline
convert_module = importlib.import_module("szformat.convert.convert")  # the package exports convert()

ROOT = Path(__file__).resolve().parents[2]

# -- two writers, one output -------------------------------------------------------------------------------------


@pytest.mark.parametrize("renameat2", ["renameat2", "link or claimed folder"])
@pytest.mark.parametrize("layout", ["file", "folder"])
def test_two_conversions_racing_to_one_output_leave_one_winner_and_one_complete_output(tmp_path, monkeypatch,
                                                                                       layout, renameat2):
    if renameat2 != "renameat2":
        monkeypatch.setattr(atomic, "_renameat2", lambda: None)
    source, target = conversion_case(tmp_path, layout)
    real = convert_module.write_tensor
    both_started = threading.Barrier(2, timeout=60)
    started: set[int] = set()

    def write_tensor(*args, **kwargs):  # both runs are past the existence check before either can finish
        if threading.get_ident() not in started:
            started.add(threading.get_ident())
            both_started.wait()
        return real(*args, **kwargs)

    monkeypatch.setattr(convert_module, "write_tensor", write_tensor)
    outcomes: list[object] = []

    def run() -> None:
        try:
            outcomes.append(convert(source, target))
        except BaseException as e:  # noqa: BLE001 (the outcome is what the test checks)
            outcomes.append(e)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    errors = [o for o in outcomes if isinstance(o, BaseException)]
    assert len(outcomes) == 2 and len(errors) == 1, outcomes
    assert isinstance(errors[0], OutputExistsError) and isinstance(errors[0], FileExistsError)
    assert str(errors[0]) == f"file {str(target)!r}: exists; pass overwrite=True to replace it"
    assert verify(target).ok
    if layout == "file":
        assert_same_tensors(szformat.load_file(target), model_tensors())
    assert not [p for p in tmp_path.rglob("*.tmp")]


@pytest.mark.parametrize("renameat2", ["renameat2", "link or claimed folder"])
def test_rename_no_replace_refuses_an_existing_file_or_folder(tmp_path, monkeypatch, renameat2):
    if renameat2 != "renameat2":  # where the C library or the file system has no renameat2
        monkeypatch.setattr(atomic, "_renameat2", lambda: None)
    for make in (lambda p: p.write_bytes(b"new"), os.mkdir):
        src = tmp_path / "src"
        make(src)
        for existing in (lambda p: p.write_bytes(b"old"), os.mkdir):
            dst = tmp_path / "dst"
            existing(dst)
            with pytest.raises(FileExistsError):
                rename_no_replace(src, dst)
            assert src.exists() and (dst.is_dir() and not any(dst.iterdir()) or dst.read_bytes() == b"old")
            (dst.rmdir() if dst.is_dir() else dst.unlink())
        rename_no_replace(src, tmp_path / "dst")
        assert not src.exists() and (tmp_path / "dst").exists()
        (tmp_path / "dst").rmdir() if (tmp_path / "dst").is_dir() else (tmp_path / "dst").unlink()


def test_a_large_append_goes_to_the_file_in_pieces_and_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(atomic, "WRITE_PIECE", 1000)
    sizes = []

    class Recording:
        def __init__(self, file):
            self.file = file

        def write(self, data):
            sizes.append(memoryview(data).nbytes)
            return self.file.write(data)

        def __getattr__(self, name):
            return getattr(self.file, name)

    payload = torch.arange(5000, dtype=torch.int16).view(torch.uint8)  # 10,000 bytes
    with atomic.AtomicFile(tmp_path / "out.bin") as f:
        f._file = Recording(f._file)
        f.write(b"head")
        f.write(memoryview(payload.numpy()))
        f.write(b"\0" * 2500)
        f.commit()
    assert (tmp_path / "out.bin").read_bytes() == b"head" + payload.numpy().tobytes() + b"\0" * 2500
    assert sizes == [4] + [1000] * 10 + [1000, 1000, 500]


# -- signals -----------------------------------------------------------------------------------------------------

SLOW_SZCONVERT = textwrap.dedent("""
    import importlib, sys, time
    from szformat.cli.main import main
    convert_module = importlib.import_module("szformat.convert.convert")
    real = convert_module.write_tensor

    def write_tensor(*args, **kwargs):
        print("tensor", flush=True)
        time.sleep(0.3)
        return real(*args, **kwargs)

    convert_module.write_tensor = write_tensor
    sys.exit(main(sys.argv[1:]))
""")


def _interruptible() -> None:
    """In the child: Ctrl-C as a terminal delivers it, even when the tests run in the background (where a shell
    starts jobs with SIGINT ignored, and szconvert, like any program, keeps ignoring it)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_szconvert(*argv: Path | str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-c", SLOW_SZCONVERT, *map(str, argv), "-q"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_interruptible)


def stop_mid_conversion(process: subprocess.Popen, signum: int) -> tuple[int, str]:
    """Wait until the second tensor is being written (a temporary exists), send ``signum``, return (status, stderr)."""
    for _ in range(2):
        assert process.stdout.readline() == "tensor\n", process.stderr.read()
    process.send_signal(signum)
    _, err = process.communicate(timeout=120)
    return process.returncode, err


def conversion_case(tmp_path, layout: str):
    """A source to convert and its target: one safetensors file, or a pipeline folder."""
    if layout == "file":
        save_safetensors(model_tensors(), tmp_path / "model.safetensors", metadata=METADATA)
        source, target = tmp_path / "model.safetensors", tmp_path / "model.szt"
    else:
        write_pipeline(tmp_path / "pipe")
        source, target = tmp_path / "pipe", tmp_path / "out"
    return source, target


@pytest.mark.skipif(os.name != "posix", reason="POSIX signals")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
@pytest.mark.parametrize("layout", ["file", "folder"])
def test_a_stopping_signal_removes_the_temporaries_and_prints_one_line(tmp_path, signum, layout):
    source, target = conversion_case(tmp_path, layout)
    before = listing(tmp_path)
    status, err = stop_mid_conversion(start_szconvert(source, target), signum)
    what = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
    assert (status, err) == (128 + signum, f"szconvert: {what}; no partial output was left\n")
    assert listing(tmp_path) == before


@pytest.mark.skipif(os.name != "posix", reason="POSIX signals")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_an_import_is_held_until_the_import_is_over(tmp_path, signum):
    """A module that receives the signal halfway through its import still finishes it (an exception raised inside
    an import leaves a half-initialised module that the clean-up would trip on); the signal is raised right after."""
    (tmp_path / "slow_module.py").write_text(
        "import os, signal, time\n"
        f"os.kill(os.getpid(), {int(signum)})\n"
        "time.sleep(0.3)\n"
        "COMPLETE = True\n")
    code = ("import sys, time\n"
            "from szformat.cli._signals import Terminated, termination_as_interrupt\n"
            "try:\n"
            "    with termination_as_interrupt():\n"
            "        import slow_module\n"
            "        time.sleep(5)\n"
            "except Terminated as e:\n"
            "    print(e.signum, sys.modules['slow_module'].COMPLETE)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60,
                          preexec_fn=_interruptible)
    assert (done.returncode, done.stdout, done.stderr) == (0, f"{int(signum)} True\n", "")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process probing through /proc")
@pytest.mark.parametrize("layout", ["file", "folder"])
def test_the_next_run_removes_what_a_killed_writer_left(tmp_path, layout):
    source, target = conversion_case(tmp_path, layout)
    before = listing(tmp_path)
    status, _ = stop_mid_conversion(start_szconvert(source, target), signal.SIGKILL)
    assert status == -signal.SIGKILL
    left = [p for p in tmp_path.iterdir() if p.name.startswith(f".{target.name}.") and p.name.endswith(".tmp")]
    assert len(left) == 1  # SIGKILL cannot be handled
    convert(source, target)
    assert listing(tmp_path) == sorted(before + [p for p in listing(tmp_path) if p.startswith(target.name)])
    assert not left[0].exists() and verify(target).ok


def _temporary_of_child(target: Path, *, wait: bool) -> tuple[Path, subprocess.Popen]:
    """The temporary name a child process would give ``target``, created here; the child stays alive if ``wait``."""
    code = (f"from pathlib import Path; from szformat.format.atomic import temporary_name; "
            f"print(temporary_name(Path({str(target)!r})), flush=True)" + ("; input()" if wait else ""))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    line = child.stdout.readline().strip()
    if not line:
        pytest.fail(f"the child wrote no temporary name: {child.communicate(timeout=60)[1]}")
    path = Path(line)
    if not wait:
        child.wait()
    path.write_bytes(b"partial")
    return path, child


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process probing through /proc")
def test_only_temporaries_of_dead_writers_on_this_host_are_removed(tmp_path):
    target = tmp_path / "model.szt"
    dead, _ = _temporary_of_child(target, wait=False)
    alive, child = _temporary_of_child(target, wait=True)
    mine = temporary_name(target)
    mine.mkdir()
    host, pid, start, _random = alive.name[len(".model.szt."): -len(".tmp")].split("-")

    def forged(name: str) -> Path:
        path = tmp_path / name
        path.write_bytes(b"partial")
        return path

    other_host = forged(f".model.szt.{'0' * 8 if host != '0' * 8 else '1' * 8}-{dead.name.split('-', 1)[1]}")
    reused_id = forged(f".model.szt.{host}-{pid}-{int(start) + 1}-{'ab' * 6}.tmp")  # a later process, same id
    other_target = forged(".other.szt." + dead.name[len(".model.szt."):])
    try:
        assert sorted(remove_stale_temporaries(target)) == sorted([dead, reused_id])
        assert all(p.exists() for p in (alive, mine, other_host, other_target))
        assert not dead.exists() and not reused_id.exists()
    finally:
        child.communicate("\n", timeout=60)


# -- a source written to while it is converted -------------------------------------------------------------------


def write_into_source_while_encoding(monkeypatch, source: Path, encoding: str, written: str, data: bytes) -> None:
    """While tensor ``encoding`` is encoded (between its exponent count and its payload), write ``data`` over the
    start of tensor ``written`` in the source file, as another process might."""
    header = read_safetensors_header(source)
    numel = {t.name: math.prod(t.shape) for t in header.tensors}[encoding]
    offset = header.data_start + next(t.begin for t in header.tensors if t.name == written)
    real = cpu.payload_layout
    done = []

    def payload_layout(histogram, codebook):
        layout = real(histogram, codebook)
        if layout.n == numel and not done:
            time.sleep(0.02)  # file times advance by the kernel's clock tick
            with open(source, "r+b") as f:
                os.pwrite(f.fileno(), data, offset)
            done.append(True)
        return layout

    monkeypatch.setattr(cpu, "payload_layout", payload_layout)


HUGE = torch.full((4,), 2.0 ** 100, dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
"""Values with an exponent no tensor of the model has: escapes where the layout counted none."""


@pytest.mark.parametrize("written", [
    "layers.0.attn.q.weight",  # under the codec
    "layers.0.norm.bias",  # another tensor: the bytes converted may mix old and new
])
def test_a_source_changed_during_conversion_is_one_error_naming_file_and_tensor(tmp_path, monkeypatch, capsys,
                                                                                 written, source_reads):
    # Under the codec, read through the mapping, the new bytes break the layout counted before them; read as a copy
    # (pread), the codec works on what it read and the file's new time gives the change away.
    under_the_codec = written == "layers.0.attn.q.weight" and source_reads == "mapped"
    detail = " (the codebook leaves 4 escapes, the layout expects 0)" if under_the_codec else ""
    source, target = tmp_path / "model.safetensors", tmp_path / "model.szt"
    save_safetensors(model_tensors(), source, metadata=METADATA)
    before = listing(tmp_path)
    expected = (f"file {str(source)!r}, tensor 'layers.0.attn.q.weight': the file changed while it was converted"
                f"{detail}; convert it again once nothing writes to it")
    write_into_source_while_encoding(monkeypatch, source, "layers.0.attn.q.weight", written, HUGE)
    with pytest.raises(ConversionError) as caught:
        convert(source, target)
    assert str(caught.value) == expected
    assert listing(tmp_path) == before

    save_safetensors(model_tensors(), source, metadata=METADATA)
    write_into_source_while_encoding(monkeypatch, source, "layers.0.attn.q.weight", written, HUGE)
    assert main([str(source), str(target)]) == 1
    assert capsys.readouterr().err == f"szconvert: error: {expected}\n"
    assert listing(tmp_path) == before
