"""Speculation's gains, the working tree's library against a git revision's, paired over fresh
processes: in each of ``--processes`` rounds, ``benchmarks/speculation.py`` runs once with each
side's ``stree`` (the revision's exported with ``git archive``), the order alternating, after one run of
each side that is not kept (its numba kernels compiled and cached, as the working tree's are). Reported
per configuration (mode, batch, temperature, drafter): both sides' gains over their own
autoregressive decoding in each round, and the mean difference; and both sides' tokens per
second (autoregressive decoding's too), with their ratio: a change to what every step costs moves
both sides of a gain, which the gains alone do not show. Writes JSON and a PNG to
benchmarks/results/.

Why: on the 2-core CPUs one process's gain for the same code moved from 1.13x to 1.75x in one
evening (docs/benchmarks.md, "Forwards after host work"), more than most changes to the library;
rounds of the two sides, back to back, share the machine's phase. Each run measures its own cost
profiles (a fresh cache directory, the built libraries linked into it), so that the rounds sample
their error too. For a change to the tree choice alone, ``choice_ab.py`` pairs the two within one
process (finer).

    python benchmarks/speculation_ab.py --against HEAD --processes 3 -- --modes eager --temperatures 0 --rounds 2
    python benchmarks/speculation_ab.py --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPECULATION = Path(__file__).with_name("speculation.py")
SIDES = ("against", "working")
DEFAULT = ["--modes", "eager", "--temperatures", "0", "--rounds", "2", "--drafters", "ngram,stand,stand-det"]


def _run(side: str, path: str, args: list[str], out: Path, stem: str) -> dict:
    """speculation.py with ``side``'s stree first on the path: its result, after checking that it
    imported that stree. The run's cost profiles are its own (:func:`_own_costs`)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([path, os.environ.get("PYTHONPATH", "")]),
               STREE_CACHE_DIR=str(_own_costs(out.parent / f"cache_{stem}")))
    where = subprocess.run([sys.executable, "-c", "import stree; print(stree.__file__)"], capture_output=True,
                           text=True, env=env, cwd=path)
    if where.returncode or not where.stdout.strip().startswith(path):
        raise RuntimeError(f"the {side} side imports stree from {where.stdout.strip() or where.stderr[-500:]}, "
                           f"not {path}")
    run = subprocess.run([sys.executable, str(SPECULATION), *args, "--out", str(out), "--stem", stem],
                         capture_output=True, text=True, env=env, cwd=path)
    if run.returncode:
        raise RuntimeError(f"speculation.py failed on the {side} side: {run.stderr[-2000:]}")
    return json.loads((out / f"{stem}.json").read_text())


def _own_costs(root: Path) -> Path:
    """A cache directory for one run (``$STREE_CACHE_DIR``): no cost profiles in it, so that the run
    measures its own, and the built libraries' directory linked from the shared cache. A profile is
    kept in a file and read by every later process of the same sources (stree.decoding.cost): shared,
    each side's profiles were measured once, in its first run, and every round read them, so that one
    measurement's error moved all of a side's rounds alike, which pairing cannot cancel (a change to the
    products read +0.034 for n-gram at batch 1 in one such run, -0.106 in all three rounds of the next:
    docs/benchmarks.md, 2026-12-07)."""
    from stree.kernels._common import cache_dir

    shared = cache_dir() / "kernels"
    shared.mkdir(parents=True, exist_ok=True)
    root.mkdir(parents=True)
    (root / "kernels").symlink_to(shared, target_is_directory=True)
    return root


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    own, rest = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, None)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                epilog="arguments after -- go to speculation.py (default: " + " ".join(DEFAULT) + ")")
    p.add_argument("--against", default="HEAD", help="the git revision to compare with (default HEAD)")
    p.add_argument("--processes", type=int, default=3, help="rounds of one run each side (default 3)")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    p.add_argument("--stem", default=None, help="result file name (default: speculation_ab_cpu, or _smoke)")
    args = p.parse_args(own)
    if args.processes < 1:
        p.error(f"--processes must be >= 1, got {args.processes}")
    if any(a in ("--out", "--stem") or a.startswith(("--out=", "--stem=")) for a in rest or ()):
        p.error("--out and --stem after -- are this script's to set")
    rest = ["--smoke"] if args.smoke else (DEFAULT if rest is None else rest)
    processes = 1 if args.smoke else args.processes
    from stree.tools.timing import revision_package, run_info, save_result

    results = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"against": revision_package(ROOT, args.against, Path(tmp) / "against"), "working": str(ROOT)}
        # A run of each side first, not kept: the revision's package is a fresh export, without the numba
        # cache the working tree has built, so its first process compiled, inside timed calls, the kernels
        # of paths speculation.py's own warm-up calls do not reach (a row leaving the batch halfway through a
        # call of 128 tokens): float16, batch 2, n-gram read 0.63x in that round, 1.16x-1.22x in seven others
        for side in SIDES:
            _run(side, paths[side], rest, Path(tmp) / "out", f"{side}_warm")
        for r in range(processes):
            for side in SIDES if r % 2 == 0 else SIDES[::-1]:
                results[side].append(_run(side, paths[side], rest, Path(tmp) / "out", f"{side}_{r}"))
    rows, fields = [], ("mode", "batch", "temperature", "drafter")
    for first in results["working"][0]["results"]:
        key = tuple(first[k] for k in fields)
        runs = {side: [next(x for x in run["results"] if tuple(x[k] for k in fields) == key) for run in results[side]]
                for side in SIDES}
        speed = {side: [x["tokens_per_s"] for x in runs[side]] for side in SIDES}
        row = dict(zip(fields, key), **{f"{side}_tokens_per_s": speed[side] for side in SIDES},
                   speed_ratio=statistics.mean(speed["working"]) / statistics.mean(speed["against"]))
        if first["drafter"] != "autoregressive":
            gains = {side: [x["gain"] for x in runs[side]] for side in SIDES}
            row.update({f"{side}_gains": gains[side] for side in SIDES},
                       difference=statistics.mean(gains["working"]) - statistics.mean(gains["against"]),
                       identical=all(x["identical"] is not False for side in SIDES for run in results[side]
                                     for x in run["results"]))
        rows.append(row)
    import torch

    result = dict(benchmark="speculation_ab", **run_info(torch.device("cpu"), argv), against=args.against,
                  speculation_args=rest, processes=processes,
                  note="*_gains: per round, the configuration's gain over autoregressive decoding in its own "
                       "speculation.py run with that side's stree; difference: working minus against, mean over rounds; "
                       "*_tokens_per_s: per round, that run's tokens per second; speed_ratio: working over against, "
                       "means over rounds (autoregressive decoding's rows have no gains)",
                  results=rows)
    save_result(result, args.out, args.stem or ("speculation_ab_smoke" if args.smoke else "speculation_ab_cpu"), plot)
    for r in rows:
        gains = "" if "difference" not in r else (
            f"gains {args.against} " + " ".join(f"{g:.2f}" for g in r["against_gains"]) + "  working "
            + " ".join(f"{g:.2f}" for g in r["working_gains"]) + f"  difference {r['difference']:+.3f}  ")
        print(f"{r['mode']:<9}b{r['batch']:<3}T{r['temperature']:<4}{r['drafter']:<22}{gains}"
              f"tokens/s working/{args.against} {r['speed_ratio']:.3f}")
    return result


def plot(result):
    from stree.tools.timing import plot_sides

    gained = dict(result, results=[r for r in result["results"] if "difference" in r])
    return plot_sides(gained, "gains", [f"{r['mode']} b{r['batch']}\nT{r['temperature']} {r['drafter']}"
                                        for r in gained["results"]],
                      "gain over autoregressive", "speculation, two libraries in turns", line=1.0)


if __name__ == "__main__":
    main()
