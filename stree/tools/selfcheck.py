"""``python -m stree.tools.selfcheck``: every kernel, every backend, against its float64 definition.

On a CUDA machine this is the one-command GPU validation (fp32 and bf16, moderate sizes); without
one it runs the Triton kernels under the interpreter at small sizes. Prints a table and exits
non-zero if any error exceeds its tolerance.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

if not torch.cuda.is_available():
    # Must precede the first import of stree.kernels: triton.jit reads it when decorating.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from .. import kernels  # noqa: E402
from ..testing import (  # noqa: E402
    max_rel_error,
    multistep_def,
    random_ssm_inputs,
    replay_def,
    tree_attention_def,
    tree_conv1d_def,
    tree_scan_def,
)
from .timing import median_ms  # noqa: E402
from ..tree import TreeShape  # noqa: E402

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _cases(device, dtype, large):
    """(kernel, tree, run(backend) -> tensors, definition tensors) for each kernel and tree."""
    g = torch.Generator().manual_seed(0)
    h, p, s, grp, dim = (8, 64, 128, 2, 256) if large else (4, 16, 16, 2, 48)
    trees = [("paper13", TreeShape.paper13()), ("full2x4", TreeShape.full(2, 4)),
             ("chain", TreeShape.chain(63 if large else 11))]
    for tree_name, shape in trees:
        n, parents = shape.n, shape.parents_tensor(device)
        inp = random_ssm_inputs(2, n, h, p, s, grp, dtype=dtype, device=device, generator=g)
        kw = dict(D=inp["D"], dt_bias=inp["dt_bias"], initial_state=inp["initial_state"])
        args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], parents)
        yield ("tree_scan", tree_name, lambda be, a=args, k=kw: (kernels.tree_scan(*a, **k, backend=be),),
               (tree_scan_def(*args, **kw),))

        xbc = torch.randn(2, n, dim, generator=g).to(device, dtype)
        conv = torch.randn(2, dim, 4, generator=g).to(device, dtype)
        w, bias = torch.randn(dim, 4, generator=g).to(device), torch.randn(dim, generator=g).to(device)
        cargs = (xbc, parents, conv, w, bias)
        yield ("tree_conv1d", tree_name, lambda be, a=cargs: (kernels.tree_conv1d(*a, backend=be),),
               (tree_conv1d_def(*cargs),))

        hq, hkv, d, t_max = (8, 2, 64, 256) if large else (4, 2, 16, 40)
        attn = dict(q=torch.randn(2, n, hq, d, generator=g), k_cache=torch.randn(2, t_max, hkv, d, generator=g),
                    v_cache=torch.randn(2, t_max, hkv, d, generator=g), k_tree=torch.randn(2, n, hkv, d, generator=g),
                    v_tree=torch.randn(2, n, hkv, d, generator=g))
        attn = {k: v.to(device, dtype) for k, v in attn.items()}
        attn.update(cache_seqlens=torch.tensor([t_max, t_max // 3], device=device), parents=parents)
        yield ("tree_attention", tree_name, lambda be, a=attn: (kernels.tree_attention(**a, backend=be),),
               (tree_attention_def(**attn),))

        path = torch.tensor(shape.leaf_paths()[-1], device=device)
        accepted = torch.stack([path, torch.zeros_like(path)])  # the deepest path, and the root alone
        num = torch.tensor([len(path), 1], device=device)
        rargs = (inp["initial_state"], conv, xbc, inp["x"], inp["dt"], inp["B"], inp["A"], accepted, num)
        yield ("replay", tree_name, lambda be, a=rargs, bias=inp["dt_bias"]: kernels.replay(*a, dt_bias=bias, backend=be),
               replay_def(*rargs, dt_bias=inp["dt_bias"]))

    T = 5
    inp = random_ssm_inputs(4, T, h, p, s, grp, dtype=dtype, device=device, generator=g)
    margs = (inp["initial_state"], inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"])
    mkw = dict(D=inp["D"], dt_bias=inp["dt_bias"])
    yield ("multistep_update", f"T={T}", lambda be: kernels.multistep_update(*margs, **mkw, backend=be),
           multistep_def(*margs, **mkw))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], action="append",
                        help="repeatable; default float32, plus bfloat16 on CUDA")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtypes = [getattr(torch, d) for d in args.dtype] if args.dtype else (
        [torch.float32, torch.bfloat16] if device.type == "cuda" else [torch.float32])
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)"
    print(f"stree selfcheck on {name}")
    header = f"{'kernel':<17}{'tree':<10}{'backend':<8}{'device':<7}{'dtype':<10}{'max rel err':>12}{'time ms':>10}  ok"
    print(header)
    print("-" * len(header))
    failures = 0
    for dtype in dtypes:
        for kernel, tree_name, run, expected in _cases(device, dtype, large=device.type == "cuda"):
            for backend in ("torch", "triton"):
                start = time.perf_counter()
                got = run(backend)
                if backend == "triton" and device.type != "cuda":
                    # under the interpreter a time says little and a run costs seconds: the checked run's own
                    ms = (time.perf_counter() - start) * 1e3
                else:
                    ms = median_ms(lambda: run(backend), device, warmup=1, reps=5 if device.type == "cuda" else 2)
                err = max(max_rel_error(o, e) for o, e in zip(got, expected))
                ok = err <= TOLERANCE[dtype]
                failures += not ok
                print(f"{kernel:<17}{tree_name:<10}{backend:<8}{device.type:<7}{str(dtype)[6:]:<10}"
                      f"{err:>12.2e}{ms:>10.3f}  {'yes' if ok else 'NO'}")
    print(f"{'all kernels match their definitions' if not failures else f'{failures} check(s) FAILED'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
