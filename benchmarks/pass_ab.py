"""A tree pass against a plain step, the working tree's library against a git revision's: in each
of ``--processes`` rounds, a fresh process of each (the revision's files exported to a temporary
directory, in turns, the order alternating) times ``--pairs`` pairs of one tree pass of n nodes and
one step on the same cache, and takes the median of the pairs' ratios. Reported per (batch, nodes):
both sides' ratios in each round and the mean difference. Writes JSON and a PNG to
benchmarks/results/.

Why a ratio of pairs: on the 2-core CPUs a call's time moves by tens of percent within minutes
(other machines' work in the shared caches, benchmarks/host_gap.py), while a pass and the step
timed back to back move together; and a tree's cost in steps is what the tree choice and the
gain of speculation depend on.

A config ``BATCHxNODES:S1+S2+...`` times the packed pass instead (``TreeLM.forward_packed``): row r's
tree the first ``Sr`` nodes (``AutoTree.per_row``'s rows of their own sizes, one ``Sr`` per row, the
largest ``NODES``). ``--iteration`` times a greedy iteration instead of the pass, as the decoding loop
calls it (``speculative_step``: the pass, verification and commit, by whatever path the side's library
takes for the draft, padded or packed). ``--accepted`` (with ``--iteration``): the drafts are chains whose
tokens are the model's own choices, so that every node is accepted and committed (the states put back
between calls, outside the timing): what a tree that is accepted whole costs, its replay included.

    python benchmarks/pass_ab.py --against HEAD --configs 1x1,1x2,1x12,2x4,2x8 --processes 3
    python benchmarks/pass_ab.py --against HEAD --configs 2x13,2x13:13+1,8x13:13+1+1+1+1+1+1+1
    python benchmarks/pass_ab.py --against HEAD --configs 2x13,2x13:13+1 --iteration
    python benchmarks/pass_ab.py --against HEAD --configs 1x4,1x8,1x16,2x8 --iteration --accepted
    python benchmarks/pass_ab.py --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIDES = ("against", "working")


def parse_configs(text: str) -> list[tuple[int, int, tuple[int, ...] | None]]:
    """``"1x2,2x8,2x8:8+3"``: (batch, nodes, the rows' sizes or None) triples, checked."""
    out = []
    for part in text.split(","):
        head, _, tail = part.partition(":")
        try:
            batch, nodes = (int(v) for v in head.split("x"))
            sizes = tuple(int(v) for v in tail.split("+")) if tail else None
        except ValueError:
            raise ValueError(f"--configs takes BATCHxNODES[:S1+S2+...] items separated by commas, got {part!r}") \
                from None
        if batch < 1 or nodes < 1:
            raise ValueError(f"--configs needs batch >= 1 and nodes >= 1, got {part!r}")
        if sizes is not None and (len(sizes) != batch or max(sizes) != nodes or min(sizes) < 1):
            raise ValueError(f"--configs needs one size per row, each >= 1, the largest NODES, got {part!r}")
        out.append((batch, nodes, sizes))
    return out


def label(batch: int, nodes: int, sizes) -> str:
    return f"{batch}x{nodes}" + ("" if sizes is None else ":" + "+".join(map(str, sizes)))


def worker(configs: list[tuple[int, int, list | None]], pairs: int, dtype: str, smoke: bool,
           iteration: bool = False, accepted: bool = False) -> dict:
    """This process's median ratio of a tree pass (a greedy iteration) to a step for each config, and
    where stree came from."""
    import numpy as np
    import torch

    import stree
    from stree.decoding.plans import cut_rows
    from stree.decoding.steps import speculative_step
    from stree.sampling.verify import SamplingParams
    from stree.models import load
    from stree.models.presets import TINY
    from stree.tools.demo import TARGET
    from stree.tree import TokenTree, TreeShape

    torch.set_grad_enabled(False)
    if smoke:
        cls, make = TINY["mamba2-tiny"]
        torch.manual_seed(0)
        model = cls(make()).to(getattr(torch, dtype)).eval()
    else:
        model = load(TARGET, dtype=getattr(torch, dtype))
    ratios = {}
    for batch, nodes, sizes in configs:
        cache = model.allocate_cache(batch, 256)
        gen = torch.Generator().manual_seed(0)
        model.prefill(torch.randint(0, model.vocab_size, (batch, 64), generator=gen), cache)
        shape = (TreeShape.chain(nodes - 1) if accepted
                 else TreeShape(tuple([-1] + [(i - 1) // 2 for i in range(1, nodes)])))
        tree = TokenTree.from_shape(shape, torch.randint(0, model.vocab_size, (batch, nodes), generator=gen))
        if accepted:  # each node the model's choice after its parent: the whole chain accepted
            for j in range(1, nodes):
                tree.tokens[:, j] = model.forward_tree(tree, cache.clone())[0][:, j - 1].argmax(-1)
            tree = TokenTree.from_shape(shape, tree.tokens)
        kept = (cache.conv.clone(), cache.ssm.clone()) if accepted else None
        token = torch.randint(0, model.vocab_size, (batch,), generator=gen)

        def step():
            model.step(token, cache, validate=False)
            cache.seqlens -= 1

        def timed(fn) -> float:
            if accepted:  # (the states the chain was drafted from, put back)
                cache.conv.copy_(kept[0])
                cache.ssm.copy_(kept[1])
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start

        draft = tree if sizes is None else cut_rows(tree, np.array(sizes))
        packed = None if sizes is None else draft.packed()

        def tree_pass():
            if iteration:  # (the commit moves the states: random ones, which the timing does not read)
                num = speculative_step(model, cache, draft, SamplingParams(0.0), None)[1].num_accepted
                cache.seqlens -= num.to(cache.seqlens.dtype)
            elif packed is None:
                model.forward_tree(tree, cache, validate=False)
            else:
                model.forward_packed(*packed, cache, validate=False)

        for _ in range(20):  # (first calls measure the products and compile)
            tree_pass(), step()
        ratios[label(batch, nodes, sizes)] = statistics.median(timed(tree_pass) / timed(step) for _ in range(pairs))
    return dict(ratios=ratios, stree=str(Path(stree.__file__).parent))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--against", default="HEAD", help="the git revision to compare with (default HEAD)")
    p.add_argument("--configs", default=None, help="BATCHxNODES, comma-separated (default 1x1,1x2,1x12,2x4,2x8; "
                                                     "--smoke: 1x2)")
    p.add_argument("--processes", type=int, default=3, help="rounds of one fresh process each side (default 3)")
    p.add_argument("--pairs", type=int, default=1500, help="timed (tree pass, step) pairs per config (default 1500)")
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    p.add_argument("--iteration", action="store_true", help="time a greedy iteration (speculative_step), not the pass")
    p.add_argument("--accepted", action="store_true",
                   help="with --iteration: chains of the model's own choices, accepted whole (their replay timed too)")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    p.add_argument("--stem", default=None, help="result file name (default: pass_ab_cpu, or pass_ab_smoke)")
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(**json.loads(args.worker))))
        return 0
    configs = parse_configs(args.configs or ("1x2,2x3:3+1" if args.smoke else "1x1,1x2,1x12,2x4,2x8"))
    if args.accepted and not args.iteration:
        p.error("--accepted times a greedy iteration: add --iteration")
    if args.processes < 1 or args.pairs < 1:
        p.error(f"--processes and --pairs must be >= 1, got {args.processes} and {args.pairs}")
    processes, pairs = (1, 20) if args.smoke else (args.processes, args.pairs)
    # (imported here: a worker imports its own side's stree, whose tools may predate these)
    from stree.tools.timing import revision_package, run_info, save_result

    job = json.dumps(dict(configs=configs, pairs=pairs, dtype=args.dtype, smoke=args.smoke, iteration=args.iteration,
                          **(dict(accepted=True) if args.accepted else {})))
    runs = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"against": revision_package(ROOT, args.against, tmp), "working": str(ROOT)}
        for r in range(processes):
            for side in SIDES if r % 2 == 0 else SIDES[::-1]:
                env = dict(os.environ, PYTHONPATH=os.pathsep.join([paths[side], os.environ.get("PYTHONPATH", "")]))
                run = subprocess.run([sys.executable, __file__, "--worker", job], capture_output=True, text=True,
                                     env=env, cwd=paths[side])
                if run.returncode:
                    raise RuntimeError(f"the {side} worker failed: {run.stderr[-2000:]}")
                out = json.loads(run.stdout.strip().splitlines()[-1])
                if not out["stree"].startswith(paths[side]):
                    raise RuntimeError(f"the {side} worker imported stree from {out['stree']}, not {paths[side]}")
                runs[side].append(out["ratios"])
    rows = []
    for batch, nodes, sizes in configs:
        key = label(batch, nodes, sizes)
        mine = {side: [run[key] for run in runs[side]] for side in SIDES}
        rows.append(dict(batch=batch, nodes=nodes, row_sizes=sizes,
                         **{f"{side}_in_steps": mine[side] for side in SIDES},
                         difference=statistics.mean(mine["working"]) - statistics.mean(mine["against"])))
    import torch

    timed = ("greedy iteration (speculative_step)" + (" of chains accepted whole" if args.accepted else "")
             if args.iteration else "tree pass")
    result = dict(benchmark="pass_ab", **run_info(torch.device("cpu"), argv), against=args.against, dtype=args.dtype,
                  model="tiny mamba2" if args.smoke else "shipped target", processes=processes, pairs=pairs,
                  timed=timed,
                  note=f"*_in_steps: per round, the median over pairs of one {timed}'s time over one step's, in a "
                       "fresh process of each side; difference: working minus against, mean over rounds",
                  results=rows)
    save_result(result, args.out, args.stem or ("pass_ab_smoke" if args.smoke else "pass_ab_cpu"), plot)
    for r in rows:
        print(f"b{r['batch']} {r['nodes']:>3} nodes{_sizes(r)}: {args.against} "
              + " ".join(f"{v:.3f}" for v in r["against_in_steps"]) + "  working "
              + " ".join(f"{v:.3f}" for v in r["working_in_steps"]) + f"  difference {r['difference']:+.3f} steps")
    return result


def _sizes(row) -> str:
    """A packed config's rows' sizes, as printed and plotted (older results have none)."""
    return "" if row.get("row_sizes") is None else " packed " + "+".join(map(str, row["row_sizes"]))


def plot(result):
    from stree.tools.timing import plot_sides

    labels = [f"b{r['batch']}, {r['nodes']} nodes{_sizes(r)}" for r in result["results"]]
    timed = result.get("timed", "tree pass")  # (older results: the pass)
    return plot_sides(result, "in_steps", labels,
                      f"{timed} / plain step (median of pairs)",
                      f"{result['model']}, {result['dtype']}: a {timed} in steps")


if __name__ == "__main__":
    main()
