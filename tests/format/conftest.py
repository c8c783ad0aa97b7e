"""Fixtures of the format tests: a forge over the module's own ``valid_file``, and a path for the forged file."""

from __future__ import annotations

from pathlib import Path

import pytest

from support import Forge


@pytest.fixture
def forge(valid_file) -> Forge:
    return Forge.load(valid_file)


@pytest.fixture
def bad(tmp_path) -> Path:
    return tmp_path / "bad.szt"
