"""How far a capacity step's in-flight line rises by chance: the noise floor of
runners/capacity/judge.py's `_RISE_NOISE`.

An M/G/inf model of the H100 decode load (docs/h100-steady.md): Poisson arrivals at the step's
rate, free or conditioned on their count per block of 64 (as the staircase draws a step's),
lives of TTFT + output tokens x TPOT with outputs uniform 600-1400, a 60 s warm-up, then the
least-squares rise of the in-flight count sampled every 0.25 s over the step's window (as
runners/capacity/step.py samples it). Prints the rise's standard deviation and quantiles in
units of sqrt(n), n the mean in flight. A model, not a measurement: vLLM's TPOT grows with the
batch, which a queue with fixed lives does not show.

    python3 bench/h100/rise_noise.py [TRIALS]
"""

from __future__ import annotations

import sys

import numpy as np

# (rate req/s, window s, TPOT s): the three H100 steps the rule was checked against
CASES = ((12.2, 12.3, 0.0092), (13.6, 11.2, 0.0126), (10.8, 14.0, 0.0137))
BLOCK = 64
WARMUP_S = 60.0
TTFT_S = 0.06


def arrivals(rng: np.random.Generator, rate: float, horizon: float,
             conditioned: bool) -> np.ndarray:
    if conditioned:
        span = BLOCK / rate
        blocks = int(np.ceil(horizon / span)) + 1
        times = np.concatenate([np.sort(rng.uniform(i * span, (i + 1) * span, BLOCK))
                                for i in range(blocks)])
    else:
        times = np.cumsum(rng.exponential(1.0 / rate, int(rate * horizon * 1.5) + 100))
    return times[times < horizon]


def rise(rng: np.random.Generator, rate: float, window_s: float, tpot_s: float,
         conditioned: bool) -> float:
    sent = arrivals(rng, rate, WARMUP_S + window_s, conditioned)
    ends = sent + rng.uniform(600, 1400, len(sent)) * tpot_s + TTFT_S
    grid = np.arange(WARMUP_S, WARMUP_S + window_s, 0.25)
    count = ((sent[None, :] <= grid[:, None]) & (ends[None, :] > grid[:, None])).sum(axis=1)
    slope = float(np.polyfit(grid - grid[0], count, 1)[0])
    return slope * float(grid[-1] - grid[0])


def main(trials: int) -> None:
    rng = np.random.default_rng(1)
    print("| rate req/s | window s | arrivals | n in flight | std / sqrt(n) | q95 / sqrt(n) "
          "| q99 / sqrt(n) |")
    print("|---|---|---|---|---|---|---|")
    for rate, window_s, tpot_s in CASES:
        n = rate * (1000 * tpot_s + TTFT_S)
        for conditioned in (True, False):
            rises = np.array([rise(rng, rate, window_s, tpot_s, conditioned)
                              for _ in range(trials)])
            root = np.sqrt(n)
            print(f"| {rate} | {window_s} | {'conditioned' if conditioned else 'free'} "
                  f"| {n:.0f} | {rises.std() / root:.2f} "
                  f"| {np.quantile(rises, 0.95) / root:.2f} "
                  f"| {np.quantile(rises, 0.99) / root:.2f} |")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4000)
