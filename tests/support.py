"""Helpers the tests share: forged files and memory ceilings for the bad-input cases, the conversion tests'
tensors and checks, the one-line-loading models and their comparison, the loopback Hub's token and cards."""

from __future__ import annotations

import json
import mmap
import os
import struct
import tracemalloc
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import msgpack
import pytest
import torch
from hub_server import LoopbackHub
from huggingface_hub import ModelCard, constants, file_download
from safetensors.torch import save_file as save_safetensors

from szformat import SzformatError, load_file
from szformat.cli.main import main as szconvert
from szformat.codec import cpu
from szformat.convert.pages import CoveredMapping
from szformat.format import at_rest
from szformat.format import constants as C
from szformat.format.reader import SztFile
from szformat.format.writer import SztWriter, tensor_bytes, write_tensor


def bf16_weights(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)


def with_outliers(weights: torch.Tensor) -> torch.Tensor:
    """Ten huge values with exponents of their own: escapes, but few enough to keep coverage above 0.99."""
    flat = weights.float().reshape(-1)
    flat[: 10 * 150: 150] = 2.0 ** torch.arange(60, 70, dtype=torch.float32)
    return flat.reshape(weights.shape).to(torch.bfloat16)


PREAMBLE_FIELDS = struct.Struct("<8sHHIQQIIQ")
"""The preamble without its 16 reserved bytes, written out here as the spec gives it."""


def read_everything(path: Path, *, verify: bool = True) -> dict[str, torch.Tensor]:
    return load_file(path, verify=verify)


@dataclass
class Forge:
    """A valid file's parts: everything before the header, the header object, and the preamble fields."""

    body: bytearray
    header: dict
    alignment: int

    @classmethod
    def load(cls, path: Path) -> "Forge":
        data = path.read_bytes()
        fields = PREAMBLE_FIELDS.unpack(data[: PREAMBLE_FIELDS.size])
        header_offset, header_length, alignment = fields[4], fields[5], fields[7]
        header = msgpack.unpackb(data[header_offset: header_offset + header_length])
        return cls(bytearray(data[:header_offset]), header, alignment)

    def entry(self, name: str) -> dict:
        return next(t for t in self.header["tensors"] if t["name"] == name)

    def payload_at(self, name: str, start: int, new: bytes, *, fix_crc: bool = True) -> None:
        """Overwrite bytes of a tensor's payload; keep its stored-bytes CRC right unless ``fix_crc`` is off."""
        e = self.entry(name)
        self.body[e["offset"] + start: e["offset"] + start + len(new)] = new
        if fix_crc:
            e["crc32"] = zlib.crc32(self.body[e["offset"]: e["offset"] + e["length"]])

    def write(self, path: Path, *, header_bytes: bytes | None = None, trailing: bytes = b"",
              reserved: bytes = bytes(16), **fields) -> Path:
        """Write the file; ``fields`` override preamble fields (the header CRC is computed unless given)."""
        hb = msgpack.packb(self.header) if header_bytes is None else header_bytes
        values = dict(magic=C.MAGIC, major=1, minor=0, flags=0, header_offset=len(self.body), header_length=len(hb),
                      header_crc32=zlib.crc32(hb), alignment=self.alignment, file_length=len(self.body) + len(hb))
        values.update(fields)
        preamble = PREAMBLE_FIELDS.pack(*values.values()) + reserved
        path.write_bytes(preamble + bytes(self.body[len(preamble):]) + hb + trailing)
        return path


def refused(path: Path, error: type[SzformatError], *reason: str, tensor: str | None = None,
            verify: bool = True) -> SzformatError:
    """Assert that opening and reading ``path`` raises ``error`` whose message names the file, tensor and reason."""
    with pytest.raises(error) as info:
        read_everything(path, verify=verify)
    e = info.value
    message = str(e)
    assert isinstance(e, SzformatError) and isinstance(e, ValueError)
    assert e.path == os.fspath(path) and path.name in message
    assert e.tensor == tensor
    if tensor is not None:
        assert repr(tensor) in message
    for fragment in reason:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return e


def peak_memory(run: Callable[[], object]) -> int:
    """Peak bytes Python allocated while ``run()`` ran: a refusal must not first allocate what the file claims."""
    tracemalloc.start()
    try:
        run()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def covers_mappings() -> bool:
    """Whether mappings are covered here (``convert.pages.CoveredMapping``): the converter then reads its source
    through a mapping of it, else through ``pread`` copies."""
    with open(__file__, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapping:
        cover = CoveredMapping.of(mapping)
        if cover is not None:
            cover.close()
    return cover is not None


def model_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """A small model with one tensor for each way a tensor can be stored."""
    g = torch.Generator().manual_seed(seed + 1000)
    return {
        "embed.weight": bf16_weights((64, 48), seed),                              # encoded
        "layers.0.attn.q.weight": bf16_weights((48, 48), seed + 1),                # encoded
        "layers.0.attn.k.weight": with_outliers(bf16_weights((32, 48), seed + 3)),  # encoded, with escapes
        "layers.0.mlp.up.weight": bf16_weights((96, 48), seed + 2),                # encoded
        "layers.0.norm.weight": torch.ones(48, dtype=torch.bfloat16),              # encoded: one exponent
        "layers.0.norm.bias": torch.randn(48, generator=g),                        # raw: F32
        "position_ids": torch.arange(16),                                          # raw: I64
        "noise": torch.randint(-32768, 32767, (2000,), generator=g, dtype=torch.int16).view(torch.bfloat16),
        "scale": torch.tensor(3.0, dtype=torch.bfloat16),                           # raw: payload not smaller
        "empty": torch.zeros(0, 4, dtype=torch.bfloat16),                          # raw: empty
    }


METADATA = {"format": "pt", "note": "ünïcode \"quoted\" / \\ \u0001"}


def write_sharded(folder: Path, seed: int = 0, stem: str = "model") -> dict[str, torch.Tensor]:
    """Two shards and their index, as transformers writes them."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = model_tensors(seed)
    names = list(tensors)
    shards = {f"{stem}-00001-of-00002.safetensors": names[:6], f"{stem}-00002-of-00002.safetensors": names[6:]}
    weight_map = {}
    for shard, keys in shards.items():
        save_safetensors({k: tensors[k] for k in keys}, folder / shard, metadata={"format": "pt"})
        weight_map.update({k: shard for k in keys})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return tensors


def write_pipeline(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    """A diffusers-style folder: a sharded transformer, a single-file text encoder, config files, a hidden cache."""
    transformer = write_sharded(folder / "transformer", seed=1, stem="diffusion_pytorch_model")
    text_encoder = model_tensors(seed=2)
    (folder / "text_encoder").mkdir()
    save_safetensors(text_encoder, folder / "text_encoder" / "model.safetensors", metadata=METADATA)
    (folder / "model_index.json").write_text('{"_class_name": "FluxPipeline"}')
    (folder / "transformer" / "config.json").write_text('{"num_layers": 1}')
    (folder / "tokenizer").mkdir()
    (folder / "tokenizer" / "tokenizer.json").write_text('{"model": {}}')
    (folder / ".cache" / "huggingface").mkdir(parents=True)
    (folder / ".cache" / "huggingface" / "lock").write_text("local state")
    return {"transformer": transformer, "text_encoder": text_encoder}


def write_at_rest(tensors: dict[str, torch.Tensor], path: Path, *, frame_size: int = at_rest.MIN_FRAME_SIZE,
                  level: int = 1) -> Path:
    """``tensors`` in the at-rest form, in frames of ``frame_size`` (default the smallest, so small tensors span
    several), payloads under 1 MiB packed at 16 bytes, the header kept as msgpack so a :class:`Forge` edits it."""
    with SztWriter(path, metadata={"format": "pt"}, at_rest=level, frame_size=frame_size,
                   small_alignment=16) as writer:
        for name, t in tensors.items():
            write_tensor(writer, name, C.TORCH_TO_DTYPE[t.dtype], t.shape, tensor_bytes(t))
    return path


def assert_same_tensors(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype and actual[name].shape == tensor.shape, name
        assert torch.equal(actual[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name


def listing(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*"))


class RecordingBackend:
    """Stands in for the GPU codec: the CPU codec behind the same two-function interface, counting calls."""

    def __init__(self, corrupt: bool = False):
        self.encoded: list[int] = []
        self.corrupt = corrupt

    def encode(self, x):
        self.encoded.append(x.numel())
        return cpu.encode(x)

    def decode(self, payload, layout, codebook):
        out = cpu.decode(payload, layout, codebook)
        if self.corrupt:
            out.view(torch.int16)[-1] ^= 1
        return out


def flip_payload_byte(path: Path, tensor: str) -> None:
    with SztFile(path) as szt:
        entry = szt.entry(tensor)
    with open(path, "r+b") as f:
        f.seek(entry.offset + entry.length // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))


def llama_config(**overrides):
    import transformers

    return transformers.LlamaConfig(**{**dict(vocab_size=128, hidden_size=32, intermediate_size=64,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                              max_position_embeddings=64), **overrides})


def bert_config(**overrides):
    import transformers

    return transformers.BertConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, max_position_embeddings=40, **overrides)


def save_and_convert(model, folder: Path, **save_kw) -> Path:
    """save_pretrained in BF16, then szconvert of the folder; returns the converted folder."""
    model.to(torch.bfloat16).save_pretrained(folder, **save_kw)
    assert szconvert([str(folder), str(folder) + "-szt", "--quiet"]) == 0
    return Path(str(folder) + "-szt")


def reference(auto_class, folder, **kwargs):
    """transformers' own load of the safetensors original, in the dtype it was saved in (the default of
    transformers 5; earlier versions load float32 unless asked)."""
    return auto_class.from_pretrained(folder, **{auto_dtype_keyword(): kwargs.pop("dtype", "auto")}, **kwargs)


def auto_dtype_keyword() -> str:
    """The name transformers gives ``from_pretrained``'s dtype argument (``dtype`` since 4.56)."""
    import transformers

    return "dtype" if tuple(map(int, transformers.__version__.split(".")[:2])) >= (4, 56) else "torch_dtype"


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers (BF16 as int16), so equality is bit for bit."""
    return tensor.view(torch.int16) if tensor.dtype in (torch.bfloat16, torch.float16) else tensor


def assert_same_model(actual, expected) -> None:
    """Same class, every parameter and buffer bit-identical, same dtypes and devices, same tying, eval mode."""
    assert type(actual) is type(expected)
    got = dict(actual.named_parameters(remove_duplicate=False)) | dict(actual.named_buffers(remove_duplicate=False))
    want = dict(expected.named_parameters(remove_duplicate=False)) | dict(
        expected.named_buffers(remove_duplicate=False))
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].device == tensor.device, name
        assert torch.equal(bits(got[name]), bits(tensor)), name
    tied = lambda m: {n for n, p in m.named_parameters(remove_duplicate=False)} - {n for n, _ in m.named_parameters()}
    assert tied(actual) == tied(expected)
    assert not actual.training


ALICE = "hf_alice_write_token"


def card_of(hub: LoopbackHub, repo_id: str, revision: str = "main") -> ModelCard:
    return ModelCard(hub.files(repo_id, revision)["README.md"].decode())


BOB = "hf_bob_write_token"


def secret_outside(root: Path, monkeypatch, token: str) -> Path:
    """A Hub token in the environment and in a file outside the model folder: what no link may copy or upload."""
    monkeypatch.setenv("HF_TOKEN", token)
    outside = root / "elsewhere"
    outside.mkdir()
    (outside / "secret.txt").write_text(token)
    return outside


def close_hub_sessions() -> None:
    """Drop the Hub client's kept-alive connections (to a loopback Hub that stops): ``close_session`` in
    huggingface_hub 1.x, ``reset_sessions`` in the 0.x releases szformat also supports."""
    import huggingface_hub
    from huggingface_hub import utils

    close = getattr(huggingface_hub, "close_session", None) or utils.reset_sessions
    close()


def point_client_at(monkeypatch, endpoint: str) -> None:
    template = endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)
    # huggingface_hub 0.x builds download URLs from its own copy of the template
    monkeypatch.setattr(file_download, "HUGGINGFACE_CO_URL_TEMPLATE", template, raising=False)
