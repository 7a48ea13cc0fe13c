"""Two builds of the CPU library, paired in one process: the one-call step of the shipped target
(``stree/kernels/cpu/mamba_step.cpp`` with ``gemm.cpp``) built from the working tree's sources with
the library's flags (``gemm.FLAGS``, "working") and another build ("other": the sources of the git
revision ``--against``, and the flags without those ``--drop`` names), decoding the held-out prompts
through ``LM.generate`` in turns: every round each build decodes every batch of prompts, the order of
the builds swapped every other round. Reported per method and batch size: each round's tokens per
second of the working build over the other's, their median, and whether the two builds' greedy
outputs were the same text.

Why in one process: on the 2-core CPUs the same configuration's speed moves by tens of percent
between fresh processes (one side of a paired run of eight read 2,070 to 2,840 tokens per second),
more than a kernel change's gain; in one process, turn by turn, the pair moves together. Only the
one call is swapped (its step, prefill, tree passes and replay: ``MambaStep``'s entry points), so the
other revision's one call must lay out the model as the working one does (checked); the products
outside it (a drafter model's, the block-by-block paths) and the tree choice's cost profile are the
working build's: measured in the first call, with the working build, so a speculative method's trees
are chosen by the working build's prices under both.

    python benchmarks/library_ab.py --drop=-fno-trapping-math
    python benchmarks/library_ab.py --against HEAD~1 --methods autoregressive --batches 1 --rounds 4
    python benchmarks/library_ab.py --smoke --drop=-fno-trapping-math
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
BUILDS = ("working", "other")
ENTRY_POINTS = {"_run": "stree_mamba_step", "_tree": "stree_mamba_tree", "_greedy": "stree_mamba_tree_greedy",
                "_prefill": "stree_mamba_prefill", "_draft": "stree_mamba_draft"}


def libraries(drop: list[str], against: str | None) -> dict:
    """The working build and the other: ``against``'s sources (None: the working tree's) with the
    library's flags but ``drop``, loaded; a clear exit where a build fails or lays out a model otherwise."""
    from stree.kernels.cpu import gemm

    with tempfile.TemporaryDirectory() as tmp:
        sources = gemm.SOURCES
        if against is not None:
            sources = tuple(Path(tmp) / path.name for path in gemm.SOURCES)
            for path, own in zip(sources, gemm.SOURCES):
                try:
                    shown = subprocess.run(["git", "-C", str(ROOT), "show", f"{against}:{own.relative_to(ROOT)}"],
                                           capture_output=True)
                except OSError as e:
                    raise SystemExit(f"--against {against!r}: git does not run here ({e})") from None
                if shown.returncode:
                    raise SystemExit(f"--against {against!r}: git cannot show {own.relative_to(ROOT)} there")
                path.write_bytes(shown.stdout)
        out = {}
        for name, flags, files in (("working", gemm.FLAGS, gemm.SOURCES),
                                   ("other", tuple(f for f in gemm.FLAGS if f not in drop), sources)):
            lib, why = gemm.compile_library(flags, files)
            if lib is None:
                raise SystemExit(f"the {name} library cannot be built: {why}")
            out[name] = lib
    try:
        layout = [(lib.stree_mamba_model_words(), lib.stree_mamba_layer_words()) for lib in out.values()]
    except AttributeError:
        raise SystemExit(f"--against {against!r}: its library has no one call to pair") from None
    if layout[0] != layout[1]:
        raise SystemExit(f"--against {against!r}: its one call lays out a model in other words {layout[1]} than the "
                         f"working one's {layout[0]}")
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
            ratios = [a / b for a, b in zip(speed["working"], speed["other"])]
            rows.append(dict(method=method, batch=batch, ratios=ratios, ratio=statistics.median(ratios),
                             working_tokens_per_s=speed["working"], other_tokens_per_s=speed["other"],
                             identical=texts_out["working"] == texts_out["other"]))
            print(f"{method:15s} b{batch}  working/other per round " + " ".join(f"{x:.3f}" for x in ratios)
                  + f"  median {rows[-1]['ratio']:.3f}  tokens/s {statistics.median(speed['working']):.0f} against "
                    f"{statistics.median(speed['other']):.0f}  identical {'yes' if rows[-1]['identical'] else 'NO'}")
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
    ax.set_ylabel("tokens/s, working / other")
    other = " ".join(([f"sources of {result['against']}"] if result["against"] else [])
                     + ([f"without {' '.join(result['drop'])}"] if result["drop"] else []))
    ax.set_title(f"the library against a build of {other}, paired in one process\n{result['device']}", fontsize=8)
    fig.tight_layout()
    return fig


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--drop", default="", help="comma-separated flags of gemm.FLAGS the other build leaves out")
    p.add_argument("--against", default=None, help="a git revision whose sources the other build is made from")
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

    drop = [f for f in args.drop.split(",") if f]
    if not all(f in gemm.FLAGS for f in drop):
        p.error(f"--drop takes flags of the library's own ({' '.join(gemm.FLAGS)}), got {args.drop!r}")
    if not drop and args.against is None:
        p.error("say what the other build is: --drop FLAGS, --against REVISION, or both")
    if args.smoke:
        args.prompts, args.max_new_tokens, args.rounds, batches = 2, 8, 2, [1]
        args.methods = "autoregressive,ngram"

    import stree
    from stree.tools.demo import TARGET, read_prompts
    from stree.tools.timing import run_info, save_result

    libs = libraries(drop, args.against)
    lm = stree.LM.from_pretrained(TARGET, dtype=getattr(torch, args.dtype))
    texts = read_prompts(TARGET / "prompts.jsonl", args.prompts)
    rows = measure(lm, libs, texts, args.methods.split(","), batches, args.rounds, args.max_new_tokens)
    result = dict(benchmark="library_ab", **run_info(torch.device("cpu"), argv), dtype=args.dtype,
                  drop=drop, against=args.against, threads=torch.get_num_threads(), prompts=args.prompts,
                  max_new_tokens=args.max_new_tokens, rounds=args.rounds,
                  note="LM.generate at default settings; per round, each build decodes every batch of prompts, the "
                       "builds' order swapped every other round; ratios: the working build's tokens/s over the other's "
                       "(against's sources, the flags without drop) in the same round; only the model's one-call "
                       "step is swapped", rows=rows)
    save_result(result, args.out, args.stem or ("library_ab_smoke" if args.smoke else "library_ab_cpu"), plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
