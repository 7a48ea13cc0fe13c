"""End-to-end decoding speed: stree (autoregressive, chain and STree under each drafter) against
transformers' own ``generate`` on the same weights, and, on CUDA when importable, mamba_ssm's
``MambaLMHeadModel.generate(cg=True)``. One process, greedy, batch 1; the configurations take
turns on every prompt (round-robin, the order rotating per prompt and round), so drift hits all
alike; speed is reported as a ratio to transformers. Every output is checked token for token
against transformers'. Also: per-iteration time split (draft / verify / commit / other), target
forwards, tau, and the op counts of one step, tree pass, commit and verify. On the CPU the main
configurations run a second time with ``torch_compile=True`` (target, and the drafter model's
steps): rows named ``...-compiled``.

    python benchmarks/e2e.py                  # shipped pair, 8 held-out prompts x 128 tokens
    python benchmarks/e2e.py --smoke          # 2 prompts x 12 tokens (CI)
    python benchmarks/e2e.py --configs A,B    # some configurations only: results/e2e_<device>_selected
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from stree.tools.demo import DRAFTER, TARGET, read_prompts
from stree.drafters.registry import NEEDS_MODEL, make_drafter, stand_tree
from stree.decoding.loop import generate, merged_trees, pooled_tau
from stree.models import load, load_tokenizer, save
from stree.runtime import CompiledModel
from stree.tools.opcount import count_ops
from stree.tools.timing import add_device_args, device_and_dtype, run_info, save_result
from stree.tree import TokenTree, TreeShape, tree_spec
from stree.sampling.verify import verify

# (name, method, drafter, tree): "auto" is the default (each step's tree, or a plain step, chosen from
# this machine's costs); the others fix the tree: chain drafts a 4-token chain, STree the drafter's
# known tree (STAND's calibrated one, else paper13) unless one is named (dynamic: grown per step).
CONFIGS = (("stree-autoregressive", "autoregressive", None, None), ("chain-ngram", "chain", "ngram", None),
           ("chain-ssm-static", "chain", "ssm-static", None), ("stree-ngram", "stree", "ngram", None),
           ("stree-ngram-auto", "stree", "ngram", "auto"),
           ("stree-stand-det", "stree", "stand-det", None), ("stree-stand-det-auto", "stree", "stand-det", "auto"),
           ("stree-stand-det-dynamic", "stree", "stand-det", "dynamic:81"),
           ("stree-ssm-static", "stree", "ssm-static", None), ("stree-ssm-static-auto", "stree", "ssm-static", "auto"),
           ("stree-ssm-static-dynamic", "stree", "ssm-static", "dynamic:20x5w3"),
           ("stree-ssm-beam", "stree", "ssm-beam", None))
# On the CPU, these also run with torch_compile=True (target and drafter model): "...-compiled".
# (Dynamic trees change shape every step: their tree pass runs eager, the drafter model compiled.)
COMPILED = ("stree-autoregressive", "stree-ngram", "stree-ngram-auto", "stree-stand-det", "stree-stand-det-auto",
            "stree-ssm-static", "stree-ssm-static-auto", "stree-ssm-static-dynamic", "stree-ssm-beam")


def fixed_tree(method: str, drafter: str | None, spec: str | None):
    """The tree a configuration drafts: its spec ("auto": chosen per step), else a 4-token chain for
    chains, STAND's calibrated tree, paper13 (ssm-beam: its own)."""
    if spec is not None:
        return spec if spec == "auto" else tree_spec(spec)
    if method == "chain":
        return TreeShape.chain(4)
    if drafter is None or drafter == "ssm-beam":
        return None
    return stand_tree(drafter) if drafter.startswith("stand") else TreeShape.paper13()


def hf_twin(model, device):
    """transformers' Mamba2ForCausalLM with ``model``'s weights (saved and loaded in its format)."""
    from transformers import Mamba2ForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        save(model, tmp, format="hf")
        return Mamba2ForCausalLM.from_pretrained(tmp, local_files_only=True, dtype=model.dtype).to(device).eval()


def mamba_ssm_twin(model, device):
    """mamba_ssm's MambaLMHeadModel with the same weights, or None where it cannot be imported."""
    if device.type != "cuda":
        return None
    try:
        from mamba_ssm.models.config_mamba import MambaConfig
        from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel
    except ImportError:
        return None
    cfg = model.cfg
    ssm = dict(layer="Mamba2", d_state=cfg.d_state, d_conv=cfg.d_conv, expand=cfg.expand, headdim=cfg.headdim,
               ngroups=cfg.ngroups, chunk_size=cfg.chunk_size)
    twin = MambaLMHeadModel(MambaConfig(d_model=cfg.d_model, n_layer=cfg.n_layer, vocab_size=cfg.vocab_size,
                                        ssm_cfg=ssm, pad_vocab_size_multiple=cfg.pad_vocab_size_multiple,
                                        tie_embeddings=cfg.tie_embeddings), device=device, dtype=model.dtype)
    twin.load_state_dict(model.state_dict(), strict=False)
    return twin.eval()


def op_counts(model) -> dict:
    """Ops of one step, one paper13 tree pass, its commit and its verification (batch 1)."""
    cache = model.allocate_cache(1, 256)
    model.prefill(torch.arange(1, 33, device=model.device)[None], cache)
    tok = torch.tensor([5], device=model.device)
    shape = TreeShape.paper13()
    tree = TokenTree.from_shape(shape, torch.randint(0, model.vocab_size, (1, shape.n)).to(model.device))
    logits, _ = model.forward_tree(tree, cache)
    path, num = torch.tensor([[0, 1, 4]], device=model.device), torch.tensor([3], device=model.device)
    counts = dict(step=count_ops(lambda: model.step(tok, cache)), forward_tree=count_ops(lambda: model.forward_tree(tree, cache)),
                  commit=count_ops(lambda tree_pass: model.commit(cache, tree_pass, path, num, validate=False),
                                   setup=lambda: model.forward_tree(tree, cache)[1:]),
                  verify=count_ops(lambda: verify(tree, logits)))
    return {k: dict(total=v.total, compute=v.compute, triton_launches=v.triton_launches) for k, v in counts.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(TARGET))
    p.add_argument("--drafter-model", default=str(DRAFTER))
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2, help="times every (prompt, configuration) runs")
    p.add_argument("--configs", default=None, help="comma-separated configuration names to run (default: all; "
                   "transformers' generate always runs, as the reference)")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    add_device_args(p)
    args = p.parse_args(argv)
    if args.smoke:
        args.prompts, args.max_new_tokens, args.rounds = 2, 12, 1
    device, dtype = device_and_dtype(args)
    target = load(args.model, dtype=dtype, device=device)
    draft_model = load(args.drafter_model, dtype=dtype, device=device)
    tokenizer = load_tokenizer(args.model, vocab_size=target.vocab_size)
    prompts = [tokenizer.encode(t, add_special_tokens=False)
               for t in read_prompts(Path(args.model) / "prompts.jsonl", args.prompts)]
    hf = hf_twin(target, device)
    ms = mamba_ssm_twin(target, device)
    N = args.max_new_tokens
    sync = (lambda: torch.cuda.synchronize()) if device.type == "cuda" else (lambda: None)

    def run_hf(model, prompt):
        ids = torch.tensor([prompt], device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, min_new_tokens=N,
                             do_sample=False, pad_token_id=0)
        return out[0, len(prompt):].tolist(), None

    def run_mamba_ssm(prompt):
        ids = torch.tensor([prompt], device=device)
        out = ms.generate(ids, max_length=len(prompt) + N, cg=True, top_k=1)
        return out[0, len(prompt):].tolist(), None

    compiled_drafter = CompiledModel(draft_model) if device.type == "cpu" else None

    def run_stree(method, drafter_name, spec=None, compiled=False):
        def run(prompt):
            model_kw = dict(drafter_model=compiled_drafter if compiled else draft_model)
            # a drafter for the call, as LM.generate makes one (a STAND store sized to the call's tokens)
            drafter = None if drafter_name is None else make_drafter(
                drafter_name, **(model_kw if drafter_name in NEEDS_MODEL else {}), vocab_size=target.vocab_size,
                tokens=N + 1)
            tree = fixed_tree(method, drafter_name, spec)
            res = generate(target, [prompt], method=method, drafter=drafter, tree=tree, max_new_tokens=N,
                           torch_compile=compiled)
            return res.new_tokens[0], res.stats
        return run

    runners = {"transformers": lambda prompt: run_hf(hf, prompt)}
    if ms is not None:
        runners["mamba_ssm-cg"] = run_mamba_ssm
    chosen = None if args.configs is None else args.configs.split(",")
    known = [c[0] for c in CONFIGS] + [f"{c}-compiled" for c in COMPILED]
    if chosen is not None and not set(chosen) <= set(known):
        p.error(f"--configs: unknown {sorted(set(chosen) - set(known))}; choose from {known}")
    runners.update({name: run_stree(method, d, spec) for name, method, d, spec in CONFIGS
                    if chosen is None or name in chosen})
    if device.type == "cpu":  # the smoke run compiles one configuration (compiling takes seconds per shape)
        compiled = ("stree-ngram",) if args.smoke else COMPILED
        runners.update({f"{name}-compiled": run_stree(method, d, spec, compiled=True)
                        for name, method, d, spec in CONFIGS
                        if name in compiled and (chosen is None or f"{name}-compiled" in chosen)})
    names = list(runners)
    for name in tqdm(names, desc="warm-up", file=sys.stderr):  # first calls allocate, compile, fill caches
        runners[name](prompts[0][:8])
    # Every prompt once through one of stree's configurations: a prompt's prefill multiplies as many rows as it has
    # tokens, and the first product of each new row count measures the product paths (stree.models.layers.linear),
    # which had landed in the timed call of whichever configuration met that prompt first (the smoke run's
    # autoregressive decoding, first to meet both prompts, took 199 tokens/s against 271 after this warm-up, and
    # configurations that took no tree had gained 2x over it).
    first = next((name for name in names if name not in ("transformers", "mamba_ssm-cg")), None)
    for prompt in prompts if first is not None else ():
        runners[first](prompt)
    seconds = {name: 0.0 for name in names}
    outputs = {name: [] for name in names}
    stats = {name: [] for name in names}
    turns = [(r, i) for r in range(args.rounds) for i in range(len(prompts))]
    for turn, (r, i) in enumerate(tqdm(turns, desc="rounds x prompts", file=sys.stderr)):
        order = names[turn % len(names):] + names[: turn % len(names)]
        for name in order:
            sync()
            t0 = time.perf_counter()
            tokens, st = runners[name](prompts[i])
            sync()
            seconds[name] += time.perf_counter() - t0
            if r == 0:
                outputs[name].append(tokens)
                if st is not None:
                    stats[name].append(st)
    base = seconds["transformers"]
    ar_iters = {name: sum(len(a) for s in stats[name] for a in s.accepted) * args.rounds for name in names
                if name.startswith("stree-autoregressive")}
    rows = []
    for name in names:
        # stree's own autoregressive decoding in the same mode: the gain speculation buys
        own = "stree-autoregressive-compiled" if name.endswith("-compiled") else "stree-autoregressive"
        st = stats[name]
        iters = sum(len(a) for s in st for a in s.accepted)
        split = {k: sum(getattr(s, f"time_{k}") for s in st) / iters * 1e3 if iters else None
                 for k in ("draft", "verify", "commit", "other")}
        rows.append(dict(
            name=name, seconds=seconds[name], tokens=args.rounds * len(prompts) * N,
            tokens_per_s=args.rounds * len(prompts) * N / seconds[name], speedup_vs_transformers=base / seconds[name],
            identical_to_transformers=outputs[name] == outputs["transformers"],
            gain_over_autoregressive=seconds[own] / seconds[name] if own in seconds and st else None,
            iteration_in_steps=(seconds[name] / iters) / (seconds[own] / ar_iters[own]) if own in seconds and st else None,
            trees=merged_trees(st) if st else None,
            tau=pooled_tau(st) if st else None, target_forwards=sum(s.target_forwards for s in st) if st else None,
            ms_per_iteration=split))
    result = dict(benchmark="e2e", **run_info(device, argv), dtype=str(dtype).replace("torch.", ""), batch=1,
                  greedy=True, prompts=len(prompts), max_new_tokens=N, rounds=args.rounds,
                  target=str(args.model), drafter_model=str(args.drafter_model),
                  note="speedup_vs_transformers: transformers' total seconds over this configuration's, same "
                       "prompts and rounds, runs interleaved; gain_over_autoregressive: the same against stree's own "
                       "autoregressive decoding in the same mode (eager or compiled); iteration_in_steps: seconds per "
                       "decoding step over the autoregressive one's; trees: steps per tree size (1: a plain step); "
                       "ms_per_iteration from GenerationStats (first round)",
                  op_counts=op_counts(target), results=rows)
    name = f"e2e_{'smoke' if args.smoke else device.type}{'' if chosen is None else '_selected'}"
    save_result(result, args.out, name, plot)
    for r in rows:
        tau = f"{r['tau']:.2f}" if r["tau"] is not None else "  - "
        gain = f"{r['gain_over_autoregressive']:.2f}" if r["gain_over_autoregressive"] is not None else "  - "
        print(f"{r['name']:<32}{r['tokens_per_s']:>9.1f} tok/s  x{r['speedup_vs_transformers']:.2f}  over own AR {gain}  "
              f"tau {tau}  identical {'yes' if r['identical_to_transformers'] else 'NO'}")
    print("ops:", {k: v["total"] for k, v in result["op_counts"].items()})
    return result


def plot(result):
    import matplotlib.pyplot as plt

    rows = result["results"]
    fig, ax = plt.subplots(figsize=(8, 4))
    colors = ["tab:gray" if not r["name"].startswith(("stree", "chain")) else "tab:blue" for r in rows]
    ax.barh([r["name"] for r in rows], [r["speedup_vs_transformers"] for r in rows], color=colors)
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set(xlabel="tokens/s relative to transformers' generate",
           title=f"{result['device']}, {result['prompts']} prompts x {result['max_new_tokens']} tokens, greedy")
    return fig


if __name__ == "__main__":
    main()
