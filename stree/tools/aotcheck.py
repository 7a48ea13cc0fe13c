"""``python -m stree.tools.aotcheck``: every Triton launch of the decoding calls, compiled for sm_80 and
sm_90 on this machine (no GPU needed), with registers, spills, shared memory and cubin size.

The calls run on models of the real widths (one layer of each kind: every layer of a kind
launches the same kernels) with the kernels' launches captured instead of run, so the table
covers whatever the models launch, fused kernels included. Exits 1 when a launch does not
compile, spills, or needs more shared memory than the target has, or when a kernel defined in
:mod:`stree.kernels` was never launched by any case.

    python -m stree.tools.aotcheck                      # the full table: real sizes, fp16 + bf16, all trees
    python -m stree.tools.aotcheck --ci                 # the few shapes the test suite compiles
    python -m stree.tools.aotcheck --json out.json      # also write the table
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import sys
import types
import warnings
from dataclasses import dataclass

import torch
import triton

from ..drafters.calibrate import stand_initial_tree
from ..kernels import MAX_TREE_NODES, _common, replay, tree_attention, tree_conv1d, tree_scan
from ..kernels.aot import SHARED_LIMIT, TARGETS, capture, compile_launch, jit_kernels
from ..models.families.llama import TransformerConfig
from ..models.layers.linear import Linear
from ..models.presets import PRESETS, TINY
from .timing import run_info, save_result
from ..tree import TokenTree, TreeShape, pack_trees

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
TREES = {5: TreeShape.chain(4), 13: TreeShape.paper13(), 31: TreeShape.full(2, 4), 63: TreeShape.full(2, 5),
         127: TreeShape.full(2, 6), 625: stand_initial_tree()}
CALLS = ("step", "prefill", "chain", "tree", "commit", "packed")


@dataclass(frozen=True)
class Case:
    """``call`` of ``model`` in ``dtype``: ``step`` (one token), ``prefill`` (one chunk of
    ``nodes`` tokens), ``chain`` (a chain of ``nodes`` through the chain scan), ``tree`` (the
    verify pass of the ``nodes``-node tree of TREES), ``commit`` (its deepest path), ``packed``
    (the engine convention: that tree, a 5-node chain and a lone root packed without padding,
    states in a pool of slots, through every tree kernel of one layer of each kind)."""

    model: str
    dtype: str
    call: str
    nodes: int = 1

    @property
    def name(self) -> str:
        return f"{self.model} {self.dtype} {self.call}" + (f" n={self.nodes}" if self.call != "step" else "")


def _commits_by_kernel(model: str) -> bool:
    """Whether the preset has Mamba2 layers (the replay kernel); an attention-only model's commit
    is a gather, no kernel."""
    return not isinstance(PRESETS[model][1](n_layer=2, vocab_size=256), TransformerConfig)


def full_cases() -> list[Case]:
    cases = []
    for model in PRESETS:
        calls = ("tree", "commit") if _commits_by_kernel(model) else ("tree",)
        for dtype in ("fp16", "bf16"):
            cases += [Case(model, dtype, "step"), Case(model, dtype, "prefill", MAX_TREE_NODES),
                      Case(model, dtype, "chain", 5)]
            cases += [Case(model, dtype, call, n) for n in TREES for call in (*calls, "packed")]
    return cases


def ci_cases() -> list[Case]:
    """Every call once at the test sizes, and the decode path at real sizes in bf16."""
    cases = [Case(model, "fp32", call, n) for model in TINY
             for call, n in (("step", 1), ("prefill", 24), ("chain", 5), ("tree", 13), ("commit", 13), ("packed", 13))]
    cases += [Case(model, "bf16", call, n) for model in PRESETS
              for call, n in (("step", 1), ("tree", 63), ("commit", 63), ("packed", 63))
              if call != "commit" or _commits_by_kernel(model)]
    return cases


_models: dict = {}


def _model(name: str, dtype: str):
    """One layer of each kind at the preset's widths, weights left uninitialised (never read:
    the kernels do not run), the Triton kernels forced, and every linear layer giving zeros of
    its output's shape: nothing reads the values, and at real widths the products (with the
    first-use choice of each one's CPU path, :mod:`stree.models.layers.linear`) had taken nine
    tenths of the check's time."""
    if (name, dtype) not in _models:
        cls, config = {**PRESETS, **TINY}[name]
        cfg = config(n_layer=2, vocab_size=256)
        model = cls(cfg, device="meta", dtype=DTYPES[dtype]).to_empty(device="cpu").eval()
        model.kernel_backend = "triton"
        for layer in model.modules():
            if isinstance(layer, Linear):
                layer.forward = types.MethodType(_zeros_of_output, layer)
        _models[(name, dtype)] = model
    return _models[(name, dtype)]


def _zeros_of_output(layer: Linear, x: torch.Tensor) -> torch.Tensor:
    """What ``layer(x)`` gives in shape, dtype and layout (contiguous), without the product."""
    return x.new_zeros(*x.shape[:-1], layer.out_features)


def _packed_launches(model, nodes: int):
    """The tree kernels on packed trees of different sizes (see :class:`Case`), at the widths of
    the model's first layer of each kind, captured."""
    trees = pack_trees([TREES[nodes], TreeShape.chain(4), TreeShape.chain(0)])
    total, rows = trees.total, trees.batch
    slots = torch.tensor([2, -1, 0], dtype=torch.int32)  # a padding row, slots out of order
    dtype = model.dtype
    mixers = {blk.mixer.kind: blk.mixer for blk in reversed(model.blocks) if blk.mixer is not None}
    with capture() as launches:
        if "ssm" in mixers:
            cfg = mixers["ssm"].cfg
            h, p, s, g, dim, k = cfg.nheads, cfg.headdim, cfg.d_state, cfg.ngroups, cfg.conv_dim, cfg.d_conv
            xBC, x = torch.zeros(1, total, dim, dtype=dtype), torch.zeros(1, total, h, p, dtype=dtype)
            dt, B = torch.zeros(1, total, h, dtype=dtype), torch.zeros(1, total, g, s, dtype=dtype)
            A, ssm, conv = torch.zeros(h), torch.zeros(rows, h, p, s), torch.zeros(rows, dim, k, dtype=dtype)
            tree_conv1d(xBC, trees, conv, torch.zeros(dim, k, dtype=dtype), state_indices=slots, backend="triton")
            tree_scan(x, dt, A, B, B, trees, D=torch.zeros(h), dt_bias=torch.zeros(h), initial_state=ssm,
                      state_indices=slots, backend="triton")
            accepted = torch.zeros(rows, 4, dtype=torch.long)
            replay(ssm[None], conv[None], xBC[None], x[None], dt[None], B[None], A[None], accepted,
                   torch.ones(rows, dtype=torch.long), dt_bias=torch.zeros(1, h), validate=False, state_indices=slots,
                   cu_seqlens=trees.cu_seqlens, backend="triton")
        if "attn" in mixers:
            attn = mixers["attn"]
            q = torch.zeros(1, total, attn.num_heads, attn.head_dim, dtype=dtype)
            kv = torch.zeros(1, total, attn.num_kv_heads, attn.head_dim, dtype=dtype)
            cache = torch.zeros(rows, 2 * MAX_TREE_NODES, attn.num_kv_heads, attn.head_dim, dtype=dtype)
            tree_attention(q, cache, cache, torch.zeros(rows, dtype=torch.int32), kv, kv, trees, validate=False,
                           state_indices=slots, backend="triton")
    return launches


def run_case(case: Case):
    """The case's call with its launches captured; returns them."""
    model = _model(case.model, case.dtype)
    if case.call == "packed":
        return _packed_launches(model, case.nodes)
    cache = model.allocate_cache(1, 2 * MAX_TREE_NODES)
    tokens = torch.zeros(1, max(case.nodes, 1), dtype=torch.long)
    if case.call == "prefill":
        with capture() as launches:
            model.prefill(tokens, cache, chunk=case.nodes)
        return launches
    cache.seqlens.fill_(100)
    if case.call == "step":
        with capture() as launches:
            model.step(tokens[:, 0], cache)
        return launches
    shape = TreeShape.chain(case.nodes - 1) if case.call == "chain" else TREES[case.nodes]
    tree = TokenTree.from_shape(shape, tokens)
    with capture() as launches:
        _, tree_pass = model.forward_tree(tree, cache, scan="chain" if case.call == "chain" else "tree")
    if case.call != "commit":
        return launches
    path = torch.tensor([shape.leaf_paths()[-1]])
    with capture() as launches:
        model.commit(cache, tree_pass, path, torch.tensor([path.shape[1]]))
    return launches


_jobs: list = []  # (launch, target) to compile; module-level so forked workers inherit it


def _compile(i: int):
    launch, target = _jobs[i]
    return compile_launch(launch, target)


def compile_cases(cases: list[Case], targets: list[str], workers: int) -> tuple[list[dict], set[str]]:
    """Capture every case, compile each distinct (kernel, specialisation, target) once; returns
    the reports (each with the cases that launch it) and the names of the kernels launched."""
    users: dict = {}
    for case in cases:
        for launch in run_case(case):
            for target in targets:
                key = (launch.name, target, launch.specs[target].key())
                if key not in users:
                    _jobs.append((launch, target))
                    users[key] = []
                if case.name not in users[key]:
                    users[key].append(case.name)
    launched = {launch.name for launch, _ in _jobs}
    if workers > 1:
        # fork: the workers inherit the captured launches (Triton kernels do not pickle).
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
            reports = list(pool.map(_compile, range(len(_jobs))))
    else:
        reports = [_compile(i) for i in range(len(_jobs))]
    return [dict(r.as_dict(), cases=cases_) for r, cases_ in zip(reports, users.values())], launched


def print_table(rows: list[dict]) -> None:
    head = (f"{'kernel':<24}{'target':<7}{'warps':>6}{'stages':>7}{'shared KB':>10}{'regs':>6}{'stack':>7}"
            f"{'spill st/ld B':>15}{'cubin KB':>9}  first case")
    print(head)
    print("-" * len(head))
    for r in rows:
        spills = f"{r['spill_stores']}/{r['spill_loads']}"
        more = f" +{len(r['cases']) - 1}" if len(r["cases"]) > 1 else ""
        print(f"{r['kernel']:<24}{r['target']:<7}{r['num_warps']:>6}{r['num_stages']:>7}{r['shared'] / 1024:>10.1f}"
              f"{r['registers']:>6}{r['stack']:>7}{spills:>15}{r['cubin'] / 1024:>9.0f}  {r['cases'][0]}{more}")
        for problem in r["problems"]:
            print(f"    PROBLEM ({r['kernel']}, {r['target']}, {r['cases'][0]}, {r['launch']}): {problem}")


def plot(result):
    import matplotlib.pyplot as plt

    targets = result["targets"]
    fig, axes = plt.subplots(1, len(targets), figsize=(7 * len(targets), 5), squeeze=False)
    for ax, target in zip(axes[0], targets):
        rows = [r for r in result["results"] if r["target"] == target and r["error"] is None]
        labels = [f"{r['kernel'].strip('_').replace('_kernel', '')} | {r['cases'][0]}" for r in rows]
        colors = ["tab:red" if r["spill_stores"] or r["spill_loads"] else "tab:blue" for r in rows]
        ax.barh(range(len(rows)), [r["registers"] for r in rows], color=colors)
        ax.set_yticks(range(len(rows)), labels, fontsize=5)
        ax.axvline(255, color="gray", ls="--", lw=0.8)
        ax.set(xlabel="registers per thread (red: spills)", title=f"{target}, triton {result['triton']}")
    return fig


def main(argv=None) -> int:
    # Triton 3.9 warns that its fp-fusion default will change; the launches here use the default.
    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ci", action="store_true", help="the test suite's few shapes instead of the full table")
    parser.add_argument("--targets", default=",".join(TARGETS), help="comma-separated, from " + ", ".join(TARGETS))
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile processes")
    parser.add_argument("--json", help="write the table to this JSON file")
    parser.add_argument("--out", help="write kernel_resources.json and .png to this directory")
    args = parser.parse_args(argv)
    targets = [t for t in args.targets.split(",") if t]
    error = None
    if _common.TRITON_INTERPRETED:
        error = "the kernels were imported under TRITON_INTERPRET=1; compiling for GPUs needs a process without it"
    elif not targets or any(t not in TARGETS for t in targets):
        error = f"--targets must name some of {', '.join(TARGETS)}, got {args.targets!r}"
    elif args.jobs < 1:
        error = f"--jobs must be >= 1, got {args.jobs}"
    if error:
        print(f"stree.tools.aotcheck: error: {error}", file=sys.stderr)
        return 2
    cases = ci_cases() if args.ci else full_cases()
    rows, launched = compile_cases(cases, targets, args.jobs)
    defined = sorted(jit_kernels())
    missing = sorted(set(defined) - launched)
    info = run_info("cpu", argv)
    info["command"] = " ".join(["python -m stree.tools.aotcheck", *(sys.argv[1:] if argv is None else argv)])
    result = dict(benchmark="kernel_resources", **info,
                  triton=triton.__version__, compiled_for="ahead of time, no GPU", targets=targets,
                  shared_limit={t: SHARED_LIMIT[t] for t in targets}, cases=[c.name for c in cases],
                  kernels_defined=defined, kernels_never_launched=missing, results=rows)
    print_table(rows)
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if args.out:
        save_result(result, args.out, "kernel_resources", plot)
    failures = sum(bool(r["problems"]) for r in rows)
    for name in missing:
        print(f"PROBLEM: kernel {name} is defined in stree.kernels but no case launches it")
    print(f"{len(rows)} compiles of {len(launched)} kernels for {', '.join(targets)} over {len(cases)} cases: "
          + ("all compile, no spills, shared memory within limits" if not failures and not missing
             else f"{failures} with problems, {len(missing)} kernels never launched"))
    return 1 if failures or missing else 0


if __name__ == "__main__":
    sys.exit(main())
