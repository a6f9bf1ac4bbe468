"""What load a hold's window offers: the spread of its realised rate (sends / window) under free
Poisson arrivals (gaps drawn one by one, as holds drew them until session 15; `vllm bench
serve` draws its gaps so but scales them to span N / rate, its count pinned over its run) and
under Poisson arrivals conditioned on their count over blocks of about four request lives
(runners/capacity/stream_source.py `hold_gap_block`, as holds draw them now); the swing of the
count over one request life that drives the batch, under both; and how far the in-flight
count's least-squares line rises by chance over the hold's window (runners/capacity/judge.py
judges a hold's line as a step's since session 15, on this model's evidence at this load).

A model, not a measurement: the H100 case of session 15 (docs/h100/session15/: Qwen3-8B shape,
fp8, prompts 100-400, answers 600-1400): rate 14.6 req/s, a mean request life of about 15 s
(answers of 1000 tokens at about 14.6 ms), windows of 98 s (where the hold stopped early) and
224 s (its plan: ten of the plan's 22.4 s lives). The block is sized from the plan's life
(15 s in the first rows, the record's 22.4 s in the last), and the window starts a block, as
runners/capacity/step.py starts a hold's (free arrivals: anywhere); the in-flight model is an
M/G/inf queue whose lives are 0.06 s + 600-1400 tokens x 14.6 ms after the plan's warm-up of
two lives (vLLM's TPOT grows with the batch, which it does not show).

    python3 bench/h100/hold_offered_spread.py [DRAWS]
"""

from __future__ import annotations

import sys

import numpy as np

from runners.capacity.stream_source import hold_gap_block

RATE = 14.6
ONE_LIFE_S = 15.0  # the load's mean request life
CASES = ((15.0, 98.0), (15.0, 224.0), (22.4, 98.0), (22.4, 224.0))  # (plan life s, window s)
CHUNK = 1000  # draws at a time
TOKEN_S = 0.0146
TTFT_S = 0.06


def arrival_times(rng: np.random.Generator, draws: int, horizon_s: float,
                  block: int | None) -> np.ndarray:
    """(draws, m) arrival times from 0 up to past `horizon_s`: free Poisson where `block` is
    None, else Poisson conditioned on its count over each block of `block` (as `ArrivalGaps`
    draws them: a block's gaps scaled to sum to exactly block / rate)."""
    if block is None:
        m = int(horizon_s * RATE * 1.3) + 200
        return np.cumsum(rng.exponential(1.0 / RATE, (draws, m)), axis=1)
    blocks = int(np.ceil(horizon_s * RATE / block)) + 1
    gaps = rng.gamma(1.0, 1.0, (draws, blocks, block))
    gaps *= (block / RATE) / gaps.sum(axis=2, keepdims=True)
    return np.cumsum(gaps.reshape(draws, -1), axis=1)


def count(times: np.ndarray, start: np.ndarray | float, end: np.ndarray | float) -> np.ndarray:
    start = np.broadcast_to(np.asarray(start, dtype=float), times.shape[:1])[:, None]
    end = np.broadcast_to(np.asarray(end, dtype=float), times.shape[:1])[:, None]
    return np.asarray(((times >= start) & (times < end)).sum(axis=1))


def offered_spread(rng: np.random.Generator, draws: int, window_s: float,
                   block: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Per draw: the window's realised rate, and the count over one life at a random place in
    the window (which starts at 0, a block's start)."""
    rates, lives = [], []
    for done in range(0, draws, CHUNK):
        n = min(CHUNK, draws - done)
        times = arrival_times(rng, n, window_s, block)
        rates.append(count(times, 0.0, window_s) / window_s)
        at = rng.uniform(0.0, window_s - ONE_LIFE_S, n)
        lives.append(count(times, at, at + ONE_LIFE_S))
    return np.concatenate(rates), np.concatenate(lives)


def line_rises(rng: np.random.Generator, draws: int, plan_life_s: float, window_s: float,
               block: int | None) -> np.ndarray:
    """The least-squares rise of an M/G/inf in-flight count, sampled every 0.25 s over the
    window (as runners/capacity/step.py samples a window's count), after a warm-up of two
    lives whose blocks start at 0 (the window's start a new block at `warmup_s`)."""
    warmup_s = 2.0 * plan_life_s
    grid = np.arange(warmup_s, warmup_s + window_s, 0.25)
    warm = arrival_times(rng, draws, warmup_s, block)
    held = warmup_s + arrival_times(rng, draws, window_s, block)
    out = []
    for before, during in zip(warm, held, strict=True):
        sent = np.concatenate([before[before < warmup_s], during[during < warmup_s + window_s]])
        ends = np.sort(sent + TTFT_S + rng.uniform(600, 1400, len(sent)) * TOKEN_S)
        in_flight = np.searchsorted(sent, grid, "right") - np.searchsorted(ends, grid, "right")
        out.append(float(np.polyfit(grid - grid[0], in_flight, 1)[0]) * (grid[-1] - grid[0]))
    return np.array(out)


def main(draws: int) -> None:
    rng = np.random.default_rng(15)
    print(f"MODEL (not a measurement): rate {RATE} req/s, {draws} draws a row\n")
    print("| plan life s | block | window s | arrivals | offered req/s p1 / p50 / p99 "
          "| beyond 3% | one life: std / sqrt(mean) |")
    print("|---|---|---|---|---|---|---|")
    for plan_life_s, window_s in CASES:
        block = hold_gap_block(RATE, plan_life_s)
        for name, size in (("free", None), (f"{block} ({block / RATE:.0f} s)", block)):
            rates, lives = offered_spread(rng, draws, window_s, size)
            p1, p50, p99 = np.percentile(rates, [1, 50, 99])
            beyond = float(np.mean(np.abs(rates / RATE - 1.0) > 0.03))
            print(f"| {plan_life_s:g} | {name} | {window_s:g} | "
                  f"{'free Poisson' if size is None else 'blocks'} "
                  f"| {p1:.2f} / {p50:.2f} / {p99:.2f} | {beyond:.1%} "
                  f"| {lives.std() / np.sqrt(RATE * ONE_LIFE_S):.3f} |")
    n = RATE * (TTFT_S + 1000 * TOKEN_S)
    bound = max(0.1 * n, 2.0 * np.sqrt(n))
    print(f"\nIn-flight line over the 224 s hold (n = {n:.0f} in flight; a step's bound "
          f"max(10% n, 2 sqrt(n)) = {bound:.0f}), {draws // 5} draws a row:\n")
    print("| arrivals | rise std / sqrt(n) | q99 / sqrt(n) | rise > 10% n | rise > bound |")
    print("|---|---|---|---|---|")
    for name, size in (("free Poisson", None),
                       (f"blocks of {hold_gap_block(RATE, 22.4)}", hold_gap_block(RATE, 22.4))):
        rises = line_rises(rng, draws // 5, 22.4, 224.0, size)
        root = np.sqrt(n)
        print(f"| {name} | {rises.std() / root:.2f} | {np.quantile(rises, 0.99) / root:.2f} "
              f"| {np.mean(rises > 0.1 * n):.1%} | {np.mean(rises > bound):.1%} |")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 10_000)
