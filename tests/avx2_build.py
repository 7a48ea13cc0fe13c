"""The CPU library built for AVX2 alone (``-march=haswell``: AVX2 + FMA + F16C), made the one every
product and one-call step of a test takes, where this CPU runs it: its vector paths checked on a
machine that would build the AVX-512 ones."""

import os

import pytest

from stree.kernels.cpu import gemm


def use_avx2_build(monkeypatch) -> None:
    """Skips the test where this CPU has no AVX2 with FMA."""
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    if " avx2" not in flags or " fma" not in flags:
        pytest.skip("this CPU has no AVX2 with FMA")
    lib, why = gemm.compile_library(gemm.FLAGS + ("-march=haswell",))
    assert lib is not None, why
    monkeypatch.setattr(gemm, "_build", lambda: (lib, ""))
