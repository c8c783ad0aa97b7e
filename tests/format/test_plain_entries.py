"""The C check of a header's plain tensor entries (``_entries.plain_entries``) that spares the Python parse.

It may only ever change how fast a header parses, never what comes of it: every entry it takes apart is the entry
``_parse_entry`` makes of the same item, and any item it declines is parsed (or refused, with the same error) by
``_parse_entry``. Checked on every golden vector, refused ones included, and on entries mutated at random (fresh
seeds) and at each rule's edge; the entries a writer makes are plain, or the fast path would never be taken.
"""

from __future__ import annotations

import copy
import dataclasses
import random
from pathlib import Path

import pytest
import torch

from szformat import save_file
from szformat.errors import SzformatError
from szformat.format import constants as C
from szformat.format import header as header_module
from szformat.format.reader import SztFile

entries_check = pytest.importorskip("szformat.format._entries",
                                    reason="the C extensions were not built here (_parse_entry parses every entry)")

VECTORS = Path(__file__).resolve().parents[2] / "spec" / "vectors"


@pytest.fixture
def rng() -> random.Random:
    seed = random.SystemRandom().randrange(2**32)
    print(f"seed={seed}")
    return random.Random(seed)


def opened(path: Path, *, plain: bool, monkeypatch) -> object:
    """What the reader makes of ``path``'s header: its entries and metadata, or the error's type and message."""
    monkeypatch.setattr(header_module, "_entries", entries_check if plain else None)
    try:
        with SztFile(path) as f:
            return f.header.tensors, f.header.metadata, f.header.required_features, f.header.small_alignment
    except SzformatError as e:
        return type(e), str(e)


@pytest.mark.parametrize("path", sorted(VECTORS.glob("*.szt")), ids=lambda p: p.name)
def test_every_vector_opens_alike_with_the_check_and_without(path, monkeypatch):
    assert opened(path, plain=True, monkeypatch=monkeypatch) == opened(path, plain=False, monkeypatch=monkeypatch)


def header_items(tmp_path: Path) -> list[dict]:
    """The tensor items of a header as a writer makes them: SplitZip with and without escapes and block checksums,
    raw for a reason (below the coverage gate), raw for its dtype, an empty tensor, an odd size."""
    g = torch.Generator().manual_seed(0)
    tensors = {
        "weight": (torch.randn(1100, 1000, generator=g) * 0.02).to(torch.bfloat16),  # 2.2 MB: block checksums
        "escapes": torch.cat([torch.randn(3001, generator=g), torch.tensor([1e30, 1e-30, 2e-38, 3e35])])
                        .to(torch.bfloat16),
        "noise": torch.randint(0, 1 << 16, (4096,), generator=g, dtype=torch.int32).to(torch.int16)
                      .view(torch.bfloat16),
        "ids": torch.arange(10, dtype=torch.int64),
        "empty": torch.zeros(0, 7, dtype=torch.bfloat16),
    }
    path = tmp_path / "m.szt"
    save_file(tensors, path)
    with SztFile(path) as f:
        return [entry.to_dict() for entry in f.header.tensors]


def same_record(made: object, expected: object) -> bool:
    """Whether two records are of one class and hold the same attributes, their records alike in turn: equal
    dataclasses could still differ in what their dicts hold past their fields."""
    if not dataclasses.is_dataclass(expected):
        return made == expected and type(made) is type(expected)
    return type(made) is type(expected) and vars(made).keys() == vars(expected).keys() and \
        all(same_record(value, getattr(expected, key)) for key, value in vars(made).items())


def agree(item: object) -> bool:
    """Whether the check and the parser agree on ``item``: declined, or taken apart into exactly the entry the
    parser makes (the parser must accept it then). Returns whether it was taken."""
    [made] = header_module._plain_entries([item])
    if made is None:
        return False
    expected = header_module._parse_entry(copy.deepcopy(item), index=0, path="m.szt")
    assert made == expected and same_record(made, expected)
    assert type(made.shape) is tuple and type(made.offset) is int and type(made.crc32) is int
    return True


def test_entries_a_writer_makes_are_plain(tmp_path):
    items = header_items(tmp_path)
    assert {item["encoding"]["name"] for item in items} == {C.ENCODING_SPLITZIP, C.ENCODING_RAW}
    assert any("block_crc32" in item for item in items)
    assert any(item["encoding"].get("configuration", {}).get("reason") for item in items)
    assert all(agree(item) for item in items)


def _paths(value: object, prefix: tuple = ()) -> list[tuple]:
    """Every key or index path inside a nested item, containers included."""
    found = [prefix] if prefix else []
    if isinstance(value, dict):
        for key, child in value.items():
            found += _paths(child, prefix + (key,))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            found += _paths(child, prefix + (index,))
    return found


REPLACEMENTS = [None, True, False, 0, 1, -1, 255, 256, 1023, 1024, 2**32 - 1, 2**32, 2**56, 2**63 - 1, 2**63, 2**64,
                0.0, 0.5, 1.0, 1.5, float("nan"), -0.0, "", "BF16", "F32", "raw", "splitzip", "__metadata__", "a\x00b",
                "é" * 3000, b"bytes", [], [0], {}, {"size": 4096}]


def test_randomly_mutated_entries_are_taken_only_as_the_parser_takes_them(tmp_path, rng):
    items = header_items(tmp_path)
    taken = declined = 0
    for _ in range(3000):
        item = copy.deepcopy(rng.choice(items))
        path = rng.choice(_paths(item))
        *inside, last = path
        parent = item
        for step in inside:
            parent = parent[step]
        action = rng.random()
        if action < 0.15 and isinstance(parent, dict):
            del parent[last]
        elif action < 0.25 and isinstance(parent, dict):
            parent["unknown_" + str(rng.randrange(3))] = rng.choice(REPLACEMENTS)  # ignored by both
        elif action < 0.5 and type(parent[last]) is int:
            parent[last] += rng.choice([-1, 1, -4, 4, 1 << 20])
        else:
            parent[last] = rng.choice(REPLACEMENTS)
        try:
            if agree(item):
                taken += 1
            else:
                declined += 1
        except SzformatError:  # the parser refuses what the check took: the assertion below says so
            raise AssertionError(f"the check took an item the parser refuses: {path} of {item!r:.400}") from None
    assert taken > 100 and declined > 1000  # both sides of the fast path were exercised


def _splitzip(tmp_path: Path) -> dict:
    return next(i for i in header_items(tmp_path) if i["name"] == "escapes")


def _raw(tmp_path: Path) -> dict:
    return next(i for i in header_items(tmp_path) if i["name"] == "ids")


RAW_EDITS = [  # (edit, whether the check takes the item): it declines all the parser refuses, and a tuple shape
    (lambda i: i.update(name="é" * 2048), True),  # 4096 UTF-8 bytes: the longest name
    (lambda i: i.update(name="é" * 2048 + "x"), False),
    (lambda i: i.update(name="__metadata__"), False),
    (lambda i: i.update(name="a\x00"), False),
    (lambda i: i.update(name=""), False),
    (lambda i: i.update(shape=[2**56, 0, 2**56], raw_length=0, length=0, crc32=0, raw_crc32=0), True),  # no elements
    (lambda i: i.update(shape=[2**28, 2**28, 2], raw_length=2**60), False),  # 2**57 elements: past the limit
    (lambda i: i.update(shape=[1] * 33), False),
    (lambda i: i.update(shape=[10, True]), False),
    (lambda i: i.update(shape=(10,)), False),  # the parser takes a tuple; msgpack never makes one
    (lambda i: i.update(offset=True), False),
    (lambda i: i.update(crc32=2**32), False),
    (lambda i: i.update(raw_crc32=i["crc32"] ^ 1), False),
    (lambda i: i["encoding"].update(configuration={"reason": None}), False),
    (lambda i: i["encoding"].update(configuration={"reason": "below the gate", "more": 1}), True),
    (lambda i: i["encoding"].update(configuration=[]), False),
    (lambda i: i["encoding"].update(at_rest={}), False),
    (lambda i: i["encoding"].update(name="zip"), False),
    (lambda i: i.update(dtype="F8_E4M3", raw_length=10), False),
    (lambda i: i.update(dtype="F8_E4M3", raw_length=10, length=10), True),
]

SPLITZIP_EDITS = [
    (lambda c: c.update(coverage=0.0, more="ignored"), True),
    (lambda c: c.update(coverage=1), False),  # an int, not a float
    (lambda c: c.update(coverage=float("nan")), False),
    (lambda c: c.update(coverage=1.0000001), False),
    (lambda c: c.update(chunk_size=2048), False),
    (lambda c: c.update(n_codes_used=17), False),
    (lambda c: c.update(n_codes_used=c["n_codes_used"] - 1), False),  # the last used code is then a nonzero tail
    (lambda c: c["codebook"].__setitem__(1, c["codebook"][0]), False),  # a code twice
    (lambda c: c["codebook"].__setitem__(0, 256), False),
    (lambda c: c["codebook"].append(0), False),
    (lambda c: c["streams"].update(esc_val=c["streams"]["esc_val"] + 1), False),
    (lambda c: c["streams"].update(extra=0), False),
    (lambda c: c["streams"].update(pk=False), False),
    (lambda c: c.update(n_esc=c["n_esc"] + 1), False),
    (lambda c: c.update(n=c["n"] + 1), False),
]


@pytest.mark.parametrize("edit, taken", RAW_EDITS, ids=[str(k) for k in range(len(RAW_EDITS))])
def test_raw_entries_at_each_rule_s_edge(tmp_path, edit, taken):
    item = _raw(tmp_path)
    edit(item)
    assert agree(item) is taken


@pytest.mark.parametrize("edit, taken", SPLITZIP_EDITS, ids=[str(k) for k in range(len(SPLITZIP_EDITS))])
def test_splitzip_entries_at_each_rule_s_edge(tmp_path, edit, taken):
    item = _splitzip(tmp_path)
    assert item["encoding"]["configuration"]["n_esc"] > 0 and item["encoding"]["configuration"]["n_codes_used"] == 16
    edit(item["encoding"]["configuration"])
    assert agree(item) is taken


def test_an_item_that_is_not_a_map_or_a_header_without_tensors_is_declined():
    rules, records = header_module._PLAIN_RULES, header_module._RECORDS
    assert entries_check.plain_entries([1, "x", None, []], rules, records) == [None] * 4
    assert entries_check.plain_entries([], rules, records) == []
    with pytest.raises(TypeError, match="takes 3 arguments"):
        entries_check.plain_entries([], rules)
    with pytest.raises(TypeError, match="must be a list"):
        entries_check.plain_entries((), rules, records)
    with pytest.raises(TypeError, match="tuple of 9"):
        entries_check.plain_entries([], rules[:8], records)
    with pytest.raises(ValueError, match="must be positive"):
        entries_check.plain_entries([], rules[:3] + (0,) + rules[4:], records)
    with pytest.raises(TypeError, match="itemsize dict"):
        entries_check.plain_entries([], (list(C.ITEMSIZE),) + rules[1:], records)
    with pytest.raises(TypeError, match="tuple of 5"):
        entries_check.plain_entries([], rules, records[:4])
    with pytest.raises(TypeError, match="the layout maker"):
        entries_check.plain_entries([], rules, records[:4] + (None,))
    with pytest.raises(TypeError, match="the entry class"):
        entries_check.plain_entries([], rules, (dict(),) + records[1:])


def test_an_error_while_an_entry_is_made_is_raised_not_declined(tmp_path):
    """A failure making an entry (here the layout maker's) propagates: it is not a rule broken, so it must not turn
    into a decline that hands the item to the Python parser as if it were malformed."""
    items = header_items(tmp_path)
    records = header_module._RECORDS[:4] + (lambda n, n_esc: 1 / 0,)
    with pytest.raises(ZeroDivisionError):
        entries_check.plain_entries(items, header_module._PLAIN_RULES, records)


def test_a_header_of_plain_entries_is_parsed_without_the_python_entry_parser(tmp_path, monkeypatch):
    """The fast path is taken: a written file's header opens with ``_parse_entry`` never called."""
    items = header_items(tmp_path)
    monkeypatch.setattr(header_module, "_parse_entry", lambda *a, **k: pytest.fail("parsed in Python"))
    with SztFile(tmp_path / "m.szt") as f:
        assert [e.to_dict() for e in f.header.tensors] == items
