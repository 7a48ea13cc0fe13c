"""How often the n-gram drafter's drafts are accepted, by the length of the match each came from: what
its weak marks (``TokenTree.weak``: nodes from a match shorter than ``max_n``, or from one other tokens had
followed too) stand on.

The shipped target decodes the held-out prompts greedily at batch 1 with the n-gram drafter over a
fixed chain (every step a tree: nothing chosen, the same run on every machine). For every drafted node
the chain's verification reached (its parent accepted), the length of the context suffix its token
continued (the reference index, ``stree.drafters.ngram.RowIndex``), whether other tokens had followed that
suffix too, and whether it was accepted. Writes JSON and a PNG with the shares by both (and of the chains'
first children alone).

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
from stree.drafters import NGramDrafter
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
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--stem", default=None, help="default ngram_matches (ngram_matches_smoke with --smoke)")
    args = p.parse_args(argv)
    if args.smoke:
        args.prompts, args.max_new_tokens = 2, 16
    stem = args.stem or ("ngram_matches_smoke" if args.smoke else "ngram_matches")
    torch.manual_seed(0)
    model, tokenizer = load(TARGET, dtype=torch.float32), load_tokenizer(TARGET)
    chain = TreeShape.chain(args.depth)
    # by (match length, whether other tokens followed that match too, first child or deeper)
    reached, accepted = collections.Counter(), collections.Counter()
    for text in tqdm(read_prompts(TARGET / "prompts.jsonl", args.prompts), desc="prompts"):
        drafter = _Recorded()
        out = generate(model, [tokenizer.encode(text)], drafter=drafter, tree=chain,
                       max_new_tokens=args.max_new_tokens)
        for (context, tokens), took in zip(drafter.drafts, out.stats.accepted[0]):
            for depth, (n, several) in enumerate(matches(context, tokens, drafter.max_n)):
                if depth > took or n == 0:  # (not reached by the verification, or nothing drafted there)
                    break
                reached[n, several, depth > 0] += 1
                accepted[n, several, depth > 0] += depth < took
    rows = []
    for n, several in sorted({key[:2] for key in reached}):
        got = accepted[n, several, False] + accepted[n, several, True]
        seen = reached[n, several, False] + reached[n, several, True]
        rows.append(dict(match=n, others_followed=several, reached=seen, accepted=got, share=got / seen,
                         first_reached=reached[n, several, False], first_accepted=accepted[n, several, False]))
        print(f"match of {n} tokens{', others followed too' if several else ''}: {got}/{seen} accepted "
              f"({got / seen:.2f}); as the first child {accepted[n, several, False]}/{reached[n, several, False]}")
    save_result(dict(
        benchmark="ngram_matches", **run_info(torch.device("cpu"), argv), target=str(TARGET), prompts=args.prompts,
        max_new_tokens=args.max_new_tokens, tree=f"chain of {args.depth}", results=rows,
        note="greedy, batch 1, every step a tree; nodes the verification reached, by the match they came from"),
        args.out, stem, _plot)


def _plot(result: dict):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    rows = result["results"]
    ax.bar([f"{r['match']}{'+' if r['others_followed'] else ''}" for r in rows], [r["share"] for r in rows],
           color=["tab:orange" if r["others_followed"] else "tab:blue" for r in rows])
    for i, r in enumerate(rows):
        ax.text(i, r["share"] + 0.02, f"{r['accepted']}/{r['reached']}", ha="center", fontsize=8)
    ax.set(xlabel="match length (tokens; +: other tokens followed it too)", ylabel="accepted", ylim=(0, 1.1),
           title="n-gram drafts accepted, by match length")
    return fig


if __name__ == "__main__":
    main()
