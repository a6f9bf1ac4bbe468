"""The study file's schema: pydantic models of every section, the bounds a study may ask for, and
the plug-in names checked against their registries (samplers, pruners, runners, objectives).
Building a `StudySpec` validates; `optimizer.config.loading` turns its errors into one line."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from optimizer.config.flag_checks import (
    HUMAN_READABLE_INT_FLAGS,
    _arg_flag,
    extra_args_problem,
    fixed_flag_problem,
    human_readable_int,
)
from optimizer.config.store_checks import storage_problem, tracking_uri_problem
from optimizer.engines import RUNNERS
from optimizer.objectives import OBJECTIVES
from optimizer.samplers import SAMPLERS
from optimizer.search.pruners import PRUNERS
from runners.credentials import API_KEY_ENV, SECRET_FLAGS, is_secret_flag

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")

# Bounds on what a study may ask for, so that a typo (10**9 requests) is refused up front rather
# than exhausting memory hours later. Each is far beyond any real benchmark.
MAX_TOKENS = 10_000_000  # one prompt or output: longer than any model's context today
MAX_REQUESTS = 100_000  # per load level (and warm-up)
# The load generator holds a level's prompts in memory as token ids, about 36 bytes a token in
# Python: 2*10^7 tokens is ~0.7 GB.
MAX_PROMPT_TOKENS_PER_LEVEL = 20_000_000
MAX_CONCURRENCY = 100_000
MAX_RATE_RPS = 1_000_000.0
MAX_SECONDS = 86_400.0  # a timeout or a level's duration: one day
MAX_SEED = 2**32 - 1  # numpy's seeds (Optuna's samplers, the load generator)
# The study file itself: a study is a page of YAML, never megabytes.
MAX_FILE_BYTES = 1_000_000
MAX_PROMPTS_FILE_BYTES = 1 << 30
MAX_TRACE_FILE_BYTES = 1 << 30
# Gamma shape: 1000 gives gaps within ~3% of 1/rate, as regular as a benchmark needs.
MAX_BURSTINESS = 1000.0
MAX_SHARED_PREFIXES = 1024


def _nonempty_path(value: Any) -> Any:
    if isinstance(value, str) and not value.strip():
        # pydantic would take "" as Path("."): the study file's own directory.
        raise ValueError("expected a path (or leave the key out)")
    return value


# A file or directory the study names, resolved against the study file's directory.
FilePath = Annotated[Path, Field(strict=False), BeforeValidator(_nonempty_path)]


def registered(field: str, name: object, registry: Mapping[str, object],
               also: tuple[str, ...] = ()) -> str:
    """`name` when it is a key of the plug-in `registry` (or one of `also`); else a ValueError
    that names the field, lists the valid names and shows what was given."""
    valid = [*registry, *also]
    if not isinstance(name, str) or name not in valid:
        raise ValueError(f"{field}: expected one of {', '.join(map(repr, valid))} but got "
                         f"{name!r:.60}")
    return name


class _Strict(BaseModel):
    # strict: no `true` for an int, no "5" for a number; allow_inf_nan: no .inf or .nan.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class ModelSpec(_Strict):
    path: str = Field(min_length=1)  # local dir with config.json, bundled shape or hub id
    load_format: Literal["auto", "dummy"] = "auto"
    skip_tokenizer_init: bool = False
    # What requests name the model (`--served-model-name`): one printable word.
    served_model_name: str = Field(default="model", min_length=1, max_length=200,
                                   pattern=r"^[^\s\x00-\x1f\x7f]+$")


# A lognormal's sigma of the log beyond which its median is under 1% of its mean.
MAX_LOGNORMAL_SIGMA = 3.0


class LengthSpec(_Strict):
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


class LevelSpec(_Strict):
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


class CapacitySpec(_Strict):
    """Find each config's capacity under the SLO instead of measuring fixed levels."""

    axis: Literal["concurrency", "request_rate"] = "concurrency"
    low: float = Field(gt=0, le=MAX_RATE_RPS)  # the lightest load probed
    high: float = Field(gt=0, le=MAX_RATE_RPS)  # the heaviest load of interest
    tolerance: float = Field(default=0.05, gt=0, le=1)
    max_probes: int = Field(default=8, ge=2, le=32)
    # A trace or multi-turn probe (measured level by level) sends no new request after this
    # long (in-flight ones finish): a light probe (few requests/s) must not take minutes.
    probe_duration_s: float = Field(default=30.0, gt=0, le=3600)
    # Every other workload walks a steady staircase (runners/staircase.py): each step's
    # measured window sends at least `min_window_requests` requests and lasts at least
    # `min_window_s`, at most `max_window_s`; its warm-up is one request life, or `warmup_s`.
    min_window_requests: int = Field(default=200, ge=1, le=1_000_000)
    min_window_s: float = Field(default=10.0, gt=0, le=3600)
    max_window_s: float = Field(default=180.0, gt=0, le=86_400)
    warmup_s: float | None = Field(default=None, ge=0, le=3600)

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


class SharedPrefixSpec(_Strict):
    """`fraction` of the requests start with one of `num_prefixes` fixed prefixes of `tokens`
    tokens (a shared system prompt); the rest are unique. `input_len` is the part after the
    prefix: a request that shares is tokens + input_len long."""

    fraction: float = Field(ge=0, le=1)
    tokens: int = Field(ge=1, le=MAX_TOKENS)
    num_prefixes: int = Field(default=1, ge=1, le=MAX_SHARED_PREFIXES)


class TraceSpec(_Strict):
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


class DatasetSpec(_Strict):
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


class MultiTurnSpec(_Strict):
    """Conversations: turn k+1 sent once turn k's reply has ended (runners/conversations.py)."""

    num_turns: int = Field(default=4, ge=1, le=100)  # user turns of a synthesised conversation
    max_turns: int | None = Field(default=None, ge=1, le=1000)  # of a dataset's conversation


def _yaml_off(value: Any) -> Any:
    """YAML 1.1 reads a bare `off` as false: the word meant."""
    return "off" if value is False else value


def _length(value: Any) -> Any:
    return {"kind": "fixed", "mean": value} if isinstance(value, int) else value


MIN_REQUEST_TIMEOUT_S = 1.0  # below, a completion cannot return (HTTP, a prefill, a token)
MIN_STARTUP_TIMEOUT_S = 1.0  # below, no engine process even imports its modules


class WorkloadSpec(_Strict):
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


class QualitySpec(_Strict):
    """The quality gate (optimizer/quality.py). The limits are provisional until measured on
    real weights (docs/quality.md): a limit set to null is not checked."""

    # auto: on with real weights and a tokenizer, skipped (and said so) otherwise.
    enabled: Literal["auto", "on", "off"] = "auto"
    # Defaults from the H200 run on SmolLM2-135M (docs/quality.md): fp8 KV passes them (+0.64%,
    # 0.0064 nats, 93.0%), fp8 weights do not (+2.9-3.1%, 0.018 nats, 86.7%); a policy choice.
    max_ppl_increase: float | None = Field(default=0.01, ge=0, le=100)  # 0.01 = +1%
    max_mean_kl: float | None = Field(default=0.01, ge=0, le=100)  # nats
    min_top1_agreement: float | None = Field(default=0.90, ge=0, le=1)  # fraction
    min_greedy_match_tokens: float | None = Field(default=None, ge=0, le=4096)
    num_prompts: int = Field(default=32, ge=1, le=45)  # of the built-in corpus (45 prompts)
    max_tokens: int = Field(default=16, ge=1, le=256)  # greedy continuation per prompt
    top_k: int = Field(default=5, ge=1, le=20)  # logprobs per position

    @field_validator("enabled", mode="before")
    @classmethod
    def _yaml_bool(cls, v: Any) -> Any:
        # YAML 1.1 reads a bare `on` / `off` as a boolean.
        return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v


# The least each SLO limit can be, in ms: below it no engine meets it and every trial fails
# (a limit written in seconds under an `_ms` key lands here). A first token takes a loopback
# HTTP round trip, a scheduling step and a prefill; a decode step of the smallest model on the
# fastest GPU takes over a millisecond.
MIN_SLO_MS: Mapping[str, float] = {"ttft_p99_ms": 5.0, "tpot_p99_ms": 1.0, "e2el_ms": 5.0}


class SLOSpec(_Strict):
    ttft_p99_ms: float | None = Field(default=None, gt=0)
    tpot_p99_ms: float | None = Field(default=None, gt=0)
    e2el_ms: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _meetable(self) -> SLOSpec:
        for name, floor in MIN_SLO_MS.items():
            value = getattr(self, name)
            if value is not None and value < floor:
                raise ValueError(
                    f"slo.{name}: {value:g} ms is below the {floor:g} ms any engine needs, so "
                    f"every trial would fail; the limit is in milliseconds (did you mean "
                    f"{value * 1000:g}?)")
        if self.e2el_ms is not None and self.ttft_p99_ms is not None \
                and self.e2el_ms < self.ttft_p99_ms:
            raise ValueError(f"slo.e2el_ms: {self.e2el_ms:g} ms is below slo.ttft_p99_ms "
                             f"({self.ttft_p99_ms:g} ms), but a request ends after its first "
                             "token; raise e2el_ms or lower ttft_p99_ms")
        return self


class BudgetSpec(_Strict):
    trials: int | None = Field(default=None, ge=1, le=100_000)
    wall_hours: float | None = Field(default=None, gt=0, le=24 * 365)

    @model_validator(mode="after")
    def _some(self) -> BudgetSpec:
        if self.trials is None and self.wall_hours is None:
            raise ValueError("set trials and/or wall_hours")
        return self


class SimulatedSpec(_Strict):
    hardware: str = "h200"  # a preset under runners/hardware_profiles/
    num_gpus: int = Field(default=2, ge=1, le=64)  # GPUs declared to Ray
    startup_time_scale: float = Field(default=0.01, gt=0, le=1)
    seed: int = Field(default=0, ge=0, le=MAX_SEED)


class SamplerSpec(_Strict):
    # A key of `samplers.SAMPLERS`. "screen" (the informed start, then TPE) since issue 36:
    # bench/search_efficiency.py shows it best of random, TPE and the screen (bench/README.md).
    name: str = "screen"
    seed: int | None = Field(default=0, ge=0, le=MAX_SEED)
    n_startup_trials: int = Field(default=6, ge=0, le=100_000)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return registered("sampler.name", v, SAMPLERS)


class PrunerSpec(_Strict):
    name: str = "bottleneck"  # a key of `pruning.PRUNERS`
    n_startup_trials: int = Field(default=4, ge=0, le=100_000)
    min_relative_gap: float = Field(default=0.10, ge=0, le=1)  # prune only when this much worse

    @field_validator("name", mode="before")
    @classmethod
    def _name(cls, v: Any) -> str:
        # `off` (YAML's false) is a guess at `none`: the message lists the names.
        return registered("pruner.name", _yaml_off(v), PRUNERS)


_RAY_ADDRESS_RE = re.compile(r"^(ray://)?[A-Za-z0-9._-]+(\[[0-9A-Fa-f:]+\])?:(\d{1,5})$|"
                             r"^(ray://)?\[[0-9A-Fa-f:]+\]:(\d{1,5})$")


def ray_address_problem(address: str) -> str | None:
    """Why `address` is not one `ray.init` joins (auto, HOST:PORT or ray://HOST:PORT), or None;
    Ray itself would raise a traceback, or wait minutes on a malformed one."""
    if address == "auto":
        return None
    match = _RAY_ADDRESS_RE.match(address)
    port = next((int(g) for g in (match.groups() if match else ()) if g and g.isdigit()), 0)
    if match is None or not 1 <= port <= 65535:
        return (f"expected auto, HOST:PORT or ray://HOST:PORT but got {address!r:.80}; give "
                "the address `ray start --head` printed")
    return None


class RaySpec(_Strict):
    """Where trials may run on a shared Ray cluster (`nightshift start --ray-address`)."""

    address: str | None = None  # "auto" or ray://host:10001; None = a local Ray in-process
    # Run only on nodes of this GPU model (Ray's accelerator_type label, e.g. "H100").
    accelerator_type: str | None = None
    # Custom resources a trial's worker needs, e.g. {"tuning_pool": 1}.
    resources: dict[str, float] = Field(default_factory=dict)

    @field_validator("address")
    @classmethod
    def _address(cls, v: str | None) -> str | None:
        problem = None if v is None else ray_address_problem(v)
        if problem is not None:
            raise ValueError(problem)
        return v

    @field_validator("resources")
    @classmethod
    def _resources(cls, v: dict[str, float]) -> dict[str, float]:
        for name, amount in v.items():
            if name in ("CPU", "GPU", "memory", "object_store_memory"):
                raise ValueError(f"{name!r} is set by nightshift per trial; name a custom "
                                 "resource")
            if not amount > 0:
                raise ValueError(f"{name} must be > 0 but got {amount}")
        return v


def env_problem(name: str, value: str) -> str | None:
    """Why a variable in `env` would spoil the study, or None."""
    if name == "CUDA_VISIBLE_DEVICES":
        return ("nightshift places each trial on its own GPUs (Ray sets CUDA_VISIBLE_DEVICES "
                "per trial), and this would override that placement; remove it, and limit the "
                "GPUs with ray.address or by starting nightshift with CUDA_VISIBLE_DEVICES set")
    if name == "LD_PRELOAD":
        # A bare name is looked up as the loader does; a path must be there.
        for library in value.replace(":", " ").split():
            if "/" in library and not Path(library).is_file():
                return (f"{library!r} is not a file, so every engine would start with a loader "
                        "error; give an existing library or remove LD_PRELOAD")
    return None


def _secret_flag_fix(flag: str) -> str:
    """Why a secret flag is refused in a study, and what to do instead."""
    kebab = "--" + flag.partition("=")[0].lstrip("-").replace("_", "-")
    variable = SECRET_FLAGS[kebab]
    if variable == API_KEY_ENV:
        return (f"{kebab} is set by nightshift, which gives each trial's engine its own random "
                "key; remove it")
    return (f"{kebab} would put a secret on the engine's command line, where every local user "
            f"reads it (ps); remove it and set env.{variable} (or export {variable}), which "
            "the engine reads from its environment")


class VllmSpec(_Strict):
    # VLLM_CACHE_ROOT shared by every trial
    cache_root: FilePath | None = None
    # Passed verbatim after the flags: only flags of vLLM that nightshift neither sets nor
    # searches (checked by `extra_args_problem`).
    extra_args: list[str] = Field(default_factory=list, max_length=256)

    @field_validator("extra_args")
    @classmethod
    def _extra_args(cls, v: list[str]) -> list[str]:
        for index, token in enumerate(v):
            if is_secret_flag(token):
                raise ValueError(f"vllm.extra_args[{index}]: {_secret_flag_fix(token)}")
        problem = extra_args_problem(v)
        if problem is not None:
            raise ValueError(problem)
        return v


# Start-up savers a study may turn on (docs/startup-cost.md): each leaves the measured config
# unchanged, by vLLM 0.26's source, under the condition named. name -> the env it sets.
STARTUP_SAVERS: dict[str, dict[str, str]] = {
    # Greedy requests never take FlashInfer's top-k/top-p sampler (v1/worker/gpu/sample/
    # sampler.py:231-246): off, the start-up skips building it (a first start JIT-builds it).
    # nightshift's load generator sends temperature 0 only (runners/loadgen.py send_request).
    "flashinfer_sampler_off": {"VLLM_USE_FLASHINFER_SAMPLER": "0"},
}


class StartupSpec(_Strict):
    """What a trial's start-up costs, and what cuts it without changing the config measured."""

    # shared: one VLLM_CACHE_ROOT for every trial on a host (vllm.cache_root, else
    # ~/.cache/nightshift/vllm), kept across daemon restarts; per_trial: each trial its own
    # cache under its results directory (isolation; every compiled start is cold).
    compile_cache: Literal["shared", "per_trial"] = "shared"
    # Start a trial whose compile key is warm before one that compiles, and never compile one
    # key twice at once (the second waits for the first, or other work starts).
    order_by_compile_key: bool = True
    # Launch a trial predicted warm with VLLM_FORCE_AOT_LOAD=1 (vLLM then fails instead of
    # compiling): a wrong prediction is recorded and the trial relaunched without it.
    verify_warm: bool = False
    savers: list[str] = Field(default_factory=list, max_length=8)

    @field_validator("savers")
    @classmethod
    def _savers(cls, v: list[str]) -> list[str]:
        for name in v:
            registered("startup.savers", name, STARTUP_SAVERS)
        if len(set(v)) != len(v):
            raise ValueError("startup.savers: a saver is named twice; name each once")
        return v


class KnownFactsSpec(_Strict):
    # Ids of measured facts (search_spaces/facts/known_facts.yaml, the user's file; `nightshift
    # hw` lists them) this study does not apply: their values stay in its space.
    ignore: list[str] = Field(default_factory=list, max_length=256)


class StudySpec(_Strict):
    name: str
    model: ModelSpec
    workload: Annotated[WorkloadSpec, Field(default_factory=WorkloadSpec)]
    slo: Annotated[SLOSpec, Field(default_factory=SLOSpec)]
    quality: Annotated[QualitySpec, Field(default_factory=QualitySpec)]
    objective: str | list[str] = "goodput"  # key(s) of `objectives.OBJECTIVES`
    search_space: str = "auto"  # bundled name, path, or "auto" (by hardware class)
    budget: BudgetSpec
    # "auto": vLLM where a GPU and vllm are present, else the simulated engine (said loudly).
    engine: str = "vllm"  # a key of `engines.RUNNERS`, or "auto"
    simulated: Annotated[SimulatedSpec, Field(default_factory=SimulatedSpec)]
    sampler: Annotated[SamplerSpec, Field(default_factory=SamplerSpec)]
    pruner: Annotated[PrunerSpec, Field(default_factory=PrunerSpec)]
    vllm: Annotated[VllmSpec, Field(default_factory=VllmSpec)]
    startup: Annotated[StartupSpec, Field(default_factory=StartupSpec)]
    ray: Annotated[RaySpec, Field(default_factory=RaySpec)]
    results_dir: FilePath | None = None  # default: results/<name>
    storage: str | None = None  # Optuna RDB URL; default sqlite under results_dir
    tracking_uri: str | None = None  # MLflow; default sqlite:///mlruns/mlflow.db
    env: dict[str, str] = Field(default_factory=dict)  # added to every trial's engine
    fixed_flags: dict[str, Any] = Field(default_factory=dict)  # vLLM flags every trial gets
    max_parallel_trials: int | None = Field(default=None, ge=1, le=1024)
    # Configs measured right after the defaults baseline, before the sampler's own: each names
    # only the params it changes (the rest stay at the defaults) and is checked against the
    # space. For coverage a short study must have, or a config the user already suspects.
    seed_trials: list[dict[str, Any]] = Field(default_factory=list, max_length=256)
    # The hardware class's folklore (search_spaces/templates/hardware.yaml) as seed trials right
    # after the defaults, before seed_trials, each tagged `seed.source: template:<name>`; a
    # template the space or its rules refuse is reported skipped with the reason. "off" by
    # default: a template takes a trial of the budget, and an existing study file (or a study
    # resumed after an upgrade) keeps running exactly the trials it asked for (docs/knobs.md).
    templates: Literal["auto", "off"] = "off"
    _templates_yaml = field_validator("templates", mode="before")(
        classmethod(lambda cls, v: _yaml_off(v)))
    retries: int = Field(default=1, ge=0, le=5)  # re-queues of a trial lost to infrastructure
    # At the end, the best config and the defaults are measured again, interleaved (A B A B
    # for 2 rounds), and the gain is stated with its confidence interval. 0 = skip.
    confirm_rounds: int = Field(default=2, ge=0, le=10)
    # The tuning memory (docs/tuning-memory.md): "auto" seeds the best configs of up to 3
    # earlier studies in the tracking store whose fingerprint is compatible, right after the
    # defaults; a list names the studies to seed from; "off" seeds none. Seeds are measured
    # anew, never copied.
    warm_start: Literal["auto", "off"] | list[str] = "auto"
    known_facts: Annotated[KnownFactsSpec, Field(default_factory=KnownFactsSpec)]

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v: str) -> str:
        if not _NAME_RE.match(v):
            raise ValueError(
                "must be 1-100 letters, digits, '.', '_' or '-' (it becomes a directory name)")
        return v

    @field_validator("warm_start", mode="before")
    @classmethod
    def _warm_start_yaml(cls, v: Any) -> Any:
        # YAML 1.1 reads a bare `off` as false.
        v = "off" if v is False else v
        if v not in ("auto", "off") and not (isinstance(v, list) and
                                             all(isinstance(n, str) for n in v)):
            got = f" but got {v!r:.60}" if isinstance(v, list) else ""
            raise ValueError(f"expected auto, off or a list of study names{got}")
        return v

    @field_validator("warm_start")
    @classmethod
    def _warm_start(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, list):
            if not 1 <= len(v) <= 16 or len(set(v)) != len(v):
                raise ValueError("expected auto, off or a list of 1-16 distinct study names "
                                 f"but got {len(v)} names")
            for name in v:
                if not _NAME_RE.match(name):
                    raise ValueError(f"expected study names but got {name!r:.60}")
        return v

    @field_validator("objective")
    @classmethod
    def _objective(cls, v: Any) -> Any:
        if isinstance(v, list) and (not 1 <= len(v) <= 2 or len(set(v)) != len(v)):
            raise ValueError("give one objective or a pair of distinct ones")
        for name in v if isinstance(v, list) else [v]:
            registered("objective", name, OBJECTIVES)
        return v

    @field_validator("engine")
    @classmethod
    def _engine(cls, v: str) -> str:
        return registered("engine", v, RUNNERS, also=("auto",))

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        out = dict(v)
        for key, value in v.items():
            if not re.match(r"^[A-Z_][A-Z0-9_]*$", key):
                raise ValueError(f"{key!r} is not an environment variable name")
            if "\0" in value:
                raise ValueError(f"env.{key}: a value cannot hold a NUL character (no process "
                                 "environment can); remove it")
            if key == API_KEY_ENV:
                raise ValueError(f"env.{key}: nightshift gives each trial's engine its own "
                                 "random key; remove it")
            if value == f"${{{key}}}":
                # A secret named, not written (as study.json and the export name it): its
                # value comes from this process's environment.
                if key not in os.environ:
                    raise ValueError(f"env.{key}: ${{{key}}} takes {key} from the environment, "
                                     f"but it is not set here; export {key} or give the value")
                out[key] = os.environ[key]
            problem = env_problem(key, out[key])
            if problem is not None:
                raise ValueError(f"env.{key}: {problem}")
        return out

    @field_validator("fixed_flags")
    @classmethod
    def _fixed_flags(cls, v: dict[str, Any]) -> dict[str, Any]:
        v = dict(v)
        for name, value in v.items():
            if is_secret_flag("--" + name.replace("_", "-")):
                raise ValueError(f"fixed_flags.{name}: {_secret_flag_fix(name)}")
            if name in HUMAN_READABLE_INT_FLAGS and isinstance(value, str):
                # vLLM takes "4k" here: read it as vLLM does, so the study holds the integer.
                try:
                    v[name] = value = human_readable_int(value)
                except ValueError:
                    raise ValueError(f"fixed_flags.{name}: {value!r:.40} is not an integer or "
                                     "vLLM's form of one (4k = 4000, 4K = 4096)") from None
            problem = fixed_flag_problem(name, value)
            if problem is not None:
                raise ValueError(problem)
        return v

    @field_validator("storage")
    @classmethod
    def _storage(cls, v: str | None) -> str | None:
        problem = None if v is None else storage_problem(v)
        if problem is not None:
            raise ValueError(problem)
        return v

    @field_validator("tracking_uri")
    @classmethod
    def _tracking_uri(cls, v: str | None) -> str | None:
        problem = None if v is None else tracking_uri_problem(v)
        if problem is not None:
            raise ValueError(problem)
        return v

    @model_validator(mode="after")
    def _extra_args_vs_fixed(self) -> StudySpec:
        for token in self.vllm.extra_args:
            name = _arg_flag(token)
            if name is not None and name.replace("-", "_") in self.fixed_flags:
                raise ValueError(f"vllm.extra_args: {token} repeats fixed_flags."
                                 f"{name.replace('-', '_')}; set it in one place")
        return self

    @model_validator(mode="after")
    def _warm_start_not_itself(self) -> StudySpec:
        if isinstance(self.warm_start, list) and self.name in self.warm_start:
            raise ValueError(f"warm_start: names this study ({self.name}) itself; a study "
                             "resumes its own trials without it: remove the name")
        return self

    @model_validator(mode="after")
    def _startup_vs_env(self) -> StudySpec:
        env = self.env
        if env.get("VLLM_ENABLE_STARTUP_PLAN", "0") not in ("", "0"):
            raise ValueError("env.VLLM_ENABLE_STARTUP_PLAN: vLLM 0.26 would apply one trial's "
                             "profiled KV-cache size to another (its plan is keyed without "
                             "gpu_memory_utilization or max_num_seqs), changing the config "
                             "measured; remove it (docs/startup-cost.md)")
        for name in self.startup.savers:
            for key in STARTUP_SAVERS[name]:
                if key in env:
                    raise ValueError(f"startup.savers: {name} sets {key} but env sets it too; "
                                     "set it in one place")
        if self.startup.verify_warm:
            if self.startup.compile_cache == "per_trial":
                raise ValueError("startup.verify_warm: a per_trial compile cache is never warm; "
                                 "set compile_cache: shared or drop verify_warm")
            if env.get("VLLM_USE_AOT_COMPILE") == "0" or env.get(
                    "VLLM_DISABLE_COMPILE_CACHE", "0") not in ("", "0"):
                raise ValueError("startup.verify_warm: VLLM_FORCE_AOT_LOAD checks the AOT cache, "
                                 "which env turns off (VLLM_USE_AOT_COMPILE=0 or "
                                 "VLLM_DISABLE_COMPILE_CACHE); drop one of them")
        if "VLLM_FORCE_AOT_LOAD" in env:
            raise ValueError("env.VLLM_FORCE_AOT_LOAD: it would fail every trial that must "
                             "compile; remove it (startup.verify_warm sets it per trial)")
        return self

    @model_validator(mode="after")
    def _quality_needs_weights(self) -> StudySpec:
        if self.quality.enabled == "on" and (self.model.load_format == "dummy"
                                            or self.model.skip_tokenizer_init):
            raise ValueError("quality.enabled: on needs real weights and a tokenizer but "
                             "model.load_format is dummy or model.skip_tokenizer_init is set; "
                             "set quality.enabled: auto (skipped, and said so) or off")
        return self

    @model_validator(mode="after")
    def _multi_turn_needs_text(self) -> StudySpec:
        if self.workload.multi_turn is not None and self.model.skip_tokenizer_init:
            raise ValueError("workload.multi_turn sends text (each turn carries the server's "
                             "reply) but model.skip_tokenizer_init makes the server take token "
                             "ids only; unset model.skip_tokenizer_init or remove multi_turn")
        return self

    @model_validator(mode="after")
    def _objectives_need_slo(self) -> StudySpec:
        objectives = self.objective if isinstance(self.objective, list) else [self.objective]
        no_slo = self.slo.ttft_p99_ms is None and self.slo.tpot_p99_ms is None
        for name in objectives:
            if OBJECTIVES[name].needs_slo and no_slo:
                raise ValueError(f"objective {name} needs slo.ttft_p99_ms and/or "
                                 "slo.tpot_p99_ms")
        return self
