"""What a staircase's stream (runners/capacity/driver.py) draws from: its requests, without
end (`endless_requests`), and the gaps between its arrivals at a rate (`ArrivalGaps`:
conditioned on their count over each block, of 64 arrivals for a step and of about four
request lives' worth for a hold: `hold_gap_block`).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator

import numpy as np

from runners.loadgen.requests import RequestSpec

GAP_BLOCK = 64  # a step's arrivals whose gaps sum to exactly their count over the rate
HOLD_BLOCK_LIVES = 4.0  # a hold's block, in request lives' worth of arrivals


def hold_gap_block(rate: float, lifetime_s: float) -> int:
    """A hold's block at `rate`: about `HOLD_BLOCK_LIVES` request lives' worth of arrivals,
    never fewer than a step's (`ArrivalGaps` says why)."""
    return max(GAP_BLOCK, round(rate * HOLD_BLOCK_LIVES * lifetime_s))


class ArrivalGaps:
    """The gaps between a stream's arrivals, drawn from `numpy.random.default_rng(seed)`: gamma
    gaps of shape `burstiness` (Poisson at 1, as `vllm bench serve` draws them), conditioned on
    their count over each block of `set_block`'s size (`GAP_BLOCK` until then): a block's gaps
    sum to exactly its count over the rate, i.e. a Poisson (or gamma) process conditioned on
    its count over each block. Arrivals stay as bursty as vLLM's within a block, and a window of
    a block or more offers the rate it is labelled with, up to a partial block at each end (at
    its end only where it starts a block: a hold's window does, runners/capacity/step.py).

    A step's block is 64 arrivals: its short window, which starts anywhere in a block, offers
    its label up to the partial blocks at its ends (about 3% at one standard deviation over 150
    requests, where a free Poisson count over 200 is off by 7%); its record keeps what it
    offered (`offered_rate_rps`). A hold's is about four request lives'
    worth (`hold_gap_block`). The batch swings with the arrival count over about one life, and
    a hold must see those swings as an operator's client sends them; it must not see a drift of
    the whole window. Inside a block the count of a one-life sub-window is binomial, its
    variance the free process's times (1 - 1/4): its swings are about 87% of a free Poisson
    process's, while the window's own count drifts no further than its partial end blocks. The
    H100 (Qwen3-8B shape, fp8, 2026-12-06, docs/h100/session15/) showed the drift: a hold at
    14.6 req/s with free gaps offered 15.8 req/s over the 98 s it ran (1553 sends, +8%, about
    three standard deviations of a Poisson count) and missed at TPOT p99 16.6 ms, where vLLM's
    own client at 15.18 req/s read 14.65 ms under the 15 ms bound. That client conditions too:
    vLLM 0.26.0's `get_request` (vllm/benchmarks/serve.py) scales its N gamma gaps to span
    exactly N / rate seconds, one block over its whole run (its 2376 and 2733 sends there
    spanned 179.9 and 180.0 s), so over 180 s of 15 s lives its one-life swings are about
    sqrt(1 - 15/180), 96%, of a free process's. A hold's blocks of four lives swing a little
    less (87%), and a hold cut short by its early stop still offers its load up to a partial
    block, where one block over the whole window would not. bench/h100/hold_offered_spread.py
    models the spread of free and blocked arrivals."""

    def __init__(self, seed: int, burstiness: float) -> None:
        self.burstiness = burstiness
        self._rng = np.random.default_rng(seed)
        self._block = GAP_BLOCK
        self._gaps = np.empty(0)  # the current block's gaps at `_gap_rate`, from `_next` on
        self._next = 0
        self._gap_rate: float | None = None
        # `set_block` runs on the caller's thread, `next_s` on the stream's: a block size must
        # never change between drawing a block and scaling it (a hold's 876 gaps scaled to a
        # step's 64 would send them at 14x the rate).
        self._lock = threading.Lock()

    def set_block(self, block: int) -> None:
        """Condition the gaps on their count over blocks of `block` arrivals (a step:
        `GAP_BLOCK`; a hold: `hold_gap_block`), the next gap starting a block afresh: a window
        that starts then offers its rate over each whole block."""
        if block < 1:
            raise ValueError(f"an arrival block holds at least one arrival but got {block}.")
        with self._lock:
            self._block = block
            self._gap_rate = None

    def next_s(self, rate: float) -> float:
        """The next gap at `rate` (s): a new block at a new rate or block size."""
        with self._lock:
            if self._gap_rate != rate or self._next >= len(self._gaps):
                gaps = self._rng.gamma(self.burstiness, 1.0, size=self._block)
                self._gaps = gaps * (self._block / rate / float(gaps.sum()))
                self._next = 0
                self._gap_rate = rate
            gap = float(self._gaps[self._next])
            self._next += 1
            return gap


def endless_requests(build: Callable[[int, int], list[RequestSpec]], chunk: int, seed: int,
                     is_finite_source: bool) -> Iterator[RequestSpec]:
    """Requests for a stream without end: synthesised ones drawn afresh in chunks of `chunk`
    (seeds `seed`, `seed + 1`, ...: no prompt repeats, so a prefix cache is not flattered);
    a file's, a dataset's or a trace's requests cycled (with the loader's own warning)."""
    if is_finite_source:
        yield from itertools.cycle(build(chunk, seed))
        return
    for k in itertools.count():
        yield from build(chunk, seed + k)
