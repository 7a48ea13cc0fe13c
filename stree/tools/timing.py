"""Measurement helpers for benchmarks: timing (device events on CUDA), peak memory, run metadata, and a git
revision's library for the benchmarks that compare it with the working tree's."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys
import time

import torch


def median_ms(fn, device, *, warmup: int = 3, reps: int = 10) -> float:
    """Median milliseconds of ``fn()`` after ``warmup`` calls (compilation, caches) are discarded."""
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def peak_bytes(fn, device) -> int | None:
    """Peak device memory ``fn()`` allocates beyond what was already allocated (None off CUDA)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def add_device_args(parser) -> None:
    """``--device`` (default: cuda when available, else cpu) and ``--dtype`` (default: bfloat16 on
    CUDA, float32 on the CPU) for a benchmark."""
    parser.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda when available)")
    parser.add_argument("--dtype", default=None, choices=("float32", "float16", "bfloat16"),
                        help="default: bfloat16 on CUDA, float32 on the CPU")


def device_and_dtype(args) -> tuple[torch.device, torch.dtype]:
    """The benchmark's device and dtype from :func:`add_device_args`' options (checked)."""
    from ..checkpoints.io import DTYPES, check_device

    device = check_device(args.device) or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = DTYPES[args.dtype] if args.dtype else torch.bfloat16 if device.type == "cuda" else torch.float32
    return device, dtype


def run_info(device, argv=None) -> dict:
    """What a committed result must carry: device name, UTC date, the exact command, torch version."""
    from ..decoding.cost import cpu_model

    device = torch.device(device)
    name = (torch.cuda.get_device_name(device) if device.type == "cuda"
            else f"cpu ({os.cpu_count()} cores, {platform.machine()}, {cpu_model()})")
    args = sys.argv[1:] if argv is None else list(argv)
    return dict(device=name, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                command=" ".join(["python", sys.argv[0], *args]), torch=torch.__version__)


def save_result(result: dict, out_dir, stem: str, plot) -> None:
    """Write ``result`` to ``{out_dir}/{stem}.json`` and the figure ``plot(result)`` returns to
    ``{stem}.png`` (matplotlib's Agg backend: no display needed)."""
    import json
    from pathlib import Path

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    fig = plot(result)
    fig.tight_layout()
    fig.savefig(out / f"{stem}.png", dpi=100)
    plt.close(fig)


def revision_package(root, revision: str, into) -> str:
    """The ``stree`` package of the git repository at ``root`` as it is at ``revision`` (``git
    archive``), extracted under ``into``: the directory to put first on a worker process's
    ``PYTHONPATH``. A revision git does not know is a clear ``ValueError``."""
    import io
    import subprocess
    import tarfile
    from pathlib import Path

    run = subprocess.run(["git", "-C", str(root), "archive", "--format=tar", revision, "stree"], capture_output=True)
    if run.returncode:
        raise ValueError(f"--against {revision!r}: git cannot export stree there ({run.stderr.decode().strip()[:200]})")
    with tarfile.open(fileobj=io.BytesIO(run.stdout)) as tar:
        tar.extractall(into, filter="data")
    return str(Path(into))


def plot_sides(result: dict, field: str, labels: list[str], ylabel: str, title: str, line: float | None = None):
    """A figure of a two-sided comparison (``result["against"]`` and the working tree): per row of
    ``result["results"]``, a bar of each side's mean of ``{side}_{field}`` (a list per round) with
    the rounds as dots; ``labels`` under the rows, a horizontal ``line`` where given."""
    import statistics

    import matplotlib.pyplot as plt

    rows = result["results"]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(rows)), 4))
    for shift, side in ((-0.2, "against"), (0.2, "working")):
        ax.bar([i + shift for i in range(len(rows))], [statistics.mean(r[f"{side}_{field}"]) for r in rows],
               width=0.4, label=result["against"] if side == "against" else "working tree")
        for i, r in enumerate(rows):
            ax.plot([i + shift] * len(r[f"{side}_{field}"]), r[f"{side}_{field}"], "k.", ms=3)
    if line is not None:
        ax.axhline(line, color="gray", lw=0.8)
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set(ylabel=ylabel, title=f"{title}\n{result['device']}")
    ax.legend()
    return fig
