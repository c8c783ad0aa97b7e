"""Installed versions and their order (``szformat._versions``): what the offload routes, DDO's pin, the GPU codec's
Triton floor and the integrations compare."""

import importlib.metadata

import pytest

from szformat._versions import installed_version, parse_version


def test_versions_sort_as_pep_440_says():
    ordered = ["0.1.0.dev1", "0.1.0a1", "0.1.0b2", "0.1.0rc1", "0.1.0rc2", "0.1.0", "0.1.0.post1", "0.1.1", "0.10"]
    keys = [parse_version(v) for v in ordered]
    assert keys == sorted(keys)
    assert len(set(keys)) == len(keys)


@pytest.mark.parametrize("a, b", [("1.0", "1.0.0"), ("0.1.0rc2", "0.1.0-rc.2"), ("2.11.0+cu130", "2.11.0"),
                                  ("1.2", "v1.2"), ("0.1.0c2", "0.1.0rc2")])
def test_equivalent_spellings_are_equal(a, b):
    assert parse_version(a) == parse_version(b)


@pytest.mark.parametrize("text", ["", "latest", "1.0-beta-gamma", "1..0"])
def test_text_that_is_not_a_version_is_refused(text):
    with pytest.raises(ValueError, match="not a version"):
        parse_version(text)


def test_an_installed_version_is_read_from_its_metadata_and_an_absent_one_is_none():
    assert installed_version("msgpack") == importlib.metadata.version("msgpack")
    assert installed_version("szformat-no-such-distribution") is None
