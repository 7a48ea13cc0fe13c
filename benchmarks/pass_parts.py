"""Where a greedy iteration's time goes, part by part, on the machine at hand: the one-call iteration
(``MambaStep.tree_greedy``: the tree pass, greedy verification, replay) of a Mamba2 model, timed inside
the call by a build of the library with ``-DSTREE_PART_TIMERS`` (``mamba_step.cpp``'s ``PART`` marks,
nothing in the library's own build), each call followed by a plain step on the same cache. Parts, per
call: the blocks' RMSNorm and in_proj (``in``, the embedding with them), the conv (``conv``), the scan's
state term (``state``) and its tree scan (``scan``), the gated norm, out_proj and residual (``out``),
the head's final norm and product on the rows the walks read (``head``, with the rows it took), the
walks and their bookkeeping (``walk``), the accepted paths' replay into the states (``replay``) and the
laws a drafter learns from (``laws``; none asked here); ``rest``: the call's time outside them (the
Python wrapper, the conv states' widening). Trees: chains of n - 1 drafts (the head's first wave takes
the whole chain) and a binary tree of n nodes; ``--accepted none`` drafts random tokens (the walk stops
at the root), ``all`` the model's own choices along a chain (every node verified and replayed; the
states put back before each call, outside the timing). Medians over ``--calls`` calls, sizes taking
turns; in microseconds and in plain steps. Writes JSON and a PNG (the parts in steps, stacked) to
benchmarks/results/.

Why: a tree pass's price in steps decides whether speculation pays on a machine (the tree choice reads
it), and where a pass of a few nodes costs twice a step, which part grows with the nodes says whether
it is the products (bound by the cores' multiply-adds) or the work around them.

    python benchmarks/pass_parts.py
    python benchmarks/pass_parts.py --sizes 2,4,8 --accepted all --batch 2
    python benchmarks/pass_parts.py --smoke      # CI: a tiny model, few calls
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

PARTS = ("in", "conv", "state", "scan", "out", "head", "walk", "replay", "laws")
HEAD_ROWS, CALLS = len(PARTS), len(PARTS) + 1  # (the counters after the parts, as mamba_step.cpp lays them out)


def timed_library():
    """The tiled product's library built with the part timers, and its reader of them."""
    from stree.kernels.cpu import gemm

    lib, why = gemm.compile_library(gemm.FLAGS + ("-DSTREE_PART_TIMERS",))
    if lib is None:
        raise SystemExit(f"the timed library cannot be built: {why}")
    lib.stree_part_times.argtypes = [ctypes.c_void_p]
    lib.stree_part_times.restype = ctypes.c_long
    return lib


def drafts(model, cache, nodes: int, batch: int, accepted: str, gen: torch.Generator) -> dict:
    """The drafts timed at ``nodes``: name -> (tokens, parents, valid, max_depth)."""
    from stree.tree import TokenTree, TreeShape

    shapes = {"chain": TreeShape.chain(nodes - 1)}
    if accepted == "none":
        shapes["binary"] = TreeShape(tuple([-1] + [(i - 1) // 2 for i in range(1, nodes)]))
    out = {}
    for name, shape in shapes.items():
        tokens = torch.randint(0, model.vocab_size, (batch, nodes), generator=gen)
        if accepted == "all":  # each node the model's choice after its parent: the whole chain accepted
            tree = TokenTree.from_shape(shape, tokens)
            for j in range(1, nodes):
                tokens[:, j] = model.forward_tree(tree, cache.clone())[0][:, j - 1].argmax(-1)
                tree = TokenTree.from_shape(shape, tokens)
        parents = np.ascontiguousarray(np.asarray(shape.parents), dtype=np.int64)[None]
        out[name] = (tokens.contiguous(), parents, np.ones((batch, nodes), dtype=bool), shape.max_depth)
    return out


@torch.no_grad()
def measure(model, lib, sizes: list[int], batch: int, accepted: str, calls: int) -> dict:
    """Per draft (``"<shape> <nodes>"``): the call's and the plain step's median microseconds, each
    part's, the head's rows a call, and the call and parts in steps."""
    from stree.models.fused_step import fused_step

    cache = model.allocate_cache(batch, 512)
    gen = torch.Generator().manual_seed(0)
    model.prefill(torch.randint(0, model.vocab_size, (batch, 64), generator=gen), cache)
    step = fused_step(model, cache, None, "auto")
    if step is None:
        raise SystemExit("the model does not decode in one call here (stree.models.fused_step)")
    step = step.reused()
    step._greedy, step._run = lib.stree_mamba_tree_greedy, lib.stree_mamba_step  # (the same layout, timed)
    kept = cache.conv.clone(), cache.ssm.clone()
    work = {f"{name} {n}": d for n in sizes for name, d in drafts(model, cache, n, batch, accepted, gen).items()}
    token = torch.randint(0, model.vocab_size, (batch,), generator=gen)
    raw = np.zeros(CALLS + 1)
    seen = {k: {"call": [], "step": [], "rows": [], **{p: [] for p in PARTS}} for k in work}

    def one(key, record: bool) -> None:
        tokens, parents, valid, depth = work[key]
        cache.conv.copy_(kept[0])
        cache.ssm.copy_(kept[1])
        lib.stree_part_times(raw.ctypes.data)
        t0 = time.perf_counter()
        step.tree_greedy(tokens, parents, valid, depth, cache.conv, cache.ssm)
        t1 = time.perf_counter()
        lib.stree_part_times(raw.ctypes.data)
        step(token, cache.conv, cache.ssm)
        t2 = time.perf_counter()
        if record:
            s = seen[key]
            s["call"].append((t1 - t0) * 1e6)
            s["step"].append((t2 - t1) * 1e6)
            s["rows"].append(raw[HEAD_ROWS])
            for i, p in enumerate(PARTS):
                s[p].append(raw[i] * 1e6)

    for key in work:  # (first calls: the products' first reads, the buffers grown)
        for _ in range(5):
            one(key, False)
    for r in tqdm(range(calls), desc="calls", leave=False):
        for key in (list(work) if r % 2 == 0 else list(work)[::-1]):
            one(key, True)
    out = {}
    for key, s in seen.items():
        med = {k: statistics.median(v) for k, v in s.items()}
        parts = {p: med[p] for p in PARTS}
        out[key] = dict(call_us=med["call"], step_us=med["step"], head_rows=med["rows"], parts_us=parts,
                        rest_us=med["call"] - sum(parts.values()), call_steps=med["call"] / med["step"],
                        parts_steps={p: v / med["step"] for p, v in parts.items()})
    return out


def plot(result: dict):
    import matplotlib.pyplot as plt

    rows = result["rows"]
    keys = list(rows)
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(keys)), 4))
    bottom = np.zeros(len(keys))
    for p in (*PARTS, "rest"):
        v = np.array([rows[k]["parts_steps"][p] if p != "rest" else rows[k]["rest_us"] / rows[k]["step_us"]
                      for k in keys])
        ax.bar(keys, v, bottom=bottom, label=p)
        bottom += v
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_ylabel("plain steps")
    ax.set_title(f"greedy iteration by part, batch {result['batch']}, accepted {result['accepted']}\n"
                 f"{result['device']}", fontsize=8)
    ax.tick_params(axis="x", rotation=60, labelsize=7)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    return fig


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1,2,3,4,6,8,13,16", help="comma-separated node counts")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--accepted", choices=("none", "all"), default="none")
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float16")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    p.add_argument("--stem", default=None, help="result file name (default: pass_parts_cpu, or _smoke)")
    args = p.parse_args(argv)
    try:
        sizes = [int(v) for v in args.sizes.split(",")]
    except ValueError:
        p.error(f"--sizes takes node counts separated by commas, got {args.sizes!r}")
    if min(sizes) < 1 or args.batch < 1 or args.calls < 1:
        p.error(f"--sizes, --batch and --calls must be >= 1, got {args.sizes!r}, {args.batch}, {args.calls}")

    from stree.models import load
    from stree.models.presets import TINY
    from stree.tools.demo import TARGET
    from stree.tools.timing import run_info, save_result

    dtype = getattr(torch, args.dtype)
    if args.smoke:
        sizes, args.calls = [1, 3], 3
        cls, make = TINY["mamba2-tiny"]
        torch.manual_seed(0)
        model = cls(make()).to(dtype).eval()
    else:
        model = load(TARGET, dtype=dtype)
    lib = timed_library()
    rows = measure(model, lib, sizes, args.batch, args.accepted, args.calls)
    for key, row in rows.items():
        print(f"{key:10s} {row['call_us']:7.1f} us = {row['call_steps']:.2f} steps (step {row['step_us']:.1f} us)  "
              + "  ".join(f"{p} {v:.0f}" for p, v in row["parts_us"].items()) + f"  rest {row['rest_us']:.0f}"
              + f"  | head rows {row['head_rows']:.0f}")
    result = dict(benchmark="pass_parts", **run_info(torch.device("cpu"), argv), dtype=args.dtype, batch=args.batch,
                  accepted=args.accepted, calls=args.calls, threads=torch.get_num_threads(),
                  target="mamba2-tiny (random)" if args.smoke else "shipped tiny-target",
                  note="medians over calls, sizes taking turns, each call followed by a plain step on the same "
                       "cache; parts timed inside the one call (-DSTREE_PART_TIMERS); rest: the call's time "
                       "outside the parts", rows=rows)
    save_result(result, args.out, args.stem or ("pass_parts_smoke" if args.smoke else "pass_parts_cpu"), plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
