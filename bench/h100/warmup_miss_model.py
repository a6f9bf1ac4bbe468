"""When the warm-up early miss (runners/capacity/slo.py `missed_in_warmup`) would fire on the
H100's first fp8 step of the fourteenth session (17 req/s into an empty server:
docs/h100-steady.md), modelled, not replayed (the record keeps the step's window, not its
warm-up requests).

The model: Poisson arrivals at 17 req/s, answers uniform 600-1400 tokens; the time of a decode
step a line through the steps' median TPOTs (8.26 ms at 92 in flight, 26.05 ms at 458); TTFT a
line through 0.086 s at 91 in flight and 1.35 s at 458; the rule checked every 2 s against the
SLO's TPOT bound (15 ms) with its 10% margin. Prints, per seed, when it fires: (seconds since the
load was set, in flight, requests ended, their TPOT p99 ms, those over the margin).

    python3 bench/h100/warmup_miss_model.py
"""

from __future__ import annotations

import numpy as np

from runners.capacity.slo import tail_count

RATE = 17.0
HORIZON_S = 120.0
DT_S = 0.02
BOUND_MS = 15.0 * 1.1


def tpot_ms(in_flight: int) -> float:
    return 3.79 + 0.0486 * in_flight


def ttft_s(in_flight: int) -> float:
    return max(0.03, 0.086 + (1.35 - 0.086) / (458 - 91) * (in_flight - 91))


def fires(seed: int) -> tuple[float, int, int, float, int] | None:
    rng = np.random.default_rng(seed)
    sent = np.cumsum(rng.exponential(1 / RATE, int(RATE * HORIZON_S * 1.5)))
    sent = sent[sent < HORIZON_S]
    out_len = rng.integers(600, 1401, len(sent))
    first = np.full(len(sent), np.nan)
    decoded = np.zeros(len(sent))
    ended = np.full(len(sent), np.nan)
    t, tick = 0.0, 0
    while t < HORIZON_S:
        active = (sent <= t) & np.isnan(ended)
        batch = int(active.sum())
        fresh = active & np.isnan(first)
        first[fresh] = sent[fresh] + ttft_s(batch)
        decoding = active & (first <= t)
        decoded[decoding] += DT_S / (tpot_ms(batch) / 1000)
        done = decoding & (decoded >= out_len - 1)
        ended[done] = t
        t += DT_S
        tick += 1
        if tick % int(2.0 / DT_S) == 0:
            over_end = ~np.isnan(ended)
            n = int(over_end.sum())
            if n >= 100:
                tpot = (ended[over_end] - first[over_end]) / (out_len[over_end] - 1) * 1000
                over = int((tpot > BOUND_MS).sum())
                if over >= tail_count(n):
                    return (round(t, 1), batch, n, round(float(np.percentile(tpot, 99)), 1),
                            over)
    return None


if __name__ == "__main__":
    for seed in range(5):
        print(seed, fires(seed))
