"""The engine under load, in process: ``C`` client threads each send ``--requests`` greedy
completions one after another (``--max-tokens`` each, the shipped pair's held-out code prompts)
to a :class:`stree.serving.Engine` of ``C`` slots, autoregressive and with the n-gram drafter
(``tree="auto"``). The same requests also go through ``LM.generate`` in batches of ``C``, what
the engine would reach if every request arrived and ended in lockstep. Prompts admitted in one
iteration are read together (one model call per chunk); ``Engine.GROUP_PREFILLS = False`` reads
them a call each, as the engine did before: both run, so the gain is measured in one process.

Reported per (drafter, concurrency): output tokens per second of the engine reading prompts
together and one by one, of ``LM.generate`` at batch ``C``, and the ratios. The configurations
take turns (``--rounds`` times, the order alternating), so drift hits all alike. JSON + PNG.

    python benchmarks/engine_load.py             # concurrency 1, 4, 16, 32
    python benchmarks/engine_load.py --smoke     # concurrency 1 and 2, two 4-token requests each
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import torch
from tqdm import tqdm

import stree
from stree.serving import Engine
from stree.tools.demo import TARGET, read_prompts
from stree.tools.timing import run_info, save_result

DRAFTERS = {"autoregressive": None, "n-gram": "ngram"}
WAYS = ("engine, prompts together", "engine, a call per prompt", "generate, batch C")


def _engine_load(engine: Engine, prompts: list[str], clients: int, requests: int, max_tokens: int,
                 drafter) -> tuple[int, float]:
    """The output tokens and wall seconds of ``clients`` threads each sending ``requests`` in turn."""
    counts = [0] * clients

    def client(i: int) -> None:
        for j in range(requests):
            prompt = prompts[(i * requests + j) % len(prompts)]
            counts[i] += len(engine.submit(prompt, max_tokens=max_tokens, drafter=drafter).result(timeout=600)[0]
                             .token_ids)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts), time.perf_counter() - t0


def _generate_load(lm, prompts: list[str], clients: int, requests: int, max_tokens: int, drafter) -> tuple[int, float]:
    """The same requests as ``LM.generate`` calls of ``clients`` prompts."""
    asked = [prompts[(i * requests + j) % len(prompts)] for j in range(requests) for i in range(clients)]
    spec = dict(method="autoregressive") if drafter is None else dict(drafter=drafter)
    tokens, t0 = 0, time.perf_counter()
    for start in range(0, len(asked), clients):
        out = lm.generate(asked[start: start + clients], max_new_tokens=max_tokens, **spec)
        tokens += sum(out.stats.new_tokens)
    return tokens, time.perf_counter() - t0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", default="1,4,16,32")
    p.add_argument("--requests", type=int, default=None, help="each client's (default: 32 / C, at least 2)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = p.parse_args(argv)
    if args.smoke:
        args.concurrency, args.requests, args.max_tokens, args.rounds = "1,2", 2, 4, 1
    levels = [int(c) for c in args.concurrency.split(",")]
    lm = stree.LM.from_pretrained(TARGET, dtype=torch.float32)
    prompts = read_prompts(TARGET / "prompts.jsonl", 64)
    rows = []
    grouped = Engine.GROUP_PREFILLS
    try:
        for (name, drafter), clients in tqdm([(d, c) for d in DRAFTERS.items() for c in levels],
                                             desc="drafter x concurrency", file=sys.stderr):
            requests = args.requests or max(2, 32 // clients)
            engine = Engine(lm, max_slots=clients, max_length=1024, seed=0)

            def run(way: str) -> tuple[int, float]:
                if way.startswith("generate"):
                    return _generate_load(lm, prompts, clients, requests, args.max_tokens, drafter)
                Engine.GROUP_PREFILLS = way == WAYS[0]
                try:
                    return _engine_load(engine, prompts, clients, requests, args.max_tokens, drafter)
                finally:
                    Engine.GROUP_PREFILLS = grouped

            with engine:
                for way in WAYS:  # numba, the cost profile of every batch size the loads make: before timing
                    run(way)
                totals = {way: [0, 0.0] for way in WAYS}
                for turn in range(args.rounds):
                    for way in (WAYS if turn % 2 == 0 else WAYS[::-1]):
                        tokens, seconds = run(way)
                        totals[way][0] += tokens
                        totals[way][1] += seconds
            speed = {way: tokens / seconds for way, (tokens, seconds) in totals.items()}
            rows.append(dict(drafter=name, concurrency=clients, requests_per_client=requests, tokens_per_s=speed,
                             together_over_apart=speed[WAYS[0]] / speed[WAYS[1]],
                             engine_over_generate=speed[WAYS[0]] / speed[WAYS[2]]))
            r = rows[-1]
            print(f"{name:<15} c={clients:<3} " + "  ".join(f"{w}: {v:7.1f}" for w, v in speed.items())
                  + f" tok/s  together/apart x{r['together_over_apart']:.2f}"
                  f"  engine/generate x{r['engine_over_generate']:.2f}", file=sys.stderr)
    finally:
        Engine.GROUP_PREFILLS = grouped
    result = dict(benchmark="engine_load", **run_info("cpu", argv), dtype="float32", max_tokens=args.max_tokens,
                  rounds=args.rounds, threads=torch.get_num_threads(),
                  note="output tokens/s of C client threads sending requests in turn to an Engine of C slots (prompts "
                       "admitted together read in one call per chunk, or a call each), and of the same requests as "
                       "LM.generate calls of C prompts; runs alternate per round, after a warm-up of each",
                  results=rows)
    save_result(result, args.out, "engine_load_smoke" if args.smoke else "engine_load_cpu", plot)
    return result


def plot(result):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(DRAFTERS), figsize=(6 * len(DRAFTERS), 4), squeeze=False)
    for ax, name in zip(axes[0], DRAFTERS):
        rows = [r for r in result["results"] if r["drafter"] == name]
        for way, style in zip(WAYS, ("o-", "s--", "x:")):
            ax.plot([r["concurrency"] for r in rows], [r["tokens_per_s"][way] for r in rows], style, label=way)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients (= slots, = generate's batch)")
        ax.set_ylabel("output tokens/s")
        ax.set_title(name)
        ax.legend(fontsize=8)
    fig.suptitle(f"the engine under load, {result['device']}", fontsize=9)
    return fig


if __name__ == "__main__":
    main()
