"""Wall-clock timing of a callable on the tensors' device (device events on CUDA)."""

from __future__ import annotations

import statistics
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
