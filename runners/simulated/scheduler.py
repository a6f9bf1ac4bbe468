"""The simulated engine's continuous batching (`Scheduler`): vLLM V1's scheduler, simplified and
pure, turning step times into request latencies; the caller owns time."""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from runners.simulated.calibration import API_LAG_PER_STREAM_S
from runners.simulated.performance import PerformanceModel, StepBreakdown


@dataclass(eq=False)
class SimRequest:
    """One request inside the scheduler. Times are on the caller's clock, in seconds."""

    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    arrival_s: float
    block_hashes: tuple[int, ...] = ()  # chained hashes of full prompt blocks (prefix caching)
    admissible_s: float = 0.0  # when it reaches the scheduler (set by Scheduler.add)
    num_computed_tokens: int = 0
    num_output_tokens: int = 0
    num_blocks: int = 0  # KV blocks held
    num_cached_tokens: int = 0  # prefix-cache hit on the last admission
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    finished_s: float | None = None
    is_admitted_once: bool = False
    num_unsent_tokens: int = 0  # produced but held back until the stream interval is reached

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    @property
    def is_finished(self) -> bool:
        return self.finished_s is not None


@dataclass(frozen=True)
class StepPlan:
    """What one iteration computes: (request, tokens scheduled) pairs and the modelled time."""

    scheduled: tuple[tuple[SimRequest, int], ...]
    breakdown: StepBreakdown
    num_decode_seqs: int
    num_prefill_tokens: int
    num_preempted: int

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


@dataclass(frozen=True)
class TokenEvent:
    """A request produced a token at the end of a step (finished: it was the last one)."""

    request: SimRequest
    is_first: bool
    is_finished: bool
    time_s: float = 0.0  # when the step that produced it ended, on the caller's clock
    num_tokens: int = 1  # tokens this chunk carries (--stream-interval buffers them)


def block_hashes(token_ids: Sequence[int], block_size: int) -> tuple[int, ...]:
    """Chained hashes of full blocks, as vLLM's prefix cache keys them (ints hash stably)."""
    hashes: list[int] = []
    parent = 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start:start + block_size])))
        hashes.append(parent)
    return tuple(hashes)


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # tokens
    prefix_cache_hits: int = 0  # tokens


class Scheduler:
    """vLLM V1's continuous batching, simplified: running requests first (decodes and unfinished
    chunks), then waiting ones while `max_num_seqs`, the token budget and free KV blocks allow.
    When a running request cannot get a block, the latest-admitted one is preempted (recompute:
    its blocks are freed and it goes back to the head of the queue). Pure: the caller owns time.
    """

    def __init__(self, model: PerformanceModel) -> None:
        self.model = model
        self.num_total_blocks = model.num_kv_blocks
        self.num_free_blocks = self.num_total_blocks
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.stats = SchedulerStats()
        # Hashes of blocks computed before, LRU; a hit saves compute (not memory: see docs).
        self._cached_blocks: OrderedDict[int, None] = OrderedDict()
        self._last_admissible_s = 0.0
        self._last_step_s: tuple[float, float] | None = None  # (planned at, ended at)

    @property
    def kv_cache_usage(self) -> float:
        if self.num_total_blocks == 0:
            return 0.0
        return 1.0 - self.num_free_blocks / self.num_total_blocks

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: SimRequest) -> None:
        """Queue a request; it reaches the scheduler after the API server's trip, which grows
        with the streams open now (API_LAG_PER_STREAM_S), in arrival order."""
        lag_s = API_LAG_PER_STREAM_S * len(self.running)
        request.admissible_s = max(request.arrival_s + lag_s, self._last_admissible_s)
        self._last_admissible_s = request.admissible_s
        self.waiting.append(request)

    def next_admissible_s(self) -> float | None:
        """When the first waiting request reaches the scheduler (None: nothing waits)."""
        return self.waiting[0].admissible_s if self.waiting else None

    def _admission_cutoff_s(self, now_s: float) -> float:
        """Arrivals the step planned now can take. With async scheduling (vLLM 0.26's default)
        the engine plans a step while the previous one runs (`EngineCore.
        step_with_batch_queue`, v1/engine/core.py:617-705, a batch queue of 2): the step that
        runs next was planned when the last one started, so it takes only what had arrived by
        then. An engine with nothing running plans at once."""
        last = self._last_step_s
        if self.model.async_scheduling and last is not None and last[1] >= now_s \
                and self.running:
            return last[0]
        return now_s

    def reset_prefix_cache(self) -> None:
        """Forget computed blocks (vLLM's /reset_prefix_cache): later prompts miss."""
        self._cached_blocks.clear()

    def abort(self, request: SimRequest) -> None:
        if request in self.running:
            self.running.remove(request)
            self._free(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.model.block_size)

    def _free(self, request: SimRequest) -> None:
        self.num_free_blocks += request.num_blocks
        request.num_blocks = 0

    def _allocate(self, request: SimRequest, num_new_tokens: int) -> bool:
        needed = self._blocks_for(request.num_computed_tokens + num_new_tokens)
        extra = needed - request.num_blocks
        if extra > self.num_free_blocks:
            return False
        self.num_free_blocks -= max(0, extra)
        request.num_blocks = max(request.num_blocks, needed)
        return True

    def _prefix_hit_tokens(self, request: SimRequest) -> int:
        if not self.model.enable_prefix_caching:
            return 0
        hits = 0
        for block_hash in request.block_hashes:
            if block_hash not in self._cached_blocks:
                break
            self._cached_blocks.move_to_end(block_hash)
            hits += 1
        # At least one token is always computed, so the last full block never counts.
        return min(hits * self.model.block_size, request.num_tokens - 1)

    def _remember_blocks(self, request: SimRequest, num_computed_before: int) -> None:
        """The prompt blocks the last step filled join the LRU (earlier ones are in it)."""
        if not self.model.enable_prefix_caching:
            return
        num_full = min(len(request.block_hashes),
                       request.num_computed_tokens // self.model.block_size)
        first = min(num_computed_before // self.model.block_size, num_full)
        for block_hash in request.block_hashes[first:num_full]:
            self._cached_blocks[block_hash] = None
            self._cached_blocks.move_to_end(block_hash)
        while len(self._cached_blocks) > self.num_total_blocks:
            self._cached_blocks.popitem(last=False)

    def schedule(self, now_s: float) -> StepPlan | None:
        """Plan the next iteration, or None when there is nothing to run."""
        budget = self.model.max_num_batched_tokens
        scheduled: list[tuple[SimRequest, int]] = []
        num_preempted = 0
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            take = min(self._prefill_cap(request.num_tokens - request.num_computed_tokens),
                       budget)
            while not self._allocate(request, take):
                victim = self.running.pop()
                self._preempt(victim)
                num_preempted += 1
                if victim is request:
                    break
            else:
                scheduled.append((request, take))
                budget -= take
                index += 1
        cutoff_s = self._admission_cutoff_s(now_s)
        if num_preempted == 0:
            while (self.waiting and budget > 0
                   and len(self.running) < self.model.max_num_seqs):
                request = self.waiting[0]
                if not request.is_admitted_once and request.admissible_s > cutoff_s:
                    break  # still on its way through the API server
                if not request.is_admitted_once:
                    hit = self._prefix_hit_tokens(request)
                    # vLLM records no query with prefix caching off (kv_cache_manager.py:
                    # 224-228 returns before `prefix_cache_stats.record`, 272-277).
                    if self.model.enable_prefix_caching:
                        self.stats.prefix_cache_queries += request.num_prompt_tokens
                        self.stats.prefix_cache_hits += hit
                    request.num_computed_tokens = hit
                    request.num_cached_tokens = hit
                else:  # a preempted request recomputes, minus what the cache still holds
                    request.num_computed_tokens = self._prefix_hit_tokens(request)
                remaining = request.num_tokens - request.num_computed_tokens
                take = min(self._prefill_cap(remaining), budget)
                if take < remaining and not self.model.enable_chunked_prefill:
                    break
                if not self._allocate(request, take):
                    break
                self.waiting.popleft()
                self.running.append(request)
                request.is_admitted_once = True
                if request.first_scheduled_s is None:
                    request.first_scheduled_s = now_s
                scheduled.append((request, take))
                budget -= take
        if not scheduled:
            return None
        num_decode = decode_ctx = prefill_tokens = prefill_seqs = 0
        pairs = 0.0
        # Prefix-cache hits share physical blocks (vLLM maps a hit to the cached block and
        # counts its references: v1/core/block_pool.py `touch`), so a step's decodes read each
        # shared block once from HBM and the other sequences' reads of it hit in L2.
        shared_blocks: set[int] = set()
        for request, take in scheduled:
            is_decode = take == 1 and request.num_output_tokens > 0
            if is_decode:
                num_decode += 1
                hits = request.block_hashes[:request.num_cached_tokens // self.model.block_size]
                shared_blocks.update(hits)
                decode_ctx += request.num_computed_tokens + 1 - len(hits) * self.model.block_size
            else:
                prefill_seqs += 1
                prefill_tokens += take
                pairs += take * (request.num_computed_tokens + (take + 1) / 2)
        decode_ctx += len(shared_blocks) * self.model.block_size
        breakdown = self.model.step_time(num_decode, decode_ctx, prefill_tokens,
                                         prefill_seqs, pairs)
        self._last_step_s = (now_s, math.inf)
        return StepPlan(tuple(scheduled), breakdown, num_decode, prefill_tokens, num_preempted)

    def _prefill_cap(self, num_new_tokens: int) -> int:
        """vLLM 0.26 caps a request's tokens per step at long_prefill_token_threshold when it is
        between 0 and the tokens left (v1/core/sched/scheduler.py:507 and :861)."""
        threshold = self.model.long_prefill_token_threshold
        return threshold if 0 < threshold < num_new_tokens else num_new_tokens

    def _preempt(self, request: SimRequest) -> None:
        self._free(request)
        request.num_computed_tokens = 0
        self.waiting.appendleft(request)
        self.stats.num_preemptions += 1

    def complete(self, plan: StepPlan, now_s: float) -> list[TokenEvent]:
        """Apply a planned step that ended at `now_s`; return the tokens it produced."""
        if self._last_step_s is not None:
            self._last_step_s = (self._last_step_s[0], now_s)
        events: list[TokenEvent] = []
        for request, take in plan.scheduled:
            if request not in self.running:  # aborted while the step ran
                continue
            request.num_computed_tokens += take
            self._remember_blocks(request, request.num_computed_tokens - take)
            if request.num_computed_tokens < request.num_tokens:
                continue  # a prefill chunk with more to come: no token yet
            request.num_output_tokens += 1
            is_first = request.first_token_s is None
            if is_first:
                request.first_token_s = now_s
            request.last_token_s = now_s
            is_finished = request.num_output_tokens >= request.max_tokens
            if is_finished:
                request.finished_s = now_s
                self.running.remove(request)
                self._free(request)
            # vLLM sends the first token at once, then every stream_interval tokens, and the
            # rest when the request finishes.
            request.num_unsent_tokens += 1
            if is_first or is_finished or \
                    request.num_unsent_tokens >= self.model.stream_interval:
                events.append(TokenEvent(request, is_first, is_finished, now_s,
                                         request.num_unsent_tokens))
                request.num_unsent_tokens = 0
        return events
