"""Requests of different temperatures in one engine: the serving engine decodes rows of every
temperature (greedy ones included: drafters of random drafts draft their likeliest tokens for
them), top-k and top-p as one batch (each row with its own values, ``SamplingParams.stack``).
Three ways, on the same engine and weights: "one batch" is the engine as it is; "greedy apart"
sampled rows in one batch and greedy rows in a cohort of their own (the engine before greedy rows
joined, for STAND and the SSM drafter before greedy rows could be drafted beside drawn ones);
"apart" a cohort per set of values (the engine before that), one target pass each per iteration.

``--concurrency`` requests at once (the shipped target, ``--max-tokens`` each, held-out code
prompts), their temperatures cycling through ``--temperatures`` (0: greedy), for each of
``--drafters`` (autoregressive, n-gram, STAND, the SSM drafter; ``tree="auto"``). Every
configuration runs once first (cost profiles measured, calls built), then they take turns for
``--rounds``, the order alternating. Reported: output tokens per second over each load's wall
time, and one batch's gain over apart. Writes JSON and a PNG.

    python benchmarks/mixed_sampling.py
    python benchmarks/mixed_sampling.py --smoke
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

import stree
from stree.serving import Engine
from stree.serving import engine as engine_module
from stree.tools.demo import DRAFTER, TARGET, read_prompts
from stree.tools.timing import run_info, save_result

DRAFTERS = {"autoregressive": None, "n-gram": "ngram", "stand": "stand", "ssm": "ssm"}
SHARED_KEY = engine_module._Settings.cohort
WAYS = ("one batch", "greedy apart", "apart")


def _greedy_apart(settings):
    """The cohort key before greedy rows joined sampled ones: greedy rows by themselves."""
    return settings if settings.params.greedy else SHARED_KEY(settings)


def _apart(settings):
    """The cohort key before sampled rows shared a batch: all of a request's settings."""
    return settings


KEYS = dict(zip(WAYS, (SHARED_KEY, _greedy_apart, _apart)))


def load(lm, prompts, temperatures, drafter, batching: str, max_tokens: int) -> tuple[int, float]:
    """One load through a fresh engine: its output tokens and wall seconds (after a short request
    that builds what the engine's first request builds)."""
    engine_module._Settings.cohort = KEYS[batching]
    try:
        with Engine(lm, max_slots=len(prompts), max_length=512, seed=0) as engine:
            engine.submit(prompts[0], max_tokens=4, temperature=1.0, drafter=drafter).result(timeout=600)
            t0 = time.perf_counter()
            requests = [engine.submit(p, max_tokens=max_tokens, temperature=temperatures[i % len(temperatures)],
                                      drafter=drafter) for i, p in enumerate(prompts)]
            tokens = sum(len(c.token_ids) for r in requests for c in r.result(timeout=600))
            return tokens, time.perf_counter() - t0
    finally:
        engine_module._Settings.cohort = SHARED_KEY


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--temperatures", default="0,0.7,0,1.0")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--drafters", default=",".join(DRAFTERS), help=f"of {', '.join(DRAFTERS)}")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = p.parse_args(argv)
    if args.smoke:
        args.concurrency, args.max_tokens, args.rounds, args.temperatures = 2, 4, 1, "0,1.0"
    temperatures = [float(t) for t in args.temperatures.split(",")]
    names = args.drafters.split(",")
    if not set(names) <= set(DRAFTERS):
        p.error(f"--drafters takes names of {', '.join(DRAFTERS)}, got {args.drafters!r}")
    torch.manual_seed(0)
    lm = stree.LM.from_pretrained(TARGET, dtype="float32", drafter_model=DRAFTER if "ssm" in names else None)
    prompts = read_prompts(TARGET / "prompts.jsonl", args.concurrency)
    configs = [(name, batching) for name in names for batching in WAYS]
    for name, batching in configs if not args.smoke else []:  # (the smoke times nothing it reports)
        load(lm, prompts, temperatures, DRAFTERS[name], batching, min(args.max_tokens, 16))
    totals = {c: [0, 0.0] for c in configs}
    for turn in tqdm(range(args.rounds), desc="rounds", file=sys.stderr):
        for name, batching in configs if turn % 2 == 0 else configs[::-1]:
            tokens, seconds = load(lm, prompts, temperatures, DRAFTERS[name], batching, args.max_tokens)
            totals[(name, batching)][0] += tokens
            totals[(name, batching)][1] += seconds
    rows = []
    for (name, batching), (tokens, seconds) in totals.items():
        rows.append(dict(drafter=name, batching=batching, tokens=tokens, seconds=seconds,
                         tokens_per_s=tokens / seconds))
    for r in rows:
        speed = {a["batching"]: a["tokens_per_s"] for a in rows if a["drafter"] == r["drafter"]}
        r["gain_over_apart"] = r["tokens_per_s"] / speed["apart"]
        r["gain_over_greedy_apart"] = r["tokens_per_s"] / speed["greedy apart"]
        print(f"{r['drafter']:<15}{r['batching']:<13}{r['tokens_per_s']:>8.1f} tok/s  x{r['gain_over_apart']:.2f} "
              f"over apart  x{r['gain_over_greedy_apart']:.2f} over greedy apart", file=sys.stderr)
    result = dict(benchmark="mixed_sampling", **run_info("cpu", argv), threads=torch.get_num_threads(),
                  concurrency=args.concurrency, temperatures=temperatures, max_tokens=args.max_tokens,
                  rounds=args.rounds,
                  note="engine output tokens/s with requests of several temperatures at once: 'one batch' (rows "
                       "of every value, greedy included, in one cohort) against 'greedy apart' (greedy rows in a "
                       "cohort of their own) and 'apart' (a cohort per value); loads interleaved, each "
                       "configuration once before timing",
                  results=rows)
    save_result(result, args.out, "mixed_sampling_smoke" if args.smoke else "mixed_sampling_cpu", plot)
    return result


def plot(result):
    import matplotlib.pyplot as plt

    rows = result["results"]
    fig, ax = plt.subplots(figsize=(6, 3))
    labels = [f"{r['drafter']}, {r['batching']}" for r in rows]
    ax.barh(labels, [r["tokens_per_s"] for r in rows],
            color=[{"one batch": "tab:green", "greedy apart": "tab:olive"}.get(r["batching"], "tab:gray")
                   for r in rows])
    ax.invert_yaxis()
    ax.set(xlabel="output tokens/s", title=f"{result['concurrency']} requests at temperatures "
           f"{', '.join(map(str, result['temperatures']))}, {result['device']}")
    ax.title.set_fontsize(7)
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main()
