"""stree.kernels.cpu.gemm: the tiled few-row product against the float64 definition (random
sizes across the row chunks and the last partial block, strided rows, a bias, poisoned outputs),
its AVX2 variant too, its packing (a half weight's in its dtype too: the same sums as its float32
copy's), its threads, its bad input, and its build: kept per source,
compiler, flags and CPU, and a clean "unavailable" where it cannot be built. Also the tree scan's
state term, the same product on a state packed as it is read, against its float64 definition."""

import os
import re
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from avx2_build import use_avx2_build

from stree.kernels.cpu import gemm

pytestmark = pytest.mark.skipif(not gemm.available(), reason=f"the tiled product cannot be built here: "
                                                              f"{gemm.unavailable_reason()}")


def _definition(x, w, b):
    out = x.double() @ w.double().t()
    return out if b is None else out + b.double()


def _close(out, x, w, b):
    # float32 sums of K products, each within a few roundings of the float64 one's terms
    scale = x.double().abs() @ w.double().abs().t() + (0 if b is None else b.double().abs())
    return bool(((out.double() - _definition(x, w, b)).abs() <= 1e-5 * scale + 1e-6).all())


def _case(rows, d_in, d_out, bias, pad, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, d_in + pad, generator=g)[:, pad:]  # rows a strided slice (row stride > K)
    w = torch.randn(d_out, d_in, generator=g)
    b = torch.randn(d_out, generator=g) if bias else None
    return x, w, b


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 40), d_in=st.integers(1, 70), d_out=st.integers(1, 100), bias=st.booleans(),
       pad=st.sampled_from([0, 3]), seed=st.integers(0, 2**16))
def test_equals_the_definition(rows, d_in, d_out, bias, pad, seed):
    x, w, b = _case(rows, d_in, d_out, bias, pad, seed)
    out = torch.full((rows, d_out), float("nan"))  # poisoned: every entry must be written, none past it
    guard = torch.full((rows + 1, d_out), float("nan"))
    into = guard[:rows]
    gemm.product(x, gemm.pack(w), d_out, b, out=into)
    out.copy_(into)
    assert _close(out, x, w, b)
    assert guard[rows].isnan().all()  # the row after the output untouched
    assert _close(gemm.product(x, gemm.pack(w), d_out, b), x, w, b)  # (allocating its own)


def test_the_avx2_variant_equals_the_definition(monkeypatch):
    """Built with ``-march=haswell`` (AVX2 + FMA: 16-column blocks, 6-row tiles), where this CPU
    runs it, on the sizes that cross its chunks and partial blocks."""
    use_avx2_build(monkeypatch)
    assert gemm.block() == 16
    for rows, d_in, d_out in [(1, 5, 16), (6, 33, 17), (7, 64, 100), (13, 9, 48), (26, 40, 31)]:
        x, w, b = _case(rows, d_in, d_out, True, 3, rows)
        packed = gemm.pack(w)
        assert packed.shape == (-(-d_out // 16), d_in, 16)
        assert _close(gemm.product(x, packed, d_out, b), x, w, b)
        for dtype in (torch.float16, torch.bfloat16):  # (half packs widened by AVX2's instructions)
            half = w.to(dtype)
            want = gemm.product(x, gemm.pack(half.float()), d_out, b)
            assert torch.equal(gemm.product(x, gemm.pack(half), d_out, b), want)
    for batch, nodes, groups, per_group, headdim, d_state in [(1, 13, 1, 8, 64, 32), (2, 7, 2, 1, 12, 19)]:
        C, x0, want, scale = _state_case(batch, nodes, groups, per_group, headdim, d_state, 3, nodes)
        out = torch.empty(batch, nodes, groups * per_group, headdim)
        _state_term(C, x0, groups, out)
        assert bool(((out.double() - want).abs() <= 1e-5 * scale + 1e-6).all())


def _state_case(batch, nodes, groups, per_group, headdim, d_state, pad, seed):
    g = torch.Generator().manual_seed(seed)
    heads = groups * per_group
    # C's nodes as a strided slice (node stride past groups * d_state, as a view of a conv's output)
    C = torch.randn(batch, nodes, groups * d_state + pad, generator=g)[..., pad:]
    x0 = torch.randn(batch, heads, headdim, d_state, generator=g)
    want = torch.einsum("bnhs,bhps->bnhp", C.reshape(batch, nodes, groups, d_state).double()
                        .repeat_interleave(per_group, dim=2), x0.double())
    scale = torch.einsum("bnhs,bhps->bnhp", C.reshape(batch, nodes, groups, d_state).double().abs()
                         .repeat_interleave(per_group, dim=2), x0.double().abs())
    return C, x0, want, scale


def _state_term(C, x0, groups, into):
    batch, nodes, _ = C.shape
    heads, headdim, d_state = x0.shape[1:]
    gemm.state_term_unchecked(C.data_ptr(), batch, nodes, groups, d_state, C.stride(1), C.stride(0), x0.data_ptr(),
                              heads, headdim, into.data_ptr())


@settings(max_examples=60, deadline=None)
@given(batch=st.integers(1, 3), nodes=st.integers(1, 40), groups=st.sampled_from([1, 2]),
       per_group=st.integers(1, 3), headdim=st.integers(1, 40), d_state=st.integers(1, 70),
       pad=st.sampled_from([0, 5]), threads=st.sampled_from([1, 2, 3]), seed=st.integers(0, 2**16))
def test_the_state_term_equals_the_definition(batch, nodes, groups, per_group, headdim, d_state, pad, threads, seed):
    """Every size across the row chunks, the 8 x 8 transposes' tails (d_state, and a group's width,
    not multiples of 8 or of a block), groups, strided nodes, rows and column parts split over the
    threads; every output written, nothing past it."""
    C, x0, want, scale = _state_case(batch, nodes, groups, per_group, headdim, d_state, pad, seed)
    heads = groups * per_group
    guard = torch.full((batch * nodes + 1, heads * headdim), float("nan"))  # poisoned, a row past the output
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        _state_term(C, x0, groups, guard)
    finally:
        torch.set_num_threads(before)
    out = guard[:-1].reshape(batch, nodes, heads, headdim)
    assert bool(((out.double() - want).abs() <= 1e-5 * scale + 1e-6).all())
    assert guard[-1].isnan().all()


def test_the_state_term_runs_within_its_scratch_only():
    assert gemm.takes_state(1) and gemm.takes_state(256) and not gemm.takes_state(257)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 30), d_in=st.integers(1, 70), d_out=st.integers(1, 100), bias=st.booleans(),
       dtype=st.sampled_from([torch.float16, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_a_half_weight_packed_in_its_dtype_gives_its_float32_copys_products(rows, d_in, d_out, bias, dtype, seed):
    """Each vector of a half pack widened as it is loaded (float16 by the conversion instruction, bfloat16
    by a shift): the float32 copy's sums exactly, term for term, whatever the rows and partial blocks."""
    x, w, b = _case(rows, d_in, d_out, bias, 3, seed)
    half = (w * torch.logspace(-6, 0, d_in)).to(dtype)  # (float16's subnormals among them)
    packed = gemm.pack(half)
    assert packed.dtype == dtype and packed.shape == gemm.pack(half.float()).shape
    assert torch.equal(gemm.product(x, packed, d_out, b), gemm.product(x, gemm.pack(half.float()), d_out, b))


def test_packing_lays_column_blocks_padded_with_zeros():
    w = torch.randn(37, 5)
    packed = gemm.pack(w)
    nb = gemm.block()
    assert packed.shape == (-(-37 // nb), 5, nb)
    flat = packed.permute(0, 2, 1).reshape(-1, 5)  # [blocks * nb, K]: the weight's rows, then zeros
    assert torch.equal(flat[:37], w) and not flat[37:].any()


def test_threads_split_the_blocks_to_the_same_result():
    x, w, b = _case(13, 256, 1000, True, 0, 0)
    packed = gemm.pack(w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gemm.product(x, packed, 1000, b)
        torch.set_num_threads(max(2, threads))
        many = gemm.product(x, packed, 1000, b)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many) and _close(one, x, w, b)  # (each element summed alike on any thread)


def test_bad_input_is_refused_before_anything_runs():
    w = torch.randn(40, 8)
    packed = gemm.pack(w)
    with pytest.raises(TypeError, match="weight"):
        gemm.pack(w.double())
    with pytest.raises(TypeError, match="weight"):
        gemm.pack(torch.randn(2, 40, 8))
    with pytest.raises(TypeError, match="x"):
        gemm.product(torch.randn(8, 3).t(), packed, 40)  # columns not unit-strided
    with pytest.raises(TypeError, match="x"):
        gemm.product(torch.randn(3, 8, dtype=torch.float64), packed, 40)
    with pytest.raises(ValueError, match="packed"):
        gemm.product(torch.randn(3, 9), packed, 40)  # K differs
    with pytest.raises(ValueError, match="packed"):
        gemm.product(torch.randn(3, 8), packed, 40 + 2 * gemm.block())  # more rows than the packed weight had
    with pytest.raises(ValueError, match="out_features"):
        gemm.product(torch.randn(3, 8), packed, 0)
    with pytest.raises(ValueError, match="packed"):
        gemm.product(torch.randn(3, 8), packed.double(), 40)
    with pytest.raises(ValueError, match="packed"):
        gemm.product(torch.randn(3, 8), packed[..., :-1], 40)  # another block width than the library's
    with pytest.raises(ValueError, match="bias"):
        gemm.product(torch.randn(3, 8), packed, 40, torch.randn(41))
    with pytest.raises(ValueError, match="out"):
        gemm.product(torch.randn(3, 8), packed, 40, out=torch.empty(3, 41))


def _in_process(code: str, **env) -> str:
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env},
                         timeout=300)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


def test_the_library_is_kept_per_source_and_flags_and_reused(tmp_path):
    code = ("from stree.kernels.cpu import gemm; import sys; "
            "lib, why = gemm.compile_library(gemm.FLAGS + tuple(sys.argv[1:])); print(lib._name if lib else why)")
    first = _in_process(code, STREE_CACHE_DIR=str(tmp_path))
    assert first.startswith(str(tmp_path / "kernels"))
    made = os.path.getmtime(first)
    assert _in_process(code, STREE_CACHE_DIR=str(tmp_path)) == first and os.path.getmtime(first) == made  # reused
    other = _in_process(code.replace("sys.argv[1:]", "('-O2',)"), STREE_CACHE_DIR=str(tmp_path))
    assert other != first and os.path.exists(other)  # other flags: another library
    assert not [p for p in os.listdir(tmp_path / "kernels") if p.endswith(".tmp")]


def test_without_a_compiler_it_is_unavailable_and_products_take_the_other_paths(tmp_path):
    out = _in_process(
        "import torch; from stree.kernels.cpu import gemm; import stree.models.layers.linear as lin; "
        "layer = lin.Linear(16, 40); x = torch.randn(13, 16)\n"
        "with torch.no_grad(): y = layer(x)\n"
        "same = torch.allclose(y, torch.nn.functional.linear(x, layer.weight, layer.bias), atol=1e-5)\n"
        "print(gemm.available(), same, sorted(lin._TIMES[(16, 40, 16, True)]), '|', gemm.unavailable_reason())",
        CXX=str(tmp_path / "no-such-compiler"), STREE_CACHE_DIR=str(tmp_path))
    assert out.startswith("False True ['blas', 'packed', 'transposed'] |") and "no-such-compiler" in out


def _assembly(source, march: str, tmp_path) -> dict[str, list[str]]:
    """The compiler's assembly of ``source`` with the library's flags for ``march`` (compiled, not run:
    no such CPU is needed), its lines by the function they lie in."""
    compiler = gemm.find_compiler()
    flags = [f for f in gemm.FLAGS if f not in ("-shared", "-fPIC", "-march=native")]
    out = tmp_path / f"{source.stem}.s"
    run = subprocess.run([compiler, *flags, f"-march={march}", "-S", "-o", str(out), str(source)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    bodies, name = {}, None
    for line in out.read_text().splitlines():
        if re.match(r"^[A-Za-z_]\S*:", line):
            name = line[:-1]
        elif name is not None:
            bodies.setdefault(name, []).append(line)
    return bodies


@pytest.mark.parametrize("march", ["haswell", "skylake-avx512"])
def test_every_tile_multiplies_the_weights_from_registers(march, tmp_path):
    """The tiles' FMAs read the block's weight vectors from registers, loaded once per k: folded into
    each FMA as a memory operand (what GCC did for tiles of 1 to 4 rows), every row loads them
    again and a tile waits on the load ports (on the 2-core EPYC the shipped target's products of 8
    rows, two tiles of 4, took 388 us against 259 with the weights in registers). Checked in the
    compiler's assembly for AVX2 and AVX-512 (compiled, not run: no such CPU is needed)."""
    tiles = {name: fmas for name, body in _assembly(gemm.SOURCE, march, tmp_path).items()
             if (fmas := [line for line in body if "vfmadd" in line])}
    # every function with FMAs (the tiles are inlined into block<MR>, the product's threads and the state
    # term's), of several row counts; a register spilled to the stack and read back by an FMA is no weight
    assert len([n for n in tiles if n.startswith("_Z5blockILi")]) >= 3, sorted(tiles)
    folded = {n: [f for f in fmas if re.search(r"vfmadd\w+\s+-?\d*\(%r(?!sp)", f)] for n, fmas in tiles.items()}
    assert not any(folded.values()), {n: f[:2] for n, f in folded.items() if f}


@pytest.mark.parametrize("march", ["haswell", "skylake-avx512"])
def test_the_row_loops_with_selects_run_in_vectors(march, tmp_path):
    """The SiLU (its polynomial exp clamps and passes NaN by selects) and the float16 rounding (F16C's
    conversions, and its branch-free rule's selects for a row's last few) run over a row in vector
    registers with AVX2 as with AVX-512: under GCC's default trapping math it kept both scalar for AVX2
    ("control flow in loop"), and on the 2-core EPYC Zen 3 a plain step of the shipped float16 target
    took a quarter longer, a 16-node chain's pass a third. Checked in the compiler's assembly of the
    library's flags (compiled, not run)."""
    bodies = _assembly(gemm.SOURCES[1], march, tmp_path)

    def vector_ops(function: str) -> set[str]:
        lines = [line for n, body in bodies.items() if function in n for line in body]
        assert lines, f"no {function} in the assembly"
        return {line.split()[0] for line in lines if re.search(r"%[yz]mm", line)}

    assert "vdivps" in vector_ops("silu_row")  # x / (1 + exp(-x)), eight or sixteen at once
    # F16C's conversion there and back, then the rule for the rest: float16's subnormal step, (|f| + 0.5) - 0.5
    assert {"vcvtps2ph", "vcvtph2ps", "vaddps"} <= vector_ops("round_half")


def test_a_new_build_leaves_the_newest_keep_builds_other_libraries(tmp_path):
    """The cache keeps, beside the library in use, the newest KEEP_BUILDS others (another
    installation's, the tests' other variant), not every one ever built: a development install's
    edits had each left one behind. Other files are left alone."""
    kept = tmp_path / "gemm-new.so"
    kept.write_bytes(b"")
    os.utime(kept, (1, 1))  # (the oldest of all: kept whatever its age)
    for i in range(gemm.KEEP_BUILDS + 4):
        old = tmp_path / f"gemm-{i:02d}.so"
        old.write_bytes(b"")
        os.utime(old, (100 + i, 100 + i))
    (tmp_path / "gemm-x.so.7.tmp").write_bytes(b"")
    gemm._prune_builds(tmp_path, kept)
    left = sorted(p.name for p in tmp_path.iterdir())
    newest = [f"gemm-{i:02d}.so" for i in range(4, gemm.KEEP_BUILDS + 4)]
    assert left == sorted(["gemm-new.so", "gemm-x.so.7.tmp", *newest])
