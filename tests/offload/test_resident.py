"""The resident route on the CPU: weights kept compressed, expanded per block, outputs bit-identical to the plain
model (forward, greedy ``generate`` with its KV cache); the plan, the memory figures, slot reuse and the ordering of
expansions against the compute stream (streams that defer work until waited for), and the refusals."""

from __future__ import annotations

import pytest
import torch

import szformat
from szformat.errors import ChecksumMismatchError, DecodeRouteError
from szformat.format.reader import SztFile
from szformat.offload.resident import _Arena, find_blocks, plan_resident

from fakes import FakeOps
from support import llama_config, reference, save_and_convert

transformers = pytest.importorskip("transformers")
LLAMA = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny Llama (GQA, untied head) in BF16 and its converted twin."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_config(**LLAMA))
    folder = tmp_path_factory.mktemp("resident") / "llama"
    return folder, save_and_convert(model, folder)


def plain(folder):
    return reference(transformers.AutoModelForCausalLM, folder).eval()


def resident(converted, original, device="cpu", **options):
    model = plain(original)  # its weights are replaced: the route holds its own
    offloaded = szformat.load_into_offloader(converted, model, route="resident", device=device, min_tensor_bytes=0,
                                             min_leaf_bytes=0,
                                             **options)
    return model, offloaded


IDS = torch.tensor([[1, 7, 42, 3, 99, 12, 5, 250]])


def test_forward_and_greedy_generate_are_bit_identical_to_the_plain_model(llama):
    expected_model = plain(llama[0])
    model, offloaded = resident(llama[1], llama[0])
    with offloaded, torch.no_grad():
        assert torch.equal(model(IDS).logits, expected_model(IDS).logits)
        got = model.generate(IDS, max_new_tokens=16, do_sample=False)
        want = expected_model.generate(IDS, max_new_tokens=16, do_sample=False)
        assert torch.equal(got, want) and got.shape[1] == IDS.shape[1] + 16


def test_weights_are_views_of_the_arena_and_held_compressed(llama):
    model, offloaded = resident(llama[1], llama[0], slots=2)
    with offloaded, torch.no_grad():
        model(IDS)
        layers = model.model.layers
        q0, q1, q2 = (layer.self_attn.q_proj.weight for layer in layers)
        assert q0.shape == (64, 64)
        # no bytes of their own: the blocks alternate between the two slots, each weight a view of its block's
        assert q0.untyped_storage().data_ptr() == q2.untyped_storage().data_ptr() != q1.untyped_storage().data_ptr()
        held = offloaded.counters()
        assert held["decodes"] >= 5  # embedding, 3 blocks, head
        with SztFile(next(llama[1].glob("*.szt"))) as f:
            stored = sum(f.entry(n).length for n in f.entries if f.entry(n).encoding == "splitzip")
        assert stored <= held["resident_stored_bytes"] < stored + 16 * len(f.entries)
        assert held["resident_stored_bytes"] + held["plain_bytes"] < 0.8 * held["raw_bytes"]
        largest = max(4 * 64 * 256 * 2, 256 * 64 * 2 + 64)  # the largest group's raw bytes, give or take padding
        assert held["arena_bytes"] <= 2 * (largest + 1024) * 1.1
    assert q0.stride() == (0, 0) and q0.shape == (64, 64)  # closed: hollow stand-ins, the slots released


def test_the_blocks_are_the_repeated_layers_and_small_leaves_outside_them_stay_plain(llama):
    model = transformers.LlamaForCausalLM(llama_config(**LLAMA)).to(torch.bfloat16)
    assert find_blocks(model) == list(model.model.layers)
    assert find_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2))) == []
    from szformat.offload.binding import bind_module
    from szformat.offload.shards import Checkpoint

    with Checkpoint(llama[1]) as checkpoint:
        bindings = list(bind_module(model, checkpoint.entries))
        by_default = plan_resident(model, bindings, checkpoint.entries, min_tensor_bytes=0)
        leaves_too = plan_resident(model, bindings, checkpoint.entries, min_tensor_bytes=0, min_leaf_bytes=0)
    assert [g.module for g in by_default.groups] == list(model.model.layers)  # a 32 kB embedding stays plain
    assert [g.module for g in leaves_too.groups] == [model.model.embed_tokens, *model.model.layers, model.model.norm,
                                                    model.lm_head]
    assert {t.entry for t in by_default.plain} >= {"model.embed_tokens.weight", "lm_head.weight"}


@pytest.mark.parametrize("slots", [2, 3])
def test_expansions_wait_for_their_slot_and_the_compute_stream_waits_for_them(llama, slots):
    """Side-stream work runs only when something waits for it: a missing wait leaves a slot unexpanded or
    overwritten under a running block, and the logits differ."""
    expected_model = plain(llama[0])
    ops = FakeOps(eager=(0,))  # the compute stream runs at once, the side stream only when waited for
    model, offloaded = resident(llama[1], llama[0], ops=ops, slots=slots)
    with offloaded, torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(IDS).logits, expected_model(IDS).logits)
    labels = [step[0] for step in ops.log]
    assert "expand" in labels and any(step[0] == "expand" and step[1] == 1 for step in ops.log)  # ahead, on the side


def test_an_expansion_ahead_never_writes_the_slot_of_the_group_about_to_run(llama):
    """Six groups in five slots: the last group and the first share a slot, so the first is not expanded ahead
    while the last runs. The side stream here runs its work as soon as its waits allow: an expansion ahead into the
    running group's slot would overwrite its weights before its forward, and the logits would differ."""
    expected_model = plain(llama[0])
    ops = FakeOps(eager=(0, 1))
    model, offloaded = resident(llama[1], llama[0], ops=ops, slots=5)
    with offloaded, torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(IDS).logits, expected_model(IDS).logits)


def test_each_expansion_ahead_waits_for_its_slot_to_be_released_on_the_compute_stream(llama):
    """Once every slot has been used, an expansion on the side stream first waits for an event of the compute
    stream: the release of the slot by the last group that ran in it (recorded when the next group starts)."""
    ops = FakeOps(eager=(0,))
    model, offloaded = resident(llama[1], llama[0], ops=ops, slots=2)
    with offloaded, torch.no_grad():
        for _ in range(3):
            model(IDS)
    expansions = [i for i, step in enumerate(ops.log) if step[:2] == ("expand", 1)]
    assert len(expansions) > 6
    for i in expansions[2:]:  # the first two find their slots unused
        waits = []
        for step in reversed(ops.log[:i]):
            if step[0] != "wait":
                break
            waits.append(step)
        assert any(step[1] == 1 and step[2].stream is ops.streams[0] for step in waits), ops.log[i - 3: i + 1]


def test_one_slot_expands_each_group_in_place_on_the_compute_stream_with_no_events(llama):
    """``slots=1``: no side stream, every group expanded on the stream it runs on just before it, so a forward
    records and waits for no event; one block's bytes of arena, and the outputs of the plain model."""
    expected_model = plain(llama[0])
    ops = FakeOps(eager=(0,))
    model, offloaded = resident(llama[1], llama[0], ops=ops, slots=1)
    with offloaded, torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(IDS).logits, expected_model(IDS).logits)
        assert torch.equal(model.generate(IDS, max_new_tokens=8, do_sample=False),
                           expected_model.generate(IDS, max_new_tokens=8, do_sample=False))
        layers = model.model.layers
        assert len({layer.self_attn.q_proj.weight.untyped_storage().data_ptr() for layer in layers}) == 1
        held, log = offloaded.counters(), list(ops.log)
    assert len(ops.streams) == 1
    assert {step[0] for step in log} == {"expand"} and len(log) == held["decodes"] >= 2 * 5
    assert ops.log[len(log):][-1][0] == "sync"  # closing waits for the last expansions
    largest = 4 * 64 * 256 * 2  # the largest group: the 256 x 64 head, or a layer's MLP, give or take padding
    assert held["arena_bytes"] <= (largest + 1024) * 1.1


@pytest.mark.parametrize("slots, eager", [(1, (0,)), (2, (0, 1))])
def test_consecutive_blocks_expand_together_as_one_group(llama, slots, eager):
    """``num_blocks_per_group=2``: layers 0 and 1 are one group (their weights side by side in one slot, one
    expansion before layer 0), layer 2 a group of its own; the outputs stay the plain model's, with the expansion
    in place or ahead on a side stream that runs as soon as its waits allow."""
    expected_model = plain(llama[0])
    ops = FakeOps(eager=eager)
    model, offloaded = resident(llama[1], llama[0], ops=ops, slots=slots, num_blocks_per_group=2)
    layers = model.model.layers
    with offloaded, torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(IDS).logits, expected_model(IDS).logits)
        assert torch.equal(model.generate(IDS, max_new_tokens=4, do_sample=False),
                           expected_model.generate(IDS, max_new_tokens=4, do_sample=False))
        a, b = layers[0].mlp.down_proj.weight, layers[1].mlp.down_proj.weight
        assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()  # one slot, side by side
        assert a.data_ptr() + a.numel() * 2 <= b.data_ptr()
        before = offloaded.counters()["decodes"]
        model(IDS)
        groups = 5  # embedding, layers 0-1, layer 2, norm, head
        assert offloaded.counters()["decodes"] - before == groups
        arena = next(c.cell_contents for hook in layers[1]._forward_pre_hooks.values()
                     for c in hook.__closure__ or () if isinstance(c.cell_contents, _Arena))
        pair = next(g for g in arena.plan.groups if g.modules == [layers[0], layers[1]])
        arena.enter_forward()
        arena.before(pair)  # layer 0's hook
        steps = len(ops.log)
        arena.before(pair)  # layer 1's hook: the group is expanded and waited for already
        assert len(ops.log) == steps
        arena.leave_forward()
    with pytest.raises(ValueError, match="num_blocks_per_group must be an integer of at least 1"):
        resident(llama[1], llama[0], num_blocks_per_group=0)


def test_in_place_a_forward_on_another_stream_waits_for_the_last_use_of_the_slot(llama):
    """The slot's last group ran on stream 0; a forward on stream 1 must not write the slot before stream 0 has
    finished with it: its first expansion comes after a wait for an event of stream 0."""
    expected_model = plain(llama[0])

    class SwitchingOps(FakeOps):
        current = 0

        def current_stream(self):
            return self.streams[self.current]

    ops = SwitchingOps(eager=(0, 1))
    other = ops.new_stream()
    model, offloaded = resident(llama[1], llama[0], ops=ops, slots=1)
    with offloaded, torch.no_grad():
        assert torch.equal(model(IDS).logits, expected_model(IDS).logits)
        ops.current = other.index
        start = len(ops.log)
        assert torch.equal(model(IDS).logits, expected_model(IDS).logits)
    steps = ops.log[start:]
    first = next(i for i, step in enumerate(steps) if step[:2] == ("expand", other.index))
    assert any(step[0] == "wait" and step[1] == other.index and step[2].stream is ops.streams[0]
               for step in steps[:first]), steps[: first + 1]


def test_the_compute_stream_is_looked_up_once_per_forward_and_expansions_are_told_it(llama):
    """The model's forward looks its stream up once for all of its groups (a block called on its own looks it up
    itself), and every expansion is enqueued with the stream to switch back to."""
    class Counting(FakeOps):
        lookups = 0
        currents = []

        def current_stream(self):
            self.lookups += 1
            return super().current_stream()

        def enqueue(self, stream, work, label, current=None):
            self.currents.append(current)
            super().enqueue(stream, work, label, current)

    expected_model = plain(llama[0])
    ops = Counting(eager=(0,))
    model, offloaded = resident(llama[1], llama[0], ops=ops)
    with offloaded, torch.no_grad():
        ops.lookups = 0
        assert torch.equal(model(IDS).logits, expected_model(IDS).logits)
        assert ops.lookups == 1 and ops.currents and all(c is ops.streams[0] for c in ops.currents)
        hidden = torch.randn(1, 8, 64).to(torch.bfloat16)
        assert torch.equal(model.lm_head(hidden), expected_model.lm_head(hidden))  # a group called on its own
        assert ops.lookups == 2


def test_a_tied_head_stays_plain_and_the_model_still_matches(tmp_path):
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(llama_config(**LLAMA, tie_word_embeddings=True))
    converted = save_and_convert(model, tmp_path / "tied")
    expected_model = plain(tmp_path / "tied")
    got, offloaded = resident(converted, tmp_path / "tied")
    with offloaded, torch.no_grad():
        assert got.lm_head.weight is got.model.embed_tokens.weight and got.lm_head.weight.stride()[1] == 1
        assert torch.equal(got(IDS).logits, expected_model(IDS).logits)


def test_training_is_refused(llama):
    model, offloaded = resident(llama[1], llama[0])
    with offloaded:
        model.train()
        with pytest.raises(DecodeRouteError, match="inference only"):
            model(IDS)


def test_stored_bytes_that_fail_their_checksum_are_refused_before_any_forward(llama, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(llama[1], broken)
    shard = next(broken.glob("*.szt"))
    with SztFile(shard) as f:
        name = next(n for n in f.entries if f.entry(n).encoding == "splitzip" and "layers.1" in n)
        offset = f.entry(name).offset
    data = bytearray(shard.read_bytes())
    data[offset + 5] ^= 0x40
    shard.write_bytes(bytes(data))
    model = plain(llama[0])
    with pytest.raises(ChecksumMismatchError, match=name.replace(".", r"\.")):
        szformat.load_into_offloader(broken, model, route="resident", device="cpu", min_tensor_bytes=0)
    assert not model._forward_pre_hooks and not model.model.layers[1]._forward_pre_hooks  # nothing left installed


def test_bad_options_and_devices_are_refused(llama):
    model = plain(llama[0])
    for slots in (0, True, 1.0):
        with pytest.raises(ValueError, match="slots must be an integer of at least 1"):
            szformat.load_into_offloader(llama[1], model, route="resident", device="cpu", slots=slots)
    with pytest.raises(ValueError, match="the resident route takes"):
        szformat.load_into_offloader(llama[1], model, route="resident", device="cpu", budget=3)
    with pytest.raises(ValueError, match="route='resident' on the CPU too"):
        szformat.load_into_offloader(llama[1], model, route="staging", device="cpu")


def test_one_line_loading_with_offload_resident_matches_the_plain_model(llama):
    import szformat.transformers as szt

    expected_model = plain(llama[0])
    model = szt.from_pretrained(llama[1], device="cpu", offload="resident",
                                offload_options={"min_tensor_bytes": 0, "min_leaf_bytes": 0})
    with model.szformat_offload, torch.no_grad():
        assert model.szformat_offload.route.name == "resident"
        assert torch.equal(model(IDS).logits, expected_model(IDS).logits)
        assert torch.equal(model.generate(IDS, max_new_tokens=16, do_sample=False),
                           expected_model.generate(IDS, max_new_tokens=16, do_sample=False))


def test_a_model_that_does_not_fit_even_compressed_is_refused_saying_how_much_it_needs(monkeypatch):
    from szformat.offload import resident

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (2_000_000_000, 80_000_000_000))
    held = {"resident_stored_bytes": 1_500_000_000, "arena_bytes": 400_000_000, "plain_bytes": 200_000_000}
    with pytest.raises(DecodeRouteError, match=r"needs 2\.10 GB of device memory .* and 2\.00 GB are free; "
                                               r"route='staging' streams"):
        resident._refuse_what_does_not_fit(held, "m.szt", torch.device("cuda", 0))
    resident._refuse_what_does_not_fit({**held, "plain_bytes": 0}, "m.szt", torch.device("cuda", 0))  # 1.9 GB fits


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_expansions_replayed_as_cuda_graphs_give_the_same_outputs(llama):
    """On CUDA each group's expansion into each slot is captured once and replayed: the same logits and tokens as
    the plain model and as the expansions launched each time."""
    expected_model = plain(llama[0]).cuda()
    ids = IDS.cuda()
    with torch.no_grad():
        want = expected_model(ids).logits, expected_model.generate(ids, max_new_tokens=16, do_sample=False)
    for graphs in (True, False):
        model = plain(llama[0])
        offloaded = szformat.load_into_offloader(llama[1], model, route="resident", device="cuda", graphs=graphs,
                                                 min_tensor_bytes=0, min_leaf_bytes=0)
        with offloaded, torch.no_grad():
            captured = offloaded.counters()["cuda_graphs"]
            assert captured == 6 if graphs else captured == 0  # a graph per group: embedding, 3 layers, norm, head
            assert torch.equal(model(ids).logits, want[0])
            assert torch.equal(model.generate(ids, max_new_tokens=16, do_sample=False), want[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA events need a CUDA device")
def test_each_slot_records_its_two_events_again_instead_of_creating_events_per_group(llama):
    """A group's hooks record the slot's ``ready`` and ``free`` events again (no event created per group and
    forward), and the outputs stay those of the plain model across forwards that reuse them."""
    from szformat.offload import resident as resident_module

    expected_model = plain(llama[0]).cuda()
    ids = IDS.cuda()
    model, offloaded = resident(llama[1], llama[0], device="cuda", slots=2)
    arena = next(c.cell_contents for hook in model.model.layers[0]._forward_pre_hooks.values()
                 for c in hook.__closure__ or () if isinstance(c.cell_contents, resident_module._Arena))
    with offloaded, torch.no_grad():
        want = expected_model(ids).logits
        assert torch.equal(model(ids).logits, want)
        events = [(slot.ready, slot.free) for slot in arena.slots]
        assert all(ready is not None and free is not None for ready, free in events)
        for _ in range(3):
            assert torch.equal(model(ids).logits, want)
        assert [(slot.ready, slot.free) for slot in arena.slots] == events


def test_a_capture_that_fails_leaves_no_graph_and_the_expansions_launch_as_before(llama, monkeypatch):
    """Graph capture refused (an old driver, a kernel that cannot be captured): nothing recorded, and the route
    expands each group by launching its decode, with the same outputs."""
    from szformat.offload import resident as resident_module

    model, offloaded = resident(llama[1], llama[0])
    arena = next(c.cell_contents for hook in model.model.layers[0]._forward_pre_hooks.values()
                 for c in hook.__closure__ or () if isinstance(c.cell_contents, resident_module._Arena))

    captures = []

    class SecondRefused:  # the first capture succeeds, so the failure must also drop what was recorded
        def __enter__(self):
            captures.append(1)
            if len(captures) == 2:
                raise RuntimeError("operation not permitted when stream is capturing")

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph", lambda graph: SecondRefused())
    arena.capture()
    expected = plain(llama[0])
    with offloaded, torch.no_grad():
        assert offloaded.counters()["cuda_graphs"] == 0
        assert torch.equal(model(IDS).logits, expected(IDS).logits)
