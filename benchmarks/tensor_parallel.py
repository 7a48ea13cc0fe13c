"""Tensor parallelism: the time of a step and of tree passes against the world size, on
random-weight models at real widths (layers cut) split over ``world`` CPU processes joined by
gloo (``stree.models.parallel``); the same over NCCL needs a multi-GPU machine, not measured yet.

On the CPU each rank gets ``cores / world`` threads, so every world size uses the same cores; the
world-1 row runs the same code with no collectives. Writes JSON and a PNG to benchmarks/results/.

    python benchmarks/tensor_parallel.py            # Mamba2-2.7B and Bamba-9B widths, world 1 and 2
    python benchmarks/tensor_parallel.py --smoke    # tiny configs (CI)
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

from stree.models import shard  # noqa: E402
from stree.models.presets import PRESETS, TINY  # noqa: E402
from stree.testing.ranks import run_ranks  # noqa: E402
from stree.tools.timing import median_ms, run_info, save_result  # noqa: E402
from stree.tree import TokenTree, TreeShape  # noqa: E402

TREES = {"paper13": TreeShape.paper13(), "binary63": TreeShape.full(2, 5)}
MODELS = {"mamba2-2.7b": 4, "bamba-9b": 2}  # the preset and the layers kept


def measure_all(tp, configs: dict, prompt: int, warmup: int, reps: int) -> dict:
    """:func:`measure` of each model, by name, in one group of ranks (a group's processes import
    torch and stree: seconds each)."""
    return {name: measure(tp, cls, cfg, prompt, warmup, reps) for name, (cls, cfg) in configs.items()}


def measure(tp, cls, cfg, prompt: int, warmup: int, reps: int) -> dict:
    """Median ms of a step and of each tree pass on this rank's slice (the ranks run in lockstep:
    every layer's all-reduce waits for all of them)."""
    torch.manual_seed(0)
    model = cls(cfg).eval()
    model = model if tp.world == 1 else shard(model, tp)
    gen = torch.Generator().manual_seed(0)
    vocab = model.vocab_size
    cache = model.allocate_cache(1, prompt + (warmup + reps) + 8)
    model.prefill(torch.randint(0, vocab, (1, prompt), generator=gen), cache)
    tok = torch.randint(0, vocab, (1,), generator=gen)
    out = {"step": median_ms(lambda: model.step(tok, cache), "cpu", warmup=warmup, reps=reps)}
    size = lambda tensors: sum(t.numel() * t.element_size() for t in tensors if t is not None)
    out["bytes"] = dict(weights=size({p.data_ptr(): p for p in model.state_dict().values()}.values()),  # tied once
                        cache=size([cache.conv, cache.ssm, cache.k, cache.v]))
    for name, shape in TREES.items():
        tree = TokenTree.from_shape(shape, torch.randint(0, vocab, (1, shape.n), generator=gen))
        out[f"tree {name}"] = median_ms(lambda: model.forward_tree(tree, cache), "cpu", warmup=warmup, reps=reps)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny configs (CI)")
    parser.add_argument("--worlds", default="1,2", help="world sizes, comma-separated (default 1,2)")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    worlds = [int(w) for w in args.worlds.split(",")]
    cores = os.cpu_count() or 1
    if args.smoke:
        configs = {name: (cls, make()) for name, (cls, make) in TINY.items()}
        warmup, reps, prompt = 1, 2, 8
    else:
        configs = {name: (PRESETS[name][0], PRESETS[name][1](n_layer=layers, vocab_size=8192))
                   for name, layers in MODELS.items()}
        warmup, reps, prompt = 3, args.reps, args.prompt
    rows = []
    for world in tqdm(worlds, desc="world sizes", file=sys.stderr):
        threads = max(1, cores // world)
        per_rank = run_ranks(measure_all, world, configs, prompt, warmup, reps, threads=threads)
        for name in configs:
            held = per_rank[0][name].pop("bytes")
            for op in per_rank[0][name]:
                ms = max(r[name][op] for r in per_rank)  # the ranks wait on each other: the slowest is the time
                rows.append(dict(model=name, world=world, threads_per_rank=threads, op=op, time_ms_median=ms,
                                 weight_bytes_per_rank=held["weights"], cache_bytes_per_rank=held["cache"]))
    for r in rows:
        base = next(b for b in rows if b["model"] == r["model"] and b["op"] == r["op"] and b["world"] == worlds[0])
        r["speedup_vs_world_" + str(worlds[0])] = base["time_ms_median"] / r["time_ms_median"]
    result = dict(benchmark="tensor_parallel", **run_info("cpu", argv), backend="gloo", dtype="float32",
                  prompt=prompt, reps=reps, layers=None if args.smoke else MODELS, vocab_size=None if args.smoke else 8192,
                  note="ranks share the machine's cores (threads_per_rank = cores / world); time_ms_median is the "
                       "slowest rank's median", results=rows)
    save_result(result, args.out, f"tensor_parallel_{'smoke' if args.smoke else 'cpu'}", plot)
    for r in rows:
        print(f"{r['model']:<14} world {r['world']}  {r['op']:<16}{r['time_ms_median']:>9.2f} ms  "
              f"x{r['speedup_vs_world_' + str(worlds[0])]:.2f}  weights {r['weight_bytes_per_rank'] / 2**20:.0f} MiB "
              f"per rank")
    return result


def plot(result):
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["model"] for r in result["results"]))
    fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names):
        ops = list(dict.fromkeys(r["op"] for r in result["results"] if r["model"] == name))
        for op in ops:
            rs = sorted((r for r in result["results"] if r["model"] == name and r["op"] == op), key=lambda r: r["world"])
            ax.plot([r["world"] for r in rs], [r["time_ms_median"] for r in rs], "o-", label=op)
        ax.set(xlabel="tensor-parallel world size", ylabel="median ms", title=f"{name}, {result['device']}, gloo")
        ax.set_xticks(sorted({r["world"] for r in result["results"]}))
        ax.legend()
        ax.grid(alpha=0.3)
    return fig


if __name__ == "__main__":
    main()
