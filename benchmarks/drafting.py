"""Drafting cost on CPU: microseconds per decoding step to draft an 80-node tree (STAND,
stochastic and deterministic; the n-gram drafter; the consensus drafter) and to feed the step's
emitted tokens back, against the store size and the context length.

Tokens are the bytes of the Python standard library's sources (V = 256: real repetition, no
tokenizer needed). A STAND store holds entries for the corpus's n-grams with synthetic top-10
distributions; a consensus store holds 8 earlier trajectories cut from the corpus. Each step
drafts for one row whose context is a corpus slice of the given length, then observes 3 emitted
tokens. Targets: <= 1 ms per step, flat in context length (issue 5); <= 100 us for the n-gram
and STAND drafters (issue 14: their indexes and stores compiled with numba). Writes JSON and a PNG.

    python benchmarks/drafting.py            # store sizes 1e3..1e5, contexts 256..16k
    python benchmarks/drafting.py --smoke    # tiny sizes
"""

from __future__ import annotations

import argparse
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch
from tqdm import tqdm

from stree.drafters import ConsensusDrafter, DraftContext, NGramDrafter, PathStore, STANDDrafter, STANDStore, TargetTop
from stree.drafters.calibrate import optimize_tree, stand_initial_tree
from stree.tools.timing import run_info, save_result

EMITTED = 3  # tokens per step (an accepted run plus the bonus)


def corpus(n_bytes: int) -> torch.Tensor:
    """The first ``n_bytes`` bytes of the standard library's .py files, in sorted path order."""
    out, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        data = path.read_bytes()
        out.append(data)
        total += len(data)
        if total >= n_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(out)[:n_bytes]), dtype=torch.uint8).long()


def tree80():
    """STAND's 625-node tree cut to its 80 best nodes under a synthetic acceptance pattern: a path
    is accepted with probability 0.7**depth * prod(0.6**rank)."""
    shape = stand_initial_tree()
    weight = [1.0] * shape.n
    kids = shape.children()
    for v in range(shape.n):
        for r, c in enumerate(kids[v]):
            weight[c] = weight[v] * 0.7 * 0.6 ** r
    return optimize_tree(shape, [int(1e6 * w) for w in weight], nodes=80)


def synthetic_top(tokens: torch.Tensor, k: int, gen: torch.Generator) -> TargetTop:
    """For positions whose next token is ``tokens``: that token first, then k-1 random ones."""
    ids = torch.cat([tokens[:, None], torch.randint(0, 256, (len(tokens), k - 1), generator=gen)], 1)
    probs = torch.softmax(torch.linspace(2, 0, k).expand(len(tokens), k) + 0.1 * torch.rand(len(tokens), k, generator=gen), 1)
    return TargetTop(ids, probs, probs[:, 0])


def fill_stand(store: STANDStore, text: torch.Tensor, size: int, gen: torch.Generator) -> None:
    """Insert the corpus's 1..4-gram keys with synthetic distributions until ``size`` entries."""
    pos, chunk = store.max_n, 4096
    with tqdm(total=size, desc=f"STAND store {size}", file=sys.stderr, leave=False) as bar:
        while len(store) < size and pos + chunk < len(text):
            top = synthetic_top(text[pos: pos + chunk], store.top_k, gen)
            first: dict[tuple[int, ...], int] = {}  # one occurrence per key and chunk: one merge round
            for e in range(pos, pos + chunk):
                for n in range(1, store.max_n + 1):
                    first.setdefault(tuple(text[e - n: e].tolist()), e - pos)
            before = len(store)
            store.update(list(first), top.ids[list(first.values())], top.probs[list(first.values())])
            bar.update(len(store) - before)
            pos += chunk


def fill_paths(store: PathStore, text: torch.Tensor, size: int, gen: torch.Generator) -> None:
    """8 earlier trajectories of ``size / 8`` tokens each, cut from the corpus."""
    each = max(size // 8, 1)
    for j in range(8):
        piece = text[j * each: (j + 1) * each + store.k]
        pid = store.open(piece[: store.k].tolist())
        store.extend(pid, piece[store.k:].tolist(), torch.rand(len(piece) - store.k, generator=gen).tolist())


def time_steps(drafter, text: torch.Tensor, context: int, shape, steps: int, gen: torch.Generator):
    """Median microseconds of propose, observe and both, and the fastest step, over ``steps`` steps of one row whose
    context starts as ``text[-context:]`` of a held-out slice and grows by EMITTED tokens a step."""
    tokens = text[None, : context + EMITTED * (steps + 1)].clone()
    drafter.reset()
    length = torch.tensor([context])
    ctx = DraftContext(tokens, length, [0])
    drafter.observe(DraftContext(tokens, length - 1, [0]), [[int(tokens[0, context - 1])]],
                    [synthetic_top(tokens[0, context - 1: context], 10, gen)])  # the prefill's token
    drafter.propose(ctx, shape)  # warm-up: the n-gram drafter indexes the whole context here
    propose_us, observe_us = [], []
    for s in range(steps):
        start = context + EMITTED * s
        ctx = DraftContext(tokens, torch.tensor([start]), [0])
        new = tokens[0, start: start + EMITTED]
        top = synthetic_top(new, 10, gen)
        t0 = time.perf_counter()
        drafter.propose(ctx, shape)
        t1 = time.perf_counter()
        drafter.observe(ctx, [new.tolist()], [top])
        t2 = time.perf_counter()
        propose_us.append((t1 - t0) * 1e6)
        observe_us.append((t2 - t1) * 1e6)
    total = [a + b for a, b in zip(propose_us, observe_us)]
    return statistics.median(propose_us), statistics.median(observe_us), statistics.median(total), min(total)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (CI)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # drafting runs beside the target; one core is the honest budget

    sizes = [300, 3000] if args.smoke else [1_000, 10_000, 100_000]
    contexts = [64, 256] if args.smoke else [256, 1024, 4096, 16384]
    steps = 5 if args.smoke else args.steps
    text = corpus(400_000 if args.smoke else 4_000_000)
    held_out = text[len(text) // 2:]  # contexts the stores were not built from
    gen = torch.Generator().manual_seed(0)
    shape = tree80()

    configs = [("ngram", None, lambda _: NGramDrafter())]
    for size in sizes:
        stand = STANDStore(capacity=max(2 * size, 1024))
        fill_stand(stand, text, size, gen)
        paths = PathStore()
        fill_paths(paths, text, size, gen)
        # learn=False would skip observe; learning keeps the store (and its size) growing slowly
        configs += [("stand", size, lambda _, s=stand: STANDDrafter(s, stochastic=True)),
                    ("stand_deterministic", size, lambda _, s=stand: STANDDrafter(s, stochastic=False)),
                    ("consensus", size, lambda _, p=paths: ConsensusDrafter(p))]
    rows = []
    for name, size, make in tqdm(configs, desc="drafters", file=sys.stderr):
        for context in contexts:
            drafter = make(None)
            store_len = None if size is None else (len(drafter.store) if name.startswith("stand")
                                                    else sum(map(len, drafter.store.tokens)))  # tokens in paths
            p, o, t, fastest = time_steps(drafter, held_out, context, shape, steps, gen)
            rows.append(dict(drafter=name, store_size=size, store_entries=store_len, context=context, nodes=shape.n,
                             propose_us_median=p, observe_us_median=o, step_us_median=t, step_us_min=fastest))

    result = dict(benchmark="drafting", **run_info("cpu", argv), threads=torch.get_num_threads(), steps=steps,
                  emitted_per_step=EMITTED, tree_nodes=shape.n, tree_depth=shape.max_depth, results=rows)
    save_result(result, args.out, "drafting_smoke" if args.smoke else "drafting_cpu", plot)
    for r in rows:
        print(f"{r['drafter']:<20}{str(r['store_size']):>8}{r['context']:>7}  propose {r['propose_us_median']:8.0f} us"
              f"  observe {r['observe_us_median']:6.0f} us  step {r['step_us_median']:8.0f} us (min {r['step_us_min']:.0f})")
    return result


def plot(result):
    import matplotlib.pyplot as plt

    rows = result["results"]
    largest = max(r["store_size"] for r in rows if r["store_size"] is not None)
    mid_context = sorted({r["context"] for r in rows})[-2]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for k, name in enumerate(dict.fromkeys(r["drafter"] for r in rows)):
        style = dict(marker="o", color=f"C{k}", label=name)  # one colour per drafter in both panels
        rs = [r for r in rows if r["drafter"] == name and r["store_size"] in (None, largest)]
        axes[0].plot([r["context"] for r in rs], [r["step_us_median"] for r in rs], **style)
        rs = [r for r in rows if r["drafter"] == name and r["context"] == mid_context and r["store_size"]]
        if rs:
            axes[1].plot([r["store_size"] for r in rs], [r["step_us_median"] for r in rs], **style)
    for ax in axes:
        ax.axhline(1000, color="grey", ls="--", lw=1, label="1 ms target")
        ax.axhline(100, color="grey", ls=":", lw=1, label="100 us target (n-gram, STAND)")
        ax.set(ylabel="µs per step (propose + observe)", yscale="log", xscale="log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set(xlabel="context length (tokens)", title=f"{result['tree_nodes']}-node tree, store {largest}")
    axes[1].set(xlabel="store size", title=f"context {mid_context}")
    return fig


if __name__ == "__main__":
    main()
