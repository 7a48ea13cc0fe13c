"""Where a decoding iteration's time goes: ``torch.profiler`` over one ``generate`` call per
configuration (the shipped pair, greedy, batch 1, the library's defaults for the device: CUDA
graphs on a GPU), divided by the call's decoding iterations. Per iteration: wall time, the time
the device was busy, the kernels it ran, the host's runtime calls (kernel launches, graph launches,
copies, synchronisations), and the host and device operations that took longest. A launch-bound
GPU shows it here: wall time far above busy time, or a host op between graph replays.

    python benchmarks/iteration_trace.py                 # results/iteration_trace_<device>.json
    python benchmarks/iteration_trace.py --smoke         # 8 tokens, CPU (CI)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from stree.tools.demo import TARGET, read_prompts
from stree.decoding.loop import generate
from stree.models import load, load_tokenizer
from stree.tools.timing import add_device_args, device_and_dtype, run_info, save_result
from stree.tree import TreeShape

# (name, method, drafter, tree): a plain step, a fixed tree (the paper's 13 nodes), the default choice
CONFIGS = (("autoregressive", "autoregressive", None, None), ("ngram-paper13", "stree", "ngram", TreeShape.paper13()),
           ("ngram-auto", "stree", "ngram", "auto"))
RUNTIME = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cudaGraphLaunch",
           "cudaMemcpyAsync", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
TOP = 12


def trace(model, ids, method, drafter, tree, tokens: int) -> dict:
    from stree.drafters.registry import make_drafter

    kw = dict(method=method, max_new_tokens=tokens)
    if drafter is not None:
        kw.update(drafter=make_drafter(drafter, vocab_size=model.vocab_size), tree=tree)
    for _ in range(2):  # graphs captured, kernels compiled, the tree choice measured
        generate(model, ids, **kw)
    if drafter is not None:
        kw["drafter"] = make_drafter(drafter, vocab_size=model.vocab_size)  # a fresh store: the traced call's
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ids.is_cuda else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        out = generate(model, ids, **kw)
        if ids.is_cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    n = max(out.stats.target_forwards, 1)
    events = prof.key_averages()
    on_device = [e for e in events if e.device_type.name == "CUDA"]
    host = sorted((e for e in events if e.device_type.name == "CPU"), key=lambda e: -e.self_cpu_time_total)
    per = lambda x: x / n  # noqa: E731
    return dict(
        iterations=n, tokens=sum(len(t) for t in out.new_tokens), tau=out.stats.tau, trees=out.stats.trees,
        wall_ms=per(wall * 1e3), device_busy_ms=per(sum(e.self_device_time_total for e in on_device) / 1e3),
        kernels=per(sum(e.count for e in on_device)),
        runtime_calls={e.key: per(e.count) for e in events if e.key in RUNTIME},
        top_host=[dict(op=e.key, self_ms=per(e.self_cpu_time_total / 1e3), calls=per(e.count)) for e in host[:TOP]],
        top_device=[dict(kernel=e.key[:120], ms=per(e.self_device_time_total / 1e3), calls=per(e.count))
                    for e in sorted(on_device, key=lambda e: -e.self_device_time_total)[:TOP]])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_args(p)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = p.parse_args(argv)
    device, dtype = device_and_dtype(args)
    tokens = 8 if args.smoke else args.tokens
    model = load(TARGET, dtype=dtype, device=device)
    ids = torch.tensor([load_tokenizer(TARGET).encode(read_prompts(TARGET / "prompts.jsonl", 1)[0])], device=device)
    rows = [dict(name=name, **trace(model, ids, method, drafter, tree, tokens)) for name, method, drafter, tree in CONFIGS]
    result = dict(benchmark="iteration_trace", **run_info(device, argv), dtype=str(dtype).removeprefix("torch."),
                  tokens=tokens, note="per decoding iteration of one generate call under torch.profiler "
                  "(the profiler's own overhead included in wall_ms)", results=rows)
    save_result(result, args.out, f"iteration_trace_{'smoke' if args.smoke else device.type}", plot)
    for r in rows:
        calls = ", ".join(f"{k} {v:.1f}" for k, v in r["runtime_calls"].items())
        print(f"{r['name']:<16} {r['iterations']:>4} it  tau {r['tau']:.2f}  wall {r['wall_ms']:.3f} ms  "
              f"device busy {r['device_busy_ms']:.3f} ms  kernels {r['kernels']:.0f}  {calls}")
        for h in r["top_host"][:6]:
            print(f"    host  {h['self_ms']:8.3f} ms  x{h['calls']:<6.1f} {h['op']}")
        for d in r["top_device"][:4]:
            print(f"    dev   {d['ms']:8.3f} ms  x{d['calls']:<6.1f} {d['kernel']}")
    return result


def plot(result):
    import matplotlib.pyplot as plt

    rows = result["results"]
    fig, ax = plt.subplots(figsize=(7, 4))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["wall_ms"] for r in rows], 0.4, label="wall")
    ax.bar([i + 0.2 for i in x], [r["device_busy_ms"] for r in rows], 0.4, label="device busy")
    ax.set_xticks(list(x), [r["name"] for r in rows])
    ax.set_ylabel("ms per decoding iteration")
    ax.set_title(f"{result['device']}, {result['dtype']}")
    ax.legend()
    return fig


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
