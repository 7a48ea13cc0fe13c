"""SpecReason and step-level search on the shipped pair (base = the tiny target, small = its
distilled drafter): wall time and tokens/s of SpecReason against the base model alone and the base
model with STree only, the share of steps the small model keeps under both judges and three
thresholds each; and DVTS's tau per branch with one shared STAND store against a fresh store per
branch. One process, greedy steps (search: sampled at 0.8); the configurations take turns on
every prompt (the order reversed on every other prompt), speed reported as ratios to the base
model alone.

THE SHIPPED MODELS ARE TINY CODE MODELS: these numbers show the mechanism's cost and how often
steps are kept, not reasoning accuracy (the judge's scores mean little at this size).

    python benchmarks/reasoning.py            # 8 held-out prompts x 128 tokens
    python benchmarks/reasoning.py --smoke    # 1 prompt x 24 tokens (CI)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from stree.decoding.autotree import tree_room
from stree.patterns.branch import Branch
from stree.tools.demo import DRAFTER, TARGET, read_prompts
from stree.drafters.registry import make_drafter
from stree.models import load, load_tokenizer
from stree.patterns.reasoning import spec_reason
from stree.patterns.search import dvts
from stree.tools.timing import run_info, save_result

NOTE = ("The shipped models are tiny code models: the numbers show the mechanism's cost and acceptance, "
        "not reasoning accuracy.")
# The prompt judge's digit read as the expectation: the tiny target's argmax after the judge prompt
# is rarely a digit, so the greedy reading would score nearly every step 0.
READ = {"prompt": dict(score="expected"), "logprob": {}}
THRESHOLDS = {"prompt": (3.0, 5.0, 7.0), "logprob": (-3.0, -2.0, -1.0)}  # 0-9 scores; mean log-probs in nats


def configs():
    """(name, kind, options): the baselines (the base model alone; with STree drafting from STAND),
    then SpecReason under each judge and threshold with token-level STree for the rejected steps,
    and once without it."""
    out = [("base", "base", {}), ("base+stree", "stree", {})]
    for judge, thresholds in THRESHOLDS.items():
        for t in thresholds:
            out.append((f"specreason-{judge}@{t:g}", "reason",
                        dict(judge=judge, threshold=t, token_spec=True, **READ[judge])))
    out.append(("specreason-prompt@7-no-token-spec", "reason",
                dict(judge="prompt", threshold=7.0, token_spec=False, **READ["prompt"])))
    return out


def run_one(kind, options, base, small, tokenizer, prompt: str, n: int, step_tokens: int) -> dict:
    t0 = time.perf_counter()
    if kind == "reason":
        out = spec_reason(base, small, tokenizer, prompt, max_new_tokens=n, max_step_tokens=step_tokens,
                          eos_token_id=[], **options)
        st = out.stats
        return dict(tokens=len(out.token_ids), seconds=time.perf_counter() - t0, judged=st.judged,
                    accepted=st.accepted, small_tokens=st.small_tokens, base_tokens=st.base_tokens,
                    base_forwards=st.base_forwards, judge_forwards=st.judge_forwards,
                    split=dict(small=st.time_small, judge=st.time_judge, base=st.time_base, sync=st.time_sync))
    ids = tokenizer.encode(prompt)
    drafter = make_drafter("stand-det") if kind == "stree" else None  # SpecReason's own choice for greedy steps
    branch = Branch.start(base, [ids], len(ids) + n + tree_room(drafter))
    out = branch.generate(n, drafter=drafter)
    return dict(tokens=len(out.new_tokens[0]), seconds=time.perf_counter() - t0, base_tokens=len(out.new_tokens[0]),
                base_forwards=out.stats.target_forwards)


def search_taus(model, tokenizer, prompts, width, expand, steps, step_tokens) -> list[dict]:
    rows = []
    for shared in (True, False):
        per_iter: dict[int, list] = {}
        for prompt in prompts:
            res = dvts(model, prompt, tokenizer=tokenizer, width=width, expand=expand, steps=steps,
                       max_step_tokens=step_tokens, scorer="logprob", share_store=shared, temperature=0.8, seed=0)
            for c in res.candidates:
                per_iter.setdefault(c.iteration, []).append((len(c.tokens), len(c.tokens) / c.tau if c.tau else 0))
        for it, pairs in sorted(per_iter.items()):
            steps_sum = sum(s for _, s in pairs)
            rows.append(dict(shared_store=shared, iteration=it, candidates=len(pairs),
                             tau=sum(t for t, _ in pairs) / steps_sum if steps_sum else float("nan")))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="1 prompt x 24 tokens (CI)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-step-tokens", type=int, default=32)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    n_prompts, n, step_tokens = (1, 24, 12) if args.smoke else (args.prompts, args.max_new_tokens, args.max_step_tokens)
    base = load(TARGET, dtype=torch.float32)
    small = load(DRAFTER, dtype=torch.float32)
    tokenizer = load_tokenizer(TARGET, vocab_size=base.vocab_size)
    prompts = read_prompts(Path(TARGET) / "prompts.jsonl", n_prompts)
    table = configs()
    for _, kind, options in table:  # warm-up: numba's first compile, allocator growth
        run_one(kind, options, base, small, tokenizer, prompts[0][:40], 8, 4)
    runs = {name: [] for name, _, _ in table}
    order = list(table)
    for i, prompt in enumerate(tqdm(prompts, desc="prompts", file=sys.stderr)):
        for name, kind, options in (order if i % 2 == 0 else order[::-1]):
            runs[name].append(run_one(kind, options, base, small, tokenizer, prompt, n, step_tokens))
    base_rate = sum(r["tokens"] for r in runs["base"]) / sum(r["seconds"] for r in runs["base"])
    rows = []
    for name, kind, options in table:
        rs = runs[name]
        tokens, seconds = sum(r["tokens"] for r in rs), sum(r["seconds"] for r in rs)
        row = dict(name=name, kind=kind, **{k: v for k, v in options.items()}, tokens=tokens, seconds=seconds,
                   tokens_per_s=tokens / seconds, speedup_vs_base=tokens / seconds / base_rate,
                   base_forwards=sum(r["base_forwards"] for r in rs))
        if kind == "reason":
            judged = sum(r["judged"] for r in rs)
            row.update(judged=judged, accepted=sum(r["accepted"] for r in rs),
                       share_accepted=sum(r["accepted"] for r in rs) / judged if judged else float("nan"),
                       small_tokens=sum(r["small_tokens"] for r in rs), base_tokens=sum(r["base_tokens"] for r in rs),
                       judge_forwards=sum(r["judge_forwards"] for r in rs),
                       time_split={k: sum(r["split"][k] for r in rs) for k in rs[0]["split"]},
                       median_seconds=statistics.median(r["seconds"] for r in rs))
        rows.append(row)
    search = search_taus(base, tokenizer, prompts[:1 if args.smoke else 4], 2, 2, 2 if args.smoke else 3,
                         8 if args.smoke else 16)
    result = dict(benchmark="reasoning", note=NOTE, **run_info("cpu", argv), prompts=n_prompts, max_new_tokens=n,
                  max_step_tokens=step_tokens, step_delimiter="\n\n", temperature=0.0,
                  search=dict(algorithm="dvts", width=2, expand=2, scorer="logprob", temperature=0.8, rows=search),
                  results=rows)
    save_result(result, args.out, "reasoning_smoke" if args.smoke else "reasoning_cpu", plot)
    print(NOTE)
    for r in rows:
        extra = (f"  kept {r['accepted']}/{r['judged']} steps ({r['share_accepted']:.0%})" if r["kind"] == "reason" else "")
        print(f"{r['name']:<36}{r['tokens_per_s']:8.1f} tok/s  x{r['speedup_vs_base']:.2f} vs base{extra}")
    for r in search:
        print(f"dvts shared_store={r['shared_store']!s:<5} iteration {r['iteration']}: tau {r['tau']:.2f}")
    return result


def plot(result):
    import matplotlib.pyplot as plt

    rows = result["results"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    axes[0].barh([r["name"] for r in rows], [r["speedup_vs_base"] for r in rows], color="C0")
    axes[0].axvline(1.0, color="grey", ls="--", lw=1)
    axes[0].set(xlabel="tokens/s vs the base model alone", title="speed (CPU, one process)")
    axes[0].invert_yaxis()
    for k, judge in enumerate(THRESHOLDS):
        rs = [r for r in rows if r.get("judge") == judge and r.get("token_spec")]
        axes[1].plot(range(len(rs)), [r["share_accepted"] for r in rs], marker="o", color=f"C{k}",
                     label=f"{judge} judge (thresholds {', '.join(format(r['threshold'], 'g') for r in rs)})")
    axes[1].set(xlabel="threshold (loosest to strictest)", ylabel="share of small-model steps kept", ylim=(-0.05, 1.05),
                title="steps kept")
    axes[1].set_xticks(range(3), ["loose", "mid", "strict"])
    axes[1].legend(fontsize=8)
    for k, shared in enumerate((True, False)):
        rs = [r for r in result["search"]["rows"] if r["shared_store"] == shared]
        axes[2].plot([r["iteration"] for r in rs], [r["tau"] for r in rs], marker="o", color=f"C{k + 2}",
                     label="one shared STAND store" if shared else "a fresh store per branch")
    axes[2].set(xlabel="search iteration", ylabel="tau (tokens per decoding step)", title="DVTS branches")
    axes[2].legend(fontsize=8)
    fig.suptitle(result["note"], fontsize=9)
    return fig


if __name__ == "__main__":
    main()
