"""What a tree costs against a plain step, the table ``tree="auto"`` decides by
(:func:`stree.decoding.cost.cost_profile`: a speculative iteration of n nodes, the target's pass,
verification, commit and host transfer, against an autoregressive step, in that step's units),
for the shipped target and a Mamba2-2.7B-width model (random weights, layers cut); and what the
shipped drafter model's step costs against the target's (a 1-layer drafter of a 4-layer target
should cost about a quarter of its step). Batch 1 and 2, eager; on CUDA in bf16 with CUDA graphs.
Writes JSON and a PNG to benchmarks/results/.

    python benchmarks/cost.py            # the shipped target and mamba2-2.7b width (4 layers)
    python benchmarks/cost.py --smoke    # tiny configs (CI)
    python benchmarks/cost.py --sizes 2,4,8,16,32,64,128,256,512 --batches 1 --stem cost_cpu_large
                                         # past the sizes tree="auto" measures: linear in the nodes?
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

from stree.decoding.cost import cost_profile, default_sizes, describe  # noqa: E402
from stree.tools.demo import DRAFTER, TARGET  # noqa: E402
from stree.models import load  # noqa: E402
from stree.models.presets import PRESETS, TINY  # noqa: E402
from stree.tools.timing import median_ms, run_info, save_result  # noqa: E402
from stree.tree import TreeShape  # noqa: E402

LAYERS = {"mamba2-2.7b": (4, 24.0)}  # the preset's width: the layers kept, seconds per profile (steps of ~0.1 s)


def binary(n: int) -> TreeShape:
    """The first n nodes of a full binary tree (what ``stree profile`` times without a drafter)."""
    return TreeShape(tuple([-1] + [(i - 1) // 2 for i in range(1, n)]))


def models(smoke: bool, device, dtype, budget: float, layers: int | None = None):
    """(name, target, drafter model or None, seconds per profile) to measure."""
    if smoke:
        cls, make = TINY["mamba2-tiny"]
        torch.manual_seed(0)
        target = cls(make()).to(device=device, dtype=dtype).eval()
        torch.manual_seed(1)
        small = cls(make(n_layer=1)).to(device=device, dtype=dtype).eval()
        yield "tiny mamba2", target, small, budget
        return
    yield "shipped target", load(TARGET, dtype=dtype, device=device), load(DRAFTER, dtype=dtype, device=device), budget
    for name, (kept, seconds) in LAYERS.items():
        kept = layers or kept
        torch.manual_seed(0)
        cls, make = PRESETS[name]
        with torch.device(device):  # made where it runs: a full-depth model's fp32 init on the host is slow
            model = cls(make(n_layer=kept)).to(dtype=dtype).eval()
        yield f"{name} width, {kept} layers", model, None, max(budget, seconds)


def _sizes(parser, text: str | None) -> tuple[int, ...] | None:
    """``--sizes``: node counts of at least 2, checked before anything is measured."""
    if text is None:
        return None
    try:
        sizes = tuple(int(s) for s in text.split(","))
    except ValueError:
        parser.error(f"--sizes must be comma-separated integers, got {text!r}")
    if not sizes or min(sizes) < 2:
        parser.error(f"--sizes must be node counts of at least 2, got {text!r}")
    return sizes


def step_ms(model, batch: int, device, reps: int) -> float:
    """Median milliseconds of one autoregressive step at ``batch`` rows."""
    cache = model.allocate_cache(batch, 64 + reps + 8)
    gen = torch.Generator().manual_seed(0)
    model.prefill(torch.randint(0, model.vocab_size, (batch, 64), generator=gen).to(device), cache)
    tok = torch.randint(0, model.vocab_size, (batch,), generator=gen).to(device)

    def one():
        model.step(tok, cache)
        cache.seqlens -= 1
    return median_ms(one, device, warmup=3, reps=reps)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,2")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds per profile at most (default 4, the 2.7B width at least 24; 10 for --smoke, "
                        "whose sizes all fit it where each size's first call captures a CUDA graph)")
    p.add_argument("--layers", type=int, default=None,
                   help=f"layers of the preset widths kept (default {', '.join(f'{k}: {v[0]}' for k, v in LAYERS.items())}; "
                        "the full depth shows what a tree costs where weights, not launches, bound a step)")
    p.add_argument("--sizes", default=None,
                   help="tree sizes, comma-separated (default: what tree='auto' measures, up to 64 nodes on the CPU, "
                        "256 on a GPU)")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    p.add_argument("--stem", default=None, help="result file name (default: cost_<device>, or cost_smoke)")
    args = p.parse_args(argv)
    sizes = _sizes(p, args.sizes)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    mode = "cuda_graph" if device.type == "cuda" else "eager"
    batches = [1] if args.smoke else [int(b) for b in args.batches.split(",")]
    budget = args.budget or (10.0 if args.smoke else 4.0)
    sizes = sizes or ((2, 4, 8) if args.smoke else default_sizes(device))
    shapes = [binary(n) for n in sizes]
    rows, drafters = [], []
    for name, model, small, seconds in tqdm(list(models(args.smoke, device, dtype, budget, args.layers)), desc="models",
                                            file=sys.stderr):
        for batch in batches:
            profile = cost_profile(model, batch, mode=mode, shapes=shapes, budget_s=seconds, refresh=True)
            rows += [dict(model=name, batch=batch, nodes=r["nodes"], target_ms=r["target_ms"], in_steps=r["steps"])
                     for r in describe(profile)]
            if small is not None:  # the two models' steps taking turns, so that drift hits both alike
                reps = 5 if args.smoke else 20
                pairs = [(step_ms(model, batch, device, reps), step_ms(small, batch, device, reps)) for _ in range(3)]
                target, drafter = min(t for t, _ in pairs), min(d for _, d in pairs)
                drafters.append(dict(model=name, batch=batch, target_step_ms=target, drafter_step_ms=drafter,
                                     ratio=drafter / target, target_layers=len(model.backbone.layers),
                                     drafter_layers=len(small.backbone.layers)))
    result = dict(benchmark="cost", **run_info(device, argv), dtype=str(dtype).removeprefix("torch."), mode=mode,
                  budget_s=budget, note="in_steps: a speculative iteration of `nodes` nodes (tree pass, verification, "
                  "commit, host transfer; no drafting) over an autoregressive step, as tree='auto' measures it",
                  results=rows, drafter_steps=drafters)
    save_result(result, args.out, args.stem or f"cost_{'smoke' if args.smoke else device.type}", plot)
    for r in rows:
        print(f"{r['model']:<30} b{r['batch']}  {r['nodes']:>4} nodes  {r['target_ms']:>9.3f} ms  "
              f"{r['in_steps']:>6.2f} steps")
    for d in drafters:
        print(f"{d['model']:<30} b{d['batch']}  drafter step ({d['drafter_layers']} layer) {d['drafter_step_ms']:.3f} ms "
              f"= {d['ratio']:.2f} of the target's ({d['target_layers']} layers, {d['target_step_ms']:.3f} ms)")
    return result


def plot(result):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    keys = sorted({(r["model"], r["batch"]) for r in result["results"]})
    for model, batch in keys:
        pts = [r for r in result["results"] if r["model"] == model and r["batch"] == batch]
        ax.plot([r["nodes"] for r in pts], [r["in_steps"] for r in pts], marker="o", label=f"{model}, batch {batch}")
    if max(r["nodes"] for r in result["results"]) <= 256:  # (past that, a linear axis shows whether growth is)
        ax.set_xscale("log", base=2)
    ax.set_xlabel("tree nodes (1: a plain step)")
    ax.set_ylabel("iteration / autoregressive step")
    ax.set_title(f"what a tree costs ({result['mode']}, {result['device']})", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main()
