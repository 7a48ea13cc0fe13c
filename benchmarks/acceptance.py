"""Acceptance length tau of every drafter on held-out code with a target trained here (default:
the shipped tiny pair, see stree/demo.py): drafter x temperature x number of trajectories.

For each held-out prompt, ``max(--trajectories)`` trajectories are sampled one after another
from the prompt (seeds 0, 1, ...), all drafting through ONE drafter (STAND's store and the
consensus drafter's paths are shared, as in test-time scaling); a fresh drafter per prompt. The
entry for n trajectories is tau over the first n of them, pooled over prompts: emitted tokens
after the prefill's / verify steps. Drafters that keep no cross-trajectory state (n-gram, SSM
static) vary with n only through sampling; dynamic trees carry their learned acceptance rates. Trees: STAND its optimised trees (stree/assets/stand-trees,
calibrated on training-split prompts; ``stand@paper13`` rows: the same drafter over the paper's 13
nodes, side by side), n-gram and SSM static the paper's 13 nodes, SSM beam 3 beams x 4 steps,
consensus the 13-node tree filled from its DAG (``consensus-paper``: by the paper's per-layer
readout). ``NAME@dynamic:...`` rows grow a tree per step under that budget (stree.tree.TreeBudget).
Writes JSON, a markdown table and a PNG.

    python benchmarks/acceptance.py            # 4 prompts x 96 new tokens, the committed table
    python benchmarks/acceptance.py --smoke    # 1 prompt, 2 trajectories, 8 tokens (CI)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from stree.tools.demo import DRAFTER, TARGET, read_prompts
from stree.drafters import ConsensusDrafter
from stree.drafters.registry import DRAFTER_NAMES, NEEDS_MODEL, make_drafter, stand_tree
from stree.decoding.loop import pooled_tau
from stree.models import load, load_tokenizer
from stree.tools.timing import add_device_args, device_and_dtype, run_info, save_result
from stree.tree import TreeShape, tree_spec
from stree.patterns.tts import sample_trajectories


# beside the named drafters: STAND over the paper's 13 nodes, dynamic trees against the static ones
# (STAND's budget its optimised trees' 81 nodes; the SSM drafter's 20 nodes, 5 levels, 3 expansions
# per level, against the paper's 13 nodes at 4 levels), the consensus DAG read out as in its paper
EXTRA = ("stand@paper13", "stand-det@paper13", "stand@dynamic:81", "stand-det@dynamic:81", "ssm-static@dynamic:20x5w3",
         "consensus-paper")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(TARGET))
    p.add_argument("--drafter-model", default=str(DRAFTER))
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--temperatures", default="0,0.6,1.0")
    p.add_argument("--trajectories", default="1,4,8,16")
    p.add_argument("--drafters", default=",".join(DRAFTER_NAMES + EXTRA),
                   help="drafter names (and consensus-paper: the paper's extraction); NAME@TREE drafts over another "
                        "tree (the STAND drafters' own are optimised), e.g. stand@dynamic:32 (grown per step)")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    add_device_args(p)
    args = p.parse_args(argv)
    if args.smoke:
        args.prompts, args.max_new_tokens, args.trajectories = 1, 8, "1,2"
    temperatures = [float(t) for t in args.temperatures.split(",")]
    counts = sorted(int(n) for n in args.trajectories.split(","))
    drafters = args.drafters.split(",")
    device, dtype = device_and_dtype(args)
    target = load(args.model, dtype=dtype, device=device)
    tokenizer = load_tokenizer(args.model, vocab_size=target.vocab_size)
    draft_model = load(args.drafter_model, dtype=dtype, device=device)
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in read_prompts(Path(args.model) / "prompts.jsonl",
                                                                                  args.prompts)]
    rows = []
    configs = [(d, t) for d in drafters for t in temperatures]
    for label, temperature in tqdm(configs, desc="drafter x temperature", file=sys.stderr):
        name, _, spec = label.partition("@")
        # the tree each drafter is known by: acceptance is measured over fixed trees, not tree="auto"'s
        # cost-driven choice; ssm-beam drafts its own
        tree = tree_spec(spec) if spec else stand_tree(name) if name.startswith("stand") else \
            None if name == "ssm-beam" else TreeShape.paper13()
        stats, t0 = [], time.perf_counter()
        for prompt in prompts:
            if name == "consensus-paper":  # the DAG read out by the paper's Algorithm 1
                drafter = ConsensusDrafter(extraction="paper")
            else:
                drafter = make_drafter(name, drafter_model=draft_model if name in NEEDS_MODEL else None,
                                       vocab_size=target.vocab_size, temperature=temperature)
            out = sample_trajectories(target, prompt, counts[-1], drafter=drafter, tree=tree, temperature=temperature,
                                      max_new_tokens=args.max_new_tokens, eos_token_id=tokenizer.eos_token_id, seed=0)
            stats.append(out.stats)
        seconds = time.perf_counter() - t0
        tokens = sum(s.new_tokens[0] for per in stats for s in per)
        for n in counts:  # tokens/s: the whole configuration (every prompt and trajectory), drafting included
            first_n = [s for per_prompt in stats for s in per_prompt[:n]]
            rows.append(dict(drafter=label, temperature=temperature, trajectories=n, tau=pooled_tau(first_n),
                             config_tokens_per_s=tokens / seconds))

    result = dict(benchmark="acceptance", **run_info(device, argv), dtype=str(dtype).replace("torch.", ""),
                  model=args.model, drafter_model=args.drafter_model,
                  prompts=len(prompts), max_new_tokens=args.max_new_tokens, threads=torch.get_num_threads(),
                  results=rows)
    stem = "acceptance_smoke" if args.smoke else f"acceptance_{device.type}"
    save_result(result, args.out, stem, plot)
    table = markdown(result, counts)
    (Path(args.out) / f"{stem}.md").write_text(table)
    print(table)
    return result


def markdown(result, counts) -> str:
    rows = result["results"]
    lines = [f"tau (tokens per target forward) on {result['prompts']} held-out prompts x {result['max_new_tokens']} "
             f"new tokens; columns: trajectories sharing one drafter. `{result['command']}` on {result['device']}, "
             f"{result['date']}.", "",
             "| drafter | T | " + " | ".join(f"n={n}" for n in counts) + " |",
             "|---|---|" + "---|" * len(counts)]
    for name, temperature in dict.fromkeys((r["drafter"], r["temperature"]) for r in rows):
        taus = [r["tau"] for r in rows if r["drafter"] == name and r["temperature"] == temperature]
        lines.append(f"| {name} | {temperature:g} | " + " | ".join(f"{t:.2f}" for t in taus) + " |")
    return "\n".join(lines) + "\n"


def plot(result):
    import matplotlib.pyplot as plt

    rows = result["results"]
    temperatures = sorted({r["temperature"] for r in rows})
    fig, axes = plt.subplots(1, len(temperatures), figsize=(4.5 * len(temperatures), 4), squeeze=False)
    for ax, temperature in zip(axes[0], temperatures):
        for k, name in enumerate(dict.fromkeys(r["drafter"] for r in rows)):
            rs = [r for r in rows if r["drafter"] == name and r["temperature"] == temperature]
            ax.plot([r["trajectories"] for r in rs], [r["tau"] for r in rs], marker="os^D"[k // 10 % 4],
                    color=f"C{k % 10}", linestyle="-" if k < 10 else "--", label=name)  # distinct past 10 rows
        ax.set(title=f"T = {temperature:g}", xlabel="trajectories sharing the drafter", ylabel="tau", xscale="log")
        ax.set_xticks(sorted({r["trajectories"] for r in rows}), labels=sorted({r["trajectories"] for r in rows}))
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    return fig


if __name__ == "__main__":
    main()
