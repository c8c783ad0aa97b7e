"""Fuzz the readers of .szt files with Hypothesis: the header parser, the whole-file reader, the sharded index.

Each target feeds generated inputs to one reader and checks its contract: it returns, or it raises an
``SzformatError`` (whose message names the file); any other exception, or a hang, is a finding. Inputs start from
the golden vectors in ``spec/vectors/`` and are mutated, some without fixing any checksum, some with every checksum
recomputed so they reach the checks behind them:

- ``header``: ``parse_header`` on mutated header objects (values replaced by hostile ones, keys dropped or added),
  on mutated msgpack bytes and on random bytes. A header it accepts must obey the placement rule, and the C check
  of plain entries (``_entries``) must change nothing: the same entries, or the same error, without it. The 1.1 vectors
  (the at-rest form) are seeds too: their headers are edited as msgpack and stored through zstd again.
- ``file``: ``load_file`` and ``safe_open`` (``get_tensor``, ``get_slice``, with and without ``verify``) on whole
  files: random byte edits with no checksum fixed (then, with ``verify``, a file that loads must give the vector's
  own tensors: no silent wrong tensor), header edits and payload edits with the checksums recomputed (then every
  tensor that loads must match its header's ``raw_crc32``, shape and ``raw_length``).
- ``index``: ``read_index`` and ``checkpoint_shards`` on mutated ``model.szt.index.json`` files beside two real
  shards, with the shard names and JSON values that break readers most; they must agree, and name no shard outside
  the index's folder. ``index_load`` also loads through them: every shard name must fail as an SzformatError.
- ``bombs``: small files that declare gigabytes (an all-zero tensor whose streams are zstd frames, a zstd header of
  short strings): a file past the spec's expansion or header bound must be refused, every other one read right,
  and no read may raise the peak memory by more than about 12 times the file's size.

Usage:
    python tools/fuzz.py --minutes 5                 # every target, rounds of each in turn until time is up
    python tools/fuzz.py --targets header file --examples 2000 --seed 7

It prints, per target, the cases run and the findings (each with Hypothesis's smallest failing example and its
round's seed: ``--seed SEED --examples N --targets TARGET`` runs that round again) and exits 1 if there is any.
``tests/tools/test_fuzz.py`` runs every default target for a few derandomized examples in the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import sys
import tempfile
import time
import traceback
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import msgpack
import zstandard

try:
    from hypothesis import HealthCheck, given, seed, settings
    from hypothesis import strategies as st
except ImportError:  # the fuzz targets are hypothesis strategies: say what to install rather than a traceback
    if __name__ == "__main__":
        sys.exit("tools/fuzz.py needs hypothesis, one of the test extras: pip install -e \".[test]\"")
    raise

ROOT = Path(__file__).resolve().parents[1]

from szformat import SzformatError, load_file, safe_open  # noqa: E402
from szformat.errors import DecodeRouteError  # noqa: E402
from szformat.checksum import tensor_crc32  # noqa: E402
from szformat.format import constants as C  # noqa: E402
from szformat.format import at_rest as A  # noqa: E402
from szformat.format.at_rest import compress_frame  # noqa: E402
from szformat.format import header as header_module  # noqa: E402
from szformat.format.header import parse_header, payload_alignment  # noqa: E402
from szformat.format.index import checkpoint_shards, read_index  # noqa: E402
from szformat.format.writer import tensor_bytes  # noqa: E402
from tools import make_vectors  # noqa: E402

VECTORS = ROOT / "spec" / "vectors"

# ---------------------------------------------------------------------------------------------------------------
# Seeds: the golden vectors, taken apart once
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, repr=False)
class Seed:
    """A valid file: its bytes, where its header is, its header object (and its msgpack bytes, inflated when the
    file stores its header through zstd: a 1.1 file, whose edited headers are stored that way again), and the
    tensors it decodes to."""

    name: str
    data: bytes
    header_offset: int
    alignment: int
    header: dict
    tensors: dict[str, bytes]
    header_bytes: bytes
    header_zstd: bool

    def __repr__(self) -> str:  # Hypothesis prints failing examples: the file's name says which one
        return f"<{self.name}>"


def _seeds() -> list[Seed]:
    listing = json.loads((VECTORS / "vectors.json").read_text(encoding="utf-8"))
    files = [case["szt"]["file"] for case in listing["cases"] + listing["read_cases"]]
    seeds = []
    for file in files:
        data = (VECTORS / file).read_bytes()
        fields = C.PREAMBLE.unpack(data[: C.PREAMBLE_SIZE])
        header_offset, alignment, header_zstd = fields[4], fields[7], bool(fields[3] & C.FLAG_HEADER_ZSTD)
        header = data[header_offset:]
        if header_zstd:
            header = zstandard.ZstdDecompressor().decompress(header)
        try:
            tensors = {name: bytes(tensor_bytes(t).numpy()) for name, t in load_file(VECTORS / file).items()}
        except DecodeRouteError:  # a dtype this torch lacks (float8_e8m0fnu before torch 2.7): not a seed here
            continue
        seeds.append(Seed(file, data, header_offset, alignment, msgpack.unpackb(header), tensors, header,
                          header_zstd))
    return seeds


SEEDS = _seeds()

# ---------------------------------------------------------------------------------------------------------------
# Hostile values
# ---------------------------------------------------------------------------------------------------------------

EDGE_INTEGERS = [0, 1, -1, 2, 3, 4, 63, 64, 100, 255, 256, 1023, 1024, 1025, 4095, 4096, 65535, 65536,
                 (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32, 1 << 41, (1 << 41) + 1, 1 << 56, (1 << 56) + 1,
                 (1 << 63) - 1, 1 << 63, (1 << 64) - 1, -(1 << 63)]
EDGE_STRINGS = ["", "a", "BF16", "F32", "raw", "splitzip", "__metadata__", "\x00", "a\x00b", "é", "x" * 5000,
                "tensors", "name", "encoding", "configuration", "streams", "pk"]

json_scalars = st.one_of(
    st.none(), st.booleans(), st.sampled_from(EDGE_INTEGERS),
    st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(EDGE_STRINGS), st.text(max_size=20))


def _nest(leaves: st.SearchStrategy) -> st.SearchStrategy:
    return st.recursive(leaves, lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=12) | st.sampled_from(EDGE_STRINGS), inner,
                                                     max_size=5)), max_leaves=12)


msgpack_values = _nest(json_scalars | st.binary(max_size=20))
json_values = _nest(json_scalars)


def _containers(obj: Any, path: tuple = ()) -> list[tuple]:
    """Paths (key sequences) of every map and array in ``obj``, ``()`` for ``obj`` itself."""
    found = [path] if isinstance(obj, (dict, list)) else []
    children = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for key, child in children:
        found += _containers(child, (*path, key))
    return found


def _at(obj: Any, path: tuple) -> Any:
    for key in path:
        obj = obj[key]
    return obj


@st.composite
def mutated_objects(draw: st.DrawFn, obj: Any, values: st.SearchStrategy = msgpack_values) -> Any:
    """``obj`` (a header or index object) after 1 to 4 edits: a value replaced, a key dropped or added, a list
    entry repeated or dropped."""
    obj = msgpack.unpackb(msgpack.packb(obj))  # a deep copy with msgpack's types
    for _ in range(draw(st.integers(1, 4))):
        paths = _containers(obj)
        target = _at(obj, draw(st.sampled_from(paths)))
        op = draw(st.sampled_from(["replace", "drop", "add", "repeat"]))
        keys = list(target) if isinstance(target, dict) else list(range(len(target)))
        if op == "add" or not keys:
            if isinstance(target, dict):
                target[draw(st.sampled_from(EDGE_STRINGS) | st.text(max_size=12))] = draw(values)
            else:
                target.append(draw(values))
            continue
        key = draw(st.sampled_from(keys))
        if op == "replace":
            target[key] = draw(values)
        elif op == "drop":
            del target[key]
        elif isinstance(target, list):
            target.append(msgpack.unpackb(msgpack.packb(target[key])))
        else:
            target[key + "_"] = target[key]
    return obj


@st.composite
def byte_edits(draw: st.DrawFn, data: bytes, regions: list[tuple[int, int]] | None = None) -> bytes:
    """``data`` after 1 to 4 edits: a bit flipped, a byte set, a range dropped, repeated or cut off, bytes inserted.

    Each edit lands in one of ``regions`` (``(start, stop)`` ranges, the whole of ``data`` by default), picked first,
    so a small region (a preamble) is hit as often as a large one (the payloads).
    """
    data = bytearray(data)
    regions = [r for r in regions or [(0, len(data))] if r[0] < r[1]]
    for _ in range(draw(st.integers(1, 4))):
        start, stop = draw(st.sampled_from(regions))
        if len(data) <= start:
            data += draw(st.binary(min_size=1, max_size=8))
            continue
        at = draw(st.integers(start, min(stop, len(data)) - 1))
        op = draw(st.sampled_from(["flip", "set", "drop", "repeat", "insert", "truncate"]))
        if op == "flip":
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "set":
            data[at] = draw(st.sampled_from([0, 1, 0x7F, 0x80, 0xC0, 0xC1, 0xDC, 0xDD, 0xDE, 0xDF, 0xFF]))
        elif op == "drop":
            del data[at: at + draw(st.integers(1, 16))]
        elif op == "repeat":
            data[at:at] = data[at: at + draw(st.integers(1, 16))]
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        else:
            del data[at:]
    return bytes(data)


def with_header(seed_file: Seed, header: bytes, body: bytes | None = None) -> bytes:
    """A file of the seed's preamble, ``body`` (the bytes from the preamble's end to the header; the seed's by
    default) and ``header`` (msgpack bytes, stored through zstd when the seed's is), the preamble's header length,
    checksum and file length made to agree."""
    body = seed_file.data[C.PREAMBLE_SIZE: seed_file.header_offset] if body is None else body
    if seed_file.header_zstd:
        header = compress_frame(header)
    fields = list(C.PREAMBLE.unpack(seed_file.data[: C.PREAMBLE_SIZE]))
    fields[5], fields[6], fields[8] = len(header), zlib.crc32(header), C.PREAMBLE_SIZE + len(body) + len(header)
    fields[4] = C.PREAMBLE_SIZE + len(body)
    return C.PREAMBLE.pack(*fields) + body + header


# ---------------------------------------------------------------------------------------------------------------
# Targets
# ---------------------------------------------------------------------------------------------------------------


class Finding(AssertionError):
    """A reader broke its contract."""


OUTCOMES: Counter[str] = Counter()
"""How many reader calls returned (``read``) and how many refused their input (``refused``)."""


def _expect_szformat_error(run: Callable[[], Any]) -> Any:
    """``run()``'s result, or None when it raised an SzformatError; anything else raised is a finding."""
    try:
        result = run()
    except SzformatError as e:
        if e.path is None:
            raise Finding(f"an SzformatError names no file: {e}") from e
        OUTCOMES["refused"] += 1
        return None
    except Exception as e:  # noqa: BLE001 - the contract is about which exceptions escape
        raise Finding(f"{type(e).__name__} escaped: {e}") from e
    OUTCOMES["read"] += 1
    return result


def _header_inputs() -> st.SearchStrategy:
    def mutated_header(s: Seed) -> st.SearchStrategy:
        return mutated_objects(s.header).map(lambda h: (s, msgpack.packb(h)))

    def mutated_bytes(s: Seed) -> st.SearchStrategy:
        return byte_edits(s.header_bytes).map(lambda b: (s, b))

    seeds = st.sampled_from(SEEDS)
    return st.one_of(seeds.flatmap(mutated_header), seeds.flatmap(mutated_bytes),
                     st.tuples(seeds, st.binary(max_size=256)))


def _check_header(case: tuple[Seed, bytes], tmp: Path) -> None:
    s, raw = case
    header = _expect_szformat_error(lambda: parse_header(raw, path="fuzz.szt", alignment=s.alignment,
                                                         header_offset=s.header_offset))
    if header_module._entries is not None and _parsed(s, raw, plain=True) != _parsed(s, raw, plain=False):
        raise Finding("the C check of plain entries changed what a header parses to")
    if header is None:
        return
    cursor = C.PREAMBLE_SIZE
    for entry in header.tensors:
        alignment = payload_alignment(entry.length, s.alignment, header.small_alignment)
        if entry.offset != C.pad_to(cursor, alignment) or entry.length < 0:
            raise Finding(f"accepted a misplaced payload: {entry}")
        if entry.layout is not None and entry.at_rest is None and entry.layout.comp_bytes != entry.length:
            raise Finding(f"accepted a splitzip length that is not its layout's: {entry}")
        cursor = entry.offset + entry.length
    if cursor != s.header_offset:
        raise Finding("accepted a header whose payloads do not end where it starts")


def _parsed(s: Seed, raw: bytes, *, plain: bool) -> Any:
    """What ``parse_header`` makes of ``raw``, its entries' C check on or off: the header's fields, or the error's
    type and message."""
    check, header_module._entries = header_module._entries, header_module._entries if plain else None
    try:
        header = parse_header(raw, path="fuzz.szt", alignment=s.alignment, header_offset=s.header_offset)
        return header.tensors, header.metadata, header.required_features, header.small_alignment
    except SzformatError as e:
        return type(e), str(e)
    finally:
        header_module._entries = check


def _file_inputs() -> st.SearchStrategy:
    """(seed, file bytes, whether any checksum was recomputed)."""
    def raw_edits(s: Seed) -> st.SearchStrategy:
        regions = [(0, C.PREAMBLE_SIZE), (C.PREAMBLE_SIZE, s.header_offset), (s.header_offset, len(s.data))]
        return byte_edits(s.data, regions).map(lambda b: (s, b, False))

    def header_edits(s: Seed) -> st.SearchStrategy:
        return mutated_objects(s.header).map(lambda h: (s, with_header(s, msgpack.packb(h)), True))

    def payload_edits(s: Seed) -> st.SearchStrategy:
        def fix(edited: bytes) -> tuple:
            edited = edited[: s.header_offset].ljust(s.header_offset, b"\0")  # payloads stay where they were
            header = msgpack.unpackb(msgpack.packb(s.header))
            for entry in header["tensors"]:  # every stored-bytes CRC made right again (of raw ones: both)
                entry["crc32"] = zlib.crc32(edited[entry["offset"]: entry["offset"] + entry["length"]])
                if entry["encoding"]["name"] == "raw":
                    entry["raw_crc32"] = entry["crc32"]
            return s, with_header(s, msgpack.packb(header), edited[C.PREAMBLE_SIZE:]), True
        return byte_edits(s.data[: s.header_offset], [(C.PREAMBLE_SIZE, s.header_offset)]).map(fix)

    seeds = st.sampled_from([s for s in SEEDS if s.header["tensors"]])
    return st.one_of(seeds.flatmap(raw_edits), seeds.flatmap(header_edits), seeds.flatmap(payload_edits))


def _check_file(case: tuple[Seed, bytes, bool], tmp: Path) -> None:
    s, data, recomputed = case
    path = tmp / "fuzz.szt"
    path.write_bytes(data)
    for verify in (True, False):
        loaded = _expect_szformat_error(lambda: load_file(path, verify=verify))
        if loaded is None or not verify:
            continue
        _expect_szformat_error(lambda: _slices(path))
        with safe_open(path, framework="pt") as f:
            entries = {name: f.entry(name) for name in f.keys()}
        for name, tensor in loaded.items():
            got = bytes(tensor_bytes(tensor).numpy())
            e = entries[name]
            if tensor_crc32(tensor_bytes(tensor)) != e.raw_crc32 or tuple(tensor.shape) != e.shape \
                    or len(got) != e.raw_length:
                raise Finding(f"tensor {name!r} loaded unlike its header says")
            if not recomputed and got != s.tensors.get(name, got):
                raise Finding(f"tensor {name!r} of {s.name} loaded with other values and no checksum failed")


def _slices(path: Path) -> None:
    """Read a few rows of every tensor with ``get_slice``, from the middle and the end."""
    with safe_open(path, framework="pt", verify=False) as f:
        for name in f.keys():
            rows = f.get_slice(name)
            shape = rows.get_shape()
            if shape and shape[0]:
                rows[shape[0] // 2: shape[0]]
                rows[-1]


SHARD_NAMES = ["s1.szt", "s2.szt", "", ".", "..", "../s1.szt", "/s1.szt", "s1.szt/", "sub/../s1.szt", "a\\s1.szt",
               "s1.szt\x00", "\x00", "x" * 300 + ".szt", "é.szt", "\ud800.szt", "s1.SZT", "missing.szt", "sub",
               "s1.szt/x", "./s1.szt", "loop.szt", "fifo.szt", "model.szt.index.json"]


VALID_INDEX = {"metadata": {"total_size": 2688, "format": "pt"},
               "weight_map": {"a": "s1.szt", "b": "s1.szt", "c": "s1.szt", "model.embed": "s2.szt",
                              "model.norm": "s2.szt"}}
"""The index of the shards :func:`_index_folder` makes."""


def _index_folder(tmp: Path) -> Path:
    """A folder with two real shards (the vectors ``alignment_64`` and ``metadata``), a subfolder, a link loop and
    (where the system has them) a FIFO."""
    folder = tmp / "checkpoint"
    if not folder.exists():
        folder.mkdir()
        shutil.copy(VECTORS / "alignment_64.szt", folder / "s1.szt")
        shutil.copy(VECTORS / "metadata.szt", folder / "s2.szt")
        (folder / "sub").mkdir()
        (folder / "loop.szt").symlink_to("loop.szt")
        if hasattr(os, "mkfifo"):
            os.mkfifo(folder / "fifo.szt")
    return folder


@st.composite
def _index_inputs(draw: st.DrawFn) -> bytes:
    index = json.loads(json.dumps(VALID_INDEX))
    kind = draw(st.sampled_from(["shards", "object", "text"]))
    if kind == "shards":  # tensors mapped to hostile shard names
        for tensor in draw(st.lists(st.sampled_from(list(index["weight_map"]) + ["extra"]), min_size=1, max_size=3)):
            index["weight_map"][tensor] = draw(st.sampled_from(SHARD_NAMES) | st.text(max_size=8))
    elif kind == "object":
        index = draw(mutated_objects(index, json_values))
    text = json.dumps(index, ensure_ascii=draw(st.booleans()))
    if kind == "text":
        return draw(byte_edits(text.encode("utf-8", "surrogatepass")))
    return text.encode("utf-8", "surrogatepass")


def _check_index(data: bytes, tmp: Path) -> Path:
    """The index reader: parsing, validation, and the list of shards to open."""
    path = _index_folder(tmp) / "model.szt.index.json"
    path.write_bytes(data)
    index = _expect_szformat_error(lambda: read_index(path))
    shards = _expect_szformat_error(lambda: checkpoint_shards(path))
    if (index is None) != (shards is None):
        raise Finding("read_index and checkpoint_shards disagree on whether the index is valid")
    for shard in shards or ():
        if shard.path.parent != path.parent and path.parent not in shard.path.parents:
            raise Finding(f"the index names a shard outside its folder: {shard.path}")
    return path


def _check_index_load(data: bytes, tmp: Path) -> None:
    """The whole load through an index: what it names is opened, so every shard name must fail as an SzformatError."""
    path = _check_index(data, tmp)
    _expect_szformat_error(lambda: load_file(path))


def _bomb_inputs() -> st.SearchStrategy:
    """(file bytes, whether it breaks a bound): the all-zero tensor of ``at_rest_zeros`` restaged to declare up to
    2^32 elements with some of its streams as zstd frames, and its header padded with short strings under an unknown
    key, stored through zstd as that seed's is: small files that would cost up to gigabytes."""
    zeros = next(s for s in SEEDS if s.name == "at_rest_zeros.szt")
    short_strings = [f"{i:04x}"[2:] for i in range(1 << 20)]  # two characters each: what costs a parser most

    @st.composite
    def build(draw: st.DrawFn) -> tuple[bytes, bool]:
        big = draw(st.booleans())
        streams = ("pk", "sm") if big else draw(st.sampled_from([("pk",), ("sm",), ("pk", "sm")]))
        numel = draw(st.integers(64, 2048) if big else st.integers(1, 4)) << 21
        parts = make_vectors.Parts.of(zeros.data)
        make_vectors.restage_zeros(parts, "zeros", numel, streams)
        padding = draw(st.sampled_from([0, 1 << 10, 1 << 20]))
        parts.header["padding"] = short_strings[:padding]
        header = msgpack.packb(parts.header)
        parts.header_bytes = compress_frame(header, 3)
        layout_bytes = 3 * numel // 2  # pk and sm of a tensor without escapes
        broken = (layout_bytes > A.MAX_EXPANSION * parts.entry("zeros")["length"]
                  or len(header) > C.header_inflate_limit(len(parts.header_bytes)))
        return parts.to_bytes(), broken
    return build()


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _check_bomb(case: tuple[bytes, bool], tmp: Path) -> None:
    data, broken = case
    path = tmp / "bomb.szt"
    path.write_bytes(data)
    before = _peak_rss()
    loaded = _expect_szformat_error(lambda: load_file(path))
    grown = _peak_rss() - before
    if grown > 12 * len(data) + (64 << 20):
        raise Finding(f"reading a file of {len(data)} bytes raised the peak memory by {grown} bytes")
    if broken and loaded is not None:
        raise Finding("a file past the expansion or header bound was read")
    if not broken and (loaded is None or any(t.count_nonzero() for t in loaded.values())):
        raise Finding("a valid all-zero file was refused or read wrong")


TARGETS: dict[str, tuple[Callable[[], st.SearchStrategy], Callable[[Any, Path], None]]] = {
    "header": (_header_inputs, _check_header),
    "file": (_file_inputs, _check_file),
    "index": (_index_inputs, _check_index),
    "index_load": (_index_inputs, _check_index_load),
    "bombs": (_bomb_inputs, _check_bomb),
}
DEFAULT_TARGETS = list(TARGETS)

# ---------------------------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------------------------


def run_target(name: str, examples: int, *, rng_seed: int | None, tmp: Path) -> tuple[int, list[str]]:
    """Run target ``name`` for ``examples`` inputs (``rng_seed`` None: derandomized); (cases run, findings).

    :data:`OUTCOMES` counts the reader calls of the cases run."""
    make_strategy, check = TARGETS[name]
    count = 0

    def body(case: Any) -> None:
        nonlocal count
        count += 1
        check(case, tmp)

    test = settings(max_examples=examples, deadline=None, database=None, derandomize=rng_seed is None,
                    suppress_health_check=list(HealthCheck), report_multiple_bugs=False)(given(make_strategy())(body))
    if rng_seed is not None:
        test = seed(rng_seed)(test)
    try:
        test()
    except Finding as e:
        notes = "\n".join(getattr(e, "__notes__", []))
        return count, [f"{e}\n{notes}"]
    except Exception:  # noqa: BLE001 - a bug in the harness is reported, not hidden
        return count, [traceback.format_exc()]
    return count, []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", nargs="+", choices=list(TARGETS), default=DEFAULT_TARGETS)
    parser.add_argument("--minutes", type=float, default=None, help="run rounds of every target until this is up")
    parser.add_argument("--examples", type=int, default=500, help="inputs per target per round (default 500)")
    parser.add_argument("--seed", type=int, default=None, help="first round's seed (default: random)")
    args = parser.parse_args(argv)

    first_seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 32)
    deadline = time.monotonic() + 60 * args.minutes if args.minutes else None
    totals = {name: Counter() for name in args.targets}
    findings: dict[str, list[str]] = {name: [] for name in args.targets}
    start, rounds = time.monotonic(), 0
    with tempfile.TemporaryDirectory(prefix="szformat-fuzz-") as tmp:
        while True:
            for name in args.targets:
                folder = Path(tmp) / name
                folder.mkdir(exist_ok=True)
                before = OUTCOMES.copy()
                count, found = run_target(name, args.examples, rng_seed=first_seed + rounds, tmp=folder)
                totals[name].update(OUTCOMES - before)
                totals[name]["cases"] += count
                findings[name] += found
                for finding in found:
                    print(f"[{name}] finding (round seed {first_seed + rounds}):\n{finding}", file=sys.stderr)
            rounds += 1
            done = sum(t["cases"] for t in totals.values())
            print(f"round {rounds}: {done} cases, {sum(map(len, findings.values()))} findings, "
                  f"{time.monotonic() - start:.0f} s", file=sys.stderr)
            if deadline is None or time.monotonic() >= deadline:
                break
    print(f"fuzz: {rounds} round(s) of {args.examples} inputs per target from seed {first_seed}, "
          f"{time.monotonic() - start:.0f} s")
    print(f"{'target':<11} {'cases':>9} {'reads returned':>15} {'refused':>9} {'findings':>9}")
    for name in args.targets:
        t = totals[name]
        print(f"{name:<11} {t['cases']:>9} {t['read']:>15} {t['refused']:>9} {len(findings[name]):>9}")
    return 1 if any(findings.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
