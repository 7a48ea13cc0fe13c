"""``stree demo``: the shipped tiny target + drafter pair (trained here on the standard library's
sources by ``stree train-lm`` and ``stree distill``) completes held-out code prompts greedily by
autoregressive, chain and STree decoding under each drafter; checks every output equals the
autoregressive one and prints tau and tokens/s per method.

Regenerate the pair (fixed seeds; numbers in each directory's training.json / distill.json)::

    stree train-lm --out build/tiny-target --save-dtype float16
    stree distill --target build/tiny-target --out build/tiny-drafter --save-dtype float16
    python -m stree.demo --install build/tiny-target build/tiny-drafter
    python -m stree.demo --calibrate-stand 32     # STAND's optimised trees for the shipped target
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

from .drafters.registry import NEEDS_MODEL, make_drafter
from .generate import generate, pooled_tau
from .models import load, load_tokenizer
from .tree import TreeShape

ASSETS = Path(__file__).parent / "assets"
TARGET, DRAFTER = ASSETS / "tiny-target", ASSETS / "tiny-drafter"
SHIPPED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "training.json",
           "distill.json", "prompts.jsonl")
# (method, drafter): chain decoding drafts a 4-token chain, STree the drafter's own tree
# (STAND's optimised tree, stree/assets/stand-trees; n-gram and SSM static the paper's 13 nodes;
# beam 3 x 4).
RUNS = (("autoregressive", None), ("chain", "ngram"), ("chain", "stand-det"), ("chain", "ssm-static"),
        ("stree", "ngram"), ("stree", "stand-det"), ("stree", "ssm-static"), ("stree", "ssm-beam"))


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
def run_demo(target_dir=TARGET, drafter_dir=DRAFTER, *, prompts: int = 4, max_new_tokens: int = 64,
             device: str = "cpu", runs=RUNS, out=print) -> list[dict]:
    """Decode the first ``prompts`` held-out prompts with every (method, drafter) of ``runs``, one
    prompt at a time; returns one row per run (identical: every output equals autoregressive's)."""
    target_dir, drafter_dir = Path(target_dir), Path(drafter_dir)
    target = load(target_dir, dtype=torch.float32, device=device)
    tokenizer = load_tokenizer(target_dir, vocab_size=target.vocab_size)
    draft_model = load(drafter_dir, dtype=torch.float32, device=device)
    texts = read_prompts(target_dir / "prompts.jsonl", prompts)
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    kw = dict(max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id)
    generate(target, ids[:1], method="autoregressive", max_new_tokens=2)  # warm-up (allocations, first calls)
    rows, reference = [], None
    out(f"{len(ids)} held-out prompts, {max_new_tokens} new tokens each, greedy, {device}")
    out(f"{'method':<15}{'drafter':<12}{'tau':>6}{'tok/s':>9}{'speedup':>9}  identical")
    for method, name in runs:
        drafter = None if name is None else make_drafter(
            name, drafter_model=draft_model if name in NEEDS_MODEL else None, vocab_size=target.vocab_size)
        tree = TreeShape.chain(4) if method == "chain" else None
        outputs, stats, tokens, seconds = [], [], 0, 0.0
        for prompt in ids:
            res = generate(target, [prompt], method=method, drafter=drafter, tree=tree, **kw)
            outputs.append(res.new_tokens[0])
            stats.append(res.stats)
            tokens += res.stats.new_tokens[0]
            seconds += res.stats.time_total
        if reference is None:
            reference = dict(outputs=outputs, tok_s=tokens / seconds)
        row = dict(method=method, drafter=name or "-", tau=pooled_tau(stats),
                   tokens_per_s=tokens / seconds, identical=outputs == reference["outputs"], tokens=tokens)
        row["speedup"] = row["tokens_per_s"] / reference["tok_s"]
        rows.append(row)
        out(f"{method:<15}{row['drafter']:<12}{row['tau']:>6.2f}{row['tokens_per_s']:>9.1f}{row['speedup']:>9.2f}  "
            f"{'yes' if row['identical'] else 'NO'}")
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
    from .drafters.registry import STAND_TREES
    from .drafters.stand import STANDDrafter, STANDStore
    from .training.corpus import HELD_OUT, code_prompts, find_sources
    from .tree_optimize import optimize_static_tree

    out_dir = Path(out_dir or STAND_TREES)
    target = load(target_dir, dtype=torch.float32)
    tokenizer = load_tokenizer(target_dir, vocab_size=target.vocab_size)
    texts = code_prompts(find_sources(None, HELD_OUT).train)[:prompts]
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    from .timing import run_info

    shown = "stree/assets/tiny-target" if Path(target_dir).resolve() == TARGET.resolve() else str(target_dir)
    report = dict(**run_info("cpu", ["--calibrate-stand", str(prompts)]), target=shown, prompts=len(ids),
                  nodes=nodes, max_new_tokens=max_new_tokens, trees={})
    report["command"] = f"python -m stree.demo --calibrate-stand {prompts}"
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
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
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
