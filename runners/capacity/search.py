"""The capacity search's decisions (`CapacitySearch`): the highest load one running server
sustains within the SLO, bracketed by probes, and what the probes showed (a `Bracket`,
runners/capacity/bracket.py). Pure: the runner measures, this decides what to measure next."""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from runners.capacity.bracket import Bracket, BracketStatus
from runners.load_level import LoadLevel

# A probe: (offered load, met the SLO) or (offered load, met the SLO, load it actually served:
# requests/s completed, or most requests running at once; None when unknown).
Probe = tuple[float, bool] | tuple[float, bool, float | None]
_MIN_GAUGE_SAMPLES = 3  # /metrics samples a probe needs before its running peak is trusted
# vLLM's counters (runners/prometheus.py names them; not imported: capacity stays pure).
_PROMPT_TOKENS = "vllm:prompt_tokens_total"
_GENERATION_TOKENS = "vllm:generation_tokens_total"


class LevelFigures(Protocol):
    """What `CapacitySearch.served_of` reads of a level's figures (`runners.base.BenchmarkMetrics`
    has them); a Protocol so that the inputs do not import the results."""

    @property
    def completed(self) -> int: ...

    @property
    def duration_s(self) -> float: ...  # s

    @property
    def request_throughput(self) -> float: ...  # requests/s


@dataclass(frozen=True)
class CapacitySearch:
    """The inner loop of a trial: the highest load one running server sustains within the SLO.

    A monotone bracketing search over one load axis (concurrency or request rate), as a
    capacity test is run by hand: probe at the highest load the user cares about; if the SLO
    holds there, the capacity is at least that. Else narrow down: a probe that missed because
    the server could not keep up also says how much it *did* serve (requests/s completed, or
    requests it ran at once), and the capacity is unlikely to lie above that, so the next probe
    goes there, then steps of `step_ratio` around it; without that evidence the next probe goes
    halfway (in log) down to the lightest load, and so on down to it (if the SLO fails even
    there, the config has none), and the bracket is bisected geometrically (latency curves bend
    by octaves) until it is within the tolerance or the probes run out.

    The bracket only ever holds what was measured: its lower end is a load that met the SLO, its
    upper end a load that missed it. What a probe served only chooses the next load to probe.
    Every probe is a load level of the same server, so a trial pays one start-up for its whole
    latency-vs-load curve. Pure: the runner measures, this decides what to measure next.
    """

    axis: Literal["concurrency", "request_rate"]
    low: float  # the lightest load probed (a concurrency or requests/s)
    high: float  # the heaviest load of interest
    tolerance: float = 0.05  # stop when the bracket is this narrow (relative)
    max_probes: int = 8
    # A probe of a trace or multi-turn workload (measured level by level, not on the steady
    # staircase) sends no new request after this long. None: unbounded.
    probe_duration_s: float | None = 30.0
    # The steady staircase (runners/capacity/): a step's window sends at least this many
    # requests and lasts at least `min_window_s`, at most `max_window_s` (None: unbounded);
    # its warm-up is one request life unless `warmup_s` is given.
    min_window_requests: int = 200
    min_window_s: float = 10.0  # s
    max_window_s: float | None = 180.0  # s
    warmup_s: float | None = None  # s; None: sized from the request's life
    # The hold (runners/capacity/staircase.py): once the steps have found the bracket, its
    # lower end is measured again over a window of at least `hold_s` of arrivals and at least
    # `hold_lives` request lives, with free (unconditioned) Poisson or gamma arrivals as
    # `vllm bench serve` sends them; the claim is a load that held. A step's short window sees
    # one batch (its p99 is about its median); the p99 an operator reads over minutes is set by the
    # load's swings (docs/h100-steady.md). 0: no hold (the claim rests on short windows and
    # says so). A hold that misses steps down (`next_hold`), at most `max_holds` times.
    hold_s: float = 180.0  # s
    hold_lives: float = 10.0  # request lives, at least, in a hold's window
    max_holds: int = 3

    def __post_init__(self) -> None:
        if not 0 < self.low < self.high:
            raise ValueError(f"capacity search needs 0 < low < high but got {self.low} and "
                             f"{self.high}.")
        if self.axis == "concurrency" and (self.low != int(self.low)
                                           or self.high != int(self.high)):
            raise ValueError("concurrency bounds are whole numbers of requests.")
        if not 0 < self.tolerance <= 1:
            raise ValueError(f"capacity tolerance must be in (0, 1] but got {self.tolerance}.")
        if self.max_probes < 1:
            raise ValueError(f"max_probes must be >= 1 but got {self.max_probes}.")
        if self.probe_duration_s is not None and not self.probe_duration_s > 0:
            raise ValueError(f"probe_duration_s must be > 0 but got {self.probe_duration_s}.")
        if self.min_window_requests < 1 or not self.min_window_s > 0:
            raise ValueError("a step's window needs min_window_requests >= 1 and "
                             f"min_window_s > 0 but got {self.min_window_requests} and "
                             f"{self.min_window_s}.")
        if self.max_window_s is not None and not self.max_window_s >= self.min_window_s:
            raise ValueError(f"max_window_s ({self.max_window_s}) must be >= min_window_s "
                             f"({self.min_window_s}).")
        if self.warmup_s is not None and not self.warmup_s >= 0:
            raise ValueError(f"warmup_s must be >= 0 but got {self.warmup_s}.")
        if not (math.isfinite(self.hold_s) and self.hold_s >= 0):
            raise ValueError(f"hold_s must be >= 0 s (0: no hold) but got {self.hold_s}.")
        if not (math.isfinite(self.hold_lives) and self.hold_lives >= 0):
            raise ValueError(f"hold_lives must be >= 0 but got {self.hold_lives}.")
        if self.max_holds < 1:
            raise ValueError(f"max_holds must be >= 1 but got {self.max_holds}.")

    @property
    def step_ratio(self) -> float:
        """The step taken near what a probe served: a bracket this wide closes in two
        bisections."""
        return (1.0 + self.tolerance) ** 4

    def worst_case_probes(self) -> int:
        """Probes plain bisection needs from [low, high] to the tolerance (high, low, then
        halvings of the log-width); served-rate steps usually need fewer."""
        halvings = math.log2(math.log(self.high / self.low) / math.log1p(self.tolerance))
        return 2 + max(0, math.ceil(halvings))

    def level(self, load: float) -> LoadLevel:
        if self.axis == "concurrency":
            return LoadLevel(max_concurrency=int(load))
        return LoadLevel(request_rate_rps=load)

    def load_of(self, level: LoadLevel) -> float:
        value = level.max_concurrency if self.axis == "concurrency" else level.request_rate_rps
        return float(value or 0.0)

    def served_of(self, metrics: LevelFigures, server: Mapping[str, float],
                  mean_input_tokens: float | None = None,
                  mean_output_tokens: float | None = None) -> float | None:
        """The load a probe actually served where it could not keep up; None when unknown.

        A rate probe stopped for saturation (its queue kept growing): the requests/s its work
        progressed at, from the server's token counters over the probe (prefill tokens / mean
        prompt, generated tokens / mean output: the smaller binds), or at least the requests/s
        that completed. The counters matter: a flood of long prompts is stopped within seconds,
        before a single request completes. A rate probe that kept up serves less than offered
        only by its drain time: no evidence of a limit. A concurrency probe that left requests
        waiting: the most requests the engine ran at once (`/metrics`)."""
        if self.axis == "request_rate":
            if server.get("is_saturated", 0.0) <= 0 or not metrics.duration_s > 0:
                return None
            rates = []
            # The steady staircase reads the counters' rates over a saturated step's second
            # half, when the engine ran full: the first half's ramp under-reads it.
            for key, mean in (("served_prompt_tokens_per_s", mean_input_tokens),
                              ("served_generation_tokens_per_s", mean_output_tokens)):
                per_s = server.get(key)
                if per_s and mean:
                    rates.append(per_s / mean)
            if rates:
                completed = metrics.request_throughput if metrics.completed else 0.0
                served = max(min(rates), completed)
                return served if served > 0 and math.isfinite(served) else None
            prompt = server.get(_PROMPT_TOKENS)
            if prompt and mean_input_tokens:
                rates.append(prompt / metrics.duration_s / mean_input_tokens)
            generated = server.get(_GENERATION_TOKENS)
            if generated and mean_output_tokens:
                rates.append(generated / metrics.duration_s / mean_output_tokens)
            completed = metrics.request_throughput if metrics.completed else 0.0
            served = max(min(rates), completed) if rates else completed
            return served if served > 0 and math.isfinite(served) else None
        # Only an engine that queued requests (it ran fewer than it was sent) shows a limit;
        # and the gauges are sampled once a second: a short probe's few samples can miss the
        # peak.
        running = server.get("max_num_requests_running")
        if running is None or not math.isfinite(running) or running <= 0 or \
                server.get("max_num_requests_waiting", 0.0) < 1 or \
                server.get("num_samples", 0.0) < _MIN_GAUGE_SAMPLES:
            return None
        return float(running)

    def next_load(self, history: Sequence[Probe]) -> float | None:
        """The load to probe next given the probes so far, or None when done."""
        if len(history) >= self.max_probes:
            return None
        if not history:
            return self.high
        probes = [_unpack(p) for p in history]
        passed = [load for load, ok, _ in probes if ok]
        if any(load >= self.high for load in passed):
            return None  # the SLO holds at the heaviest load of interest
        lo = max(passed) if passed else None
        misses = [(load, served) for load, ok, served in probes
                  if not ok and (lo is None or load > lo)]
        if not misses:
            return None  # nothing above the best pass missed: nothing left to narrow
        hi = min(load for load, _ in misses)
        if lo is None and any(not ok and load <= self.low for load, ok, _ in probes):
            return None  # missed even at the lightest load: no capacity
        if lo is None and len(history) == self.max_probes - 1:
            # Nothing met yet and one probe left: it goes to `low`, the only probe that can
            # show "no load in [low, high] meets the SLO"; a step above it shows nothing more.
            return self.low
        if lo is not None and hi <= lo * (1.0 + self.tolerance):
            return None
        floor = lo if lo is not None else self.low
        # What the server could serve where it missed for want of throughput: the most any
        # such probe served (a probe stopped early under-reads it; the largest reads best).
        served = [s for load, s in misses
                  if s is not None and s > 0 and s * (1.0 + self.tolerance) < load]
        estimate = max(served) if served else None
        step = self.step_ratio
        candidate: float | None = None
        if estimate is not None and floor * (1.0 + self.tolerance) < estimate < \
                hi / (1.0 + self.tolerance):
            candidate = estimate  # not above what it could serve
        elif lo is None:
            if estimate is not None and hi <= estimate * step:
                # Came down to the estimate and still missed: the knee is just below; step
                # down, doubling the step after each further miss, never below `low`.
                near = sum(load <= estimate * (1.0 + self.tolerance) for load, _ in misses)
                candidate = max(self.low, hi / step ** (2 ** (near - 1)))
                if candidate <= self.low * (1.0 + self.tolerance):
                    candidate = self.low
            elif hi > self.low * step ** 2:
                # Nothing met the SLO yet and nothing says what was served: step down halfway
                # (in log) to `low`, not straight there; a step at the lightest load has the
                # longest window of the search (on the H100 a step at 2 req/s cost 103 s).
                candidate = math.sqrt(self.low * hi)
            else:
                candidate = self.low
        else:
            mid = math.sqrt(lo * hi)
            candidate = mid
            if estimate is not None and estimate / step <= lo < estimate:
                # Met the SLO just below what the server could serve: the knee is just above;
                # step up, doubling after each further pass, never past the midpoint. A pass
                # at or above the estimate shows it read low: bisect from there.
                near = sum(load * step >= estimate for load in passed)
                candidate = min(mid, lo * step ** (2 ** (near - 1)))
        return self._round(candidate, lo, hi)

    def _round(self, load: float, lo: float | None, hi: float) -> float | None:
        """`load` on the axis' grid, strictly inside (lo, hi); None when nothing is left."""
        if self.axis == "request_rate":
            # 3 significant figures, rounded down: readable labels, never above a guess.
            digits = 2 - math.floor(math.log10(load))
            value = math.floor(load * 10.0 ** digits + 1e-6) / 10.0 ** digits
            value = round(value, max(0, digits))
            if (lo is not None and value <= lo) or value >= hi or value <= 0:
                value = load
            return value
        # Whole requests: a guess rounds down ("not above what it could serve").
        first = math.floor(lo) + 1 if lo is not None else int(self.low)
        last = math.ceil(hi) - 1
        if first > last:
            return None  # neighbours: nothing left between them
        return float(min(max(math.floor(load), first), last))

    def next_hold(self, history: Sequence[Probe],
                  holds: Sequence[tuple[float, bool]]) -> float | None:
        """The load to hold next, or None when done: the highest load a step met below every
        hold that missed; after a hold missed more than the tolerance above that load, the
        geometric middle between the two (held directly: a short step there would read as
        optimistically as the one that misled the first hold). None once a hold met, after
        `max_holds`, with the hold off, or when no step met below the holds that missed."""
        if self.hold_s <= 0 or len(holds) >= self.max_holds or any(ok for _, ok in holds):
            return None
        probes = [_unpack(p) for p in history]
        failed = min((load for load, _ in holds), default=None)
        below = [load for load, ok, _ in probes if ok and (failed is None or load < failed)]
        top = max(below, default=None)
        if top is None:
            return None
        if failed is None:
            return top  # the first hold: the highest load a step met
        # The lowest probe above `top` that missed: the hold that missed, or a step below it
        # (after a hold missed with nothing met below it, the steps walked down under it).
        ceiling = min((load for load, ok, _ in probes if not ok and load > top),
                      default=failed)
        if ceiling <= top * (1.0 + self.tolerance):
            return top
        middle = self._round(math.sqrt(top * ceiling), top, ceiling)
        return top if middle is None else middle

    def bracket(self, history: Sequence[Probe], unapplied: Collection[float] = ()) -> Bracket:
        """What the probes showed: the highest load that met the SLO, the lowest above it that
        missed, and whether that is within the tolerance. `unapplied`: loads whose probe did
        not apply its load (the client fell behind: `judge.late_sends`, `unapplied_load`): not
        a measurement of the config there, so they end no bracket; the lowest above the met
        load is named beside it (`Bracket.unapplied_load`)."""
        probes = [_unpack(p) for p in history]
        passed = [load for load, ok, _ in probes if ok]
        met = max(passed) if passed else None
        missed_loads = [load for load, ok, _ in probes if not ok and (met is None or load > met)
                        and load not in unapplied]
        missed = min(missed_loads) if missed_loads else None
        above = [load for load in unapplied if (met is None or load > met)
                 and (missed is None or load < missed)]
        status: BracketStatus
        if met is not None and missed is None:
            status = "at_least" if met >= self.high else "unresolved"
        elif met is None:
            status = "none" if missed is not None and missed <= self.low else "unresolved"
        else:
            assert missed is not None
            if missed <= met * (1.0 + self.tolerance):
                status = "resolved"
            elif self.axis == "concurrency" and missed - met <= 1:
                status = "resolved"  # neighbouring whole numbers: nothing between them
            else:
                status = "unresolved"
        return Bracket(self.axis, met, missed, status, len(probes), search_high=self.high,
                       unapplied_load=min(above, default=None))

    @staticmethod
    def capacity(history: Sequence[Probe]) -> float:
        """The highest load that met the SLO (0 when none did): the bracket's lower end."""
        return max((p[0] for p in history if p[1]), default=0.0)


def _unpack(probe: Probe) -> tuple[float, bool, float | None]:
    served = probe[2] if len(probe) > 2 else None
    return float(probe[0]), bool(probe[1]), None if served is None else float(served)
