"""The tree choice of the working tree (``stree/decoding/autotree.py``) against another revision's,
paired: in each of ``--processes`` fresh processes, the revision's choice, the working tree's and
autoregressive decoding take turns on every batch of the held-out prompts (``LM.generate`` at
default settings; each choice with its own learned state, the model, its product paths and the
drafters' stores shared), and each choice gets its gain over autoregressive decoding. Reported per
configuration: both gains in each process and their paired difference (mean, least, most).

Why paired: between fresh processes the same configuration's gain moves by several percent on the
2-core CPUs (the product paths each process measures, the choice's path through its first calls),
more than most changes of the choice; the paired difference moves by about one (docs/benchmarks.md,
2026-11-30, night). Only the choice differs between the two: the rest of the library is the
working tree's, so the revision's choice must speak the working tree's interfaces (a change to
``acceptance`` or ``plans`` calls for a copy of the working choice with the change undone).

    python benchmarks/choice_ab.py --against HEAD --configs "eager 2 0 ngram,eager 1 0 stand" --processes 5
    python benchmarks/choice_ab.py --against HEAD --configs "compiled 2 0 stand" --stale 4
    python benchmarks/choice_ab.py --smoke

``--stale F``: every worker starts from a cost cache file whose times are F times what a setup
process measured for its configuration (a profile measured while other work took the cores, which
the file then keeps): what each choice makes of a profile that is off.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHOICE = "stree/decoding/autotree.py"
NAMES = ("autoregressive", "against", "working")


def parse_config(text: str) -> dict:
    """``"mode batch temperature drafter"`` (e.g. ``"eager 2 0 ngram"``) as a dict, checked."""
    parts = text.split()
    if len(parts) != 4 or parts[0] not in ("eager", "compiled"):
        raise ValueError(f"a config is 'mode batch temperature drafter' with mode eager or compiled, got {text!r}")
    try:
        batch, temperature = int(parts[1]), float(parts[2])
    except ValueError:
        raise ValueError(f"a config's batch must be an int and its temperature a number, got {text!r}") from None
    if batch < 1 or temperature < 0:
        raise ValueError(f"a config's batch must be >= 1 and its temperature >= 0, got {text!r}")
    return dict(mode=parts[0], batch=batch, temperature=temperature, drafter=parts[3])


def revision_source(revision: str) -> str:
    """The choice's source at ``revision`` (git), or a clear error."""
    run = subprocess.run(["git", "-C", str(ROOT), "show", f"{revision}:{CHOICE}"], capture_output=True, text=True)
    if run.returncode:
        raise ValueError(f"--against {revision!r}: git cannot show {CHOICE} there ({run.stderr.strip()[:200]})")
    return run.stdout


def load_pair(config: dict, dtype: str):
    """The shipped pair as a worker decodes with it (the drafter model compiled in compiled mode)."""
    import torch

    import stree
    from stree.models import load
    from stree.runtime import CompiledModel
    from stree.tools.demo import DRAFTER, TARGET

    torch.set_grad_enabled(False)
    small = load(DRAFTER, dtype=getattr(torch, dtype))
    return stree.LM.from_pretrained(TARGET, dtype=getattr(torch, dtype),
                                    drafter_model=CompiledModel(small) if config["mode"] == "compiled" else small)


def measure_costs(config: dict, dtype: str) -> None:
    """Measure ``config``'s cost profile into this process's cost cache (``$STREE_CACHE_DIR``): one short call."""
    from stree.tools.demo import TARGET, read_prompts

    texts = read_prompts(TARGET / "prompts.jsonl", config["batch"])
    load_pair(config, dtype).generate(texts[: config["batch"]], max_new_tokens=8, drafter=config["drafter"],
                                      temperature=config["temperature"], torch_compile=config["mode"] == "compiled")


def stale_file(measured: Path, factor: float, out: Path) -> None:
    """``measured`` (a cost cache file) with every time in its profiles ``factor`` times over, written to ``out``."""
    data = json.loads(measured.read_text())
    for entry in data["entries"].values():
        value = entry["value"]
        for key in ("step_ms", "catch_ms"):
            value[key] *= factor
        for key in ("tree_ms", "draft_ms"):
            value[key] = [factor * t for t in value[key]]
    out.write_text(json.dumps(data))


def worker(choice_file: str, config: dict, rounds: int, prompts: int, tokens: int, dtype: str) -> dict:
    """One process's paired run of ``config``: each name's seconds over the timed turns, the gains,
    and the steps by tree size of each choice."""
    import stree.decoding.loop as loop
    from stree.tools.demo import TARGET, read_prompts

    spec = importlib.util.spec_from_file_location("stree.decoding._autotree_against", choice_file)
    against = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = against
    spec.loader.exec_module(against)
    import stree.decoding.autotree as working

    if not hasattr(loop, "auto_tree"):
        raise RuntimeError("stree.decoding.loop no longer makes its choice through auto_tree: update this benchmark")
    choices = dict(against=against.auto_tree, working=working.auto_tree)
    compiled = config["mode"] == "compiled"
    lm = load_pair(config, dtype)
    texts = read_prompts(TARGET / "prompts.jsonl", max(prompts, config["batch"]))
    batch, temperature = config["batch"], config["temperature"]
    kw = dict(max_new_tokens=tokens, temperature=temperature, torch_compile=compiled)
    trees = {name: {} for name in NAMES[1:]}

    def run(name, start, count=True):
        rows = texts[start: start + batch]
        if name == "autoregressive":
            how = dict(method="autoregressive")
        else:
            loop.auto_tree = choices[name]
            how = dict(drafter=config["drafter"])
        t0 = time.perf_counter()
        out = lm.generate(rows, seed=start if temperature > 0 else None, **how, **kw)
        seconds = time.perf_counter() - t0
        if count and name != "autoregressive":
            for n, k in out.stats.trees.items():
                trees[name][n] = trees[name].get(n, 0) + k
        return seconds

    starts = range(0, len(texts) - batch + 1, batch)
    for name in NAMES:  # compiling, measuring the machine's costs, each prompt length's first prefill
        for start in starts:
            run(name, start, count=False)
    seconds = dict.fromkeys(NAMES, 0.0)
    for turn in range(rounds * len(starts)):
        k = turn % len(NAMES)
        order = NAMES[k:] + NAMES[:k]
        for name in order if turn // len(NAMES) % 2 == 0 else order[::-1]:
            seconds[name] += run(name, starts[turn % len(starts)])
    gains = {name: seconds["autoregressive"] / seconds[name] for name in NAMES[1:]}
    return dict(seconds=seconds, gains=gains, trees={name: dict(sorted(t.items())) for name, t in trees.items()})


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--against", default="HEAD", help="the git revision whose choice the working tree's is paired with")
    p.add_argument("--configs", default="eager 1 0 ngram,eager 2 0 ngram",
                   help="comma-separated 'mode batch temperature drafter' (mode: eager or compiled)")
    p.add_argument("--processes", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3, help="times each choice decodes every batch of prompts a process")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    p.add_argument("--stale", type=float, default=None, metavar="F",
                   help="start every worker from a cost cache with F times the measured times (see above)")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    p.add_argument("--stem", default=None, help="result file name (default: choice_ab, or choice_ab_smoke)")
    p.add_argument("--worker", nargs=2, metavar=("CHOICE_FILE", "CONFIG"), help=argparse.SUPPRESS)
    p.add_argument("--measure", metavar="CONFIG", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.measure:
        measure_costs(parse_config(args.measure), args.dtype)
        return 0
    if args.worker:
        print(json.dumps(worker(args.worker[0], parse_config(args.worker[1]), args.rounds, args.prompts,
                                args.max_new_tokens, args.dtype)))
        return 0
    if args.smoke:
        args.configs, args.processes, args.rounds, args.prompts, args.max_new_tokens = "eager 1 0 ngram", 1, 1, 2, 8
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    for c in configs:
        parse_config(c)
    if args.processes < 1 or args.rounds < 1:
        raise ValueError(f"--processes and --rounds must be >= 1, got {args.processes} and {args.rounds}")
    if args.stale is not None and not args.stale > 0:
        raise ValueError(f"--stale must be > 0, got {args.stale}")
    from tqdm import tqdm

    from stree.tools.timing import run_info, save_result

    source = revision_source(args.against)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        choice_file = Path(tmp) / "autotree_against.py"
        choice_file.write_text(source)
        for k, config in enumerate(tqdm(configs, desc="configs", file=sys.stderr)):
            runs = []
            stale = Path(tmp) / f"stale{k}.json"
            if args.stale is not None:
                _run([sys.executable, __file__, "--measure", config, "--dtype", args.dtype], config,
                     cache=Path(tmp) / f"measured{k}")
                stale_file(Path(tmp) / f"measured{k}" / "costs.json", args.stale, stale)
            for i in range(args.processes):
                cmd = [sys.executable, __file__, "--worker", str(choice_file), config, "--rounds", str(args.rounds),
                       "--prompts", str(args.prompts), "--max-new-tokens", str(args.max_new_tokens),
                       "--dtype", args.dtype]
                cache = None
                if args.stale is not None:  # (each worker from its own copy: a choice may drop what it finds off)
                    cache = Path(tmp) / f"cache{k}-{i}"
                    cache.mkdir()
                    (cache / "costs.json").write_text(stale.read_text())
                done = _run(cmd, config, cache)
                runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
                if cache is not None:  # (the stale profiles still in the file: the working choice may drop them)
                    runs[-1]["profiles_left"] = len(json.loads((cache / "costs.json").read_text())["entries"])
            diff = [r["gains"]["working"] - r["gains"]["against"] for r in runs]
            rows.append(dict(config=config, **parse_config(config), processes=runs,
                             against=statistics.mean(r["gains"]["against"] for r in runs),
                             working=statistics.mean(r["gains"]["working"] for r in runs),
                             difference=dict(mean=statistics.mean(diff), least=min(diff), most=max(diff))))
            print(f"{config:28s} against {rows[-1]['against']:.3f}  working {rows[-1]['working']:.3f}  paired "
                  f"difference {rows[-1]['difference']['mean']:+.3f} ({min(diff):+.3f} to {max(diff):+.3f}), "
                  f"{len(runs)} processes", flush=True)
    result = dict(run_info("cpu", argv), against=args.against, rounds=args.rounds, prompts=args.prompts,
                  stale=args.stale,
                  max_new_tokens=args.max_new_tokens, dtype=args.dtype, results=rows,
                  note="gains over autoregressive decoding in the same process; difference: working minus against, "
                       "per process")
    save_result(result, args.out, args.stem or ("choice_ab_smoke" if args.smoke else "choice_ab"), plot)
    return result


def _run(cmd: list, config: str, cache: Path | None = None):
    """``cmd`` run to its end (with ``cache`` as its cost cache directory, if given), or a clear error."""
    env = None if cache is None else dict(os.environ, STREE_CACHE_DIR=str(cache))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"the worker for {config!r} failed:\n{done.stderr[-3000:]}")
    return done


def plot(result: dict):
    import matplotlib.pyplot as plt

    rows = result["results"]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(rows) + 2), 3.5))
    means = [100 * r["difference"]["mean"] for r in rows]
    low = [m - 100 * r["difference"]["least"] for m, r in zip(means, rows)]
    high = [100 * r["difference"]["most"] - m for m, r in zip(means, rows)]
    ax.bar(range(len(rows)), means, yerr=[low, high], capsize=4, color="tab:blue")
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(rows)), [r["config"] for r in rows], rotation=20, ha="right", fontsize=8)
    ax.set(ylabel="working minus against, % of plain pace", title=f"choice against {result['against']}, paired")
    return fig


if __name__ == "__main__":
    main()
