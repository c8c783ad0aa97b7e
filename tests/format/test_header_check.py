"""The C header check (``_msgpack_check.plain``) that lets msgpack parse a header without Python hooks.

It may only ever change how fast a header parses, never what comes of it: on random msgpack (duplicate, non-string
and many keys, deep nesting, floods of containers, truncations and flipped bytes) the header parser gives the same
object or the same error with the check and without it; headers that keep every rule pass it (or they would all
take the slow path); each rule alone fails it.
"""

from __future__ import annotations

import random
import struct

import msgpack
import pytest

from szformat import save_file
from szformat.errors import HeaderError
from szformat.format import constants as C
from szformat.format import header as header_module
from szformat.format.reader import SztFile

check = pytest.importorskip("szformat.format._msgpack_check",
                            reason="the C extensions were not built here (the hooks alone are the parser then)")

DEPTH = C.MAX_HEADER_DEPTH


def plain(raw: bytes, max_containers: int = 1 << 30) -> bool:
    return check.plain(raw, DEPTH, max_containers)


def outcome(raw: bytes, *, checked: bool, monkeypatch) -> object:
    """What the header parser makes of ``raw``: the object's repr (a NaN equals itself there, and -0.0 differs
    from 0.0), or the error's type and message."""
    monkeypatch.setattr(header_module, "_msgpack_check", check if checked else None)
    try:
        return repr(header_module._unpack(raw, path="h.szt"))
    except HeaderError as e:
        return type(e), str(e)


@pytest.fixture
def rng() -> random.Random:
    seed = random.SystemRandom().randrange(2**32)
    print(f"seed={seed}")
    return random.Random(seed)


class Tree:
    """A random msgpack value written by hand, so a map can hold a key twice or a key that is not a string; it
    remembers whether it keeps the header's rules."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.clean = True
        self.containers = 0

    def value(self, depth: int) -> bytes:
        rng = self.rng
        nest = self.containers < 200 and depth < DEPTH + 2  # deep, but not exponentially large
        kind = rng.choice(["int", "str", "float", "nil", "bin", "ext", "array", "map", "map"] if nest
                          else ["int", "str", "nil"])
        if kind == "int":
            return msgpack.packb(rng.choice([0, 1, -1, 127, 128, -33, 2**16, -2**31, 2**63 - 1, -2**63, 2**64 - 1]))
        if kind == "str":
            return msgpack.packb(rng.choice(["", "a", "é", "x" * 40, "y" * 300]))
        if kind == "float":
            return msgpack.packb(rng.random(), use_single_float=rng.random() < 0.5)
        if kind == "nil":
            return msgpack.packb(rng.choice([None, True, False]))
        if kind == "bin":
            return msgpack.packb(bytes(rng.choice([0, 3, 300])))
        if kind == "ext":
            return msgpack.packb(msgpack.ExtType(rng.randrange(1, 100), bytes(rng.choice([1, 2, 4, 8, 16, 3, 300]))))
        self.containers += 1
        if depth + 1 > DEPTH:
            self.clean = False
        packer = msgpack.Packer()
        count = rng.choice([0, 1, 2, 5, 17, 40])
        if kind == "array":
            return packer.pack_array_header(count) + b"".join(self.value(depth + 1) for _ in range(count))
        keys = [rng.choice(["name", "k%d" % rng.randrange(30), "é", "x" * 40]) for _ in range(count)]
        if len(set(keys)) != len(keys):
            self.clean = False
        out = packer.pack_map_header(count)
        for key in keys:
            if rng.random() < 0.03:
                self.clean = False
                out += msgpack.packb(rng.choice([b"name", 7, None]))
            else:
                out += msgpack.packb(key)
            out += self.value(depth + 1)
        return out


def test_the_check_never_changes_what_a_header_parses_to(rng, monkeypatch):
    taken = 0
    for _ in range(400):
        tree = Tree(rng)
        raw = tree.value(0)
        budget = len(raw) // C.HEADER_BYTES_PER_CONTAINER + 8
        if tree.clean and tree.containers <= budget:
            assert plain(raw, budget), raw[:80]
            taken += 1
        flip = rng.randrange(len(raw))
        for variant in (raw, raw[:rng.randrange(len(raw))], raw + b"\x00",
                        raw[:flip] + bytes([raw[flip] ^ rng.randrange(1, 256)]) + raw[flip + 1:]):
            assert outcome(variant, checked=True, monkeypatch=monkeypatch) == \
                outcome(variant, checked=False, monkeypatch=monkeypatch), variant[:80]
    assert taken > 40  # the fast path was taken often enough for the comparison to mean something


def test_headers_the_writer_makes_pass_the_check(tmp_path, monkeypatch):
    import torch

    tensors = {f"layer.{i}.weight": torch.randn(8, 64).to(torch.bfloat16) for i in range(50)}
    tensors["ids"] = torch.arange(10)
    path = tmp_path / "m.szt"
    save_file(tensors, path, metadata={"format": "pt", "note": "é" * 100})
    with open(path, "rb") as f:
        data = f.read()
    (_, _, _, _, offset, length, *_rest) = C.PREAMBLE.unpack(data[: C.PREAMBLE_SIZE])
    raw = data[offset: offset + length]
    assert plain(raw, length // C.HEADER_BYTES_PER_CONTAINER + 8)
    calls, original = [], msgpack.unpackb
    monkeypatch.setattr(msgpack, "unpackb", lambda *a, **k: calls.append(k) or original(*a, **k))
    with SztFile(path) as f:
        assert set(f.entries) == set(tensors)
    assert calls and "object_pairs_hook" not in calls[0]  # parsed without the hooks


def nested(levels: int) -> bytes:
    return b"\x91" * (levels - 1) + b"\x90"


@pytest.mark.parametrize("raw, rule", [
    (b"\x82\xa1a\x01\xa1a\x02", "a key twice"),
    (b"\x81\xa1x\x82\xa1a\x01\xa1a\x02", "a key twice in a nested map"),
    (b"\x82\xa1a\x01\xd9\x01a\x02", "a key twice, written as str 8 once"),
    (b"\x81\xc4\x01a\x01", "a bin key"),
    (b"\x81\x07\x01", "an int key"),
    (b"\x81\xc0\x01", "a nil key"),
    (nested(DEPTH + 1), "nested one level too deep"),
    (b"\x81\xa1a", "a map that ends before its value"),
    (b"\x92\x01", "an array that ends early"),
    (b"\xda\x00\x05abc", "a string that ends early"),
    (b"\x01\x02", "two objects"),
    (b"\xc1", "the byte msgpack never uses"),
    (b"\xdd\xff\xff\xff\xff\x00", "an array claiming four billion elements"),
    (b"\xdf\xff\xff\xff\xff\x00", "a map claiming four billion pairs"),
    (b"\xdb\xff\xff\xff\xff", "a string claiming four gigabytes"),
    (b"", "nothing"),
])
def test_each_rule_alone_fails_the_check(raw, rule):
    assert not plain(raw), rule


def test_the_limits_are_exact():
    assert plain(nested(DEPTH)) and not plain(nested(DEPTH + 1))
    flood = b"\xdc" + struct.pack(">H", 99) + b"\x90" * 99  # 100 containers
    assert plain(flood, 100) and not plain(flood, 99)


def test_many_keys_are_checked_for_repeats_by_sorting():
    keys = [f"key{i}" for i in range(5000)]
    distinct = msgpack.packb({k: i for i, k in enumerate(keys)})
    assert plain(distinct)
    repeated = msgpack.Packer().pack_map_pairs([(k, 0) for k in keys] + [("key2500", 1)])
    assert not plain(repeated)


def test_bad_arguments_are_refused():
    with pytest.raises(TypeError):
        check.plain(b"\x90", DEPTH)
    with pytest.raises(ValueError, match="max_depth"):
        check.plain(b"\x90", 65, 10)
    with pytest.raises(TypeError):
        check.plain("not bytes", DEPTH, 10)
