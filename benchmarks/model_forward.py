"""Target-model cost of verifying a token tree: ``forward_tree`` (packed STree), the SSM-only
unrolled backend (``unrolled``: only the scan per path) and the paper's full unrolled baseline
(``unrolled-full``: every root-to-leaf path through the whole model from its own state copy, with
its memory; paper 001 Table 2) against one autoregressive ``step``, on random-weight models at real configurations
(``stree.models.presets.PRESETS``: Mamba2-2.7B, MambaInLlama-8B, Bamba-9B, Nemotron-H-8B,
Granite-4.0-H-Small, Falcon-H1-7B). On CUDA both are also timed replayed from CUDA
graphs (``GraphedStep``, ``GraphedTreePass``), where the ratio is to the graphed step. Writes JSON
and a PNG to benchmarks/results/.

    python benchmarks/model_forward.py            # full size, bf16 (meant for a GPU)
    python benchmarks/model_forward.py --smoke    # tiny configs, any machine
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before stree.kernels is imported

from tqdm import tqdm  # noqa: E402

from stree.runtime import GraphedStep, GraphedTreePass
from stree.models.presets import PRESETS, TINY  # noqa: E402
from stree.tools.timing import median_ms, peak_bytes, run_info, save_result  # noqa: E402
from stree.tree import TokenTree, TreeShape  # noqa: E402
from stree.runtime.unrolled import UnrolledTarget  # noqa: E402


def models(smoke):
    for name, (cls, config) in (TINY if smoke else PRESETS).items():
        yield name, cls, config()


TREES = [("chain5", TreeShape.chain(4)), ("paper13", TreeShape.paper13())] + [
    (f"binary{TreeShape.full(2, d).n}", TreeShape.full(2, d)) for d in (3, 4, 5)]


def measure(name, cls, cfg, device, dtype, batch: int, prompt: int, warmup: int, reps: int, gen) -> list[dict]:
    """One model's rows: its step, and every tree by each backend (and as a CUDA graph on a GPU)."""
    rows = []
    torch.manual_seed(0)
    model = cls(cfg, device=device, dtype=dtype).eval()
    unrolled = UnrolledTarget(model)  # the paper's baseline: each root-to-leaf path its own sequence
    vocab = model.vocab_size
    graphs = device.type == "cuda"
    cache = model.allocate_cache(batch, prompt + 64 + (warmup + reps + 4) * (4 if graphs else 2))
    model.prefill(torch.randint(0, vocab, (batch, prompt), generator=gen).to(device), cache)
    tok = torch.randint(0, vocab, (batch,), generator=gen).to(device)
    step_ms = median_ms(lambda: model.step(tok, cache), device, warmup=warmup, reps=reps)
    step_peak = peak_bytes(lambda: model.step(tok, cache), device)
    rows.append(dict(model=name, tree="step", nodes=1, backend="step", time_ms_median=step_ms, ratio_to_step=1.0,
                     peak_mem_bytes=step_peak))
    if graphs:  # validate=False: the length check is a host sync, and the cache has room by construction
        graphed_step = GraphedStep(model, cache)
        graph_step_ms = median_ms(lambda: graphed_step(tok, validate=False), device, warmup=warmup, reps=reps)
        rows.append(dict(model=name, tree="step", nodes=1, backend="step-graph", time_ms_median=graph_step_ms,
                         ratio_to_step=1.0, peak_mem_bytes=None))
    for tree_name, shape in tqdm(TREES, desc=name, file=sys.stderr):
        tree = TokenTree.from_shape(shape, torch.randint(0, vocab, (batch, shape.n), generator=gen).to(device))
        for backend in ("tree", "unrolled", "unrolled-full"):
            target = unrolled if backend == "unrolled-full" else model
            run = lambda: target.forward_tree(tree, cache, scan="tree" if backend == "unrolled-full" else backend)
            ms = median_ms(run, device, warmup=warmup, reps=reps)
            rows.append(dict(model=name, tree=tree_name, nodes=shape.n, backend=backend, time_ms_median=ms,
                             ratio_to_step=ms / step_ms, peak_mem_bytes=peak_bytes(run, device),
                             tokens=sum(map(len, shape.leaf_paths())) if backend == "unrolled-full" else shape.n))
        if graphs:
            graphed_tree = GraphedTreePass(model, cache, shape)
            ms = median_ms(lambda: graphed_tree(tree.tokens, validate=False), device, warmup=warmup, reps=reps)
            rows.append(dict(model=name, tree=tree_name, nodes=shape.n, backend="tree-graph", time_ms_median=ms,
                             ratio_to_step=ms / graph_step_ms, peak_mem_bytes=None))
            del graphed_tree
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny configs (CI)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    prompt, reps = (8, 2) if args.smoke else (args.prompt, args.reps)
    warmup = 1 if args.smoke else 3
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, cls, cfg in models(args.smoke):
        rows += measure(name, cls, cfg, device, dtype, args.batch, prompt, warmup, reps, gen)
        gc.collect()  # a model and its graphs go before the next is made: the 8B widths share one GPU
        if device.type == "cuda":
            torch.cuda.empty_cache()

    result = dict(
        benchmark="model_forward", **run_info(device, argv),
        dtype=str(dtype).replace("torch.", ""), batch=args.batch, prompt=prompt, reps=reps,
        kernels="triton" if device.type == "cuda" else "torch reference",
        note="ratio_to_step: eager rows over the eager step, *-graph rows over the graphed step",
        results=rows,
    )
    save_result(result, args.out, f"model_forward_{'smoke' if args.smoke else device.type}", plot)
    for r in rows:
        print(f"{r['model']:<14}{r['tree']:<10}{r['backend']:<9}{r['time_ms_median']:>10.3f} ms  x{r['ratio_to_step']:.2f} of a step")
    return result


def plot(result):
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["model"] for r in result["results"]))
    fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names):
        for backend in ("tree", "unrolled", "unrolled-full", "tree-graph"):
            rs = sorted((r for r in result["results"] if r["model"] == name and r["backend"] == backend),
                        key=lambda r: r["nodes"])
            if not rs:
                continue
            ax.plot([r["nodes"] for r in rs], [r["ratio_to_step"] for r in rs], "o-", label=f"forward_tree ({backend})")
        ax.axhline(1.0, color="gray", lw=0.8, ls="--", label="one step")
        ax.set(xscale="log", xlabel="tree nodes", ylabel="time / step time", title=f"{name}, {result['device']}")
        ax.legend()
        ax.grid(alpha=0.3)
    return fig


if __name__ == "__main__":
    main()
