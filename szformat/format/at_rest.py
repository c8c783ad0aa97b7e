"""The at-rest stages: streams of a SplitZip payload (1.1), or byte planes of a raw tensor (1.2), stored as
independent zstd frames.

The in-memory SplitZip payload is what GPU kernels, in-place decoding and the offload routes consume; it stays
exactly as it is. At rest (on disk, on the Hub) some of its streams (``pk``, the packed 4-bit exponent codes, is the
one that pays: ``sm`` is sign and mantissa bits, close to random) are cut into frames of ``frame_size`` in-memory
bytes, each compressed on its own, so that several threads can inflate one tensor and a slice inflates only the
frames it covers. Inflating gives back the in-memory payload byte for byte.

The payload's five streams, each extended to the next stream's offset (so the ``align4`` padding belongs to the
stream before it), tile ``[0, comp_bytes)``. The stored bytes are those extents in payload order: a compressed
stream as its frames, one after another; any other stream verbatim.

Every frame is checked before it is inflated: its length in the header, the zstd frame that length holds (walked
block by block, so a frame that ends early or runs on is refused), its declared content size (exactly the in-memory
bytes it stands for: a frame that claims more is refused before any memory is allocated for it), and zstd's own
content checksum, which every frame carries. Inflating writes into the caller's buffer; nothing larger than a
frame's in-memory size is allocated.

A raw tensor (FP32, FP16, FP8, any dtype the SplitZip codec does not take) is stored at rest by :class:`PlanesStage`:
its bytes cut into frames of ``frame_size`` bytes, each frame's bytes regrouped into byte planes (plane ``j`` holds
byte ``j`` of each of its elements; for floats, of each element rotated left by one bit, so the exponent fills the
high byte: ``codec/planes.py``), each plane a zstd frame, or verbatim where zstd does not make it smaller. A float's
exponent plane shrinks to a third or less; the low mantissa bytes are close to random and stay verbatim. Both stages
cut their payload into :class:`Segment` pieces, so every reader slices, threads and checks them the same way.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, Sequence

from .._lazy import byte_planes, torch, zstandard
from ..codec.layout import PayloadLayout

__all__ = ["AT_REST_ZSTD", "AT_REST_PLANES", "PlanesStage", "parse_planes", "compress_planes", "STREAMS",
           "DEFAULT_LEVEL", "DEFAULT_FRAME_SIZE", "TAIL_FRAME_SIZE", "TAIL_BYTES",
           "DEFAULT_STREAMS", "ESCAPE_STREAMS", "ESCAPE_STREAMS_MIN_BYTES", "AT_REST_COVERAGE_GATE", "MIN_FRAME_SIZE",
           "MAX_FRAME_SIZE", "MAX_EXPANSION", "ZstdStage", "Segment", "AtRestError", "check_frame_size",
           "parse_at_rest", "parse_at_rest_option", "stream_extents", "segments", "writer_streams", "compress",
           "inflate", "inflate_segments", "StoredBytes", "StoredView", "inflate_ranges", "stored_ranges",
           "decompressor", "frame_compressed_size", "inflate_bounded", "compress_frame",
           "PLANES_MIN_MATCH", "LOW_ENTROPY", "TRANSFORMS", "SIGN_LAST_DTYPES", "planes_transform"]

AT_REST_ZSTD = "zstd"
"""The at-rest codec of SplitZip payloads (1.1)."""
AT_REST_PLANES = "zstd_planes"
"""The at-rest codec of raw tensors (1.2): byte planes as zstd frames."""
AT_REST_CODECS = (AT_REST_ZSTD, AT_REST_PLANES)
TRANSFORMS = ("bytes", "sign_last")
"""How a raw tensor's elements become byte planes: as they are, or each rotated left by one bit first."""
SIGN_LAST_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
"""Dtypes the writer stores ``sign_last``: floats whose sign bit would otherwise share a byte with the exponent."""

STREAMS = ("pk", "sm", "chunk_id", "local_pos", "esc_val")
"""The streams of a SplitZip payload, in payload order."""

DEFAULT_STREAMS = ("pk",)
"""Streams the writer compresses: on real BF16 weights ``pk`` shrinks to ~0.65 and ``sm`` not at all (1.0000);
the escape streams are usually a fraction of a per mille of the payload (``bench/at_rest.py``)."""

ESCAPE_STREAMS = ("chunk_id", "local_pos", "esc_val")
ESCAPE_STREAMS_MIN_BYTES = 4096
"""The writer compresses the escape streams too when they hold at least this many bytes (about 585 escapes): then
they shrink to about half (chunk ids are sorted, positions and exponents few-valued); below it a frame's own
header and tables would cost more than it saves."""

AT_REST_COVERAGE_GATE = 0.90
"""The writer's coverage gate for the at-rest form. The in-memory form stores tensors under 0.99 raw (escapes cost
7 bytes each there); at rest their escape streams go through zstd, so a tensor down to about 0.93 (below that its
in-memory payload is no smaller than raw, and the size gate stores it raw) still ends near 0.7 of raw instead of
1.0. On CRAFT's 12 such tensors (5.5 % of it): 0.68-0.78."""

DEFAULT_LEVEL = 1
"""zstd level: level 1 stores ``pk`` smaller than 3 or 6 on real weights, and compresses 2-6x faster."""

DEFAULT_FRAME_SIZE = 1 << 20
"""In-memory bytes per frame: small enough that a slice inflates little more than it needs and that many threads
share one large tensor, large enough that the per-frame cost (header, checksum, a call) stays under 1 %."""

TAIL_FRAME_SIZE = 128 << 10
"""In-memory bytes per frame of the tensors that end a file (:data:`TAIL_BYTES`). A GPU load inflates the frames of
each transfer with one nvCOMP call, which lasts about one frame's decode whatever the frames' count (about 10 ms for
1 MiB frames on the H200, 2.8 ms for 128 KiB ones), so the last transfer's call is the load's tail: with small frames
at the end of the file it shrinks, for 0.01 % of the file (``bench/RESULTS.md``, "Byte planes at rest")."""

TAIL_BYTES = 256 << 20
"""Raw bytes at the end of a file whose tensors (those no larger than this) get :data:`TAIL_FRAME_SIZE`: about the
last two transfers of a GPU load (its staging slots hold 128 MiB). A file of no more raw bytes than this gets none:
there they would be every frame, costing 0.02-0.05 % of the file on the real models of ``bench.dtypes`` (enough to
make CRAFT's and english_g2's FP32 files larger than ZipNN's), where the at-rest form is chosen to be small and a
load lasts a few milliseconds."""

MIN_FRAME_SIZE = 1 << 12
MAX_FRAME_SIZE = 1 << 26
"""Bounds on ``frame_size``: they bound both the header's frame list and the memory one frame may claim."""

MAX_EXPANSION = 8
"""A staged payload's in-memory bytes are at most this many times its stored bytes, so no file is a decompression
bomb: the memory a read can cost is a stated multiple of the bytes the file holds (the tensor's raw bytes are at most
4/3 of its in-memory payload, so at most ~11x its stored bytes). The writer's payloads stay under 1.6: ``sm``, two
thirds of the payload, is stored verbatim, and the escape streams are compressed only under the at-rest coverage
gate. A frame may shrink far more (``pk`` of an all-zero tensor, ~20,000x): the bound is per tensor, and checked
from the header, before a frame is read."""

_MAX_WINDOW = MAX_FRAME_SIZE
"""A frame never needs a window larger than its content; a hostile frame asking for more is refused by zstd."""


class AtRestError(ValueError):
    """An at-rest configuration or a stored frame breaks a rule; callers add the file and tensor.

    ``unknown_codec`` says the file names an at-rest codec this reader does not implement (it needs a newer one)."""

    def __init__(self, message: str, *, unknown_codec: bool = False):
        super().__init__(message)
        self.unknown_codec = unknown_codec


@dataclass(frozen=True)
class ZstdStage:
    """How a tensor's SplitZip payload is stored at rest: which streams are zstd frames, of what size.

    ``frames`` lists the stored length of every frame, streams in payload order, frames in order within a stream.
    ``level`` is informational (what the writer used); a reader does not need it.
    """

    streams: tuple[str, ...]
    frame_size: int
    frames: tuple[int, ...]
    level: int | None = None

    def to_dict(self) -> dict[str, Any]:
        configuration: dict[str, Any] = {"streams": list(self.streams), "frame_size": self.frame_size,
                                         "frames": list(self.frames)}
        if self.level is not None:
            configuration["level"] = self.level
        return {"name": AT_REST_ZSTD, "configuration": configuration}


@dataclass(frozen=True)
class PlanesStage:
    """How a raw tensor's bytes are stored at rest (1.2): frames of ``frame_size`` bytes (the last one shorter), each
    as its ``itemsize`` byte planes in order (after rotating each element left by one bit with ``transform``
    ``"sign_last"``), each plane one zstd frame or verbatim.

    ``planes`` lists the stored length of every plane, frame after frame: the plane's own length for a verbatim
    plane, less for a zstd frame. ``itemsize`` comes from the tensor's dtype, not from the header map.
    ``level`` is informational (what the writer used); a reader does not need it.
    """

    itemsize: int
    transform: str
    frame_size: int
    planes: tuple[int, ...]
    level: int | None = None

    def to_dict(self) -> dict[str, Any]:
        configuration: dict[str, Any] = {"transform": self.transform, "frame_size": self.frame_size,
                                         "planes": list(self.planes)}
        if self.level is not None:
            configuration["level"] = self.level
        return {"name": AT_REST_PLANES, "configuration": configuration}

    def segments(self, size: int) -> list[Segment]:
        """The frames of a tensor of ``size`` raw bytes, in order (the stage has as many as ``size`` makes)."""
        result: list[Segment] = []
        stored, k, sign_last = 0, self.itemsize, self.transform == "sign_last"
        for i, memory in enumerate(range(0, size, self.frame_size)):
            lengths = self.planes[i * k: (i + 1) * k]
            result.append(Segment(memory, min(self.frame_size, size - memory), stored, sum(lengths), True, lengths,
                                  sign_last))
            stored += result[-1].stored_length
        return result


class Segment(NamedTuple):
    """One piece of a payload: in-memory bytes ``[memory, memory + memory_length)`` stored at ``[stored,
    stored + stored_length)`` of the stored bytes, as one zstd frame or (``compressed`` false) verbatim; or, with
    ``planes`` (the stored length of each byte plane, :class:`PlanesStage`), as those planes one after another,
    of elements rotated left by one bit when ``sign_last``.

    A named tuple, not a frozen dataclass: a load of a large file lists thousands of them before its first read,
    and a tuple is built several times faster."""

    memory: int
    memory_length: int
    stored: int
    stored_length: int
    compressed: bool
    planes: tuple[int, ...] | None = None
    sign_last: bool = False


def stream_extents(layout: PayloadLayout) -> list[tuple[str, int, int]]:
    """``(stream, start, stop)`` of each stream with the padding after it: together they tile ``[0, comp_bytes)``."""
    offsets = layout.stream_offsets()
    bounds = [offsets[name] for name in STREAMS] + [layout.comp_bytes]
    return [(name, bounds[i], bounds[i + 1]) for i, name in enumerate(STREAMS)]


def check_frame_size(frame_size: object, what: str = "frame_size") -> None:
    """Raise ValueError, naming the value ``what``, unless ``frame_size`` is an integer within
    :data:`MIN_FRAME_SIZE`..:data:`MAX_FRAME_SIZE` (what a reader accepts, so what a writer may write)."""
    if type(frame_size) is not int or not MIN_FRAME_SIZE <= frame_size <= MAX_FRAME_SIZE:
        raise ValueError(f"{what} must be an integer in [{MIN_FRAME_SIZE}, {MAX_FRAME_SIZE}], got {frame_size!r}")


def _frame_count(length: int, frame_size: int) -> int:
    return -(-length // frame_size)


def _check_frame_count(extents: Sequence[tuple[str, int, int]], stage: ZstdStage) -> None:
    expected = sum(_frame_count(stop - start, stage.frame_size) for name, start, stop in extents
                   if name in stage.streams)
    if len(stage.frames) != expected:
        raise AtRestError(f"zstd stage lists {len(stage.frames)} frames; streams {list(stage.streams)} of this "
                          f"layout in frames of {stage.frame_size} bytes make {expected}")


def _stored_length(layout: PayloadLayout, stage: ZstdStage) -> int:
    """The stored bytes of a payload stored with ``stage``: its frames and its verbatim streams.

    Raises:
        AtRestError: the stage does not list as many frames as its streams make.
    """
    extents = stream_extents(layout)
    _check_frame_count(extents, stage)
    return sum(stage.frames) + sum(stop - start for name, start, stop in extents if name not in stage.streams)


def segments(layout: PayloadLayout, stage: ZstdStage) -> list[Segment]:
    """The pieces of a payload stored with ``stage``, in order.

    Raises:
        AtRestError: the stage does not list as many frames as its streams make.
    """
    extents = stream_extents(layout)
    _check_frame_count(extents, stage)
    result: list[Segment] = []
    stored = 0
    frames = iter(stage.frames)
    for name, start, stop in extents:
        if name not in stage.streams:
            if stop > start:
                result.append(Segment(start, stop - start, stored, stop - start, False))
                stored += stop - start
            continue
        for memory in range(start, stop, stage.frame_size):
            length = next(frames)
            result.append(Segment(memory, min(stage.frame_size, stop - memory), stored, length, True))
            stored += length
    return result


# ---------------------------------------------------------------------------------------------------------------
# Header form
# ---------------------------------------------------------------------------------------------------------------


def parse_at_rest(obj: object, *, layout: PayloadLayout, length: int) -> ZstdStage:
    """Validate an encoding's ``at_rest`` map against the payload layout and the entry's stored ``length``.

    Raises:
        AtRestError: a malformed map, an unknown codec (its message says so), or frames that do not add up.
    """
    config = _configuration(obj, AT_REST_ZSTD, "a splitzip payload")
    streams = config.get("streams")
    if (not isinstance(streams, list) or not streams or not all(isinstance(s, str) for s in streams)
            or any(s not in STREAMS for s in streams) or len(set(streams)) != len(streams)
            or streams != sorted(streams, key=STREAMS.index)):
        raise AtRestError(f"zstd 'streams' must be distinct stream names in payload order {list(STREAMS)}, "
                          f"got {streams!r}")
    frame_size = _frame_size(config, AT_REST_ZSTD)
    frames = config.get("frames")
    if not isinstance(frames, list) or any(type(f) is not int or f <= 0 for f in frames):
        raise AtRestError("zstd 'frames' must be a list of positive integers (stored frame lengths)")
    stage = ZstdStage(tuple(streams), frame_size, tuple(frames), _level(config, AT_REST_ZSTD))
    stored = _stored_length(layout, stage)
    if stored != length:
        raise AtRestError(f"frames and verbatim streams add up to {stored} stored bytes, the entry records {length}")
    if layout.comp_bytes > MAX_EXPANSION * length:
        raise AtRestError(f"{length} stored bytes would inflate to {layout.comp_bytes}, more than {MAX_EXPANSION} "
                          "times as many; refusing a decompression bomb")
    return stage


def _configuration(obj: object, codec: str, what: str) -> dict:
    """The ``configuration`` map of an ``at_rest`` map naming ``codec``, the stage of ``what``.

    Raises:
        AtRestError: not a map with a string name and a configuration map; a codec this reader does not know (the
            file needs a newer one: ``unknown_codec``), or the other stage's.
    """
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise AtRestError(f"'at_rest' must be a map with a string 'name', got {obj!r}")
    name = obj["name"]
    if name not in AT_REST_CODECS:
        raise AtRestError(f"at-rest codec {name!r} is not known to this reader (known: "
                          f"{', '.join(map(repr, AT_REST_CODECS))}); the file needs a newer szformat",
                          unknown_codec=True)
    if name != codec:
        raise AtRestError(f"at-rest codec {name!r} does not apply to {what} (only {codec!r} does)")
    config = obj.get("configuration")
    if not isinstance(config, dict):
        raise AtRestError(f"{codec} 'configuration' must be a map")
    return config


def _frame_size(config: dict, codec: str) -> int:
    """The configuration's ``frame_size``, within the bounds every stage shares."""
    frame_size = config.get("frame_size")
    try:
        check_frame_size(frame_size, f"{codec} 'frame_size'")
    except ValueError as e:
        raise AtRestError(str(e)) from None
    return frame_size


def _level(config: dict, codec: str) -> int | None:
    """The configuration's informational ``level``: absent, or an integer."""
    level = config.get("level")
    if level is not None and type(level) is not int:
        raise AtRestError(f"{codec} 'level' must be an integer, got {level!r}")
    return level


_INT = {int}


def _check_plane_sizes(planes: list[int], itemsize: int, frame_size: int, raw_length: int) -> None:
    """Every plane's stored size is between 1 and its plane's bytes: whole frames' planes hold ``frame_size //
    itemsize`` bytes, the last frame's what is left. Checked with the builtins' ``min``/``max`` over the list (a
    Python loop over a 1 GB tensor's 4,000 planes took milliseconds of every open), the first bad plane found by
    the loop only when there is one, so the message names it."""
    last = itemsize * (len(planes) // itemsize - 1)
    whole, tail = planes[:last], planes[last:]
    if min(planes) > 0 and (not whole or max(whole) <= frame_size // itemsize) and \
            max(tail) <= (raw_length - last // itemsize * frame_size) // itemsize:
        return
    for i, stored in enumerate(planes):
        frame = min(frame_size, raw_length - (i // itemsize) * frame_size)
        if not 0 < stored <= frame // itemsize:
            raise AtRestError(f"zstd_planes plane {i} is stored in {stored} bytes; a plane of {frame // itemsize} "
                              "bytes takes between 1 and as many")


def parse_planes(obj: object, *, itemsize: int, raw_length: int, length: int) -> PlanesStage:
    """Validate a raw tensor's ``at_rest`` map against its ``raw_length`` bytes of ``itemsize``-byte elements and
    its stored ``length``.

    Raises:
        AtRestError: a malformed map, an unknown codec (its message says so), planes that do not add up, or a
            tensor that would inflate to more than :data:`MAX_EXPANSION` times its stored bytes.
    """
    config = _configuration(obj, AT_REST_PLANES, "a raw tensor")
    transform = config.get("transform")
    if transform not in TRANSFORMS:
        raise AtRestError(f"zstd_planes 'transform' must be one of {list(TRANSFORMS)}, got {transform!r}")
    if transform == "sign_last" and itemsize == 1:
        raise AtRestError("zstd_planes 'transform' 'sign_last' needs elements of at least two bytes")
    frame_size = _frame_size(config, AT_REST_PLANES)
    if frame_size % itemsize:
        raise AtRestError(f"zstd_planes 'frame_size' {frame_size} is not a multiple of the {itemsize}-byte element")
    if raw_length == 0:
        raise AtRestError("an empty tensor has no at-rest stage")
    planes = config.get("planes")
    count = _frame_count(raw_length, frame_size) * itemsize
    if not isinstance(planes, list) or len(planes) != count or set(map(type, planes)) != _INT:
        raise AtRestError(f"zstd_planes 'planes' must list {count} integers ({itemsize} planes of each of "
                          f"{count // itemsize} frames of {frame_size} bytes), got "
                          f"{len(planes) if isinstance(planes, list) else type(planes).__name__}")
    _check_plane_sizes(planes, itemsize, frame_size, raw_length)
    level = _level(config, AT_REST_PLANES)
    if sum(planes) != length:
        raise AtRestError(f"planes add up to {sum(planes)} stored bytes, the entry records {length}")
    if raw_length > MAX_EXPANSION * length:
        raise AtRestError(f"{length} stored bytes would inflate to {raw_length}, more than {MAX_EXPANSION} "
                          "times as many; refusing a decompression bomb")
    return PlanesStage(itemsize, transform, frame_size, tuple(planes), level)


def parse_at_rest_option(option: str | None) -> int | None:
    """``"zstd"`` or ``"zstd:LEVEL"`` (the ``--at-rest`` form) as a zstd level; ``None`` or ``"none"``: no stage.

    Raises:
        ValueError: anything else, saying what is accepted.
    """
    if option is None or option == "none":
        return None
    name, _, level = option.partition(":")
    if name != AT_REST_ZSTD:
        raise ValueError(f"at-rest codec {name!r} is not supported; use 'zstd', 'zstd:LEVEL' or 'none'")
    if not level:
        return DEFAULT_LEVEL
    try:
        value = int(level)
    except ValueError:
        raise ValueError(f"zstd level {level!r} is not an integer") from None
    lo, hi = -7, zstandard.MAX_COMPRESSION_LEVEL
    if not lo <= value <= hi or value == 0:
        raise ValueError(f"zstd level must be in [{lo}, -1] or [1, {hi}], got {value}")
    return value


# ---------------------------------------------------------------------------------------------------------------
# Compressing and inflating
# ---------------------------------------------------------------------------------------------------------------


def writer_streams(layout: PayloadLayout) -> tuple[str, ...]:
    """The streams a writer compresses for a payload of this layout: ``pk``, and the escape streams when they hold
    :data:`ESCAPE_STREAMS_MIN_BYTES` or more."""
    many_escapes = layout.comp_bytes - layout.off_cid >= ESCAPE_STREAMS_MIN_BYTES
    return DEFAULT_STREAMS + ESCAPE_STREAMS if many_escapes else DEFAULT_STREAMS


def compress(payload: torch.Tensor, layout: PayloadLayout, *, level: int = DEFAULT_LEVEL,
             frame_size: int = DEFAULT_FRAME_SIZE,
             streams: Sequence[str] | None = None) -> tuple[list[memoryview | bytes], ZstdStage]:
    """The stored bytes of an in-memory payload (flat uint8 CPU tensor of ``layout.comp_bytes``) and their stage.

    The stored bytes come as their pieces, in order: views of the payload's verbatim streams and the frames, so
    nothing is copied before it is written (joining them cost more than compressing, on MiniLM). ``streams``
    defaults to :func:`writer_streams`.
    """
    check_frame_size(frame_size)
    streams = writer_streams(layout) if streams is None else tuple(s for s in STREAMS if s in streams)
    parts, stage = _compress(memoryview(payload.numpy()), layout, level, frame_size, streams)
    if streams != DEFAULT_STREAMS and layout.comp_bytes > MAX_EXPANSION * sum(map(len, parts)):
        parts, stage = _compress(memoryview(payload.numpy()), layout, level, frame_size, DEFAULT_STREAMS)
    return parts, stage


def _compress(data: memoryview, layout: PayloadLayout, level: int, frame_size: int,
              streams: tuple[str, ...]) -> tuple[list[memoryview | bytes], ZstdStage]:
    """:func:`compress` with the given streams. With ``sm`` verbatim (two thirds of a payload) the stored bytes
    always respect :data:`MAX_EXPANSION`; with more streams compressed the caller checks."""
    compressor = zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True)
    parts: list[memoryview | bytes] = []
    frames: list[int] = []
    for name, start, stop in stream_extents(layout):
        if name not in streams:
            if stop > start:
                parts.append(data[start:stop])
            continue
        for memory in range(start, stop, frame_size):
            frame = compressor.compress(data[memory: min(memory + frame_size, stop)])
            parts.append(frame)
            frames.append(len(frame))
    return parts, ZstdStage(streams, frame_size, tuple(frames), level)


PLANES_MIN_MATCH = 7
"""The shortest match the writer's zstd looks for in a byte plane at levels under 10 (a parameter of the
compressor only; readers need nothing). A float's exponent plane holds few values, and the short matches the fast
levels find in it cost more than the literals they replace: on MiniLM's FP32 exponent plane (``sign_last``) level 1
stores 0.384 of it with zstd's own minimum match and 0.362 with 7, and runs faster."""

LOW_ENTROPY = 0.5
"""A plane that level 1 shrinks below this share (an exponent plane) is compressed again with zstd's optimal parser
over a short search, which weighs every match against the literals it replaces: MiniLM's FP32 exponent plane 0.362
-> 0.330 (its order-0 entropy: 0.333), at 27 MB/s of that plane where level 19 runs at 2-3 MB/s for 0.332. Planes
above it (FP16's high byte, FP8) gained nothing from it on MiniLM (0.696 and 0.760 either way)."""


def _planes_compressors(level: int) -> tuple[zstandard.ZstdCompressor, zstandard.ZstdCompressor | None]:
    """The writer's zstd for every plane, and for the planes under :data:`LOW_ENTROPY` (levels under 10 only)."""
    frame = {"write_checksum": 1, "write_content_size": 1}
    if level >= 10:
        return zstandard.ZstdCompressor(compression_params=zstandard.ZstdCompressionParameters.from_level(
            level, **frame)), None
    fast = zstandard.ZstdCompressionParameters.from_level(level, min_match=PLANES_MIN_MATCH, **frame)
    parsed = zstandard.ZstdCompressionParameters.from_level(16, window_log=17, chain_log=8, hash_log=8, search_log=1,
                                                            min_match=PLANES_MIN_MATCH, **frame)
    return zstandard.ZstdCompressor(compression_params=fast), zstandard.ZstdCompressor(compression_params=parsed)


def planes_transform(dtype: str) -> str:
    """The transform the writer uses for a dtype's byte planes (:data:`SIGN_LAST_DTYPES`)."""
    return "sign_last" if dtype in SIGN_LAST_DTYPES else "bytes"


def compress_planes(raw: torch.Tensor, dtype: str, itemsize: int, *, level: int = DEFAULT_LEVEL,
                    frame_size: int = DEFAULT_FRAME_SIZE, threads: int | None = None
                    ) -> tuple[list[memoryview | bytes], PlanesStage] | None:
    """The stored bytes of a raw tensor's bytes (flat uint8 CPU tensor of ``itemsize``-byte ``dtype`` elements) as
    byte planes, and their stage; ``None`` when they would not be smaller, or would inflate more than
    :data:`MAX_EXPANSION` times (an all-zero tensor: the writer keeps it raw).

    Each plane is compressed on its own and kept verbatim where its frame would not be smaller. Frames are
    compressed on up to ``threads`` threads (default: one per core; zstd releases the GIL), each with its own
    compressors."""
    check_frame_size(frame_size)
    if frame_size % itemsize:
        raise ValueError(f"frame_size {frame_size} is not a multiple of the {itemsize}-byte element")
    size = raw.numel()
    if not size:
        return None
    transform = planes_transform(dtype) if itemsize > 1 else "bytes"
    data = memoryview(raw.numpy())
    local = threading.local()

    def frame_parts(memory: int) -> list[memoryview | bytes]:
        if not hasattr(local, "compressors"):
            local.compressors = _planes_compressors(level)
        compressor, low_entropy = local.compressors
        frame = data[memory: memory + frame_size]
        plane = len(frame) // itemsize
        planes = frame if itemsize == 1 else memoryview(bytearray(len(frame)))
        if itemsize > 1:
            byte_planes.split_planes(frame, planes, itemsize, transform == "sign_last")
        kept: list[memoryview | bytes] = []
        for j in range(itemsize):
            piece = planes[j * plane: (j + 1) * plane]
            compressed = compressor.compress(piece)
            if low_entropy is not None and len(compressed) < LOW_ENTROPY * plane:
                compressed = min(compressed, low_entropy.compress(piece), key=len)
            kept.append(compressed if len(compressed) < plane else piece)
        return kept

    starts = range(0, size, frame_size)
    workers = min(len(starts), threads or os.cpu_count() or 1)
    if workers > 1:
        with ThreadPoolExecutor(workers, thread_name_prefix="szformat-planes") as pool:
            frames = list(pool.map(frame_parts, starts))
    else:
        frames = [frame_parts(memory) for memory in starts]
    parts = [part for kept in frames for part in kept]
    lengths = [len(part) for part in parts]
    stored = sum(lengths)
    if stored >= size or size > MAX_EXPANSION * stored:
        return None
    return parts, PlanesStage(itemsize, transform, frame_size, tuple(lengths), level)

def frame_compressed_size(frame: memoryview, *, has_checksum: bool | None = None) -> int:
    """The length of the zstd frame at the start of ``frame``, walked block by block (zstd's
    ``ZSTD_findFrameCompressedSize``). ``has_checksum``: the frame header's flag, when the caller has parsed it.

    Raises:
        AtRestError: not a zstd frame, or it ends before its last block (and checksum).
    """
    try:
        cursor = zstandard.frame_header_size(frame)
        if has_checksum is None:
            has_checksum = zstandard.get_frame_parameters(frame).has_checksum
    except zstandard.ZstdError as e:
        raise AtRestError(f"not a zstd frame ({e})") from None
    size = len(frame)
    while True:
        if cursor + 3 > size:
            raise AtRestError("zstd frame ends inside a block header")
        header = frame[cursor] | frame[cursor + 1] << 8 | frame[cursor + 2] << 16
        last, kind, block = header & 1, (header >> 1) & 3, header >> 3
        if kind == 3:
            raise AtRestError("zstd frame holds a reserved block type")
        cursor += 3 + (1 if kind == 1 else block)  # an RLE block stores one byte
        if cursor > size:
            raise AtRestError("zstd frame ends inside a block")
        if last:
            break
    cursor += 4 if has_checksum else 0
    if cursor > size:
        raise AtRestError("zstd frame ends inside its checksum")
    return cursor


def _check_frame(frame: memoryview, size: int) -> None:
    """Every check a stored frame gets before it is inflated: it declares ``size`` bytes of content and a checksum,
    and its blocks end exactly at its end."""
    try:
        params = zstandard.get_frame_parameters(frame)
    except zstandard.ZstdError as e:
        raise AtRestError(f"not a zstd frame ({e})") from None
    if params.content_size != size:
        raise AtRestError(
            "zstd frame does not declare its content size" if params.content_size == zstandard.CONTENTSIZE_UNKNOWN
            else f"zstd frame declares {params.content_size} bytes, the layout gives it {size}")
    if not params.has_checksum:
        raise AtRestError("zstd frame carries no content checksum")
    if params.dict_id:
        raise AtRestError(f"zstd frame names dictionary {params.dict_id}; frames are independent")
    if params.window_size > _MAX_WINDOW:
        raise AtRestError(f"zstd frame asks for a window of {params.window_size} bytes, more than {_MAX_WINDOW}")
    walked = frame_compressed_size(frame, has_checksum=True)
    if walked != len(frame):
        raise AtRestError(f"zstd frame is {walked} bytes long, the header records {len(frame)}")


def _inflate_frames(stored: memoryview, run: Sequence[Segment], out: memoryview,
                    dctx: zstandard.ZstdDecompressor) -> None:
    """Inflate the frames ``run``, stored back to back in ``stored``, into ``out``, which their contents fill
    exactly, in order; every frame checked first.

    One reader inflates them all: python-zstandard goes from frame to frame in C (releasing the GIL for each), so
    a run of frames costs the Python of one call, and its thread takes the GIL back once per frame with no Python
    in between (on a many-core host each take waits behind whichever thread holds the GIL)."""
    if run and run[0].planes is not None:
        _inflate_plane_frames(stored, run, out, dctx)
        return
    cursor = 0
    for seg in run:
        _check_frame(stored[cursor: cursor + seg.stored_length], seg.memory_length)
        cursor += seg.stored_length
    try:
        reader = dctx.stream_reader(stored, read_across_frames=True)
        filled = reader.readinto(out) if len(out) else 0
        trailing = reader.read(1)  # reads a checksum still left, which zstd then checks
    except zstandard.ZstdError as e:
        raise AtRestError(f"zstd frame is corrupt ({e})") from None
    if filled != len(out) or trailing:
        raise AtRestError(f"zstd frames inflate to {filled + len(trailing)}+ bytes, not {len(out)}")


def _inflate_plane_frames(stored: memoryview, run: Sequence[Segment], out: memoryview,
                          dctx: zstandard.ZstdDecompressor) -> None:
    """Inflate the frames of byte planes ``run``, stored back to back in ``stored``, into ``out``: each compressed
    plane into this thread's scratch, then all joined into the frame's elements (a verbatim plane is read where it
    is stored: copied once, by the join, with the GIL released). A one-byte element's single plane is its frame:
    inflated, or copied, straight into ``out``."""
    cursor, base = 0, run[0].memory
    for seg in run:
        itemsize, plane = len(seg.planes), seg.memory_length // len(seg.planes)
        target = out[seg.memory - base: seg.memory - base + seg.memory_length]
        scratch = target if itemsize == 1 else _planes_scratch(seg.memory_length)
        planes = []
        for j, length in enumerate(seg.planes):
            piece = stored[cursor: cursor + length]
            if length < plane:
                piece = scratch[j * plane: (j + 1) * plane]
                _inflate_frame(stored[cursor: cursor + length], piece, dctx)
            planes.append(piece)
            cursor += length
        if itemsize > 1 or seg.planes[0] == plane:  # (a single compressed plane was inflated in place)
            byte_planes.join_planes(planes, target, itemsize, seg.sign_last)


def _planes_scratch(nbytes: int) -> memoryview:
    """This thread's buffer for one frame's planes, kept between frames (at most :data:`MAX_FRAME_SIZE`)."""
    buffer = getattr(_contexts, "planes", None)
    if buffer is None or len(buffer) < nbytes:
        buffer = _contexts.planes = memoryview(bytearray(nbytes))
    return buffer[:nbytes]


def _inflate_frame(frame: memoryview, out: memoryview, dctx: zstandard.ZstdDecompressor) -> None:
    """Inflate one stored frame into ``out``, which it must fill exactly; every check first."""
    _inflate_frames(frame, [Segment(0, len(out), 0, len(frame), True)], out, dctx)


def inflate_bounded(frame: bytes | memoryview, limit: int) -> bytearray:
    """The content of one whole zstd frame that declares its size (at most ``limit`` bytes) and carries a
    checksum: what a 1.1 header stored through zstd holds. Nothing is allocated before the declared size is checked.

    Raises:
        AtRestError: not such a frame, a size over ``limit``, or a corrupt frame.
    """
    frame = memoryview(frame)
    try:
        size = zstandard.get_frame_parameters(frame).content_size
    except zstandard.ZstdError as e:
        raise AtRestError(f"not a zstd frame ({e})") from None
    if size == zstandard.CONTENTSIZE_UNKNOWN or size > limit:
        raise AtRestError("zstd frame does not declare its content size" if size == zstandard.CONTENTSIZE_UNKNOWN
                          else f"zstd frame declares {size} bytes, more than the limit of {limit}")
    out = bytearray(size)
    _inflate_frame(frame, memoryview(out), decompressor())
    return out


def compress_frame(data: bytes, level: int = DEFAULT_LEVEL) -> bytes:
    """One zstd frame holding ``data``, with its content size and checksum (what every reader check expects)."""
    return zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True).compress(data)


_contexts = threading.local()


def decompressor() -> zstandard.ZstdDecompressor:
    """This thread's zstd decompression context: one per thread (a context serves one call at a time), reused by
    every frame the thread inflates instead of set up again for each."""
    dctx = getattr(_contexts, "dctx", None)
    if dctx is None:
        dctx = _contexts.dctx = zstandard.ZstdDecompressor(max_window_size=_MAX_WINDOW)
    return dctx


class StoredBytes(Protocol):
    """Where inflating takes a payload's stored bytes from: a view of them, or a file read piece by piece."""

    length: int
    """How many stored bytes the payload has."""

    def copy_into(self, start: int, out: memoryview) -> None:
        """Stored bytes from ``start`` into ``out`` (a writable byte memoryview): verbatim bytes, copied with the
        GIL released."""

    def frames(self, run: Sequence[Segment]) -> memoryview:
        """The stored bytes of the consecutive frames ``run``, back to back (one read), valid until this thread
        asks for the next."""


class StoredView:
    """:class:`StoredBytes` of a flat uint8 CPU tensor holding all of them (a mapping's view, a buffer)."""

    def __init__(self, stored: torch.Tensor):
        self.stored = stored
        self.length = stored.numel()
        self._view = memoryview(stored.numpy()) if stored.numel() else memoryview(b"")

    def copy_into(self, start: int, out: memoryview) -> None:
        _copy(self.stored[start: start + len(out)], out)

    def frames(self, run: Sequence[Segment]) -> memoryview:
        return self._view[run[0].stored: run[-1].stored + run[-1].stored_length]


def inflate(stored: torch.Tensor, pieces: Sequence[Segment], size: int, out: torch.Tensor | None = None, *,
            start: int = 0, stop: int | None = None) -> torch.Tensor:
    """In-memory bytes ``[start, stop)`` (default: all ``size`` of them) of a payload stored as ``pieces`` (its
    segments: :func:`segments` of a SplitZip payload, :meth:`PlanesStage.segments` of a raw tensor) from the stored
    bytes.

    Only the segments overlapping the range are read; a frame partly inside it is inflated whole into a scratch
    buffer of one frame. ``out`` (flat uint8, ``stop - start`` bytes) receives the bytes when given.

    Raises:
        AtRestError: a frame is corrupt, truncated, or does not inflate to exactly its in-memory size.
    """
    stop = size if stop is None else stop
    if not 0 <= start <= stop <= size:
        raise ValueError(f"range [{start}, {stop}) is outside the payload of {size} bytes")
    if out is None:
        out = torch.empty(stop - start, dtype=torch.uint8)
    elif out.numel() != stop - start:
        raise ValueError(f"output holds {out.numel()} bytes, the range {stop - start}")
    inflate_segments(StoredView(stored), pieces, memoryview(out.numpy()), start=start)
    return out


def inflate_segments(stored: StoredBytes, pieces: Sequence[Segment], out: memoryview, *, start: int = 0,
                     first: int = 0) -> None:
    """In-memory bytes ``[start, start + len(out))`` of a payload stored as ``pieces`` (its :func:`segments`)
    into ``out`` (a writable byte memoryview). ``first`` may skip pieces known to end before ``start``.

    Every byte is moved with the GIL released (reader threads inflate side by side). Consecutive frames inside the
    range are read and inflated as one run (:func:`_inflate_frames`); a frame partly inside it is inflated whole
    into a scratch buffer of its in-memory size. Bytes are handled as memoryviews, not tensors: on a reader
    thread every torch call holds the GIL for microseconds, and for tens of them right after a large read or
    inflate has left the caches cold.

    Raises:
        AtRestError: a frame is corrupt, truncated, or does not inflate to exactly its in-memory size.
    """
    stop = start + len(out)
    run: list[Segment] = []
    for index in range(first, len(pieces)):
        seg = pieces[index]
        if seg.memory >= stop:
            break
        lo, hi = max(start, seg.memory), min(stop, seg.memory + seg.memory_length)
        if lo >= hi:
            continue
        if seg.stored + seg.stored_length > stored.length:
            raise AtRestError(f"segment at stored byte {seg.stored} runs past the {stored.length} stored bytes")
        if seg.compressed and lo == seg.memory and hi == seg.memory + seg.memory_length:
            run.append(seg)
            continue
        _inflate_run(stored, run, out, start)
        run = []
        if seg.compressed:
            scratch = torch.empty(seg.memory_length, dtype=torch.uint8)
            _inflate_run(stored, [seg], memoryview(scratch.numpy()), seg.memory)
            _copy(scratch[lo - seg.memory: hi - seg.memory], out[lo - start: hi - start])
        else:
            stored.copy_into(seg.stored + lo - seg.memory, out[lo - start: hi - start])
    _inflate_run(stored, run, out, start)


def _inflate_run(stored: StoredBytes, run: Sequence[Segment], out: memoryview, start: int) -> None:
    """Inflate the consecutive frames ``run`` (if any) into ``out``, which holds in-memory bytes from ``start``."""
    if run:
        lo, hi = run[0].memory - start, run[-1].memory + run[-1].memory_length - start
        _inflate_frames(stored.frames(run), run, out[lo:hi], decompressor())


def _copy(source: torch.Tensor, out: memoryview) -> None:
    """``source`` (flat uint8) into ``out``: a torch copy releases the GIL, a memoryview assignment would not."""
    torch.frombuffer(out, dtype=torch.uint8).copy_(source)


def stored_ranges(pieces: Sequence[Segment], ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The stored byte ranges (frames whole, verbatim pieces in part) that inflating in-memory ``ranges`` of a
    payload stored as ``pieces`` reads: what a reader must fetch from the file to inflate only them."""
    spans = []
    for seg in pieces:
        for lo, hi in ranges:
            lo, hi = max(lo, seg.memory), min(hi, seg.memory + seg.memory_length)
            if lo < hi:
                spans.append((seg.stored, seg.stored + seg.stored_length) if seg.compressed
                             else (seg.stored + lo - seg.memory, seg.stored + hi - seg.memory))
    return spans


def inflate_ranges(stored: torch.Tensor, pieces: Sequence[Segment], size: int, ranges: Sequence[tuple[int, int]],
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """A buffer of the payload's in-memory ``size`` (``out`` when given) where only ``ranges`` are inflated (the
    rest is left unwritten: a new buffer's pages are never touched, so a slice of a large tensor costs memory for
    what it reads)."""
    payload = torch.empty(size, dtype=torch.uint8) if out is None else out
    for lo, hi in ranges:
        inflate(stored, pieces, size, payload[lo:hi], start=lo, stop=hi)
    return payload
