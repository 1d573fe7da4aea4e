"""numpy element types of kvmesh's dtypes, and bfloat16 conversions.

numpy has no bfloat16, so kvmesh represents BF16 data as ``uint16`` arrays of the raw bits (the
upper 16 bits of a float32), the bytes the node stores. :func:`to_bfloat16` and
:func:`from_bfloat16` convert to and from float32; arrays of a ``bfloat16`` extension type of
itemsize 2 (ml_dtypes, as JAX and TensorFlow use) are accepted as they are.
"""

from __future__ import annotations

import numpy as np

from .spec import DType

__all__ = ["numpy_dtype", "to_bfloat16", "from_bfloat16", "DELTA_DTYPE"]

# The gated-delta state of a Recurrent group is always little-endian float32.
DELTA_DTYPE = np.dtype("<f4")

_NUMPY = {
    DType.F32: np.dtype("<f4"),
    DType.F16: np.dtype("<f2"),
    DType.BF16: np.dtype("<u2"),  # raw bfloat16 bits
}


def numpy_dtype(dtype: DType) -> np.dtype:
    """The little-endian numpy dtype that holds elements of ``dtype`` (uint16 bits for BF16)."""
    return _NUMPY[DType(dtype)]


def to_bfloat16(values: np.ndarray) -> np.ndarray:
    """float32 (or anything castable to it) -> bfloat16 bits as ``uint16``, rounded to nearest
    even, as kvmesh itself rounds; NaNs stay (quiet) NaNs."""
    f32 = np.ascontiguousarray(values, dtype="<f4")
    bits = f32.view("<u4").astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    nan = np.isnan(f32)
    rounded = np.where(nan, (bits >> 16) | 0x40, rounded)
    return rounded.astype("<u2")


def from_bfloat16(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits (``uint16``) -> float32, exactly."""
    b = np.ascontiguousarray(bits)
    if b.dtype.itemsize != 2:
        raise ValueError(f"bfloat16 bits must be 2-byte elements, not {b.dtype}")
    # Integers keep their values whatever their byte order; a bfloat16 extension type is viewed.
    b = b.astype("<u2") if b.dtype.kind in "ui" else b.view("<u2")
    return (b.astype("<u4") << 16).view("<f4")
