"""A short, derandomized run of every fuzz target in ``tools/fuzz.py`` (``python tools/fuzz.py --minutes 5`` runs
them for longer), and proof that each target notices a reader that breaks its contract."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from szformat.format.index import Shard
from szformat.loading import host_decode, host_reader

from tools import fuzz


@pytest.mark.parametrize("target", fuzz.DEFAULT_TARGETS)
def test_a_short_fuzz_run_finds_nothing(target, tmp_path):
    before = fuzz.OUTCOMES.copy()
    cases, findings = fuzz.run_target(target, 150, rng_seed=None, tmp=tmp_path)
    outcomes = fuzz.OUTCOMES - before
    assert findings == [] and cases == 150
    assert outcomes["read"] and outcomes["refused"]  # the inputs reach both sides of the readers' checks


pytestmark = pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisWarning")  # failing examples' long reprs


def test_the_header_target_notices_an_exception_that_is_not_szformat_s(tmp_path, monkeypatch):
    def parse_header(raw, **kw):
        raise KeyError("tensors")

    monkeypatch.setattr(fuzz, "parse_header", parse_header)
    _, findings = fuzz.run_target("header", 20, rng_seed=None, tmp=tmp_path)
    assert len(findings) == 1 and "KeyError escaped" in findings[0]


def test_the_file_target_notices_a_silently_wrong_tensor(tmp_path, monkeypatch):
    real = host_decode.check_decoded_payload

    def escapes_only(entry, stored, decoded, error, **kwargs):  # what the kernels found, but no CRC-32 compared
        real(entry, stored, decoded, error, **{**kwargs, "check_stored": False, "check_decoded": False})

    monkeypatch.setattr(host_reader, "check_crc", lambda *args, **kwargs: None)  # a reader that checks no payload CRC
    monkeypatch.setattr(host_decode, "check_crc", lambda *args, **kwargs: None)
    monkeypatch.setattr(host_decode, "compare_crc", lambda *args, **kwargs: None)
    monkeypatch.setattr(host_decode, "check_decoded_payload", escapes_only)
    _, findings = fuzz.run_target("file", 300, rng_seed=None, tmp=tmp_path)
    assert len(findings) == 1
    assert "loaded unlike its header says" in findings[0] or "loaded with other values" in findings[0]


def test_the_index_target_notices_a_shard_outside_the_folder(tmp_path, monkeypatch):
    real = fuzz.checkpoint_shards
    elsewhere = lambda path: [Shard(Path("/elsewhere.szt"), None, path)] + real(path)  # noqa: E731
    monkeypatch.setattr(fuzz, "checkpoint_shards", elsewhere)
    _, findings = fuzz.run_target("index", 20, rng_seed=None, tmp=tmp_path)
    assert len(findings) == 1 and "outside its folder" in findings[0]


def test_without_hypothesis_the_fuzzer_says_what_to_install_in_one_line(tmp_path):
    import subprocess
    import sys

    blocker = tmp_path / "hypothesis.py"
    blocker.write_text("raise ImportError('No module named hypothesis')\n")  # as if it were not installed
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, str(root / "tools" / "fuzz.py"), "--examples", "1"], cwd=tmp_path,
                          capture_output=True, text=True,
                          env={"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
                               "PATH": "/usr/bin:/bin"})
    assert done.returncode == 1
    assert done.stderr == 'tools/fuzz.py needs hypothesis, one of the test extras: pip install -e ".[test]"\n'
