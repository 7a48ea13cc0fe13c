"""Two builds of the CPU library, paired in one process: the one-call step of the shipped target
(``stree/kernels/cpu/mamba_step.cpp`` with ``gemm.cpp``) built with the library's flags
(``gemm.FLAGS``, "working") and without the flags named by ``--drop`` ("without"), decoding the
held-out prompts through ``LM.generate`` in turns: every round each build decodes every batch of
prompts, the order of the builds swapped every other round. Reported per method and batch size:
each round's tokens per second of the working build over the other's, their median, and whether
the two builds' greedy outputs were the same text.

Why in one process: on the 2-core CPUs the same configuration's speed moves by tens of percent
between fresh processes (one side of a paired run of eight read 2,070 to 2,840 tokens per second),
more than a build flag's gain; in one process, turn by turn, the pair moves together. Only the one
call is swapped (its step, prefill, tree passes and replay: ``MambaStep``'s entry points); the
products outside it (a drafter model's, the block-by-block paths) and the tree choice's cost
profile are the working build's: measured in the first call, with the working build, so a
speculative method's trees are chosen by the working build's prices under both.

    python benchmarks/library_ab.py                        # without -fno-trapping-math
    python benchmarks/library_ab.py --methods autoregressive --batches 1 --rounds 4
    python benchmarks/library_ab.py --smoke
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

BUILDS = ("working", "without")
ENTRY_POINTS = {"_run": "stree_mamba_step", "_tree": "stree_mamba_tree", "_greedy": "stree_mamba_tree_greedy",
                "_prefill": "stree_mamba_prefill", "_draft": "stree_mamba_draft"}


def libraries(drop: list[str]) -> dict:
    """The working build and the one without ``drop`` (each a flag of ``gemm.FLAGS``), loaded."""
    from stree.kernels.cpu import gemm

    out = {}
    for name, flags in (("working", gemm.FLAGS), ("without", tuple(f for f in gemm.FLAGS if f not in drop))):
        lib, why = gemm.compile_library(flags)
        if lib is None:
            raise SystemExit(f"the {name} library cannot be built: {why}")
        out[name] = lib
    return out


def one_call_step(model):
    """The model's one-call step (its twins made per decoding call copy its entry points), or exit."""
    from stree.models.fused_step import fused_step

    with torch.no_grad():
        step = fused_step(model, model.allocate_cache(1, 4), None, "auto")
    if step is None:
        raise SystemExit("the model does not decode in one call here (stree.models.fused_step)")
    return step


def measure(lm, libs: dict, texts: list[str], methods: list[str], batches: list[int], rounds: int,
            max_new_tokens: int) -> list[dict]:
    step = one_call_step(lm.model)

    def use(name):
        for attr, symbol in ENTRY_POINTS.items():
            setattr(step, attr, getattr(libs[name], symbol))

    rows = []
    for method in methods:
        kw = dict(method="autoregressive") if method == "autoregressive" else dict(drafter=method)
        for batch in batches:
            groups = [texts[i: i + batch] for i in range(0, len(texts) - batch + 1, batch)]
            for name in BUILDS:  # (first calls: the cost profile, with the working build, and the buffers)
                use(name)
                for prompts in groups:
                    lm.generate(prompts, max_new_tokens=min(32, max_new_tokens), **kw)
            speed, texts_out = {name: [] for name in BUILDS}, {name: [] for name in BUILDS}
            for r in tqdm(range(rounds), desc=f"{method} b{batch}", leave=False):
                for name in (BUILDS if r % 2 == 0 else BUILDS[::-1]):
                    use(name)
                    tokens, t0 = 0, time.perf_counter()
                    for prompts in groups:
                        out = lm.generate(prompts, max_new_tokens=max_new_tokens, **kw)
                        tokens += sum(out.stats.new_tokens)
                        texts_out[name] += out.texts
                    speed[name].append(tokens / (time.perf_counter() - t0))
            use("working")
            ratios = [a / b for a, b in zip(speed["working"], speed["without"])]
            rows.append(dict(method=method, batch=batch, ratios=ratios, ratio=statistics.median(ratios),
                             working_tokens_per_s=speed["working"], without_tokens_per_s=speed["without"],
                             identical=texts_out["working"] == texts_out["without"]))
            print(f"{method:15s} b{batch}  working/without per round " + " ".join(f"{x:.3f}" for x in ratios)
                  + f"  median {rows[-1]['ratio']:.3f}  tokens/s {statistics.median(speed['working']):.0f} against "
                    f"{statistics.median(speed['without']):.0f}  identical {'yes' if rows[-1]['identical'] else 'NO'}")
    return rows


def plot(result: dict):
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(max(5, 0.9 * len(rows)), 3.5))
    for i, row in enumerate(rows):
        ax.scatter([i] * len(row["ratios"]), row["ratios"], s=12, color="C0", alpha=0.6)
        ax.scatter([i], [row["ratio"]], marker="_", s=400, color="k")
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks(range(len(rows)), [f"{r['method']}\nb{r['batch']}" for r in rows], fontsize=7)
    ax.set_ylabel("tokens/s, working / without")
    ax.set_title(f"library built without {' '.join(result['drop'])}, paired in one process\n{result['device']}",
                 fontsize=8)
    fig.tight_layout()
    return fig


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--drop", default="-fno-trapping-math", help="comma-separated flags of gemm.FLAGS the other build leaves out")
    p.add_argument("--methods", default="autoregressive,ngram,stand-det",
                   help="comma-separated: autoregressive, or a drafter name (tree='auto')")
    p.add_argument("--batches", default="1,2")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float16")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    p.add_argument("--stem", default=None, help="result file name (default: library_ab_cpu, or _smoke)")
    args = p.parse_args(argv)
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        p.error(f"--batches takes batch sizes separated by commas, got {args.batches!r}")
    if min(batches) < 1 or args.rounds < 1 or args.prompts < max(batches) or args.max_new_tokens < 1:
        p.error(f"--batches, --rounds and --max-new-tokens must be >= 1 and --prompts at least the largest batch, "
                f"got {args.batches!r}, {args.rounds}, {args.max_new_tokens}, {args.prompts}")
    from stree.kernels.cpu import gemm

    drop = args.drop.split(",")
    if not all(f in gemm.FLAGS for f in drop):
        p.error(f"--drop takes flags of the library's own ({' '.join(gemm.FLAGS)}), got {args.drop!r}")
    if args.smoke:
        args.prompts, args.max_new_tokens, args.rounds, batches = 2, 8, 2, [1]
        args.methods = "autoregressive,ngram"

    import stree
    from stree.tools.demo import TARGET, read_prompts
    from stree.tools.timing import run_info, save_result

    libs = libraries(drop)
    lm = stree.LM.from_pretrained(TARGET, dtype=getattr(torch, args.dtype))
    texts = read_prompts(TARGET / "prompts.jsonl", args.prompts)
    rows = measure(lm, libs, texts, args.methods.split(","), batches, args.rounds, args.max_new_tokens)
    result = dict(benchmark="library_ab", **run_info(torch.device("cpu"), argv), dtype=args.dtype,
                  drop=drop, threads=torch.get_num_threads(), prompts=args.prompts,
                  max_new_tokens=args.max_new_tokens, rounds=args.rounds,
                  note="LM.generate at default settings; per round, each build decodes every batch of prompts, the "
                       "builds' order swapped every other round; ratios: the working build's tokens/s over the other's "
                       "in the same round; only the model's one-call step is swapped", rows=rows)
    save_result(result, args.out, args.stem or ("library_ab_smoke" if args.smoke else "library_ab_cpu"), plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
