"""The half rounding of the bound layers (:mod:`stree.kernels.cpu.round_jit`) and of a half model's
one-call step (``stree_round_half`` of :mod:`stree.kernels.cpu.mamba_step`'s library) against
PyTorch's conversion there and back, bit for bit, over float32 values of every kind."""

import numpy as np
import pytest
import torch

from stree.kernels.cpu import gemm
from stree.kernels.cpu.round_jit import round_half


def _values() -> np.ndarray:
    """float32 bit patterns: random ones, and every pattern around float16's edges (the step of its
    subnormals, its smallest normal, its largest value and the overflow to infinity) and around
    ties of both formats, both signs, zeros, infinities and NaNs."""
    rng = np.random.default_rng(0)
    around = [0x33000000, 0x33800000, 0x38800000, 0x477FE000, 0x477FF000, 0x47800000, 0x3F801000, 0x3F808000,
              0x7F7F8000, 0x00008000]
    dense = np.concatenate([np.arange(c - 3000, c + 3000) for c in around])
    edges = np.array([0, 0x7F800000, 0x7FC00000, 0x7F800001, 0x7F7FFFFF, 1], dtype=np.int64)
    pos = np.concatenate([rng.integers(0, 0x7F800000, 200_000), dense, edges]).astype(np.uint32)
    return np.concatenate([pos, pos | np.uint32(0x80000000)]).view(np.float32)


def _one_call_rounding(a: np.ndarray, bfloat: bool) -> None:
    gemm.library().stree_round_half(a.ctypes.data, a.size, int(bfloat))


@pytest.mark.parametrize("rounding", ["numba", "one call"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_rounding_is_pytorchs_conversion_there_and_back(dtype, rounding):
    if rounding == "one call" and not gemm.available():
        pytest.skip(f"no CPU library here: {gemm.unavailable_reason()}")
    values = _values()
    expect = torch.from_numpy(values.copy()).to(dtype).float().numpy()
    got = values.reshape(2, -1).copy()  # (any shape)
    (round_half if rounding == "numba" else _one_call_rounding)(got, dtype == torch.bfloat16)
    got = got.reshape(-1)
    nan = np.isnan(values)
    assert nan.sum() > 0 and np.isnan(got[nan]).all()
    assert np.array_equal(got[~nan].view(np.uint32), expect[~nan].view(np.uint32))


def test_a_strided_array_is_refused_not_copied():
    a = np.ones((4, 6), dtype=np.float32)
    with pytest.raises(Exception, match="contiguous"):
        round_half(a[:, ::2], False)
