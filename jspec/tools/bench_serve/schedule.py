"""The arrival schedule of a pass: the rates parsed from ``--request-rates``, Poisson send times at each, and the
label of a rate in tables and reports (``seq`` for one request after another)."""

from __future__ import annotations

import math

import numpy as np

SEQUENTIAL = "sequential"  # the pass label of one request after another


def parse_rates(text: str) -> list[float]:
    """--request-rates "0.5,1,inf" -> [0.5, 1.0, inf] (requests per second; inf: all at once)."""
    rates = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            rate = float(part)
        except ValueError:
            raise ValueError(f"--request-rates {text!r}: {part!r} is not a number (or inf)") from None
        if not rate > 0:
            raise ValueError(f"--request-rates {text!r}: {part!r} is not > 0")
        rates.append(rate)
    if not rates:
        raise ValueError(f"--request-rates {text!r}: expected comma-separated rates, e.g. 0.5,1,inf")
    return rates


def poisson_offsets(num_requests: int, rate: float, seed: int) -> np.ndarray:
    """Send times f64[num_requests] in seconds after the pass starts: a Poisson process of ``rate`` requests/s
    (the first at 0, then exponential gaps of mean 1 / rate drawn from ``seed``); rate inf: all zeros."""
    if num_requests < 1:
        raise ValueError(f"num_requests={num_requests}: expected >= 1")
    if math.isinf(rate):
        return np.zeros(num_requests)
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=num_requests - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])



def rate_label(rate: float | str) -> str:
    if rate == SEQUENTIAL:
        return "seq"
    return "inf" if math.isinf(rate) else f"{rate:g}"

