"""float32 values rounded in place to a half precision's (float16 or bfloat16), compiled with numba:
where a half model's public kernels return half outputs that the next kernel reads widened again
(:mod:`.bound`), one call where PyTorch takes a conversion there and one back, each a dispatcher
call. Round to nearest, ties to even, as PyTorch's conversions: float16 overflows to infinity past
its largest value (65504) and keeps a fixed step (2^-24) below its smallest normal (2^-14), bfloat16
keeps float32's range. A NaN stays a NaN (its payload is not kept to the bit)."""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["round_half"]

_HALF_NORMAL = 0x38800000  # 2^-14, float16's smallest normal, as float32 bits
_HALF_OVERFLOW = 0x47800000  # 2^16: a float16 rounded this far is past 65504 (infinity)
_INF = 0x7F800000


@njit(cache=True)
def round_half(a, bfloat):
    """``a`` (float32, contiguous, any shape) rounded to float16 (``bfloat`` False) or bfloat16 values."""
    a = a.reshape(-1)  # (an array that is not contiguous does not compile: no silent copy)
    bits = a.view(np.uint32)
    half = np.float32(0.5)
    for i in range(bits.size):
        u = bits[i]
        sign = u & np.uint32(0x80000000)
        mag = u & np.uint32(0x7FFFFFFF)
        if mag > _INF:  # NaN: quiet, as a conversion makes it
            bits[i] = u | np.uint32(0x00400000)
        elif bfloat:
            bits[i] = sign | ((mag + np.uint32(0x7FFF) + ((mag >> np.uint32(16)) & np.uint32(1)))
                              & np.uint32(0xFFFF0000))
        elif mag < _HALF_NORMAL:
            # float16's fixed step 2^-24 is float32's at 0.5: the sum rounds to it (ties to even), the
            # difference is exact
            v = (abs(a[i]) + half) - half
            a[i] = -v if sign else v
        else:
            r = (mag + np.uint32(0x0FFF) + ((mag >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000)
            bits[i] = sign | (np.uint32(_INF) if r >= _HALF_OVERFLOW else r)
