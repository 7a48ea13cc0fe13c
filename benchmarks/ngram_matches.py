"""How often the n-gram drafter's drafts are accepted, by the length of the match each came from: what
its weak marks (``TokenTree.weak``: nodes from a match shorter than ``max_n``, or from one other tokens had
followed too) stand on.

The shipped target decodes the held-out prompts greedily at batch 1 with the n-gram drafter over a
fixed chain (every step a tree: nothing chosen, the same run on every machine). For every drafted node
the chain's verification reached (its parent accepted), the length of the context suffix its token
continued (the reference index, ``stree.drafters.ngram.RowIndex``), whether other tokens had followed that
suffix too, whether a node above it in the chain came from a weak match (shorter than ``max_n``, or one
others followed too: the drafter marks such nodes weak too), and whether it was accepted. Writes JSON and a
PNG with the shares by all three (and of the chains' first children alone).

    python benchmarks/ngram_matches.py                 # 16 prompts x 128 new tokens, chain of 8
    python benchmarks/ngram_matches.py --smoke         # 2 prompts x 16 tokens
"""

from __future__ import annotations

import argparse
import collections

import numpy as np
import torch
from tqdm import tqdm

from stree.decoding.loop import generate
from stree.drafters import NGramDrafter, STANDDrafter
from stree.drafters.stand import STANDStore
from stree.drafters.ngram import RowIndex
from stree.models import load, load_tokenizer
from stree.tools.demo import TARGET, read_prompts
from stree.tools.timing import run_info, save_result
from stree.tree import TreeShape


class _Recorded(NGramDrafter):
    """The n-gram drafter, keeping each draft's context (the row's committed tokens) and tokens."""

    def __init__(self):
        super().__init__()
        self.drafts = []

    def propose(self, context, shape):
        tree = super().propose(context, shape)
        tokens, lengths = context.arrays()
        row = context.rows[0]
        self.drafts.append((tokens[row, : int(lengths[row])].tolist(), tree.tokens[0].tolist()))
        return tree

    def nodes(self, draft) -> list[tuple[int, bool]]:
        return matches(*draft, self.max_n)


class _RecordedSTAND(STANDDrafter):
    """STAND deterministic, keeping for each draft's chain the length of the n-gram each node's entry was
    found under in the store as it stood (0: none) and whether its stored probability was under one half."""

    def __init__(self, tokens: int):
        super().__init__(STANDStore(capacity=4 * tokens), stochastic=False)
        self.drafts = []

    def propose(self, context, shape):
        tree = super().propose(context, shape)
        tokens, lengths = context.arrays()
        row = context.rows[0]
        path, out = tokens[row, : int(lengths[row])].tolist(), []
        for tok in tree.tokens[0, 1:].tolist():
            n = next((n for n in range(min(self.store.max_n, len(path)), 0, -1)
                      if self.store.slot(tuple(path[len(path) - n:])) is not None), 0)
            entry = self.store.entry(tuple(path[len(path) - n:])) if n else None
            out.append((n, entry is not None and float(entry[1][0]) < 0.5))
            path.append(tok)
        self.drafts.append(out)
        return tree

    def nodes(self, draft) -> list[tuple[int, bool]]:
        return draft


def matches(context: list[int], chain: list[int], max_n: int) -> list[tuple[int, bool]]:
    """For each drafted token of ``chain`` (its root first, then one node per level), the length of
    the longest suffix of the path's context after which it occurred in ``context`` (0: none), and
    whether other tokens followed that suffix too."""
    index = RowIndex(max_n, 1 << 20, 0.1)
    index.extend(np.asarray(context, dtype=np.int64))
    path, out = list(context), []
    for tok in chain[1:]:
        hit = (0, False)
        for n in range(min(max_n, len(path)), 0, -1):
            followers = index.next.get(tuple(path[len(path) - n:]), ({}, []))[0]
            if tok in followers:
                hit = (n, len(followers) > 1)
                break
        out.append(hit)
        path.append(tok)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--depth", type=int, default=8, help="the chain's drafted nodes")
    p.add_argument("--drafter", choices=("ngram", "stand-det"), default="ngram",
                   help="stand-det: STAND deterministic, its nodes split by the length of the n-gram whose "
                        "entry they come from and by a stored probability under one half")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--stem", default=None, help="default ngram_matches (ngram_matches_smoke with --smoke)")
    args = p.parse_args(argv)
    if args.smoke:
        args.prompts, args.max_new_tokens = 2, 16
    stem = args.stem or (("ngram_matches" if args.drafter == "ngram" else "stand_matches")
                         + ("_smoke" if args.smoke else ""))
    torch.manual_seed(0)
    model, tokenizer = load(TARGET, dtype=torch.float32), load_tokenizer(TARGET)
    chain = TreeShape.chain(args.depth)
    # by (match length, whether other tokens followed that match too, whether a node above came from a weak
    # match, first child or deeper)
    reached, accepted = collections.Counter(), collections.Counter()
    for text in tqdm(read_prompts(TARGET / "prompts.jsonl", args.prompts), desc="prompts"):
        drafter = _Recorded() if args.drafter == "ngram" else _RecordedSTAND(args.max_new_tokens + 1)
        out = generate(model, [tokenizer.encode(text)], drafter=drafter, tree=chain,
                       max_new_tokens=args.max_new_tokens)
        max_n = drafter.max_n if args.drafter == "ngram" else drafter.store.max_n
        for draft, took in zip(drafter.drafts, out.stats.accepted[0]):
            below = False
            for depth, (n, several) in enumerate(drafter.nodes(draft)):
                if depth > took or n == 0:  # (not reached by the verification, or nothing drafted there)
                    break
                reached[n, several, below, depth > 0] += 1
                accepted[n, several, below, depth > 0] += depth < took
                below = below or n < max_n or (several and args.drafter == "ngram")
    rows = []
    for n, several, below in sorted({key[:3] for key in reached}):
        first, deeper = (n, several, below, False), (n, several, below, True)
        got, seen = accepted[first] + accepted[deeper], reached[first] + reached[deeper]
        rows.append(dict(match=n, other=several, below_weak=below, reached=seen, accepted=got, share=got / seen,
                         first_reached=reached[first], first_accepted=accepted[first]))
        print(f"match of {n} tokens{', ' + OTHER[args.drafter] if several else ''}"
              f"{', below a weak one' if below else ''}: {got}/{seen} accepted ({got / seen:.2f}); as the first child "
              f"{accepted[first]}/{reached[first]}")
    save_result(dict(
        benchmark="ngram_matches", **run_info(torch.device("cpu"), argv), target=str(TARGET), drafter=args.drafter,
        prompts=args.prompts, max_new_tokens=args.max_new_tokens, tree=f"chain of {args.depth}", results=rows,
        other=OTHER[args.drafter],
        note="greedy, batch 1, every step a tree; nodes the verification reached, by the match they came from"),
        args.out, stem, _plot)


# what a row's ``other`` says, per drafter
OTHER = {"ngram": "other tokens followed that match too", "stand-det": "a stored probability under one half"}


def _plot(result: dict):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    rows = result["results"]
    ax.bar([f"{r['match']}{'+' if r['other'] else ''}{'v' if r['below_weak'] else ''}" for r in rows],
           [r["share"] for r in rows], color=["tab:orange" if r["other"] else "tab:blue" for r in rows],
           hatch=["//" if r["below_weak"] else "" for r in rows])
    for i, r in enumerate(rows):
        ax.text(i, r["share"] + 0.02, f"{r['accepted']}/{r['reached']}", ha="center", fontsize=8)
    ax.set(xlabel=f"match length (tokens; +: {result['other']}; v: below a weak node)", ylabel="accepted",
           ylim=(0, 1.1),
           title=f"{result['drafter']} drafts accepted, by match length")
    return fig


if __name__ == "__main__":
    main()
