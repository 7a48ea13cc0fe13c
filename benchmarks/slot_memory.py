"""What a serving slot holds, per model preset: the SSM layers' states (fixed per request) and the
attention layers' KV preallocated to the slot's max length, in bf16; and how many slots fit on an
80 GiB card beside the weights, preallocated against KV paged in blocks that hold only the
tokens a request uses (ideal blocks: no fragmentation, requests of ``--mean-tokens`` tokens).
Sizes come from the models' own ``allocate_cache`` on the meta device: nothing is allocated, and
the numbers are the same on every machine. Writes JSON and a PNG.

    python benchmarks/slot_memory.py            # every preset, max lengths 2k / 8k / 32k
    python benchmarks/slot_memory.py --smoke    # the tiny test models, 256 tokens
"""

from __future__ import annotations

import argparse

import torch

from stree.models.presets import PRESETS, TINY
from stree.serving.engine import slot_bytes
from stree.tools.timing import run_info, save_result

CARD_GIB = 80.0


def measure(presets: dict, lengths, mean_tokens: int) -> list[dict]:
    rows = []
    for name, (cls, config) in presets.items():
        model = cls(config(vocab_size=256) if name in TINY else config(), device="meta", dtype=torch.bfloat16)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        room = CARD_GIB * 2**30 - weights
        for length in lengths:
            state, kv = slot_bytes(model, length)
            used = slot_bytes(model, min(mean_tokens, length))[1]  # the KV blocks a mean request fills
            rows.append(dict(model=name, max_length=length, weights_gib=weights / 2**30, state_mib=state / 2**20,
                             kv_mib=kv / 2**20, kv_share=kv / (state + kv),
                             slots_preallocated=int(room // (state + kv)), slots_blocks=int(room // (state + used))))
    return rows


def plot(result):
    import matplotlib.pyplot as plt

    length = max(r["max_length"] for r in result["results"])
    rows = [r for r in result["results"] if r["max_length"] == length]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["slots_preallocated"] for r in rows], 0.4, label="KV preallocated")
    ax.bar([i + 0.2 for i in x], [r["slots_blocks"] for r in rows], 0.4,
           label=f"KV in ideal blocks ({result['mean_tokens']}-token requests)")
    ax.set_xticks(list(x), [r["model"] for r in rows], rotation=30, ha="right", fontsize=8)
    ax.set(ylabel=f"slots on an {CARD_GIB:.0f} GiB card beside the weights", yscale="log",
           title=f"serving slots at max length {length}, bf16")
    ax.legend()
    fig.tight_layout()
    return fig


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mean-tokens", type=int, default=1024)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    if args.mean_tokens < 1:
        parser.error(f"--mean-tokens must be >= 1, got {args.mean_tokens}")
    presets, lengths = (TINY, (256,)) if args.smoke else (PRESETS, (2048, 8192, 32768))
    result = dict(benchmark="slot_memory", **run_info("cpu", argv), card_gib=CARD_GIB, mean_tokens=args.mean_tokens,
                  dtype="bfloat16", results=measure(presets, lengths, args.mean_tokens))
    for r in result["results"]:
        print(f"{r['model']:20s} {r['max_length']:6d} tokens: state {r['state_mib']:7.1f} MiB, KV {r['kv_mib']:7.1f} MiB "
              f"({100 * r['kv_share']:3.0f}%), slots {r['slots_preallocated']:6d} preallocated, "
              f"{r['slots_blocks']:6d} in blocks")
    save_result(result, args.out, "slot_memory_smoke" if args.smoke else "slot_memory", plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
