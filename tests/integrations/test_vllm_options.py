"""The vLLM loader's options (``--model-loader-extra-config``), read without vLLM: what is taken, what is refused by
name. The engine itself runs them in ``test_vllm.py``."""

from __future__ import annotations

import pytest

from szformat.errors import InvalidArgumentError
from szformat.integrations.vllm import verify_option


@pytest.mark.parametrize("extra, expected", [(None, True), ({}, True), ({"verify": True}, True),
                                             ({"verify": False}, False)])
def test_verify_is_on_unless_turned_off(extra, expected):
    assert verify_option(extra) is expected


@pytest.mark.parametrize("extra, message", [
    ({"verfy": False}, "unexpected model_loader_extra_config keys for load format 'szt': verfy (it takes verify)"),
    ({"verify": "no"}, "'verify' must be true or false, got 'no'"),
    ({"verify": 0}, "'verify' must be true or false, got 0"),
    (["verify"], "must be a dict for load format 'szt', got list"),
])
def test_other_keys_and_values_are_refused_by_name(extra, message):
    with pytest.raises(InvalidArgumentError) as info:
        verify_option(extra)
    assert message in str(info.value) and isinstance(info.value, ValueError)
