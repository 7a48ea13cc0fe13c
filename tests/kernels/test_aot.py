"""Every Triton kernel compiled for real GPUs (sm_80, sm_90) without one: ``stree.tools.aotcheck --ci``
in a process without the interpreter; no compile errors, no spills, shared memory within the
target's limit, at the test sizes and at Mamba2-2.7B / MambaInLlama-8B sizes."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from stree.tools.aotcheck import ci_cases
from stree.kernels import _common
from stree.kernels.aot import TARGETS, capture, jit_kernels

ROOT = Path(__file__).resolve().parents[2]


def _compiler_env():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


@pytest.fixture(scope="module")
def ci_table(tmp_path_factory):
    out = tmp_path_factory.mktemp("aot") / "aot.json"
    run = subprocess.run([sys.executable, "-m", "stree.tools.aotcheck", "--ci", "--json", str(out)], env=_compiler_env(),
                         capture_output=True, text=True, timeout=1800)
    assert out.exists(), f"stree.tools.aotcheck --ci wrote no table (exit {run.returncode}):\n{run.stderr[-3000:]}"
    return json.loads(out.read_text()), run


def test_every_jit_function_is_a_kernel_or_a_helper_of_one():
    """jit_kernels finds kernels by their ``_kernel`` suffix; anything else jit-compiled must be a
    helper some other jit function calls, or a new kernel would escape the check by its name."""
    import importlib
    import inspect
    import pkgutil

    from triton.runtime.jit import KernelInterface

    from stree import kernels

    jitted = {}
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"stree.kernels.{info.name}")
        jitted.update({name: obj for name, obj in vars(module).items()
                       if isinstance(obj, KernelInterface) and obj.fn.__module__ == module.__name__})
    sources = {name: inspect.getsource(obj.fn) for name, obj in jitted.items()}
    for name in set(jitted) - set(jit_kernels()):
        callers = [other for other, src in sources.items() if other != name and f"{name}(" in src]
        assert callers, f"{name} is jit-compiled but neither named *_kernel nor called by another jit function"


def test_every_kernel_is_launched_by_the_ci_cases(ci_table):
    table, _ = ci_table
    assert sorted(table["kernels_defined"]) == sorted(jit_kernels()) and len(table["kernels_defined"]) >= 5
    assert table["kernels_never_launched"] == []
    assert {r["kernel"] for r in table["results"]} == set(table["kernels_defined"])


@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("case", ci_cases(), ids=lambda c: c.name.replace(" ", "-"))
def test_compiles_without_spills_within_shared_memory(ci_table, case, target):
    table, _ = ci_table
    rows = [r for r in table["results"] if r["target"] == target and case.name in r["cases"]]
    assert rows, f"{case.name}: no launch was captured and compiled for {target}"
    problems = [f"{r['kernel']} for {target} ({case.name}; {r['launch']}): {p}" for r in rows for p in r["problems"]]
    assert not problems, "\n".join(problems)
    for r in rows:
        assert r["registers"] > 0 and r["cubin"] > 0 and r["num_warps"] in (1, 2, 4, 8, 16)


def test_the_table_run_exits_0_and_prints_a_summary(ci_table):
    _, run = ci_table
    assert run.returncode == 0, run.stdout[-3000:]
    assert "all compile, no spills" in run.stdout.splitlines()[-1]


# Kernels that must be caught: a tl.dot the GPU cannot do (the interpreter runs it), one that
# spills, one that asks for more shared memory than an H100 has.
BAD_KERNELS = textwrap.dedent('''
    import json, sys
    import torch, triton, triton.language as tl
    from stree.kernels.aot import capture, compile_launch

    @triton.jit
    def small_dot_kernel(a_ptr, b_ptr, c_ptr, K: tl.constexpr):
        r = tl.arange(0, 16)
        k = tl.arange(0, K)
        a = tl.load(a_ptr + r[:, None] * K + k[None, :])
        b = tl.load(b_ptr + k[:, None] * 16 + r[None, :])
        tl.store(c_ptr + r[:, None] * 16 + r[None, :], tl.dot(a, b))

    @triton.jit
    def spill_kernel(x_ptr, steps_ptr, N: tl.constexpr):  # 128 live values a lane, sin's too: past 255 registers
        offs = tl.arange(0, N)
        acc = tl.load(x_ptr + offs)
        for _ in range(tl.load(steps_ptr)):  # every element stays live across a runtime loop
            acc = acc * 1.0001 + tl.sin(acc)
        tl.store(x_ptr + offs, acc)

    @triton.jit
    def big_shared_kernel(a_ptr, b_ptr, c_ptr, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        rm, rn, rk = tl.arange(0, BM), tl.arange(0, BN), tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            a = tl.load(a_ptr + rm[:, None] * K + (k0 + rk)[None, :])
            b = tl.load(b_ptr + (k0 + rk)[:, None] * BN + rn[None, :])
            acc += tl.dot(a, b)
        tl.store(c_ptr + rm[:, None] * BN + rn[None, :], acc)

    h = lambda *s: torch.zeros(*s, dtype=torch.float16)
    with capture() as launches:
        small_dot_kernel[(1,)](h(16, 8), h(8, 16), torch.zeros(16, 16), K=8)
        spill_kernel[(1,)](torch.zeros(4096), torch.ones(1, dtype=torch.int32), N=4096, num_warps=1)
        big_shared_kernel[(1,)](h(256, 1024), h(1024, 256), torch.zeros(256, 256), 1024, BM=256, BN=256, BK=128,
                                num_stages=4)
    print(json.dumps([compile_launch(launch, "sm90").as_dict() for launch in launches]))
''')


@pytest.fixture(scope="module")
def bad_reports(tmp_path_factory):
    script = tmp_path_factory.mktemp("bad") / "bad_kernels.py"
    script.write_text(BAD_KERNELS)
    run = subprocess.run([sys.executable, str(script)], env=_compiler_env(), capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return {r["kernel"]: r for r in json.loads(run.stdout.splitlines()[-1])}


def test_a_kernel_that_cannot_compile_names_itself_the_target_the_shape_and_tritons_line(bad_reports):
    r = bad_reports["small_dot_kernel"]
    assert r["target"] == "sm90" and "K=8" in r["launch"]
    assert r["error"].startswith("at ") and "K >= 16" in r["error"]
    assert r["problems"] == [f"does not compile: {r['error']}"]


def test_spills_are_reported(bad_reports):
    r = bad_reports["spill_kernel"]
    assert r["error"] is None and r["spill_stores"] > 0 and r["stack"] > 0
    assert r["problems"] and r["problems"][0].startswith("spills")


def test_shared_memory_over_the_targets_limit_is_reported(bad_reports):
    r = bad_reports["big_shared_kernel"]
    assert r["error"] is None and r["shared"] > 227 * 1024
    assert any("shared memory" in p for p in r["problems"])


@pytest.mark.skipif(not _common.TRITON_INTERPRETED, reason="this process compiles kernels (CUDA): nothing to refuse")
def test_capture_refuses_interpreted_kernels():
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        with capture():
            pass


def test_bad_arguments_exit_2_with_one_line():
    run = subprocess.run([sys.executable, "-m", "stree.tools.aotcheck", "--targets", "sm70"], env=_compiler_env(),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1] == "stree.tools.aotcheck: error: --targets must name some of sm80, sm90, got 'sm70'"
    assert "Traceback" not in run.stderr
