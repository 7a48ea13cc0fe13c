"""Serving throughput and latency: ``stree serve`` (the shipped target, in its own process) under
1 to 32 concurrent streaming clients, speculative (the n-gram drafter, ``tree="auto"``) against
autoregressive (``"drafter": null``), greedy, on the shipped pair's held-out code prompts.

Each client sends its requests one after another (``--requests`` each, cycling through the
prompts, ``--max-tokens`` each) over raw HTTP and reads the server-sent events. Reported per
(mode, concurrency): output tokens per second over the wall time of the whole load, time to first
token (p50, p99), time per output token after the first (TPOT: (last - first) / (tokens - 1) per
request; p50, p99), the gaps between streamed chunks (ITL; a speculative chunk holds every token
one iteration accepted) and the server's tau (its /metrics). The two modes take turns at each
concurrency, so drift hits both alike. Writes JSON and a PNG.

    python benchmarks/serve.py              # concurrency 1, 2, 4, 8, 16, 32
    python benchmarks/serve.py --smoke      # concurrency 1 and 2, a few short requests
    python benchmarks/serve.py --device cuda --out DIR   # on a GPU (benchmarks/gpu_check.sh bench)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import socket
import subprocess
import sys
import time

from tqdm import tqdm

from stree.tools.demo import TARGET, read_prompts
from stree.tools.timing import add_device_args, device_and_dtype, run_info, save_result

MODES = {"autoregressive": None, "speculative": "ngram"}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(port: int, path: str) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", path)
    response = conn.getresponse()
    return response.status, response.read().decode()


def _request(port: int, prompt: str, max_tokens: int, drafter) -> dict:
    """One streamed completion: the arrival time of every chunk of text and the token count."""
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}, "drafter": drafter})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
    arrivals, tokens = [], None
    for line in response:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        event = json.loads(line[6:])
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
        elif event["choices"] and event["choices"][0]["text"]:
            arrivals.append(time.perf_counter() - start)
    conn.close()
    return dict(arrivals=arrivals, tokens=tokens)


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def _load(port: int, prompts: list[str], concurrency: int, requests: int, max_tokens: int, drafter) -> dict:
    """``concurrency`` clients, ``requests`` each, all at once; the load's figures."""
    def client(k):
        return [_request(port, prompts[(k * requests + i) % len(prompts)], max_tokens, drafter)
                for i in range(requests)]

    before = _tau_counts(port)
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        done = [r for rs in pool.map(client, range(concurrency)) for r in rs]
    wall = time.perf_counter() - start
    after = _tau_counts(port)
    tokens = sum(r["tokens"] for r in done)
    ttft = [r["arrivals"][0] for r in done if r["arrivals"]]
    tpot = [(r["arrivals"][-1] - r["arrivals"][0]) / (r["tokens"] - 1) for r in done if r["tokens"] > 1]
    itl = [b - a for r in done for a, b in zip(r["arrivals"], r["arrivals"][1:])]
    stepped = after[1] - before[1]
    return dict(concurrency=concurrency, requests=len(done), tokens=tokens, wall_s=wall, tokens_per_s=tokens / wall,
                ttft_p50_ms=1e3 * _percentile(ttft, 50), ttft_p99_ms=1e3 * _percentile(ttft, 99),
                tpot_p50_ms=1e3 * _percentile(tpot, 50), tpot_p99_ms=1e3 * _percentile(tpot, 99),
                itl_p50_ms=1e3 * _percentile(itl, 50), itl_p99_ms=1e3 * _percentile(itl, 99),
                tau=(after[0] - before[0]) / stepped if stepped else float("nan"))


def _tau_counts(port: int) -> tuple[float, float]:
    """(tokens the target's steps produced, rows they stepped) from the server's /metrics: tau is
    the ratio of their growth over a load."""
    _, text = _get(port, "/metrics")
    values = dict(line.split(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    steps = float(values["stree_target_steps_total"])
    return float(values["stree_tau"]) * steps, steps


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="1,2,4,8,16,32")
    p.add_argument("--requests", type=int, default=8, help="requests each client sends, one after another")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-slots", type=int, default=32)
    p.add_argument("--smoke", action="store_true", help="concurrency 1 and 2, two 8-token requests each")
    p.add_argument("--out", default="benchmarks/results")
    add_device_args(p)
    args = p.parse_args(argv)
    args.dtype = args.dtype or "float32"  # the server's greedy outputs stay comparable with the CPU's
    device, dtype = device_and_dtype(args)
    if args.smoke:
        args.concurrency, args.requests, args.max_tokens, args.max_slots = "1,2", 2, 8, 4
    levels = [int(c) for c in args.concurrency.split(",")]
    prompts = read_prompts(TARGET / "prompts.jsonl", 16)
    port = _port()
    server = subprocess.Popen([sys.executable, "-m", "stree", "serve", "--model", str(TARGET), "--served-name", "tiny",
                               "--port", str(port), "--max-slots", str(args.max_slots), "--max-length", "1024",
                               "--dtype", str(dtype).removeprefix("torch."), "--device", str(device)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while True:
            try:
                if _get(port, "/health")[0] == 200:
                    break
            except OSError:
                if server.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"the server did not start: {server.stderr.read()[-2000:]}")
                time.sleep(0.2)
        # warm-up, every load once: numba, and the cost profile of every batch size the loads make
        # (tree="auto" measures a size the first time a cohort reaches it, about 2 s, then caches it)
        for c in tqdm(levels, desc="warm-up", file=sys.stderr):
            for drafter in MODES.values():
                _load(port, prompts, c, 1, args.max_tokens, drafter)
        rows = []
        for c in tqdm(levels, desc="concurrency", file=sys.stderr):
            for mode, drafter in MODES.items():
                rows.append(dict(mode=mode, **_load(port, prompts, c, args.requests, args.max_tokens, drafter)))
    finally:
        server.terminate()
        server.wait(120)
    for row in rows:
        if row["mode"] == "speculative":
            base = next(r for r in rows if r["mode"] == "autoregressive" and r["concurrency"] == row["concurrency"])
            row["gain_over_autoregressive"] = row["tokens_per_s"] / base["tokens_per_s"]
    result = dict(run_info(device, argv), benchmark="serve", dtype=str(dtype).removeprefix("torch."),
                  max_tokens=args.max_tokens, requests_per_client=args.requests, max_slots=args.max_slots, results=rows)
    save_result(result, args.out, "serve_smoke" if args.smoke else f"serve_{device.type}", _plot)
    for row in rows:
        print(f"{row['mode']:>15} c={row['concurrency']:>2}: {row['tokens_per_s']:7.1f} tok/s, tau {row['tau']:.2f}, "
              f"TTFT p50 {row['ttft_p50_ms']:.0f} ms, TPOT p50 {row['tpot_p50_ms']:.1f} ms p99 {row['tpot_p99_ms']:.1f}"
              + (f", x{row['gain_over_autoregressive']:.2f}" if "gain_over_autoregressive" in row else ""))
    return 0


def _plot(result: dict):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for mode in MODES:
        rows = [r for r in result["results"] if r["mode"] == mode]
        c = [r["concurrency"] for r in rows]
        axes[0].plot(c, [r["tokens_per_s"] for r in rows], "o-", label=mode)
        axes[1].plot(c, [r["ttft_p50_ms"] for r in rows], "o-", label=f"{mode} p50")
        axes[1].plot(c, [r["ttft_p99_ms"] for r in rows], "x--", label=f"{mode} p99")
        axes[2].plot(c, [r["tpot_p50_ms"] for r in rows], "o-", label=f"{mode} p50")
        axes[2].plot(c, [r["tpot_p99_ms"] for r in rows], "x--", label=f"{mode} p99")
    for ax, title in zip(axes, ("output tokens/s", "time to first token (ms)", "time per output token (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.suptitle(f"stree serve, {result['device']}", fontsize=9)
    return fig


if __name__ == "__main__":
    sys.exit(main())
