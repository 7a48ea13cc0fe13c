"""Packed tree scan vs the unrolled baseline on the SSM part of one Mamba2-2.7B layer.

For each tree: ``tree_scan`` over the packed tree (one state in, n tokens) against
``multistep_update`` over the tree's root-to-leaf paths as a batch (one state per leaf, every
shared prefix recomputed), and mamba_ssm's chunk scan on that batch when mamba_ssm imports.
Writes JSON and a PNG to benchmarks/results/.

    python benchmarks/tree_scan_sweep.py            # full size (meant for a GPU)
    python benchmarks/tree_scan_sweep.py --smoke    # tiny sizes, any machine
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before stree.kernels is imported

from tqdm import tqdm  # noqa: E402

from stree.kernels import multistep_update, tree_scan  # noqa: E402
from stree.testing import max_rel_error, random_ssm_inputs  # noqa: E402
from stree.tools.timing import median_ms, peak_bytes, run_info, save_result  # noqa: E402
from stree.tree import TreeShape, tree_index  # noqa: E402

FULL = dict(nheads=80, headdim=64, dstate=128, ngroups=1)  # Mamba2-2.7B: d_inner 5120 = 80 x 64
SMOKE = dict(nheads=2, headdim=8, dstate=16, ngroups=1)


def trees(smoke):
    shapes = [("chain5", TreeShape.chain(4)), ("paper13", TreeShape.paper13())]
    depths = (2, 3) if smoke else (3, 4, 5, 6)
    shapes += [(f"binary{TreeShape.full(2, d).n}", TreeShape.full(2, d)) for d in depths]
    return shapes


def unrolled_inputs(inp, paths):
    """Each leaf path as a batch row, right-padded by repeating the leaf (padding sits after the
    real tokens, so causality keeps it from changing them)."""
    length = max(len(p) for p in paths)
    idx = torch.tensor([p + [p[-1]] * (length - len(p)) for p in paths], device=inp["x"].device)
    real = torch.tensor([[t < len(p) for t in range(length)] for p in paths], device=idx.device)
    take = lambda t: t[0, idx]
    return dict(x=take(inp["x"]), dt=take(inp["dt"]), B=take(inp["B"]), C=take(inp["C"])), idx, real


def mamba_chunk_scan():
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except Exception:  # not installed, or no CUDA build: an optional baseline only
        return None
    return mamba_chunk_scan_combined


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (CI)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dims = SMOKE if args.smoke else FULL
    # float32 on the CPU and for --smoke, whose check is the float32 tolerance
    dtype = getattr(torch, args.dtype) if device.type == "cuda" and not args.smoke else torch.float32
    reps = 1 if args.smoke else args.reps  # (the smoke runs the interpreter: its times say nothing)
    backend = "triton" if device.type == "cuda" or args.smoke else "torch"
    chunk_scan = mamba_chunk_scan() if device.type == "cuda" else None
    gen = torch.Generator().manual_seed(0)
    state_bytes = dims["nheads"] * dims["headdim"] * dims["dstate"] * 4

    rows = []
    for name, shape in tqdm(trees(args.smoke), desc="trees", file=sys.stderr):
        inp = random_ssm_inputs(1, shape.n, dims["nheads"], dims["headdim"], dims["dstate"], dims["ngroups"],
                                dtype=dtype, device=device, generator=gen)
        parents = shape.parents_tensor(device)
        paths = shape.leaf_paths()
        un, idx, real = unrolled_inputs(inp, paths)
        x0 = inp["initial_state"]
        x0_leaves = x0.expand(len(paths), -1, -1, -1)
        common = dict(D=inp["D"], dt_bias=inp["dt_bias"])

        # as the models call it: the tree's index built once a pass (shared by its layers), not per call
        index = tree_index(parents)
        packed = lambda: tree_scan(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], index, initial_state=x0,
                                   backend=backend, **common)
        unrolled = lambda: multistep_update(x0_leaves, un["x"], un["dt"], inp["A"], un["B"], un["C"],
                                            backend=backend, **common)
        # (name, run, outputs at the path positions [leaves, L, h, p], states held, tokens computed)
        methods = [("tree_scan", packed, lambda y: y[0, idx], 1, shape.n),
                   ("unrolled_multistep", unrolled, lambda out: out[0], len(paths), idx.numel())]
        if chunk_scan is not None:
            x0_rows = x0_leaves.contiguous()
            methods.append(("unrolled_mamba_chunk_scan", lambda: chunk_scan(
                un["x"], un["dt"], inp["A"], un["B"], un["C"], chunk_size=256, D=inp["D"], dt_bias=inp["dt_bias"],
                initial_states=x0_rows, dt_softplus=True), lambda y: y, len(paths), idx.numel()))
        y_tree = packed()[0, idx][real]
        for method, fn, on_paths, states, tokens in methods:
            # Every method computes the same function: check before timing (padding excluded).
            agreement = max_rel_error(on_paths(fn())[real], y_tree)
            ms = median_ms(fn, device, warmup=2 if reps > 1 else 0, reps=reps)
            peak = peak_bytes(fn, device)
            rows.append(dict(tree=name, nodes=shape.n, leaves=len(paths), depth=shape.max_depth, method=method,
                             time_ms_median=ms, states_held=states, state_bytes=states * state_bytes,
                             tokens_computed=tokens, peak_mem_bytes=peak,
                             max_rel_diff_vs_tree_scan=agreement))

    result = dict(
        benchmark="tree_scan_sweep",
        **run_info(device, argv),
        backend=backend,
        dtype=str(dtype).replace("torch.", ""),
        dims=dims,
        reps=reps,
        results=rows,
    )
    save_result(result, args.out, f"tree_scan_sweep_{'smoke' if args.smoke else device.type}", plot)
    for r in rows:
        print(f"{r['tree']:<11}{r['method']:<27}{r['time_ms_median']:>10.3f} ms  states {r['states_held']:>3}  "
              f"tokens {r['tokens_computed']:>4}  diff {r['max_rel_diff_vs_tree_scan']:.1e}")
    return result


def plot(result):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for method in dict.fromkeys(r["method"] for r in result["results"]):
        rs = sorted((r for r in result["results"] if r["method"] == method), key=lambda r: r["nodes"])
        axes[0].plot([r["nodes"] for r in rs], [r["time_ms_median"] for r in rs], "o-", label=method)
        axes[1].plot([r["nodes"] for r in rs], [r["tokens_computed"] for r in rs], "o-", label=method)
    for r in result["results"]:
        if r["method"] == "tree_scan":
            axes[1].annotate(r["tree"], (r["nodes"], r["tokens_computed"]), fontsize=7, xytext=(3, -9),
                             textcoords="offset points")
    axes[0].set(xlabel="tree nodes", ylabel="median time (ms)", xscale="log", yscale="log",
                title=f"SSM part of one layer, {result['device']}")
    axes[1].set(xlabel="tree nodes", ylabel="tokens computed", xscale="log", yscale="log", title="work")
    for ax in axes:
        ax.legend()
        ax.grid(alpha=0.3)
    return fig


if __name__ == "__main__":
    main()
