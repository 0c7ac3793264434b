"""Timed calls: medians of images per second, latency percentiles, and a runner's measurements."""
import functools
import time
from typing import Callable, Dict, List, Sequence

import numpy as np


def percentiles_ms(seconds: Sequence[float]) -> Dict[str, float]:
    """p50, p95 and p99 of `seconds`, in milliseconds."""
    values = np.asarray(seconds) * 1000.0
    return {f"p{q}": round(float(np.percentile(values, q)), 3) for q in (50, 95, 99)}


def median_rate(fn: Callable[[], None], images: int, *, steps: int, repeats: int) -> float:
    """Median over `repeats` runs of `steps` calls of images/second."""
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            fn()
        rates.append(images * steps / (time.perf_counter() - start))
    return round(float(np.median(rates)), 2)


def latency(fn: Callable[[], None], images: int, calls: int) -> Dict[str, float]:
    """Images per second at the median call of `calls`, and the calls' percentiles."""
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return {"img_per_s": round(images / float(np.median(times)), 2), "latency_ms": percentiles_ms(times)}


def measure_runner(runner, batch: int, *, steps: int, repeats: int, calls: int) -> Dict:
    """A runner's training img/s (where it trains), and its evaluation img/s and latency at batch 1
    and at `batch`."""
    result = {}
    if getattr(runner, "trains", True):
        result["train_compute_img_per_s"] = median_rate(runner.train_step, batch, steps=steps, repeats=repeats)
    for label, single in (("eval_batch_1", True), (f"eval_batch_{batch}", False)):
        runner.eval_step(single)  # warm-up (compiles the inference graph once)
        result[label] = latency(functools.partial(runner.eval_step, single), 1 if single else batch, calls)
    return result


def median_of(results: List[Dict]) -> Dict:
    """Element-wise median of nested measurement dicts."""
    first = results[0]
    if isinstance(first, dict):
        return {key: median_of([r[key] for r in results]) for key in first}
    return round(float(np.median(results)), 3)
