"""Cache specs: the Python side of ``kvmesh.v1.CacheSpec`` (docs/api.md, "Caches").

A spec is built from frozen dataclasses that mirror the proto messages field for field::

    spec = CacheSpec(
        name="llama3-8b", dtype=DType.F16, max_sequences=16, capacity=8192, max_batch=512,
        groups=[Attention(num_layers=32, num_kv_heads=8, head_dim_k=128,
                          rope=Rope.normal(dims=128, base=500000.0))])

Nothing here checks the limits: the node does, and its INVALID_ARGUMENT names the field and
value (docs/api.md, "Spec limits"). Only Python types are checked.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional, Sequence, Tuple, Union

__all__ = [
    "DType",
    "RopeType",
    "Rope",
    "FullWindow",
    "SlidingWindow",
    "ChunkedWindow",
    "Window",
    "Attention",
    "Rotating",
    "Recurrent",
    "Group",
    "CacheSpec",
]


class DType(enum.IntEnum):
    """Element type of K, V and the recurrent conv state (the delta state is always float32)."""

    F32 = 1
    F16 = 2
    BF16 = 3

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return 4 if self is DType.F32 else 2


class RopeType(enum.IntEnum):
    """How the model rotated its keys (docs/api.md, "RoPE shift")."""

    NONE = 0
    NORMAL = 1  # adjacent pairs (2i, 2i + 1)
    NEOX = 2    # halves (i, i + dims / 2)


@dataclasses.dataclass(frozen=True)
class Rope:
    """RoPE parameters, so that a Remove can re-rotate the keys whose positions move.

    With ``type = NONE`` the other fields are ignored and positions can never move. Otherwise
    ``dims`` (even, at most ``head_dim_k``), ``base`` and ``freq_scale`` (1 for no scaling) must
    describe the model exactly.
    """

    type: RopeType = RopeType.NONE
    dims: int = 0
    base: float = 0.0
    freq_scale: float = 0.0

    @classmethod
    def none(cls) -> "Rope":
        """Keys are not rotated."""
        return cls()

    @classmethod
    def normal(cls, dims: int, base: float = 10000.0, freq_scale: float = 1.0) -> "Rope":
        """Rotation of adjacent pairs (Llama's original layout)."""
        return cls(RopeType.NORMAL, dims, base, freq_scale)

    @classmethod
    def neox(cls, dims: int, base: float = 10000.0, freq_scale: float = 1.0) -> "Rope":
        """Rotation of element i with element i + dims / 2 (GPT-NeoX, HF Llama)."""
        return cls(RopeType.NEOX, dims, base, freq_scale)


@dataclasses.dataclass(frozen=True)
class FullWindow:
    """Every stored position up to the query is visible; everything is kept."""


@dataclasses.dataclass(frozen=True)
class SlidingWindow:
    """A query at pos sees stored p in [pos - window, pos]; ``memory`` tokens are kept per
    sequence (0: ``window``; see docs/api.md, "Layer groups", for the effective memory)."""

    window: int
    memory: int = 0


@dataclasses.dataclass(frozen=True)
class ChunkedWindow:
    """A query at pos sees stored p in [pos - pos % chunk, pos]; everything is kept."""

    chunk: int


Window = Union[FullWindow, SlidingWindow, ChunkedWindow]


def _default_head_dim_v(group: "Union[Attention, Rotating]") -> None:
    """``head_dim_v`` None means ``head_dim_k`` (the usual K = V head size)."""
    if group.head_dim_v is None:
        object.__setattr__(group, "head_dim_v", group.head_dim_k)


@dataclasses.dataclass(frozen=True)
class Attention:
    """A group of attention layers: one K and one V row per token and layer, in shared cells.

    ``head_dim_v`` defaults to ``head_dim_k``.
    """

    num_layers: int
    num_kv_heads: int
    head_dim_k: int
    head_dim_v: Optional[int] = None
    window: Window = FullWindow()
    rope: Rope = Rope()

    __post_init__ = _default_head_dim_v


@dataclasses.dataclass(frozen=True)
class Rotating:
    """A group of layers with a per-sequence ring of the last ``max_size`` tokens.

    ``head_dim_v`` defaults to ``head_dim_k``. The rope is validated by the node but never used.
    """

    num_layers: int
    num_kv_heads: int
    head_dim_k: int
    max_size: int
    head_dim_v: Optional[int] = None
    rope: Rope = Rope()

    __post_init__ = _default_head_dim_v


@dataclasses.dataclass(frozen=True)
class Recurrent:
    """A group of recurrent layers: per sequence and layer a conv state
    ``[conv_tail][conv_dim]`` in the cache's dtype and, when ``num_v_heads > 0``, a gated-delta
    state ``[num_v_heads][head_v_dim][head_k_dim]`` in float32."""

    num_layers: int
    conv_tail: int
    conv_dim: int
    num_v_heads: int = 0
    head_v_dim: int = 0
    head_k_dim: int = 0


Group = Union[Attention, Rotating, Recurrent]


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """The shape of one model's KV storage (``kvmesh.v1.CacheSpec``).

    ``groups`` may be given as any sequence; it is stored as a tuple.
    """

    name: str
    dtype: DType
    max_sequences: int
    capacity: int
    max_batch: int
    groups: Tuple[Group, ...] = ()
    #: Tokens per block of a sequence's hash chain (docs/api.md#tokens); 0: the node's 16.
    token_block_size: int = 0
    #: What an Append short of room does (docs/api.md#eviction): "none" refuses it, "lru" first
    #: evicts whole sequences (lowest priority, then least recently used) when that makes room.
    eviction: str = "none"

    def __post_init__(self) -> None:
        if self.eviction not in ("none", "lru"):
            raise ValueError(f"eviction must be 'none' or 'lru', got {self.eviction!r}")
        groups: Sequence[Group] = self.groups
        if isinstance(groups, (Attention, Rotating, Recurrent)):
            groups = (groups,)
        for i, group in enumerate(groups):
            if not isinstance(group, (Attention, Rotating, Recurrent)):
                raise TypeError(f"groups[{i}] is a {type(group).__name__}, not an Attention, "
                                "Rotating or Recurrent")
        object.__setattr__(self, "groups", tuple(groups))
        object.__setattr__(self, "dtype", DType(self.dtype))

    @property
    def contiguous(self) -> bool:
        """Whether every Append must continue each sequence at its offset (a Rotating or
        Recurrent group is present)."""
        return any(not isinstance(g, Attention) for g in self.groups)
