"""The resident route: weights stay compressed in device memory while the model runs, expanded block by block.

``load_into_offloader(path, module, route="resident", device=...)``. The stored bytes of every SplitZip weight are
copied to the device once, as they are (0.75 of the raw bytes on real BF16 weights, CRC-checked on the way). A
*group* is what expands at once: each repeated block (the children of the module's largest ``ModuleList`` of one
class, as diffusers' group offloading and DDO find them), and each leaf module outside the blocks that holds
compressed weights (an embedding, an output head). The groups share a small device arena of ``slots`` slots (default
1), the ``k``-th group of the order always the slot ``k % slots``, and each grouped weight is a view of its group's
slot, bound once. Just before a group runs, one batched decode expands all of its weights into its slot (unless the
slot holds them already); between forwards a grouped weight reads whatever its slot holds, and ``close()`` leaves
hollow stand-ins.

Ordering (CUDA): with ``slots=1`` (the default) there is no side stream: each group expands on the stream it runs
on, just before it, and stream order alone orders the slot's reuse (the hook is one launch and no event: where the
host issues a forward more slowly than the device runs it, the cheaper trade; the expansions' device time is then
not hidden behind the block before). With two slots or more, while a group computes, the next group of the order is
expanded into its own slot on a side stream; the compute stream waits for that decode's event before the group runs,
and a slot is written again only after the event recorded once its last group's forward has been enqueued (when the
next group starts, or the model's forward ends). Groups run in module order (the order a forward takes through most
models); a group that runs out of that order is expanded on the compute stream when it is needed, so the outputs are
the same either way, only slower.

Stay plain on the device (decoded once): raw-stored tensors, buffers, tensors under ``min_tensor_bytes`` (norms,
biases), tied tensors (one storage used by two modules), weights of modules outside the blocks that are not leaves,
and leaves outside the blocks under ``min_leaf_bytes``. On the CPU the same plan runs with the reference decoder
and no streams.

Memory: the stored bytes of the grouped weights, plus ``slots`` x the largest group's raw bytes, plus the plain
tensors; :meth:`ResidentPlan.device_bytes` gives the figures before anything is allocated, and the returned
``OffloadedModel.counters()`` reports them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import DecodeRouteError
from ..format import constants as C
from ..loading.device_codec import DeviceCodec, HostCodec, triton_codec
from ..loading.ops import CudaOps, DeviceOps
from .binding import TensorBinding, assign_tensor, module_tensor, snapshot_tensors, tensor_owner
from .decoding import CheckpointDecoder
from .handle import OffloadedModel

__all__ = ["ResidentGroup", "ResidentPlan", "find_blocks", "plan_resident", "install_resident", "RESIDENT_OPTIONS"]

PAYLOAD_ALIGNMENT = 16
"""Each tensor's stored bytes start at a multiple of this in its group's device buffer (the batch decode's rule)."""
OUTPUT_ALIGNMENT = 64
"""Each tensor's expansion starts at a multiple of this many elements in a slot (128 bytes; the decode needs 8)."""
DEFAULT_SLOTS = 1
"""Each group expanded in place, just before it runs: on the H200 the forwards of a DiT and of an LM (prefill and
decode at batch 1) are issued by the host more slowly than the device runs them, and a hook that only launches its
expansion cost them less than one that also orders a side stream with events (run 76 in ``bench/RESULTS.md``); it
also needs half the arena. ``slots=2`` or more expands the next group ahead on a side stream."""
DEFAULT_MIN_TENSOR_BYTES = 1 << 16
"""BF16 tensors smaller than this (norms, biases) stay plain: decoding them saves little and costs a table row."""
DEFAULT_MIN_LEAF_BYTES = 32 << 20
"""A leaf module outside the blocks becomes a group of its own only with at least this many raw bytes of
compressed weights (an embedding, an output head); smaller ones (a DiT's input projections) stay plain: each group
costs its expansion's host work on every forward, about 0.1 ms, which only a large tensor repays in memory."""
RESIDENT_OPTIONS = ("blocks", "num_blocks_per_group", "slots", "min_tensor_bytes", "min_leaf_bytes", "ops", "graphs")
"""Engine options: the blocks (default: found), how many consecutive blocks expand together (diffusers' group
offloading's name; default 1), arena slots, the size under which a tensor stays plain, the
:class:`~szformat.loading.ops.DeviceOps` work is ordered through (default: CUDA streams; on the CPU, none), and
whether each expansion is replayed as a CUDA graph (default: on CUDA)."""


@dataclasses.dataclass
class ResidentGroup:
    """The weights that expand together: the modules that run them (one block or leaf; several consecutive blocks
    with ``num_blocks_per_group``), and where each tensor lands in a slot."""

    modules: list[torch.nn.Module]
    name: str
    tensors: list[TensorBinding]
    output_offsets: list[int]
    raw_elements: int
    payloads: torch.Tensor | None = None
    table: Any = None

    @property
    def module(self) -> torch.nn.Module:
        """The first module of the group: the one whose hook expands it when the model runs in order."""
        return self.modules[0]

    def absorb(self, other: "ResidentGroup") -> None:
        """Take ``other``'s weights after this group's own in the slot, and its module."""
        self.tensors += other.tensors
        self.output_offsets += [self.raw_elements + offset for offset in other.output_offsets]
        self.raw_elements += other.raw_elements
        self.modules += other.modules


@dataclasses.dataclass
class ResidentPlan:
    """What the route will hold on the device, decided from the headers before anything moves."""

    groups: list[ResidentGroup]
    plain: list[TensorBinding]
    slots: int
    raw_bytes: int

    @property
    def slot_elements(self) -> int:
        return max((g.raw_elements for g in self.groups), default=0)

    def device_bytes(self, entries: Any) -> dict[str, int]:
        """Device bytes by kind: ``resident_stored_bytes`` (the groups' compressed weights), ``arena_bytes``,
        ``plain_bytes``, and ``raw_bytes`` (the whole model decoded, for comparison)."""
        stored = sum(_padded(entries[t.entry].length) for g in self.groups for t in g.tensors)
        plain = sum(entries[t.entry].raw_length for t in self.plain)
        return {"resident_stored_bytes": stored, "arena_bytes": 2 * self.slots * self.slot_elements,
                "plain_bytes": plain, "raw_bytes": self.raw_bytes}


def find_blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of ``module``: the children of its ``ModuleList`` holding the most parameters whose
    children are all of one class (transformer layers, DiT blocks); none when it has no such list."""
    best, best_size = [], 0
    for child in module.modules():
        if not isinstance(child, torch.nn.ModuleList) or len(child) < 2:
            continue
        kinds = {type(block) for block in child}
        size = sum(p.numel() for p in child.parameters())
        if len(kinds) == 1 and size > best_size:
            best, best_size = list(child), size
    return best


def plan_resident(module: torch.nn.Module, bindings: Sequence[TensorBinding], entries: Any, *,
                  blocks: Sequence[torch.nn.Module] | None = None, num_blocks_per_group: int = 1,
                  slots: int = DEFAULT_SLOTS, min_tensor_bytes: int = DEFAULT_MIN_TENSOR_BYTES,
                  min_leaf_bytes: int = DEFAULT_MIN_LEAF_BYTES) -> ResidentPlan:
    """Group the bound tensors (see the module docstring); raises ValueError for a bad ``slots``, ``blocks`` or
    ``num_blocks_per_group``."""
    if not isinstance(num_blocks_per_group, int) or isinstance(num_blocks_per_group, bool) or num_blocks_per_group < 1:
        raise ValueError(f"num_blocks_per_group must be an integer of at least 1, got {num_blocks_per_group!r}")
    if not isinstance(slots, int) or isinstance(slots, bool) or slots < 1:
        raise ValueError(f"slots must be an integer of at least 1 (1: each group expanded in place just before it "
                         f"runs; 2 or more: the next group expanded ahead on a side stream), got {slots!r}")
    blocks = find_blocks(module) if blocks is None else list(blocks)
    block_of = {id(sub): block for block in blocks for sub in block.modules()}
    if len(block_of) != sum(len(list(b.modules())) for b in blocks):
        raise ValueError("blocks must not contain one another")
    groups: dict[int, ResidentGroup] = {}
    names = {id(m): name for name, m in module.named_modules()}
    plain: list[TensorBinding] = []
    for binding in bindings:
        entry = entries[binding.entry]
        owner_modules = [tensor_owner(module, name)[0] for name in binding.names]
        owners = {id(m) for m in owner_modules}
        owner = owner_modules[0]
        group_module = block_of.get(id(owner))
        if group_module is None and not list(owner.children()):
            group_module = owner  # a leaf outside the blocks: its own group
        tied_across = len({id(block_of.get(o, o)) for o in owners}) > 1
        if (binding.is_buffer or entry.encoding != C.ENCODING_SPLITZIP or entry.raw_length < min_tensor_bytes
                or group_module is None or tied_across):
            plain.append(binding)
            continue
        group = groups.get(id(group_module))
        if group is None:
            name = names.get(id(group_module), "")
            group = groups[id(group_module)] = ResidentGroup([group_module], name, [], [], 0)
        group.tensors.append(binding)
        group.output_offsets.append(group.raw_elements)
        group.raw_elements += -(-entry.layout.n // OUTPUT_ALIGNMENT) * OUTPUT_ALIGNMENT
    blocks_ids = {id(b) for b in blocks}
    for key, group in list(groups.items()):
        if id(group.module) not in blocks_ids and 2 * group.raw_elements < min_leaf_bytes:
            plain.extend(group.tensors)
            del groups[key]
    order = {id(m): i for i, m in enumerate(module.modules())}
    merged: list[ResidentGroup] = []
    for group in sorted(groups.values(), key=lambda g: order[id(g.module)]):
        last = merged[-1] if merged else None
        if last is not None and id(group.module) in blocks_ids and id(last.module) in blocks_ids \
                and len(last.modules) < num_blocks_per_group:
            last.absorb(group)
        else:
            merged.append(group)
    raw = sum(entries[b.entry].raw_length for b in bindings)
    return ResidentPlan(merged, plain, slots, raw)


class _Slot:
    """One arena slot: its buffer, the group it holds, and the events that order its reuse: ``ready`` when the
    expansion into it has run (``ready_on``: the stream it ran on), ``free`` when the forward of the group that
    used it last has."""

    def __init__(self, buffer: torch.Tensor):
        self.buffer = buffer
        self.holds: ResidentGroup | None = None
        self.ready: Any = None
        self.ready_on: Any = None
        self.free: Any = None
        self.used_on: Any = None  # in place: the stream of the last group that ran in it


class _Arena:
    """The slots, and the hook that expands each group into its slot before it runs.

    Every group has a slot of its own choosing: the ``k``-th group of the plan's order expands into slot ``k %
    slots``, and its weights are bound to views of that slot once, at installation. A forward whose host is the
    bottleneck (a DiT or an LM prefill at batch 1 on a busy host: the device idle half the time) pays every
    microsecond a hook takes, and rebinding each weight to a slot before its block and to a stand-in after cost
    more host time than the rest of the hooks together; with fixed slots nothing is rebound while the model runs.
    Between forwards a grouped weight therefore reads its slot, which holds whichever of the slot's groups
    expanded last: it is not the model's weight (the route runs inference only; ``close()`` leaves hollow
    stand-ins).

    One hook per block of a group, before it (the first one of a group does the work; a later block of the same
    group finds it done). In place (no side stream) the hook launches the group's expansion on its own stream and
    nothing else. With a side stream, the slot of the group that ran before it is released then (an event recorded
    on the stream it ran on: in stream order everything that group enqueued comes before), and the model's forward
    releases the last one when it ends, so there is no hook after each group.

    Work goes through ``ops`` (:class:`~szformat.loading.ops.DeviceOps`): CUDA streams and events on a GPU, work
    run at once on the CPU, and in the tests streams that defer work until something waits for it."""

    def __init__(self, root: torch.nn.Module, plan: ResidentPlan, codec: DeviceCodec, device: torch.device,
                 ops: DeviceOps):
        self.root, self.plan, self.codec, self.ops, self.device = root, plan, codec, ops, device
        self.side = ops.new_stream() if plan.slots > 1 else None
        self.slots = [_Slot(torch.empty(plan.slot_elements, dtype=torch.bfloat16, device=device))
                      for _ in range(plan.slots)]
        self.slot_of = {id(g): self.slots[k % len(self.slots)] for k, g in enumerate(plan.groups)}
        self.following = {id(g): plan.groups[(k + 1) % len(plan.groups)] for k, g in enumerate(plan.groups)}
        self.released: tuple[_Slot, Any] | None = None  # the slot of the group that ran last, and its stream
        self.forward_stream: Any = None  # the stream of the model's forward under way, looked up once per forward
        self.decodes = 0
        self._graphs: dict[int, Any] = {}

    def capture(self) -> None:
        """Record each group's expansion into its slot as a CUDA graph, replayed from then on: a group's batched
        decode is a few kernel launches whose host cost (Triton's launcher, about 0.1 ms) was most of what a group
        added to a forward. Every address is fixed (stored bytes, table, slot), so one graph per group does. The
        kernels run once first (compiled, warmed up; an error there is the decode's own and is raised). Where the
        capture fails nothing is recorded and the expansions launch as before (``counters()`` reports how many
        graphs there are)."""
        for group in self.plan.groups:
            self.codec.decode_batch(group.payloads, group.table, self.slots[0].buffer)
        torch.cuda.synchronize()
        try:
            for group in self.plan.groups:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    self.codec.decode_batch(group.payloads, group.table, self.slot_of[id(group)].buffer)
                self._graphs[id(group)] = graph
        except RuntimeError:
            self._graphs.clear()

    def bind(self) -> None:
        """Point every grouped weight at its view of its group's slot, once."""
        for group in self.plan.groups:
            buffer = self.slot_of[id(group)].buffer
            for t, offset in zip(group.tensors, group.output_offsets):
                assign_tensor(self.root, t.names, buffer[offset: offset + t.tensor.numel()].view(t.tensor.shape))

    def unbind(self) -> None:
        """Leave hollow stand-ins (no bytes of their own) where the slot views were, so the slots can be freed."""
        for group in self.plan.groups:
            for t in group.tensors:
                assign_tensor(self.root, t.names, _hollow(t.tensor, self.device))

    def before(self, group: ResidentGroup) -> None:
        if torch.is_grad_enabled() and group.module.training:
            raise DecodeRouteError("route='resident' runs inference only: its weights are expanded into shared "
                                   "slots; call model.eval() and run under torch.no_grad() or torch.inference_mode()")
        compute = self.forward_stream if self.forward_stream is not None else self.ops.current_stream()
        if self.side is None:
            self._expand_in_place(group, compute)
            return
        slot = self.slot_of[id(group)]
        if self.released is not None and self.released[0] is slot and slot.holds is group:
            return  # a later block of the group that just ran: its wait for the expansion is enqueued already
        self.release_previous()
        if slot.holds is group:
            self.ops.wait(compute, slot.ready)
        else:
            self._expand(group, slot, compute, compute)
        self.released = (slot, compute)
        following = self.following[id(group)]
        ahead = self.slot_of[id(following)]
        if self.side is not None and ahead is not slot and ahead.holds is not following:
            self._expand(following, ahead, self.side, compute)

    def _expand_in_place(self, group: ResidentGroup, compute: Any) -> None:
        """With no side stream (one slot, or no streams at all: the CPU) a group expands on the stream it runs on,
        just before it: stream order alone keeps the slot from being written while a group before it reads it, so
        the hook is the expansion's launch (one graph replay) and nothing else. Only a forward on another stream than
        the slot's last one waits for that stream first."""
        slot = self.slot_of[id(group)]
        if slot.used_on is not None and slot.used_on != compute:
            self.ops.wait(compute, self.ops.record(slot.used_on))
        slot.used_on = compute
        if slot.holds is not group:
            slot.holds = group
            self.decodes += 1
            self.ops.enqueue(compute, self._launcher(group, slot), "expand", current=compute)

    def _launcher(self, group: ResidentGroup, slot: _Slot) -> Any:
        graph = self._graphs.get(id(group))
        return graph.replay if graph is not None else (
            lambda: self.codec.decode_batch(group.payloads, group.table, slot.buffer))

    def release_previous(self) -> None:
        """The slot of the group that ran last may be written again once the work enqueued so far has run."""
        if self.released is not None:
            slot, stream = self.released
            slot.free = self.ops.record(stream, into=slot.free)
            self.released = None

    def enter_forward(self) -> None:
        """The model's forward begins: its stream, looked up here once, is the one every group of it runs on (a
        lookup costs 5 us on the H200 host, each group's hook would pay it; a block called on its own looks it up)."""
        self.forward_stream = self.ops.current_stream()

    def leave_forward(self) -> None:
        self.release_previous()
        self.forward_stream = None

    def finish(self) -> None:
        """Wait for the expansions still enqueued (before the buffers they write are released)."""
        streams = [self.side] if self.side is not None else [slot.used_on for slot in self.slots]
        for stream in streams:
            if stream is not None:
                self.ops.synchronize(self.ops.record(stream))

    def _expand(self, group: ResidentGroup, slot: _Slot, stream: Any, compute: Any) -> None:
        """Enqueue the expansion of ``group`` into ``slot`` on ``stream``, after the slot's last group has finished
        with it and any expansion still writing it on another stream; ``compute`` is the stream to switch back to."""
        slot.holds = group
        self.decodes += 1
        if slot.free is not None:
            self.ops.wait(stream, slot.free)
        if slot.ready is not None and slot.ready_on is not stream:
            self.ops.wait(stream, slot.ready)
        self.ops.enqueue(stream, self._launcher(group, slot), "expand", current=compute)
        slot.ready = self.ops.record(stream, into=slot.ready)
        slot.ready_on = stream


class _Immediate:
    """:class:`~szformat.loading.ops.DeviceOps` for the CPU: one stream, work run when enqueued, no side stream
    (so nothing is expanded ahead)."""

    def new_stream(self) -> None:
        return None

    def current_stream(self) -> None:
        return None

    def enqueue(self, stream: Any, work: Any, label: str, current: Any = None) -> None:
        work()

    def record(self, stream: Any, into: Any = None) -> None:
        return None

    def wait(self, stream: Any, event: Any) -> None:
        pass

    def synchronize(self, event: Any) -> None:
        pass


def install_resident(installation: Any) -> OffloadedModel:
    """The resident route's installer (see the module docstring); ``installation.options`` may hold ``blocks``,
    ``slots`` and ``min_tensor_bytes``."""
    unknown = set(installation.options) - set(RESIDENT_OPTIONS)
    if unknown:
        raise ValueError(f"the resident route takes {', '.join(RESIDENT_OPTIONS)}; got {', '.join(sorted(unknown))}")
    module, binding, device, checkpoint = (installation.module, installation.binding, installation.device,
                                           installation.checkpoint)
    codec = _codec_for(device, checkpoint.path)
    options = dict(installation.options)
    ops = options.pop("ops", None) or (CudaOps(device) if device.type == "cuda" else _Immediate())
    graphs = options.pop("graphs", device.type == "cuda") and isinstance(ops, CudaOps)
    plan = plan_resident(module, list(binding), checkpoint.entries, **options)
    if not plan.groups:
        raise DecodeRouteError("route='resident' found no compressed weights to keep resident (no BF16 tensor "
                               "SplitZip-encoded, or none outside plain tensors); load the model plainly",
                               path=checkpoint.path)
    held = plan.device_bytes(checkpoint.entries)
    _refuse_what_does_not_fit(held, checkpoint.path, device)
    restore = snapshot_tensors(module, [name for tensor in binding for name in tensor.names])
    decoder = CheckpointDecoder(checkpoint, device, "cpu" if device.type == "cpu" else installation.route.decoder)
    handles: list[Any] = []
    arena: _Arena | None = None
    try:
        for t in plan.plain:  # refused by name before anything runs, as the grouped tensors are in _upload
            checkpoint.file(t.entry).payload(t.entry, verify=True)
        values = decoder.load(t.entry for t in plan.plain)
        for t in plan.plain:
            assign_tensor(module, t.names, values.pop(t.entry))
        for group in plan.groups:
            _upload(group, checkpoint, codec, device)
        arena = _Arena(module, plan, codec, device, ops)
        if graphs:
            arena.capture()
        arena.bind()
        for group in plan.groups:
            for t in group.tensors:
                module_tensor(module, t.names[0]).requires_grad_(False)
            handles += [member.register_forward_pre_hook(lambda m, args, g=group: arena.before(g))
                        for member in group.modules]
        handles.append(module.register_forward_pre_hook(lambda m, args: arena.enter_forward()))
        handles.append(module.register_forward_hook(lambda m, args, out: arena.leave_forward(), always_call=True))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except BaseException:
        if arena is not None:
            arena.finish()
        for handle in handles:
            handle.remove()
        decoder.close()
        restore()
        raise

    def release() -> None:
        for handle in handles:
            handle.remove()
        arena.finish()
        arena.unbind()
        decoder.close()
        for group in plan.groups:
            group.payloads = group.table = None
        arena.slots.clear()

    return OffloadedModel(module, installation.route, checkpoint, setup_bytes=held["resident_stored_bytes"],
                          counters=lambda: {**held, "h2d_bytes": 0, "decodes": arena.decodes,
                                            "cuda_graphs": len(arena._graphs)}, release=release)


def _codec_for(device: torch.device, path: Any) -> DeviceCodec:
    if device.type == "cpu":
        return HostCodec()
    if device.type != "cuda":
        raise DecodeRouteError(f"route='resident' has no decoder for device {str(device)!r}: it runs on CUDA "
                               "(Triton) or on the CPU", path=path)
    return triton_codec()


def _refuse_what_does_not_fit(held: dict[str, int], path: Any, device: torch.device) -> None:
    """DecodeRouteError, saying how much is needed, when ``held`` (:meth:`ResidentPlan.device_bytes`) is more than
    the CUDA device has free."""
    if device.type != "cuda":
        return
    need = held["resident_stored_bytes"] + held["arena_bytes"] + held["plain_bytes"]
    free, _ = torch.cuda.mem_get_info(device)
    if need > free:
        raise DecodeRouteError(f"route='resident' needs {need / 1e9:.2f} GB of device memory for this model "
                               f"(compressed weights, arena, plain tensors) and {free / 1e9:.2f} GB are free; "
                               "route='staging' streams the weights from host memory instead", path=path)


def _upload(group: ResidentGroup, checkpoint: Any, codec: DeviceCodec, device: torch.device) -> None:
    """The group's stored bytes (CRC-checked) in one device buffer, and its batch table."""
    entries, offsets, cursor = [], [], 0
    for t in group.tensors:
        offsets.append(cursor)
        cursor += _padded(checkpoint.entries[t.entry].length)
    host = torch.empty(max(cursor, PAYLOAD_ALIGNMENT), dtype=torch.uint8)
    for t, offset in zip(group.tensors, offsets):
        stored = checkpoint.file(t.entry).payload(t.entry, verify=True)
        host[offset: offset + stored.numel()].copy_(stored)
    for t, offset, out in zip(group.tensors, offsets, group.output_offsets):
        entry = checkpoint.entries[t.entry]
        entries.append((entry.layout, entry.codebook, offset, out))
    group.payloads = host.to(device)
    group.table = codec.batch_tables([entries], device)[0]


def _padded(nbytes: int) -> int:
    return -(-nbytes // PAYLOAD_ALIGNMENT) * PAYLOAD_ALIGNMENT


def _hollow(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A stand-in of ``tensor``'s shape and dtype on ``device`` that holds one element (an expanded zero)."""
    return torch.zeros((), dtype=tensor.dtype, device=device).expand(tensor.shape)

