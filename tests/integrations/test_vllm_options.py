"""The vLLM loader's options (``--model-loader-extra-config``), read without vLLM: what is taken, what is refused by
name; and its entry point under a vLLM too old to take a loader. The engine itself runs them in ``test_vllm.py``."""

from __future__ import annotations

import logging
import sys
import types

import pytest

from szformat.errors import InvalidArgumentError
from szformat.integrations.vllm import register, verify_option


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


def test_the_entry_point_leaves_a_vllm_without_register_model_loader_running(monkeypatch, caplog):
    """vLLM calls every general plugin in every process, whatever the load format: under vLLM 0.10.0, which has no
    ``register_model_loader``, the plugin warns instead of stopping the engine."""
    modules = {"vllm": types.ModuleType("vllm"), "vllm.model_executor": types.ModuleType("vllm.model_executor"),
               "vllm.model_executor.model_loader": types.ModuleType("vllm.model_executor.model_loader")}
    modules["vllm"].__version__ = "0.10.0"
    modules["vllm"].model_executor = modules["vllm.model_executor"]
    modules["vllm.model_executor"].model_loader = modules["vllm.model_executor.model_loader"]
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    with caplog.at_level(logging.WARNING):
        register()
    assert "vLLM 0.10.0 cannot register a model loader (0.10.1 and later can): load_format='szt'" in caplog.text
