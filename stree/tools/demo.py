"""``stree demo``: the shipped tiny target + drafter pair (trained here on the standard library's
sources by ``stree train-lm`` and ``stree distill``) completes held-out code prompts greedily by
autoregressive, chain and STree decoding under each drafter, at default settings (``tree="auto"``:
each step's tree, or a plain step, chosen from this machine's measured costs); checks every output
equals the autoregressive one and prints tau, tokens/s, the gain and the trees chosen per method.
Every method is warmed up first (numba compiling, measuring the machine's costs): that time is
reported apart, never inside tokens/s. By default 8 prompts of 128 new tokens, as
``benchmarks/speculation.py`` decodes them: ``tree="auto"`` learns from its first probes what the
drafter's trees bring on this text, and in the 4 x 64 tokens the demo once decoded those first
probes decided the rows alone (on the project's 2-core EPYC the n-gram drafter's row ran plain at
0.91x-1.10x in some runs and speculated at 1.39x in others; 8 x 128 gave it 1.10x-1.86x and STAND
deterministic 1.15x-1.55x in six runs, where a run's first probes still weigh). The last row,
autoregressive decoding again, is the noise the others' speedups sit in.

Regenerate the pair (fixed seeds; numbers in each directory's training.json / distill.json)::

    stree train-lm --out build/tiny-target --save-dtype float16
    stree distill --target build/tiny-target --out build/tiny-drafter --save-dtype float16
    python -m stree.tools.demo --install build/tiny-target build/tiny-drafter
    python -m stree.tools.demo --calibrate-stand 32     # STAND's optimised trees for the shipped target
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

from ..drafters.registry import NEEDS_MODEL, make_drafter
from ..decoding.loop import generate, merged_trees, pooled_tau, trees_chosen
from ..checkpoints.io import load
from ..checkpoints.tokenizer import load_tokenizer

ASSETS = Path(__file__).resolve().parents[1] / "assets"
TARGET, DRAFTER = ASSETS / "tiny-target", ASSETS / "tiny-drafter"
SHIPPED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "training.json",
           "distill.json", "draft_vocab.json", "prompts.jsonl")
# (method, drafter), each with tree="auto": chains under method="chain", trees under "stree"; the
# last, autoregressive decoding again, shows the run-to-run noise the other rows' gains sit in (on a
# 2-core CPU rows that ran plain throughout came out at 0.84x-1.24x).
RUNS = (("autoregressive", None), ("chain", "ngram"), ("stree", "ngram"), ("stree", "stand-det"),
        ("stree", "ssm-static"), ("autoregressive", None))


def install(target: Path, drafter: Path) -> None:
    """Copy a trained pair's shipped files into the package."""
    for src, dst in ((target, TARGET), (drafter, DRAFTER)):
        dst.mkdir(parents=True, exist_ok=True)
        for name in SHIPPED:
            if (src / name).exists():
                shutil.copy(src / name, dst / name)


def read_prompts(path: Path, n: int) -> list[str]:
    lines = [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"{path} holds no prompts")
    return lines[:n]


@torch.no_grad()
def run_demo(target_dir=TARGET, drafter_dir=DRAFTER, *, prompts: int = 8, max_new_tokens: int = 128,
             device: str = "cpu", runs=RUNS, out=print) -> list[dict]:
    """Decode the first ``prompts`` held-out prompts with every (method, drafter) of ``runs``, one
    prompt at a time, the runs taking turns on each prompt (the order rotating from prompt to
    prompt); returns one row per run (identical: every output equals autoregressive's)."""
    from .timing import run_info

    target_dir, drafter_dir = Path(target_dir), Path(drafter_dir)
    target = load(target_dir, dtype=torch.float32, device=device)
    tokenizer = load_tokenizer(target_dir, vocab_size=target.vocab_size)
    draft_model = load(drafter_dir, dtype=torch.float32, device=device)
    texts = read_prompts(target_dir / "prompts.jsonl", prompts)
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    kw = dict(max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id)

    def drafter(name):
        """A drafter for one call, as ``LM.generate`` makes a named one (STAND a fresh store: one
        store shared over the demo's unrelated prompts had its deterministic trees draft earlier
        prompts' continuations, accepted next to never, in half the calls)."""
        if name is None:
            return None
        made = make_drafter(name, drafter_model=draft_model if name in NEEDS_MODEL else None,
                            vocab_size=target.vocab_size, tokens=max_new_tokens + 1)
        made.serves_one_call = True
        return made

    t0 = time.perf_counter()
    longest = [max(ids, key=len)]  # (a long prompt's prefill runs the chain scan's heads in parallel: loaded here)
    for method, name in runs:  # compiling and measuring costs, before any timing
        generate(target, longest, method=method, drafter=drafter(name), **dict(kw, max_new_tokens=8))
    for prompt in ids:  # (each prompt's prefill: the first product of a new row count measures the product paths)
        generate(target, [prompt], method="autoregressive", **dict(kw, max_new_tokens=1))
    warmup = time.perf_counter() - t0
    results = [dict(outputs=[], stats=[]) for _ in runs]
    for turn, prompt in enumerate(ids):
        # no run always goes first or always follows the same one (whose weights it finds in the caches)
        for k in range(len(runs)):
            i = (turn + k) % len(runs)
            run = generate(target, [prompt], method=runs[i][0], drafter=drafter(runs[i][1]), **kw)
            res = results[i]
            res["outputs"].append(run.new_tokens[0])
            res["stats"].append(run.stats)
    out(f"{len(ids)} held-out prompts, {max_new_tokens} new tokens each, greedy, {run_info(device)['device']}; "
        f"warm-up {warmup:.1f}s (compiling, measuring this machine's costs), not timed")
    out(f"{'method':<15}{'drafter':<12}{'tau':>6}{'tok/s':>9}{'speedup':>9}  {'identical':<11}trees chosen")
    rows, reference = [], results[0]
    for (method, name), res in zip(runs, results):
        stats = res["stats"]
        tokens, seconds = sum(sum(s.new_tokens) for s in stats), sum(s.time_total for s in stats)
        trees = merged_trees(stats)
        again = (method, name) in runs[: len(rows)]  # (a run repeated: the noise row)
        row = dict(method=method, drafter=name or ("again" if again else "-"), tau=pooled_tau(stats),
                   tokens_per_s=tokens / seconds,
                   identical=res["outputs"] == reference["outputs"], tokens=tokens, trees=trees)
        row["speedup"] = row["tokens_per_s"] / rows[0]["tokens_per_s"] if rows else 1.0
        rows.append(row)
        out(f"{method:<15}{row['drafter']:<12}{row['tau']:>6.2f}{row['tokens_per_s']:>9.1f}{row['speedup']:>9.2f}  "
            f"{'yes' if row['identical'] else 'NO':<11}{trees_chosen(trees)}")
    if any(r["drafter"] == "again" for r in rows):
        out("(autoregressive again: this machine's run-to-run noise, which the other rows' speedups sit in)")
    out(f"\n{tokenizer.decode(ids[0])}" + "\u2588" + tokenizer.decode(reference["outputs"][0]))
    return rows


def calibrate_stand(target_dir=TARGET, prompts: int = 32, *, nodes: int = 80, max_new_tokens: int = 128,
                    temperature: float = 0.6, out_dir=None, progress: bool = True) -> dict:
    """STAND's trees for the target (paper 000, appendix A and Table 5): decode ``prompts``
    training-split code prompts (the standard library's sources, never the held-out modules) over
    the 625-node initial tree, separately for the deterministic drafter (greedy) and the
    stochastic one (at ``temperature``), and keep each one's ``nodes`` most accepted nodes.
    Writes ``{stand,stand-det}.json`` and ``calibration.json`` to ``out_dir`` (default: the
    package's)."""
    from ..drafters.registry import STAND_TREES
    from ..drafters.stand import STANDDrafter, STANDStore
    from ..training.corpus import HELD_OUT, code_prompts, find_sources
    from .optimize_tree import optimize_static_tree

    out_dir = Path(out_dir or STAND_TREES)
    target = load(target_dir, dtype=torch.float32)
    tokenizer = load_tokenizer(target_dir, vocab_size=target.vocab_size)
    texts = code_prompts(find_sources(None, HELD_OUT).train)[:prompts]
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    from .timing import run_info

    shown = "stree/assets/tiny-target" if Path(target_dir).resolve() == TARGET.resolve() else str(target_dir)
    report = dict(**run_info("cpu", ["--calibrate-stand", str(prompts)]), target=shown, prompts=len(ids),
                  nodes=nodes, max_new_tokens=max_new_tokens, trees={})
    report["command"] = f"python -m stree.tools.demo --calibrate-stand {prompts}"
    for name, temp in (("stand-det", 0.0), ("stand", temperature)):
        drafter = STANDDrafter(STANDStore(), stochastic=name == "stand")
        shape, counts = optimize_static_tree(target, ids, drafter, nodes=nodes, temperature=temp,
                                             max_new_tokens=max_new_tokens, progress=progress)
        out_dir.mkdir(parents=True, exist_ok=True)
        shape.save(out_dir / f"{name}.json")
        steps = int(counts[0])
        report["trees"][name] = dict(temperature=temp, verify_steps=steps, nodes=shape.n, depth=shape.max_depth,
                                     initial_tree_tau=float(counts.sum()) / max(steps, 1))
    (out_dir / "calibration.json").write_text(json.dumps(report, indent=2))
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="stree demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(TARGET), help="target checkpoint directory (default: the shipped one)")
    p.add_argument("--drafter-model", default=str(DRAFTER), help="drafter checkpoint directory")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--install", nargs=2, metavar=("TARGET_DIR", "DRAFTER_DIR"),
                   help="copy a trained pair into the package (see the module docstring) and exit")
    p.add_argument("--calibrate-stand", type=int, metavar="PROMPTS",
                   help="optimise STAND's trees for the target on this many training-split prompts and exit")
    args = p.parse_args(argv)
    if args.calibrate_stand:
        report = calibrate_stand(args.model, args.calibrate_stand)
        print(json.dumps(report["trees"], indent=2))
        return 0
    if args.install:
        install(Path(args.install[0]), Path(args.install[1]))
        return 0
    rows = run_demo(args.model, args.drafter_model, prompts=args.prompts, max_new_tokens=args.max_new_tokens,
                    device=args.device)
    if not all(r["identical"] for r in rows):
        print("greedy outputs differ from autoregressive decoding", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
