"""The ``stree`` command line."""

from __future__ import annotations

import argparse
import sys

import torch

from .drafters import ConsensusDrafter, NGramDrafter, STANDDrafter, STANDStore
from .generate import METHODS, generate
from .tree import TreeShape

DRAFTERS = {"ngram": lambda: NGramDrafter(), "stand": lambda: STANDDrafter(STANDStore()),
            "consensus": lambda: ConsensusDrafter(include_self=True)}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="decode a prompt with speculative tree decoding")
    p.add_argument("--model", required=True, help="local checkpoint directory (mamba_ssm, HF Mamba2 or MambaInLlama)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--method", choices=METHODS, default="stree")
    p.add_argument("--drafter", choices=sorted(DRAFTERS), default="ngram",
                   help="consensus drafts from its own earlier text here (one prompt, no other trajectories)")
    p.add_argument("--tree", default=None, help="paper13 | chain:D | full:WxD | PATH.json (default: paper13; chain:4 for --method chain)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: the checkpoint's")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--compare", action="store_true", help="also decode autoregressively; print the speedup and "
                                                             "whether greedy outputs are identical")


def _optimize_parser(sub) -> None:
    p = sub.add_parser("optimize-tree", help="calibrate a static STAND tree on prompts (STAND appendix A)")
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True, help="a text file, one prompt per line (.jsonl: a 'prompt' field per line)")
    p.add_argument("--out", required=True, help="where to write the tree JSON (for --tree PATH.json)")
    p.add_argument("--nodes", type=int, default=80, help="draft nodes kept besides the root")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    p.add_argument("--device", default=None)


def _load(args):
    from .models import load, load_tokenizer

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = load(args.model, dtype=DTYPES.get(args.dtype), device=device)
    return model, load_tokenizer(args.model, vocab_size=model.vocab_size)


def _read_prompts(path: str) -> list[str]:
    import json
    from pathlib import Path

    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    prompts = [json.loads(line)["prompt"] for line in lines] if path.endswith(".jsonl") else lines
    if not prompts:
        raise ValueError(f"--prompts {path} holds no prompts")
    return prompts


def _run_optimize(args) -> int:
    from .tree_optimize import optimize_static_tree

    model, tokenizer = _load(args)
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in _read_prompts(args.prompts)]
    if any(not p for p in prompts):
        raise ValueError(f"--prompts {args.prompts}: a prompt encodes to no tokens")
    shape, counts = optimize_static_tree(model, prompts, STANDDrafter(STANDStore()), nodes=args.nodes,
                                         temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                                         seed=args.seed, progress=True)
    shape.save(args.out)
    steps = int(counts[0])
    print(f"{len(prompts)} prompts, {steps} verify steps, tau {float(counts.sum()) / max(steps, 1):.2f} on the initial "
          f"tree; kept {shape.n - 1} nodes (depth {shape.max_depth}) -> {args.out}")
    return 0


def _run_generate(args) -> int:
    model, tokenizer = _load(args)
    ids = tokenizer.encode(args.prompt, add_special_tokens=False)
    if not ids:
        raise ValueError(f"--prompt {args.prompt!r} encodes to no tokens")
    tree = TreeShape.from_spec(args.tree) if args.tree else None
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
              eos_token_id=tokenizer.eos_token_id, seed=args.seed)
    out = generate(model, [ids], drafter=DRAFTERS[args.drafter](), tree=tree, method=args.method, **kw)
    print(tokenizer.decode(out.sequences[0]))
    print(f"[{args.method}] {out.stats.summary()}")
    if args.compare:
        ref = generate(model, [ids], method="autoregressive", **kw)
        print(f"[autoregressive] {ref.stats.summary()}")
        speedup = out.stats.tokens_per_s / ref.stats.tokens_per_s
        same = "yes" if out.sequences == ref.sequences else "NO"
        identical = same if args.temperature == 0 else f"n/a at temperature {args.temperature} (same tokens: {same})"
        print(f"speedup x{speedup:.2f} | greedy outputs identical: {identical}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stree", description="speculative tree decoding for Mamba2 and hybrids")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _optimize_parser(sub)
    args = parser.parse_args(argv)
    try:
        return _run_generate(args) if args.command == "generate" else _run_optimize(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"stree {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
