"""The payload layout (docs/api.md, "Payload layout"): the one place where the client turns numpy
arrays into the bytes of an Append, and the bytes of a Read back into arrays.

On the wire a payload is raw little-endian bytes: for each group in spec order, for each layer,

- Attention and Rotating: K ``[T][num_kv_heads][head_dim_k]`` then V
  ``[T][num_kv_heads][head_dim_v]`` in the cache's dtype, one row per token in batch order;
- Recurrent: for each state, the conv state ``[conv_tail][conv_dim]`` in the cache's dtype, then
  the delta state ``[num_v_heads][head_v_dim][head_k_dim]`` in float32.

In Python a group's data is one object whose arrays have a leading layer axis:

- :class:`KV` for Attention and Rotating groups: ``k`` ``[num_layers, T, num_kv_heads,
  head_dim_k]`` and ``v`` ``[num_layers, T, num_kv_heads, head_dim_v]``;
- :class:`States` for Recurrent groups: ``conv`` ``[num_layers, S, conv_tail, conv_dim]`` and
  ``delta`` ``[num_layers, S, num_v_heads, head_v_dim, head_k_dim]`` float32 (``None`` for a
  conv-only group, ``num_v_heads = 0``).

T is the number of tokens of an Append batch (in batch order), or the number of positions a Read
header lists for the group (ascending). S is the number of states: for a plain Append, the
number of distinct sequences of the batch in order of first appearance (each the state after
the sequence's last token in the batch); for a speculative Append, T (the state after each
token); for a Read, 1 when the group's state is VALID, else 0.

Elements are in the cache's dtype: float32, float16, or for BF16 the raw bits as uint16 (see
:mod:`kvmesh.dtypes`).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np

from .dtypes import DELTA_DTYPE, numpy_dtype
from .spec import Attention, CacheSpec, DType, Recurrent, Rotating

__all__ = ["KV", "States", "GroupData", "PayloadLayout", "count_states"]

_U8 = np.dtype(np.uint8)


@dataclasses.dataclass(eq=False)
class KV:
    """K and V of an Attention or Rotating group: ``k`` ``[layers, T, heads, head_dim_k]``,
    ``v`` ``[layers, T, heads, head_dim_v]``."""

    k: np.ndarray
    v: np.ndarray


@dataclasses.dataclass(eq=False)
class States:
    """Recurrent states: ``conv`` ``[layers, S, conv_tail, conv_dim]``, ``delta``
    ``[layers, S, num_v_heads, head_v_dim, head_k_dim]`` float32, or ``None`` for a conv-only
    group."""

    conv: np.ndarray
    delta: Optional[np.ndarray] = None


GroupData = Union[KV, States]


def count_states(tokens: Iterable[Tuple[int, int]], speculative: bool = False) -> int:
    """How many recurrent states an Append of ``tokens`` carries per Recurrent layer: one per
    distinct sequence, or with ``speculative`` one per token."""
    tokens = list(tokens)
    if speculative:
        return len(tokens)
    return len(dict.fromkeys(int(seq) for seq, _ in tokens))


@dataclasses.dataclass(frozen=True)
class _Array:
    """One array of a group's data: its name, per-layer element shape (after the layer and row
    axes) and dtype."""

    name: str
    shape: Tuple[int, ...]
    dtype: np.dtype
    axes: str  # the shape's meaning, for error messages

    @property
    def elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def bytes(self) -> int:
        return self.elements * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class _Section:
    """The layout of one group: per layer, ``rows`` rows (tokens or states), each made of
    ``arrays``. Attention/Rotating rows are stored array by array (all K rows, then all V rows);
    Recurrent rows row by row (conv then delta of one state, then the next state)."""

    label: str
    layers: int
    arrays: Tuple[_Array, ...]
    per_state: bool  # Recurrent: rows are states, interleaved

    @property
    def row_bytes(self) -> int:
        return sum(a.bytes for a in self.arrays)


class PayloadLayout:
    """The payload layout of one cache spec: sizes, array shapes, encoding and decoding.

    Thread-safe (immutable once built).
    """

    def __init__(self, spec: CacheSpec) -> None:
        self.spec = spec
        self.dtype: np.dtype = numpy_dtype(spec.dtype)
        self._sections: List[_Section] = [
            self._section(i, group) for i, group in enumerate(spec.groups)]

    def _section(self, index: int, group: object) -> _Section:
        label = f"groups[{index}] ({type(group).__name__})"
        if isinstance(group, (Attention, Rotating)):
            h, dk, dv = group.num_kv_heads, group.head_dim_k, group.head_dim_v
            return _Section(label, group.num_layers, (
                _Array("k", (h, dk), self.dtype, "num_kv_heads, head_dim_k"),
                _Array("v", (h, dv), self.dtype, "num_kv_heads, head_dim_v")), per_state=False)
        if isinstance(group, Recurrent):
            arrays = [_Array("conv", (group.conv_tail, group.conv_dim), self.dtype,
                             "conv_tail, conv_dim")]
            if group.num_v_heads > 0:
                arrays.append(_Array("delta",
                                     (group.num_v_heads, group.head_v_dim, group.head_k_dim),
                                     DELTA_DTYPE, "num_v_heads, head_v_dim, head_k_dim"))
            return _Section(label, group.num_layers, tuple(arrays), per_state=True)
        raise TypeError(f"{label}: not an Attention, Rotating or Recurrent group")

    # ---- sizes ---------------------------------------------------------------------------

    def token_bytes(self, group: int) -> int:
        """Bytes of one token of ``group`` over all its layers, K and V (0 when Recurrent)."""
        s = self._sections[group]
        return 0 if s.per_state else s.layers * s.row_bytes

    def state_bytes(self, group: int) -> int:
        """Bytes of one recurrent state of ``group`` over all its layers (0 unless Recurrent)."""
        s = self._sections[group]
        return s.layers * s.row_bytes if s.per_state else 0

    def payload_bytes(self, tokens: Union[int, Sequence[int]],
                      states: Union[int, Sequence[int]]) -> int:
        """Bytes of a payload with ``tokens`` rows in each Attention/Rotating group and
        ``states`` states in each Recurrent group (each an int for every group, or one per
        group)."""
        return sum(self._group_bytes(g, t, s)
                   for g, (t, s) in enumerate(self._counts(tokens, states)))

    def append_bytes(self, tokens: Sequence[Tuple[int, int]], speculative: bool = False) -> int:
        """Bytes of the Append payload of ``tokens`` ((seq, pos) pairs in batch order), the
        size the node checks (docs/api.md, "Append payload")."""
        return self.payload_bytes(len(tokens), count_states(tokens, speculative))

    def max_append_bytes(self) -> int:
        """The largest Append payload the cache takes: ``max_batch`` speculative tokens."""
        return self.payload_bytes(self.spec.max_batch, self.spec.max_batch)

    def shapes(self, group: int, tokens: int, states: int) -> Dict[str, Tuple[int, ...]]:
        """The array shapes of ``group``'s data: ``{"k": ..., "v": ...}`` or
        ``{"conv": ..., "delta": ...}`` (no "delta" for a conv-only group)."""
        s = self._sections[group]
        rows = states if s.per_state else tokens
        return {a.name: (s.layers, rows) + a.shape for a in s.arrays}

    def zeros(self, tokens: Union[int, Sequence[int]],
              states: Union[int, Sequence[int]] = 0) -> List[GroupData]:
        """Zero-filled data of the right shapes and dtypes, to fill in before an Append."""
        out: List[GroupData] = []
        for g, (t, st) in enumerate(self._counts(tokens, states)):
            s = self._sections[g]
            rows = st if s.per_state else t
            arrays = {a.name: np.zeros((s.layers, rows) + a.shape, a.dtype) for a in s.arrays}
            out.append(States(arrays["conv"], arrays.get("delta")) if s.per_state
                       else KV(arrays["k"], arrays["v"]))
        return out

    # ---- encoding and decoding -------------------------------------------------------------

    def encode(self, data: Sequence[GroupData], tokens: Union[int, Sequence[int]],
               states: Union[int, Sequence[int]]) -> bytes:
        """The payload bytes of ``data`` (one :class:`KV` or :class:`States` per group).

        Raises ValueError, naming the group, the array and the expected shape or dtype, when
        ``data`` does not fit the layout for ``tokens`` rows and ``states`` states.
        """
        counts = self._counts(tokens, states)
        if isinstance(data, (KV, States)) or len(data) != len(self._sections):
            got = 1 if isinstance(data, (KV, States)) else len(data)
            raise ValueError(f"the payload needs data for {len(self._sections)} group(s) "
                             f"(one KV or States each, in spec order), got {got}")
        out = np.empty(self.payload_bytes(tokens, states), _U8)
        offset = 0
        for g, (section, item, (t, st)) in enumerate(zip(self._sections, data, counts)):
            rows = st if section.per_state else t
            arrays = self._arrays_of(section, item, rows)
            size = self._group_bytes(g, t, st)
            dest = out[offset:offset + size]
            offset += size
            if section.per_state:
                # [layers][state][conv bytes | delta bytes]
                view = dest.reshape(section.layers, rows, section.row_bytes)
                col = 0
                for spec, array in zip(section.arrays, arrays):
                    view[:, :, col:col + spec.bytes] = array.reshape(
                        section.layers, rows, spec.elements).view(_U8)
                    col += spec.bytes
            else:
                # [layers][K rows | V rows]
                view = dest.reshape(section.layers, rows * section.row_bytes)
                col = 0
                for spec, array in zip(section.arrays, arrays):
                    view[:, col:col + rows * spec.bytes] = array.reshape(
                        section.layers, rows * spec.elements).view(_U8)
                    col += rows * spec.bytes
        return out.tobytes()

    def decode(self, payload: bytes, tokens: Union[int, Sequence[int]],
               states: Union[int, Sequence[int]]) -> List[GroupData]:
        """The arrays of a payload with ``tokens`` rows and ``states`` states per group (for a
        Read: the positions each group lists, and 1 or 0 states). The arrays are copies, in
        native byte order, writable.

        Raises ValueError when the payload's size differs from the layout's.
        """
        counts = self._counts(tokens, states)
        want = self.payload_bytes(tokens, states)
        if len(payload) != want:
            raise ValueError(f"the payload has {len(payload)} bytes; the layout needs {want} "
                             f"for tokens {[t for t, _ in counts]} and states "
                             f"{[s for _, s in counts]} per group")
        raw = np.frombuffer(payload, _U8)
        out: List[GroupData] = []
        offset = 0
        for g, (section, (t, st)) in enumerate(zip(self._sections, counts)):
            rows = st if section.per_state else t
            size = self._group_bytes(g, t, st)
            block = raw[offset:offset + size]
            offset += size
            arrays: Dict[str, np.ndarray] = {}
            col = 0
            for spec in section.arrays:
                if section.per_state:
                    part = block.reshape(section.layers, rows, section.row_bytes)[
                        :, :, col:col + spec.bytes]
                    col += spec.bytes
                else:
                    part = block.reshape(section.layers, rows * section.row_bytes)[
                        :, col:col + rows * spec.bytes]
                    col += rows * spec.bytes
                arrays[spec.name] = (np.ascontiguousarray(part).view(spec.dtype)
                                     .reshape((section.layers, rows) + spec.shape)
                                     .astype(spec.dtype.newbyteorder("="), copy=False))
            out.append(States(arrays["conv"], arrays.get("delta")) if section.per_state
                       else KV(arrays["k"], arrays["v"]))
        return out

    # ---- helpers ---------------------------------------------------------------------------

    def _group_bytes(self, group: int, tokens: int, states: int) -> int:
        s = self._sections[group]
        return s.layers * s.row_bytes * (states if s.per_state else tokens)

    def _counts(self, tokens: Union[int, Sequence[int]],
                states: Union[int, Sequence[int]]) -> List[Tuple[int, int]]:
        n = len(self._sections)

        def per_group(value: Union[int, Sequence[int]], what: str) -> List[int]:
            if isinstance(value, (int, np.integer)):
                values = [int(value)] * n
            else:
                values = [int(v) for v in value]
                if len(values) != n:
                    raise ValueError(f"{what}: {len(values)} counts for {n} groups")
            if any(v < 0 for v in values):
                raise ValueError(f"{what} must be >= 0, got {values}")
            return values

        return list(zip(per_group(tokens, "tokens"), per_group(states, "states")))

    def _arrays_of(self, section: _Section, item: GroupData, rows: int) -> List[np.ndarray]:
        """``item``'s arrays in layout order, checked and converted to little-endian
        contiguous arrays of the layout's dtypes."""
        want_type = States if section.per_state else KV
        if not isinstance(item, want_type):
            raise ValueError(f"{section.label}: needs a {want_type.__name__}, "
                             f"got {type(item).__name__}")
        out = []
        for spec in section.arrays:
            value = getattr(item, spec.name)
            if value is None:
                raise ValueError(f"{section.label}: {spec.name} is missing")
            out.append(self._checked(section, spec, np.asarray(value), rows))
        if section.per_state and len(section.arrays) == 1 and item.delta is not None:
            if np.asarray(item.delta).size != 0:
                raise ValueError(f"{section.label}: a conv-only group (num_v_heads = 0) takes "
                                 "no delta state; pass delta=None")
        return out

    def _checked(self, section: _Section, spec: _Array, value: np.ndarray,
                 rows: int) -> np.ndarray:
        shape = (section.layers, rows) + spec.shape
        what = "states" if section.per_state else "tokens"
        if value.shape != shape:
            raise ValueError(f"{section.label}: {spec.name} has shape {value.shape}; the "
                             f"layout needs {shape} = [num_layers, {what}, {spec.axes}]")
        dtype = value.dtype
        if spec.dtype == DELTA_DTYPE or self.spec.dtype != DType.BF16:
            ok = dtype.kind == spec.dtype.kind and dtype.itemsize == spec.dtype.itemsize
        else:
            # bfloat16: raw bits as uint16, or a bfloat16 extension type (ml_dtypes).
            ok = (dtype.kind == "u" and dtype.itemsize == 2) or (
                dtype.name == "bfloat16" and dtype.itemsize == 2)
            if ok and dtype.kind != "u":
                value = value.view("<u2")  # an extension type has the machine's (little) order
                dtype = value.dtype
        if not ok:
            raise ValueError(f"{section.label}: {spec.name} is {dtype}; "
                             f"{self._dtype_hint(spec)}")
        return np.ascontiguousarray(value.astype(spec.dtype, copy=False))

    def _dtype_hint(self, spec: _Array) -> str:
        if spec.dtype == DELTA_DTYPE and spec.name == "delta":
            return "the delta state is always float32"
        if self.spec.dtype == DType.BF16:
            return ("a BF16 cache takes uint16 bfloat16 bits (kvmesh.to_bfloat16(x)) or a "
                    "bfloat16 array")
        return (f"a {self.spec.dtype.name} cache takes {spec.dtype.newbyteorder('=').name} "
                f"(x.astype(numpy.{spec.dtype.newbyteorder('=').name}))")
