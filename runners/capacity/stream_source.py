"""What a staircase's stream (runners/capacity/driver.py) draws from: its requests, without
end (`endless_requests`), and the gaps between its arrivals at a rate (`ArrivalGaps`:
conditioned on their count over each block for a step, drawn one by one for a hold).
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Iterator

import numpy as np

from runners.loadgen.requests import RequestSpec

_GAP_BLOCK = 64  # arrivals whose gaps sum to exactly their count over the rate


class ArrivalGaps:
    """The gaps between a stream's arrivals, drawn from `numpy.random.default_rng(seed)`: gamma
    gaps of shape `burstiness` (Poisson at 1). A step's are conditioned on their count over each
    block (`next_s`); a hold's are free (`set_free`)."""

    def __init__(self, seed: int, burstiness: float) -> None:
        self.burstiness = burstiness
        self._rng = np.random.default_rng(seed)
        self._gaps: collections.deque[float] = collections.deque()
        self._gap_rate: float | None = None
        self._free_arrivals = False  # True: gaps drawn one by one, as `vllm bench serve` does

    def set_free(self, free_arrivals: bool) -> None:
        """Free gaps (a hold) or gaps conditioned on their count (a step) from the next on."""
        if free_arrivals != self._free_arrivals:
            self._free_arrivals = free_arrivals
            self._gap_rate = None  # the next gap starts afresh

    def next_s(self, rate: float) -> float:
        """The next gap at `rate`: gamma gaps (Poisson at burstiness 1, as `vllm bench serve`
        draws them) in blocks of `_GAP_BLOCK` whose sum is exactly their count over the rate,
        i.e. a Poisson process conditioned on its count over each block. Arrivals stay as
        bursty as vLLM's within a block, and a window offers the rate it is labelled with
        (a free Poisson count over 200 requests is off by 7% at one standard deviation).
        With free arrivals (a hold) each gap is drawn alone, as vLLM's client draws them: the
        count swings freely, and so does the batch, which is what a hold must see."""
        if self._gap_rate != rate:
            self._gaps.clear()
            self._gap_rate = rate
        if self._free_arrivals:
            shape = self.burstiness  # mean 1/rate; vLLM's gamma(burstiness, 1/(rate x it))
            return float(self._rng.gamma(shape, 1.0 / (rate * shape)))
        if not self._gaps:
            shape = self.burstiness
            block = self._rng.gamma(shape, 1.0, size=_GAP_BLOCK)
            block *= _GAP_BLOCK / rate / float(block.sum())
            self._gaps.extend(float(g) for g in block)
        return self._gaps.popleft()


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
