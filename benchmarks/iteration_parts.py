"""What one speculative iteration costs, part by part, in autoregressive steps of the same model
and process: the tree pass (``forward_tree``), the pass with verification, the whole speculative
step (commit and the one host transfer added; on a float32 Mamba2 model the pass, verification and
commit as one call, and ``separate_calls`` the same step with them apart, as before that call),
and the decoding loop's iteration (drafting, the
choice, the rows' bookkeeping added), for an explicit tree (the paper's 13 nodes by default) and
the n-gram drafter, batch 1 and 2, eager, greedy, on the shipped target. The first three are
timed in turns with a plain step on a random context (medians); the loop's from ``generate``
calls on the held-out prompts, against its own plain iterations' autoregressive steps. Also
timed in those turns: the model's linear layers at the step's rows and at the tree's, whose
difference (``products_added``) bounds the pass from below: 1 + it, in steps, is the least a tree
pass can cost while the products run at this machine's throughput; and, inside the pass, what its
layers' two compiled calls and the norms take there (``in_pass_*``: the pass timed with those
kernels zeroing their outputs instead, :data:`IN_PASS`), where their code and data come cold.
Then the same calls with the default choice (``tree="auto"``), their iterations by class (trees,
plain steps decided ahead or weighed alone, those that drafted a watched draft): what each class
made them gain or lose against plain decoding (``auto_loop``), and each class by the class of the
iteration before it (``auto_after``: a tree after plain steps, a plain step after a tree, the
switches' price). ``--drafter``, ``--temperature``
(seeded) and ``--compiled`` change the loops' settings.

    python benchmarks/iteration_parts.py
    python benchmarks/iteration_parts.py --batches 1 --temperature 1.0   # where nothing is accepted
    python benchmarks/iteration_parts.py --smoke     # CI: a tiny model, few rounds
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

import stree
from stree.decoding import loop
from stree.decoding.steps import _finite, autoregressive_step, speculative_step
from stree.models.layers.linear import Linear, following, leading
from stree.models.presets import TINY
from stree.runtime.runners import EagerRunner
from stree.kernels.cpu import bound
from stree.sampling.verify import SamplingParams, greedy_on_host, verify, verify_greedy_host
from stree.tools.demo import TARGET, read_prompts
from stree.tools.timing import run_info, save_result
from stree.tree import TokenTree, TreeShape


# Inside the pass, on the CPU's bound kernels (stree.kernels.cpu.bound, a float32 model): each part's
# kernels, replaced by zeroing their outputs for a timed pass, with the caches and every other call of
# the pass as they are there. What the pass then saves is what the part costs inside it, its code and
# data as the rest of the pass leaves them, which a kernel timed alone, hot, does not show. Per part,
# each kernel's output arguments. A serial pass's layer is two compiled calls (stree.kernels.cpu.layer_jit):
# "layer_in" the copies replay keeps, the gate's copy and the tree conv; "layer_out" x, B and C taken
# apart, the scan and the gated norm (where the tiled product is built, the scan's state term is its
# product, made between the two calls and not in either). Rows run in parallel take the separate
# kernels of the same work.
IN_PASS = {"layer_in": {"tree_layer_in": (7, 8, 9, 10), "tree_conv_rows": (-1,)},
           "layer_out": {"tree_layer_out": (15, 16, -1), "tree_scan_rows": (-1,), "gated_rms_norm_rows": (-1,)},
           "norms": {"rms_norm_rows": (-1,)}}


def _zeroing(outputs):
    def kernel(*args):
        for i in outputs:
            args[i].fill(0.0)
    return kernel


def _without(kernels, fn):
    """``fn`` run with the bound kernels ``kernels`` (name: its output arguments' positions)
    writing zeros to their outputs instead."""
    real = {name: getattr(bound, name) for name in kernels}

    def run():
        for name, outputs in kernels.items():
            setattr(bound, name, _zeroing(outputs))
        try:
            fn()
        finally:
            for name, kernel in real.items():
                setattr(bound, name, kernel)

    return run


def parts(model, batch: int, shape: TreeShape, rounds: int) -> dict:
    """Medians (ms) of a plain step and of the tree pass, pass + verification and speculative
    step over ``shape``, taking turns (each call run twice, the second timed), and of the pass
    without each part of :data:`IN_PASS` (``in_pass_<part>``: what the part costs in it)."""
    cache = model.allocate_cache(batch, 1024)
    seq = torch.randint(0, model.vocab_size, (batch, 64), generator=torch.Generator().manual_seed(0))
    model.prefill(seq[:, :32], cache)
    runner, params = EagerRunner(model, cache), SamplingParams(0.0)
    tree = TokenTree.from_shape(shape, seq[:, : shape.n])

    def step():
        with following():
            autoregressive_step(model, cache, seq[:, 0], params, None, runner, None)
        cache.seqlens -= 1

    def tree_pass():
        with leading():
            model.forward_tree(tree, cache, validate=False)

    def pass_and_verify():  # (as the speculative step verifies)
        with leading():
            logits, _ = model.forward_tree(tree, cache, validate=False)
            if greedy_on_host(params, logits):
                verify_greedy_host(tree, logits)
            else:
                verify(tree, _finite(logits, params)[1], params, validate=False)

    def whole():
        with leading():
            _, result = speculative_step(model, cache, tree, params, None, runner=runner)
        cache.seqlens -= result.num_accepted.to(cache.seqlens.dtype)

    apart = EagerRunner(model, cache)
    apart.greedy_tree = lambda draft, top_k=None: None  # (the step's calls as they were before the one-call iteration)

    def separate_calls():
        with leading():
            _, result = speculative_step(model, cache, tree, params, None, runner=apart)
        cache.seqlens -= result.num_accepted.to(cache.seqlens.dtype)

    calls = dict(step=step, tree_pass=tree_pass, pass_and_verify=pass_and_verify, speculative_step=whole,
                 separate_calls=separate_calls)
    calls.update({f"without_{part}": _without(kernels, tree_pass) for part, kernels in IN_PASS.items()})
    # The model's products (every Linear once, as a pass runs them) at the step's rows and at the tree's:
    # what the tree's rows add to them is arithmetic no overhead removes while the products run at the
    # throughput they have here, so 1 + that, in steps, is the least a tree pass can cost on this machine.
    linears = [m for m in model.modules() if isinstance(m, Linear)]

    def products(xs):
        with torch.no_grad():  # (as a pass runs them: with autograd on they take PyTorch's own product)
            for m, x in zip(linears, xs):
                m(x)

    for name, rows in (("products_step", batch), ("products_tree", batch * shape.n)):
        xs = [torch.randn(rows, m.in_features, generator=torch.Generator().manual_seed(1)) for m in linears]
        calls[name] = functools.partial(products, xs)
    times = {k: [] for k in calls}
    for _ in range(3):
        for fn in calls.values():
            fn()
    for _ in range(rounds):
        for name, fn in calls.items():
            fn()
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    ms = {k: statistics.median(v) for k, v in times.items()}
    ms["products_added"] = ms.pop("products_tree") - ms.pop("products_step")
    for part in IN_PASS:
        ms[f"in_pass_{part}"] = ms["tree_pass"] - ms.pop(f"without_{part}")
    return ms


def loop_iterations(lm, prompts, batch: int, tree, tokens: int, drafter: str = "ngram",
                    **settings) -> tuple[dict, dict, dict]:
    """Medians (ms) of the loop's speculative iterations, of the speculative steps inside them,
    and of autoregressive decoding's steps, over ``generate`` calls taking turns (``tree``: a
    shape, or "auto"; ``settings``: more of ``generate``'s arguments, both sides); the speculative
    calls' iterations by class (:func:`classes`); and by class and the class of the iteration
    before (:func:`transitions`)."""
    seen = {"iteration": [], "speculative_step": [], "autoregressive": []}
    kinds: dict[str, list[float]] = {}
    pairs: dict[str, list[float]] = {}  # "<class> after <class before>" (a call's first: after "prefill")
    last = ["prefill"]  # the class of the call's last iteration
    real_iterate, real_step, real_watch = loop._Loop.iterate, loop.speculative_step, loop._Loop.start_watch
    watches = [0]

    def step(*args, **kw):
        t0 = time.perf_counter()
        out = real_step(*args, **kw)
        seen["speculative_step"].append((time.perf_counter() - t0) * 1e3)
        return out

    def start_watch(self):
        before = self.watch
        real_watch(self)
        watches[0] += self.watch is not None and self.watch is not before

    def iterate(self):
        before, watched, in_run = len(seen["speculative_step"]), watches[0], self.plain_run is not None
        t0 = time.perf_counter()
        real_iterate(self)
        ms = (time.perf_counter() - t0) * 1e3
        if self.c.speculative:
            tree = len(seen["speculative_step"]) > before
            if tree:
                seen["iteration"].append(ms)
            kind = "tree" if tree else "plain_run" if in_run else "plain"
            kinds.setdefault(kind + ("+watch" if watches[0] > watched else ""), []).append(ms)
            pairs.setdefault(f"{kind} after {last[0]}", []).append(ms)
            last[0] = "tree" if tree else "plain"
        else:
            seen["autoregressive"].append(ms)

    loop._Loop.iterate, loop.speculative_step, loop._Loop.start_watch = iterate, step, start_watch
    try:
        lm.generate(prompts[:batch], max_new_tokens=8, drafter=drafter, tree=tree, **settings)  # first uses
        lm.generate(prompts[:batch], max_new_tokens=8, method="autoregressive", **settings)
        for k in seen:
            seen[k].clear()
        kinds.clear()
        pairs.clear()
        for start in range(0, len(prompts) - batch + 1, batch):
            rows = prompts[start: start + batch]
            last[0] = "prefill"
            lm.generate(rows, max_new_tokens=tokens, drafter=drafter, tree=tree, **settings)
            lm.generate(rows, max_new_tokens=tokens, method="autoregressive", **settings)
    finally:
        loop._Loop.iterate, loop.speculative_step, loop._Loop.start_watch = real_iterate, real_step, real_watch
    return ({k: statistics.median(v) for k, v in seen.items() if v}, classes(kinds, seen["autoregressive"]),
            transitions(pairs, seen["autoregressive"]))


def classes(kinds: dict[str, list[float]], autoregressive: list[float]) -> dict:
    """Per class of a speculative call's iterations (``tree``; ``plain_run``: a plain step decided
    ahead; ``plain``: one weighed alone; ``+watch``: it also drafted a watched draft): the count,
    the median in autoregressive iterations, and ``beyond``: its time past as many autoregressive
    iterations (their mean), as a share of autoregressive decoding's whole time. The shares and
    ``iterations`` (the speculative calls' iterations less autoregressive decoding's, at that mean,
    as a share: negative where trees saved iterations) sum to
    ``time_ratio - 1``: what each class made the speculative calls gain or lose."""
    median, mean, total = statistics.median(autoregressive), statistics.mean(autoregressive), sum(autoregressive)
    out = {k: dict(count=len(v), in_steps=statistics.median(v) / median, beyond=(sum(v) - len(v) * mean) / total)
           for k, v in sorted(kinds.items())}
    count = sum(len(v) for v in kinds.values())
    return dict(out, iterations=(count - len(autoregressive)) * mean / total,
                time_ratio=sum(sum(v) for v in kinds.values()) / total)


def transitions(pairs: dict[str, list[float]], autoregressive: list[float]) -> dict:
    """Per pair "<class> after <class before>" (classes ``tree`` and ``plain``, a plain run's steps
    among the latter; a call's first iteration after ``prefill``): the count and the median in
    autoregressive iterations. What an iteration costs depends on the one before: a pass or a step
    finds in the caches what the same kind of call left there (a tree after a tree, a plain step
    after a plain step), and the other kind's code and data where a switch came between."""
    median = statistics.median(autoregressive)
    return {k: dict(count=len(v), in_steps=statistics.median(v) / median) for k, v in sorted(pairs.items())}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tree", default="paper13", help="an explicit tree spec (paper13, chain:D, full:WxD)")
    p.add_argument("--batches", default="1,2")
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--drafter", default="ngram", help="the drafter of the loops (default ngram)")
    p.add_argument("--temperature", type=float, default=0.0, help="the loops' (seeded where above 0; default 0)")
    p.add_argument("--compiled", action="store_true", help="the loops with torch_compile=True")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    p.add_argument("--stem", default=None, help="result file name (default: iteration_parts_cpu, or _smoke)")
    args = p.parse_args(argv)
    shape = TreeShape.from_spec(args.tree)
    batches = [int(b) for b in args.batches.split(",")]
    torch.manual_seed(0)
    if args.smoke:
        cls, make = TINY["mamba2-tiny"]
        model, lm, prompts, tokens, args.rounds, batches = cls(make()).eval(), None, None, 0, 3, [1]
    else:
        lm = stree.LM.from_pretrained(TARGET, dtype=torch.float32)
        model, prompts, tokens = lm.model, read_prompts(TARGET / "prompts.jsonl", 8), 128
    rows = []
    for batch in batches:
        ms = parts(model, batch, shape, args.rounds)
        row = dict(batch=batch, nodes=shape.n, ms=ms, in_steps={k: v / ms["step"] for k, v in ms.items()})
        if lm is not None:
            settings = dict(temperature=args.temperature, seed=0 if args.temperature > 0 else None,
                            torch_compile=args.compiled)
            it = loop_iterations(lm, prompts, batch, shape, tokens, args.drafter, **settings)[0]
            row["loop_ms"] = it
            row["loop_in_steps"] = {k: v / it["autoregressive"] for k, v in it.items()}
            # the default choice (tree="auto"): its calls' iterations by class, against plain decoding
            row["auto_loop"], row["auto_after"] = loop_iterations(lm, prompts, batch, "auto", tokens, args.drafter,
                                                                  **settings)[1:]
        rows.append(row)
        print(f"batch {batch}, {shape.n} nodes, in steps: "
              + "  ".join(f"{k} {v:.2f}" for k, v in row["in_steps"].items())
              + ("" if lm is None else "  | loop: " + "  ".join(f"{k} {v:.2f}" for k, v in row["loop_in_steps"].items())),
              file=sys.stderr)
        if lm is not None:
            auto = row["auto_loop"]
            print(f"  tree=auto: time {auto['time_ratio']:.3f} of plain decoding's; iterations "
                  f"{auto['iterations']:+.3f}; " + "  ".join(
                      f"{k} x{v['count']} {v['in_steps']:.2f} steps ({v['beyond']:+.3f})"
                      for k, v in auto.items() if isinstance(v, dict)), file=sys.stderr)
            print("  by the iteration before: " + "  ".join(
                f"{k} x{v['count']} {v['in_steps']:.2f}" for k, v in row["auto_after"].items()), file=sys.stderr)
    result = dict(benchmark="iteration_parts", **run_info(model.device, argv), tree=args.tree, threads=torch.get_num_threads(),
                  drafter=args.drafter, temperature=args.temperature, compiled=args.compiled,
                  note="each part in plain steps of the same model and process: the tree pass, + greedy verification, "
                       "+ commit and the host transfer (speculative_step: on a float32 Mamba2 model the pass, "
                       "verification and commit as one call; separate_calls: the same step with them apart), "
                       "+ drafting, the choice and the rows' "
                       "bookkeeping (the loop's iteration, against the loop's autoregressive iterations); "
                       "products_added: what the model's linear layers take at the tree's rows beyond the step's "
                       "(a tree pass costs at least 1 + that while they run at this machine's throughput); "
                       "in_pass_<part>: what the pass saves with that part's bound kernels zeroing their outputs "
                       "instead (IN_PASS), the part's cost inside the pass; auto_loop: tree='auto' calls' iterations "
                       "by class (count, median in autoregressive iterations, beyond: time past as many "
                       "autoregressive iterations as a share of autoregressive decoding's; iterations: the count "
                       "difference's share; time_ratio: the speculative calls' time over autoregressive decoding's); "
                       "auto_after: the same iterations by class and the class of the one before (count, median "
                       "in autoregressive iterations)",
                  results=rows)
    save_result(result, args.out, args.stem or ("iteration_parts_smoke" if args.smoke else "iteration_parts_cpu"), plot)
    return result


def plot(result):
    import matplotlib.pyplot as plt

    fig, (ax, inside) = plt.subplots(1, 2, figsize=(10, 3), gridspec_kw=dict(width_ratios=[5, 3]))
    names = ["tree_pass", "pass_and_verify", "speculative_step"]
    for i, row in enumerate(result["results"]):
        values = ([1.0 + row["in_steps"]["products_added"]] + [row["in_steps"][k] for k in names]
                  + ([row["loop_in_steps"]["iteration"]] if "loop_in_steps" in row else []))
        labels = ["1 + products\nadded", "tree\npass", "pass +\nverification", "speculative\nstep"] + (
            ["loop\niteration"] if "loop_in_steps" in row else [])
        ax.bar([x + 0.4 * i for x in range(len(values))], values, width=0.4, label=f"batch {row['batch']}")
    ax.set_xticks(range(len(labels)), labels)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set(ylabel="plain steps", title=f"{result['tree']} iteration by parts, {result['device']}")
    ax.title.set_fontsize(8)
    ax.legend()
    for i, row in enumerate(result["results"]):  # inside the pass: products added, then IN_PASS's parts
        keys = ["products_added"] + [f"in_pass_{part}" for part in IN_PASS]
        inside.bar([x + 0.4 * i for x in range(len(keys))], [row["in_steps"][k] for k in keys], width=0.4,
                   label=f"batch {row['batch']}")
    inside.set_xticks(range(len(keys)), ["products\nadded"] + [part.replace("_", "\n") for part in IN_PASS])
    inside.set(ylabel="plain steps", title="inside the tree pass")
    inside.title.set_fontsize(8)
    return fig


if __name__ == "__main__":
    main()
