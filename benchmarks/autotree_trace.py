"""What ``tree="auto"`` does iteration by iteration on this machine: the README's text API at
default settings (``LM.generate``, the shipped pair, greedy or ``--temperature``), each drafter
and batch size after a warm-up over every batch of prompts, with the chooser's records wrapped
to log each iteration. Per kind of iteration the count, the time the choice predicted, the time by the clock and the
tokens emitted per row:

- ``plain``: a plain step the choice weighed on its own (after drafting, or planned plain);
- ``run``: a run of plain steps decided ahead (counted, predicted and timed per step);
- ``probe`` and ``tree``, by size: a tree verified as a probe of the ledger, or chosen on its worth.

Beside them, each configuration's wall time per call and per decoding step, against
autoregressive decoding's, and the loop's own host time per iteration outside the model's step
and pass (drafting, the choice, emitting, bookkeeping), by kind: ``plain``, ``run``, ``tree``
(probes included) and autoregressive decoding's ``step``. Where speculation loses, this says
whether trees lost their bets (clock over prediction, fewer tokens than promised), probes cost
more than their share, or the plain steps of a speculative call cost more than autoregressive
ones, and how much of that is the loop's host work (on a GPU, where a graphed step is a fraction
of a millisecond, that work decides).

    python benchmarks/autotree_trace.py                    # results/autotree_trace_<device>.json
    python benchmarks/autotree_trace.py --compiled         # results/autotree_trace_<device>_compiled.json
    python benchmarks/autotree_trace.py --smoke            # 2 prompts x 8 tokens (CI)
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

import stree
import stree.decoding.autotree as autotree
import stree.decoding.loop as loop
from stree.tools.demo import DRAFTER, TARGET, read_prompts
from stree.models import load
from stree.tools.timing import add_device_args, device_and_dtype, run_info, save_result

DRAFTERS = ("ngram", "stand", "ssm")


class Log:
    """The chooser's iterations, logged by wrapping :meth:`AutoTree.record` and
    :meth:`AutoTree.plain_steps` (each call hands the original what it was given) until ``undo``
    closes."""

    def __init__(self, undo: contextlib.ExitStack):
        self.rows: list[tuple] = []
        record, plain_steps = autotree.AutoTree.record, autotree.AutoTree.plain_steps
        undo.callback(setattr, autotree.AutoTree, "record", record)
        undo.callback(setattr, autotree.AutoTree, "plain_steps", plain_steps)
        log = self.rows

        def logged_record(chooser, tree, tokens=None, counts=None, rows=None, elapsed_ms=None, ids=None):
            kind = "plain" if tree is None else "probe" if chooser._probing else "tree"
            emitted = 1.0 if tree is None else float(np.mean(counts[rows]))
            log.append((kind, 1 if tree is None else tree.n, 1, chooser._predicted[1], elapsed_ms, emitted))
            return record(chooser, tree, tokens, counts, rows, elapsed_ms, ids)

        def logged_plain_steps(chooser, steps, times_ms=None):
            log.append(("run", 1, steps, chooser.cost[1] * steps, None if times_ms is None else sum(times_ms),
                        float(steps)))
            return plain_steps(chooser, steps, times_ms)

        autotree.AutoTree.record, autotree.AutoTree.plain_steps = logged_record, logged_plain_steps

    def summary(self) -> list[dict]:
        groups = defaultdict(list)
        for kind, n, steps, predicted, elapsed, emitted in self.rows:
            groups[(kind, n)].append((steps, predicted, elapsed or 0.0, emitted))
        out = []
        for (kind, n), g in sorted(groups.items()):
            a = np.array(g)
            steps = a[:, 0].sum()
            out.append(dict(kind=kind, nodes=n, iterations=int(steps), predicted_ms=a[:, 1].sum() / steps,
                            clock_ms=a[:, 2].sum() / steps, emitted=a[:, 3].sum() / steps,
                            share_of_loop=float(a[:, 2].sum())))
        total = sum(r["share_of_loop"] for r in out) or 1.0
        for r in out:
            r["share_of_loop"] /= total
        return out


class HostClock:
    """The loop's host time per iteration outside the model's device work: wraps
    ``_Loop.iterate`` and the two step functions it calls (each ends in the device-to-host sync
    that hands the host its tokens, so their time is the device's too), and sorts each iteration
    by what it was: an autoregressive ``step``, a ``run`` step decided ahead, a ``plain`` step
    weighed alone, or a ``tree``. The wrappers come off when ``undo`` closes."""

    def __init__(self, undo: contextlib.ExitStack):
        self.kinds: dict[str, list[float]] = defaultdict(list)
        inside = [0.0]
        for owner, name in ((loop, "autoregressive_step"), (loop, "speculative_step"), (loop._Loop, "iterate")):
            undo.callback(setattr, owner, name, getattr(owner, name))

        def timed(fn):
            def run(*args, **kwargs):
                t = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    inside[0] += time.perf_counter() - t
            return run

        loop.autoregressive_step, loop.speculative_step = map(timed, (loop.autoregressive_step,
                                                                      loop.speculative_step))
        iterate, kinds = loop._Loop.iterate, self.kinds

        def clocked(state):
            kind = "step" if not state.c.speculative else "run" if state.plain_run is not None else None
            plain = state.stats.trees.get(1, 0)
            inside[0], t = 0.0, time.perf_counter()
            iterate(state)
            kind = kind or ("plain" if state.stats.trees.get(1, 0) > plain else "tree")
            kinds[kind].append((time.perf_counter() - t - inside[0]) * 1e3)

        loop._Loop.iterate = clocked

    def summary(self) -> dict[str, dict]:
        return {k: dict(iterations=len(v), host_ms=float(np.mean(v))) for k, v in sorted(self.kinds.items())}


def trace(args, device, dtype, log: Log, host: HostClock) -> list[dict]:
    """Each batch size and drafter (autoregressive decoding first), timed after its warm-up: wall
    time per call and step, tau, and what ``log`` and ``host`` saw of the timed calls."""
    small = None if args.target == "drafter" else load(DRAFTER, dtype=dtype, device=device)
    lm = stree.LM.from_pretrained(DRAFTER if small is None else TARGET, dtype=dtype, device=device, drafter_model=small)
    texts = read_prompts(TARGET / "prompts.jsonl", args.prompts)
    results = []
    for batch in (int(b) for b in args.batches.split(",")):
        starts = range(0, len(texts) - batch + 1, batch)
        ar_step = None
        for name in ["autoregressive"] + [d for d in args.drafters.split(",") if small or not d.startswith("ssm")]:
            spec = dict(method="autoregressive") if name == "autoregressive" else dict(drafter=name)
            spec.update(max_new_tokens=args.max_new_tokens, temperature=args.temperature, torch_compile=args.compiled)
            seed = (lambda s: s) if args.temperature > 0 else (lambda s: None)
            for s in starts:  # compiling, capturing, measuring the machine's costs: before any timing
                lm.generate(texts[s: s + batch], seed=seed(s), **spec)
            log.rows.clear()
            host.kinds.clear()
            t0, stats = time.perf_counter(), []
            for s in starts:
                stats.append(lm.generate(texts[s: s + batch], seed=seed(s), **spec).stats)
            wall = (time.perf_counter() - t0) * 1e3 / len(stats)
            steps = sum(sum(x.trees.values()) for x in stats) / len(stats)
            ar_step = ar_step or wall / steps
            results.append(dict(batch=batch, drafter=name, ms_per_call=wall, steps_per_call=steps,
                                ms_per_step=wall / steps, step_in_ar_steps=wall / steps / ar_step,
                                tau=sum(sum(x.new_tokens) for x in stats) / (steps * batch * len(stats)),
                                setup_ms=1e3 * sum(x.time_setup for x in stats) / len(stats),
                                prefill_ms=1e3 * sum(x.time_prefill for x in stats) / len(stats),
                                kinds=log.summary(), host=host.summary()))
            r = results[-1]
            print(f"b{batch} {name:<15} {r['ms_per_call']:8.2f} ms/call  {r['steps_per_call']:6.1f} steps  "
                  f"step {r['step_in_ar_steps']:.2f} AR  tau {r['tau']:.2f}  host ms outside the model: "
                  + "  ".join(f"{k} {h['host_ms']:.3f} x{h['iterations']}" for k, h in r["host"].items()),
                  file=sys.stderr)
            for k in r["kinds"]:
                print(f"    {k['kind']:<6}{k['nodes']:>4} x{k['iterations']:<5} predicted {k['predicted_ms']:7.3f}  "
                      f"clock {k['clock_ms']:7.3f} ms  emitted {k['emitted']:5.2f}  {k['share_of_loop']:4.0%} of the loop",
                      file=sys.stderr)
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_args(p)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batches", default="1,2")
    p.add_argument("--drafters", default=",".join(DRAFTERS))
    p.add_argument("--temperature", type=float, default=0.0, help="sampled: seeded per batch of prompts, as "
                   "speculation.py does (a seeded choice then prices from the profile alone)")
    p.add_argument("--compiled", action="store_true", help="torch_compile=True (CPU): the compiled step and "
                   "tree passes, against compiled autoregressive decoding")
    p.add_argument("--target", choices=("target", "drafter"), default="target",
                   help="the model that decodes: the shipped target, or the 1-layer drafter (a cheap step: the loop's "
                        "host work weighs as on a GPU's graphed steps; the ssm drafters are left out)")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = p.parse_args(argv)
    args.dtype = args.dtype or "float32"
    device, dtype = device_and_dtype(args)
    if args.smoke:
        args.prompts, args.max_new_tokens, args.batches, args.drafters = 2, 8, "1", "ngram"
    # (the wrappers come off at the end: a test that runs main in its process leaves the loop as it was)
    with contextlib.ExitStack() as undo:
        results = trace(args, device, dtype, Log(undo), HostClock(undo))
    result = dict(benchmark="autotree_trace", **run_info(device, argv), dtype=str(dtype).removeprefix("torch."),
                  temperature=args.temperature, compiled=args.compiled, prompts=args.prompts, target=args.target,
                  max_new_tokens=args.max_new_tokens,
                  note="LM.generate defaults (tree='auto'), after a warm-up over every batch of prompts; "
                       "per kind of iteration (plain: weighed alone; run: decided ahead, per step; probe / tree by "
                       "size): mean predicted and clock ms, tokens emitted per row, share of the loop's clock; "
                       "host: per kind of iteration (step: autoregressive; run; plain: weighed alone; tree, probes "
                       "included) the mean ms of the loop's host work outside the model's step and pass",
                  results=results)
    stem = "autotree_trace_smoke" if args.smoke else (f"autotree_trace_{device.type}{'_compiled' * args.compiled}"
                                                      f"{'_host_bound' * (args.target == 'drafter')}")
    save_result(result, args.out, stem, plot)
    return result


def plot(result):
    import matplotlib.pyplot as plt

    rows = [r for r in result["results"] if r["drafter"] != "autoregressive"]
    fig, ax = plt.subplots(figsize=(8, max(2.5, 0.5 * len(rows))))
    colours = {"plain": "tab:gray", "run": "silver", "probe": "tab:orange", "tree": "tab:green"}
    for i, r in enumerate(rows):
        left = 0.0
        for k in r["kinds"]:
            ax.barh(i, k["share_of_loop"], left=left, color=colours[k["kind"]], edgecolor="white")
            left += k["share_of_loop"]
    ax.set_yticks(range(len(rows)), [f"b{r['batch']} {r['drafter']} ({r['step_in_ar_steps']:.2f} AR steps/step, "
                                     f"tau {r['tau']:.2f})" for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()], labels=list(colours),
              fontsize=7, loc="lower right")
    ax.set(xlabel="share of the decoding loop's clock", title=f"tree='auto' per iteration, {result['device']}")
    ax.title.set_fontsize(8)
    return fig


if __name__ == "__main__":
    main()
