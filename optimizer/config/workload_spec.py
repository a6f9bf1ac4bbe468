"""The study file's `workload` section: lengths, load levels, the capacity search, a shared
prefix, a trace, a dataset, multi-turn conversations, and the checks between them. Each spec
builds the runners' value type it stands for (`runners/workload.py`, the runner contract), so a
field is named and copied in one place."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from optimizer.config.fields import (
    MAX_BURSTINESS,
    MAX_CONCURRENCY,
    MAX_PROMPT_TOKENS_PER_LEVEL,
    MAX_RATE_RPS,
    MAX_REQUESTS,
    MAX_SECONDS,
    MAX_SEED,
    MAX_SHARED_PREFIXES,
    MAX_TOKENS,
    FilePath,
    StrictSpec,
)
from runners.capacity.search import CapacitySearch
from runners.load_level import LoadLevel
from runners.workload import (
    DatasetSource,
    LengthDistribution,
    MultiTurn,
    SharedPrefix,
    TraceReplay,
)

# A lognormal's sigma of the log beyond which its median is under 1% of its mean.
MAX_LOGNORMAL_SIGMA = 3.0


class LengthSpec(StrictSpec):
    kind: Literal["fixed", "uniform", "normal", "lognormal"] = "fixed"
    mean: int = Field(default=512, ge=1, le=MAX_TOKENS)  # tokens
    low: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    high: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    std: float = Field(default=0.0, ge=0, le=MAX_TOKENS)  # tokens; lognormal: sigma of the log

    @property
    def longest(self) -> int:
        """The longest length this can draw, as far as it is bounded: `high`, else the mean
        (a normal or lognormal tail without `high` is not bounded)."""
        return self.high if self.high is not None else self.mean

    def distribution(self) -> LengthDistribution:
        return LengthDistribution(**self.model_dump())

    @model_validator(mode="after")
    def _range(self) -> LengthSpec:
        if self.low is not None and self.high is not None and self.low > self.high:
            raise ValueError(f"low ({self.low}) must be <= high ({self.high})")
        if self.kind != "uniform" and not (self.low or 1) <= self.mean <= (self.high or
                                                                             self.mean):
            # Every draw would be clipped to a bound: the lengths would not be the ones asked.
            raise ValueError(f"mean ({self.mean}) must lie within low..high "
                             f"({self.low or 1}..{self.high or 'unbounded'}); move the mean or "
                             "the bounds")
        if self.kind == "lognormal" and self.std > MAX_LOGNORMAL_SIGMA:
            # Read as tokens, a sigma of hundreds puts nearly every draw at 1 token.
            raise ValueError(f"a lognormal's std is the sigma of the log of the length (0.3-1.5 "
                             f"is typical), at most {MAX_LOGNORMAL_SIGMA:g}, but got "
                             f"{self.std:g}; give it in those units, or use kind: normal for "
                             "a std in tokens")
        if self.kind == "uniform" and (self.low is None or self.high is None):
            raise ValueError("a uniform length needs both low and high")
        return self


class LevelSpec(StrictSpec):
    request_rate: float | None = Field(default=None, gt=0, le=MAX_RATE_RPS)  # None = all at once
    concurrency: int | None = Field(default=None, ge=1, le=MAX_CONCURRENCY)
    # Gamma shape of this level's arrival gaps (`vllm bench serve --burstiness`); None = the
    # workload's burstiness.
    burstiness: float | None = Field(default=None, gt=0, le=MAX_BURSTINESS)

    @model_validator(mode="after")
    def _some(self) -> LevelSpec:
        if self.request_rate is not None and not math.isfinite(self.request_rate):
            raise ValueError("request_rate must be finite; leave it out for 'all at once'")
        if self.request_rate is None and self.concurrency is None:
            raise ValueError("a load level needs request_rate and/or concurrency")
        return self

    def load_level(self) -> LoadLevel:
        return LoadLevel(request_rate_rps=self.request_rate, max_concurrency=self.concurrency,
                         burstiness=self.burstiness)


class CapacitySpec(StrictSpec):
    """Find each config's capacity under the SLO instead of measuring fixed levels."""

    axis: Literal["concurrency", "request_rate"] = "concurrency"
    low: float = Field(gt=0, le=MAX_RATE_RPS)  # the lightest load probed
    high: float = Field(gt=0, le=MAX_RATE_RPS)  # the heaviest load of interest
    tolerance: float = Field(default=0.05, gt=0, le=1)
    max_probes: int = Field(default=8, ge=2, le=32)
    # A trace or multi-turn probe (measured level by level) sends no new request after this
    # long (in-flight ones finish): a light probe (few requests/s) must not take minutes.
    probe_duration_s: float = Field(default=30.0, gt=0, le=3600)
    # Every other workload walks a steady staircase (runners/capacity/): each step's measured
    # window sends at least `min_window_requests` requests and lasts at least `min_window_s`, at
    # most `max_window_s`; its warm-up is two request lives (up to four while the in-flight
    # count still rises), or `warmup_s`.
    min_window_requests: int = Field(default=200, ge=1, le=1_000_000)
    min_window_s: float = Field(default=10.0, gt=0, le=3600)
    max_window_s: float = Field(default=180.0, gt=0, le=86_400)
    warmup_s: float | None = Field(default=None, ge=0, le=3600)
    # Then the bracket's lower end is held (runners/capacity/staircase.py): measured again over
    # at least `hold_s` and `hold_lives` request lives (Poisson arrivals conditioned on their
    # count over blocks of four lives: runners/capacity/stream_source.py), stepping down at most
    # `max_holds` times; 0 s: no hold (the claim rests on short windows, and says so).
    hold_s: float = Field(default=180.0, ge=0, le=86_400)
    hold_lives: float = Field(default=10.0, ge=0, le=1000)
    max_holds: int = Field(default=3, ge=1, le=10)

    @model_validator(mode="after")
    def _bracket(self) -> CapacitySpec:
        if self.low >= self.high:
            raise ValueError(f"low ({self.low:g}) must be below high ({self.high:g})")
        if self.max_window_s < self.min_window_s:
            raise ValueError(f"max_window_s ({self.max_window_s:g}) must be at least "
                             f"min_window_s ({self.min_window_s:g})")
        if self.axis == "concurrency" and (self.low != int(self.low) or
                                           self.high != int(self.high)):
            raise ValueError("concurrency bounds are whole numbers of requests")
        if not math.isfinite(self.high):
            raise ValueError("high must be finite")
        return self

    def search(self) -> CapacitySearch:
        return CapacitySearch(**self.model_dump())


class SharedPrefixSpec(StrictSpec):
    """`fraction` of the requests start with one of `num_prefixes` fixed prefixes of `tokens`
    tokens (a shared system prompt); the rest are unique. `input_len` is the part after the
    prefix: a request that shares is tokens + input_len long."""

    fraction: float = Field(ge=0, le=1)
    tokens: int = Field(ge=1, le=MAX_TOKENS)
    num_prefixes: int = Field(default=1, ge=1, le=MAX_SHARED_PREFIXES)

    def shared_prefix(self) -> SharedPrefix:
        return SharedPrefix(fraction=self.fraction, num_tokens=self.tokens,
                            num_prefixes=self.num_prefixes)


class TraceSpec(StrictSpec):
    """Requests and arrival times from a JSONL trace (vLLM's timed_trace fields: `timestamp`,
    `input_length`, `output_length`, optionally `prompt`), replayed in time from the first
    arrival; timestamps may be relative or absolute."""

    path: FilePath
    timestamp_unit_s: float = Field(default=1.0, gt=0, le=3600)  # 0.001: timestamps in ms
    # Replay speed of the default level (when `levels` is left out): 2 = twice as fast as
    # recorded. A level's request_rate, when given, is the replay's mean rate instead.
    time_scale: float = Field(default=1.0, gt=0, le=MAX_RATE_RPS)
    # Seconds: a longer gap between consecutive arrivals (an idle night) is replayed this
    # long, before time_scale or a level's rate; None replays every gap as recorded.
    max_gap_s: float | None = Field(default=None, gt=0, le=MAX_SECONDS)

    def replay(self, path: Path) -> TraceReplay:
        """The replay of the file at `path` (this spec's, resolved against the study file)."""
        return TraceReplay(**{**self.model_dump(exclude={"time_scale"}), "path": path})


class DatasetSpec(StrictSpec):
    """A conversation dataset the prompts come from (runners/datasets.py); the bounds are
    vLLM's ShareGPT filter's defaults (`is_valid_sequence`)."""

    format: Literal["sharegpt"] = "sharegpt"  # JSON list or JSONL of {"id", "conversations"}
    path: FilePath
    output_len: int | None = Field(default=None, ge=1, le=MAX_TOKENS)  # None: the reply's
    min_len: int = Field(default=4, ge=1, le=MAX_TOKENS)  # tokens
    max_prompt_len: int = Field(default=1024, ge=1, le=MAX_TOKENS)  # tokens
    max_total_len: int = Field(default=2048, ge=2, le=MAX_TOKENS)  # tokens, prompt + output

    @model_validator(mode="after")
    def _bounds(self) -> DatasetSpec:
        if self.min_len > self.max_prompt_len:
            raise ValueError(f"min_len ({self.min_len}) must be <= max_prompt_len "
                             f"({self.max_prompt_len})")
        return self

    def source(self, path: Path) -> DatasetSource:
        """The dataset at `path` (this spec's, resolved against the study file)."""
        return DatasetSource(**{**self.model_dump(), "path": path})


class MultiTurnSpec(StrictSpec):
    """Conversations: turn k+1 sent once turn k's reply has ended (runners/conversations.py)."""

    num_turns: int = Field(default=4, ge=1, le=100)  # user turns of a synthesised conversation
    max_turns: int | None = Field(default=None, ge=1, le=1000)  # of a dataset's conversation

    def multi_turn(self) -> MultiTurn:
        return MultiTurn(**self.model_dump())

def _length(value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool):
        return {"kind": "fixed", "mean": value}
    if not isinstance(value, dict):  # "five hundred", 512.5, true, a list
        raise ValueError("give a whole number of tokens (e.g. 512) or a distribution "
                         "{kind: uniform, low: .., high: ..}")
    return value


MIN_REQUEST_TIMEOUT_S = 1.0  # below, a completion cannot return (HTTP, a prefill, a token)
MIN_STARTUP_TIMEOUT_S = 1.0  # below, no engine process even imports its modules


class WorkloadSpec(StrictSpec):
    input_len: Annotated[LengthSpec, Field(default_factory=lambda: LengthSpec(mean=512))]
    output_len: Annotated[LengthSpec, Field(default_factory=lambda: LengthSpec(mean=128))]
    prompts_file: FilePath | None = None
    dataset: DatasetSpec | None = None  # prompts from a conversation dataset
    multi_turn: MultiTurnSpec | None = None  # conversations of several turns
    levels: list[LevelSpec] = Field(default_factory=lambda: [LevelSpec(concurrency=16)],
                                    min_length=1, max_length=32)
    num_requests: int | None = Field(default=128, ge=1, le=MAX_REQUESTS)
    duration_s: float | None = Field(default=None, gt=0, le=MAX_SECONDS)
    warmup_requests: int = Field(default=8, ge=0, le=MAX_REQUESTS)
    seed: int = Field(default=0, ge=0, le=MAX_SEED)
    request_timeout_s: float = Field(default=600.0, gt=0, le=MAX_SECONDS)
    max_failed_fraction: float = Field(default=0.05, ge=0, le=1)
    startup_timeout_s: float = Field(default=900.0, gt=0, le=MAX_SECONDS)
    # no token this long = a hung engine
    stall_timeout_s: float = Field(default=120.0, gt=0, le=MAX_SECONDS)
    profile: bool = False
    capacity: CapacitySpec | None = None  # bracket the load within the SLO; levels unused
    repeats: int = Field(default=1, ge=1, le=10)  # measurements of each level (noise)
    # A trial whose objective varies more than this across repeats (max-min over median) is
    # flagged unstable.
    max_spread: float = Field(default=0.10, gt=0, le=100)
    # Gamma shape of the gaps between arrivals at a request rate, as `vllm bench serve
    # --burstiness`: 1 = Poisson, lower = burstier, higher = more regular. A level may set its own.
    burstiness: float = Field(default=1.0, gt=0, le=MAX_BURSTINESS)
    # A fraction of the prompts start with a shared prefix; input_len is the part after it.
    shared_prefix: SharedPrefixSpec | None = None
    # Replay a trace's requests at its arrival times; levels' request_rate = its mean rate.
    trace: TraceSpec | None = None

    _coerce_lengths = field_validator("input_len", "output_len", mode="before")(
        classmethod(lambda cls, v: _length(v)))

    @model_validator(mode="after")
    def _trace(self) -> WorkloadSpec:
        if self.shared_prefix is not None and self.prompts_file is not None:
            raise ValueError("shared_prefix does not apply to a prompts_file (its prompts are "
                             "whole); leave one out")
        if self.trace is None:
            return self
        if self.prompts_file is not None:
            raise ValueError("trace and prompts_file both give the requests; keep one")
        if self.capacity is not None and self.capacity.axis == "concurrency":
            raise ValueError("a trace sets its own arrivals, so a capacity search over "
                             "concurrency does not apply; use capacity.axis: request_rate (the "
                             "replay's mean rate) or leave capacity out")
        if "levels" in self.model_fields_set and any(lv.request_rate is None
                                                     for lv in self.levels):
            raise ValueError("with a trace each level's request_rate is the replay's mean "
                             "rate (the recorded gaps compressed or stretched to it); give "
                             "every level a request_rate, or leave levels out to replay it as "
                             "recorded")
        if self.burstiness != 1.0 or any(lv.burstiness is not None for lv in self.levels):
            raise ValueError("a trace replays its own arrival times, so burstiness does not "
                             "apply; leave burstiness out")
        return self

    @model_validator(mode="after")
    def _meetable(self) -> WorkloadSpec:
        if self.request_timeout_s < MIN_REQUEST_TIMEOUT_S:
            raise ValueError(f"workload.request_timeout_s: {self.request_timeout_s:g} s is "
                             f"below the {MIN_REQUEST_TIMEOUT_S:g} s a request needs, so every "
                             "request would time out; it is in seconds (the default is 600)")
        if self.startup_timeout_s < MIN_STARTUP_TIMEOUT_S:
            raise ValueError(f"workload.startup_timeout_s: {self.startup_timeout_s:g} s is "
                             f"below the {MIN_STARTUP_TIMEOUT_S:g} s any engine process needs "
                             "to start, so every trial would fail; it is in seconds (the "
                             "default is 900)")
        if self.capacity is not None and "levels" in self.model_fields_set:
            raise ValueError("workload.levels is unused with workload.capacity (the search "
                             "chooses each probe's load); leave levels out, or capacity out to "
                             "measure the levels")
        return self

    @model_validator(mode="after")
    def _bound(self) -> WorkloadSpec:
        if self.num_requests is None and self.duration_s is None and self.trace is None:
            raise ValueError("set num_requests or duration_s to bound each load level")
        if self.dataset is not None and self.prompts_file is not None:
            raise ValueError("set workload.dataset or workload.prompts_file, not both")
        source = "prompts_file" if self.prompts_file is not None else "dataset" \
            if self.dataset is not None else "trace" if self.trace is not None else None
        if source is not None and "input_len" in self.model_fields_set:
            # Its prompts are the file's: a length given here would silently do nothing.
            raise ValueError(f"workload.input_len has no effect: the prompts come from "
                             f"workload.{source}; leave input_len out")
        if self.multi_turn is not None and self.prompts_file is not None:
            raise ValueError("workload.multi_turn takes its turns from workload.dataset or "
                             "synthesises them; remove workload.prompts_file")
        if self.multi_turn is not None and (
                any(lv.request_rate is not None for lv in self.levels)
                or (self.capacity is not None and self.capacity.axis != "concurrency")):
            raise ValueError("workload.multi_turn: a level's load is conversations in flight; "
                             "give levels with concurrency only (no request_rate) and "
                             "capacity.axis: concurrency")
        if self.trace is not None and (self.dataset is not None
                                       or self.multi_turn is not None):
            raise ValueError("a trace gives the requests and their arrival times; leave "
                             "workload.dataset and workload.multi_turn out")
        if self.shared_prefix is not None and (self.dataset is not None
                                               or self.multi_turn is not None):
            raise ValueError("shared_prefix applies to synthesised single-turn prompts; "
                             "leave it out with workload.dataset or workload.multi_turn")
        if self.duration_s is None and self.trace is None and self.capacity is None \
                and self.num_requests is not None:
            for index, level in enumerate(self.levels):
                rate = level.request_rate
                if rate is not None and self.num_requests / rate > MAX_SECONDS:
                    # The load generator would sleep between arrivals for days.
                    raise ValueError(
                        f"workload.levels[{index}]: {self.num_requests} requests at {rate:g} "
                        "requests/s "
                        f"take {self.num_requests / rate / 3600:,.0f} h to send, over the "
                        f"{MAX_SECONDS / 3600:g} h a level may take; raise request_rate, lower "
                        "num_requests or set duration_s")
        if self.prompts_file is None and self.dataset is None and self.trace is None:
            count = max(self.num_requests or 0, self.warmup_requests)
            prefix = self.shared_prefix.tokens if self.shared_prefix else 0
            tokens = count * (self.input_len.longest + prefix)
            if tokens > MAX_PROMPT_TOKENS_PER_LEVEL:
                longest = self.input_len.longest + prefix
                raise ValueError(
                    f"{count} requests of up to {longest} prompt tokens make "
                    f"{tokens:,} tokens a level, over the {MAX_PROMPT_TOKENS_PER_LEVEL:,} the "
                    "load generator holds in memory; lower num_requests or input_len")
        return self
