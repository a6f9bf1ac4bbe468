"""What a trial is asked to measure: prompt and output lengths, where the prompts come from (a
file, a dataset, a trace, conversations), the SLO, the levels or the capacity search that finds
them (runners/capacity/search.py), and the quality evaluation.

Plain data that pickles through Ray; imports of `runners` only the value types it holds
(`LoadLevel`, `CapacitySearch`), so that `base.py` (the results and the Runner protocol) and
`capacity.py` (judging a level) both build on it. A trace's file is read when its entries are
first asked for (`TraceReplay.entries`), once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from runners.capacity.search import CapacitySearch
from runners.load_level import LoadLevel

if TYPE_CHECKING:
    from runners.arrivals import TraceEntry


@dataclass(frozen=True)
class LengthDistribution:
    """Token-length distribution of prompts or outputs; `sample` lives in the load generator."""

    kind: Literal["fixed", "uniform", "normal", "lognormal"] = "fixed"
    mean: int = 512  # tokens; the value for "fixed"
    low: int | None = None  # tokens, inclusive clip (uniform: range start)
    high: int | None = None  # tokens, inclusive clip (uniform: range end)
    std: float = 0.0  # tokens for "normal"; sigma of log for "lognormal"


@dataclass(frozen=True)
class SLO:
    """Per-request latency targets, as `vllm bench serve --goodput ttft:MS tpot:MS e2el:MS`
    uses them: a request is good when it meets every bound set, so any one of them, e2el's
    alone included, defines goodput."""

    ttft_p99_ms: float | None = None
    tpot_p99_ms: float | None = None
    e2el_ms: float | None = None

    @property
    def is_set(self) -> bool:
        """Whether any bound is set (the one place that says which bounds count)."""
        return any(getattr(self, name) is not None for name in SLO_BOUNDS)


# The SLO's bounds, as the study file's `slo` section names them.
SLO_BOUNDS = ("ttft_p99_ms", "tpot_p99_ms", "e2el_ms")
# How a message asks for one.
SLO_BOUNDS_TEXT = "slo.ttft_p99_ms, slo.tpot_p99_ms and/or slo.e2el_ms"


@dataclass(frozen=True)
class QualityEval:
    """The output-quality evaluation a run adds after its load levels (runners/quality_eval.py):
    the first `num_prompts` prompts of the built-in corpus, each scored teacher-forced
    (`prompt_logprobs`) and continued greedily for `max_tokens` with top-`top_k` logprobs."""

    num_prompts: int = 32  # prompts of the built-in corpus (45 at most)
    max_tokens: int = 16  # greedy continuation per prompt, tokens
    top_k: int = 5  # logprobs per position
    # Also measure the prompts one at a time (the reference) besides all at once: the defaults
    # trial's two samples give the reference and the noise floor.
    measure_floor: bool = False
    timeout_s: float = 300.0  # the whole evaluation


@dataclass(frozen=True)
class SharedPrefix:
    """A fraction of the requests start with one of a few fixed prefixes (a shared system
    prompt); the rest are unique. The workload's `input_len` is the part *after* the prefix: a
    request that shares is `num_tokens` + input_len tokens long (runners/prefixes.py)."""

    fraction: float  # of requests, 0-1, that start with a shared prefix
    num_tokens: int  # tokens of each prefix
    num_prefixes: int = 1  # distinct prefixes, each request that shares picks one (uniform)

    def __post_init__(self) -> None:
        if not 0 <= self.fraction <= 1:
            raise ValueError(f"shared_prefix.fraction must be in [0, 1] but got "
                             f"{self.fraction}.")
        if self.num_tokens < 1 or self.num_prefixes < 1:
            raise ValueError(f"shared_prefix needs tokens >= 1 and num_prefixes >= 1 but got "
                             f"{self.num_tokens} and {self.num_prefixes}.")

    def describe(self) -> str:
        count = f"one of {self.num_prefixes} prefixes" if self.num_prefixes > 1 else \
            "one prefix"
        return f"{self.fraction:.0%} share {count} of {self.num_tokens} tokens"


@dataclass(frozen=True)
class TraceReplay:
    """Requests and their arrival times from a JSONL trace, replayed in time from the first
    arrival (runners/arrivals.py `read_trace` reads and checks it). A level's request rate is
    the replay's mean rate: the recorded gaps compressed or stretched to it."""

    path: Path
    timestamp_unit_s: float = 1.0  # seconds per timestamp unit: 0.001 for milliseconds
    # s; a longer gap between consecutive arrivals (an idle night) is replayed this long,
    # before any rate scaling. None: every gap as recorded.
    max_gap_s: float | None = None


    @functools.cached_property
    def entries(self) -> tuple[TraceEntry, ...]:
        """The trace's requests (`arrivals.read_trace`), read on first use and kept with the
        value: one parse however many levels replay it. Raises as `read_trace` does (ValueError
        naming `file:line`, OSError or UnicodeDecodeError), and reads again after a failure."""
        from runners.arrivals import read_trace

        return tuple(read_trace(self.path, self.timestamp_unit_s, self.max_gap_s))

@dataclass(frozen=True)
class DatasetSource:
    """A conversation dataset the prompts come from (runners/datasets.py reads it): each
    request is a conversation's first user turn, its output the length of the reply, and a
    conversation outside the bounds is left out, as vLLM's ShareGPT dataset does."""

    path: Path
    format: Literal["sharegpt"] = "sharegpt"
    output_len: int | None = None  # tokens for every request; None = the dataset reply's count
    min_len: int = 4  # tokens; vLLM's `is_valid_sequence` defaults, here and below
    max_prompt_len: int = 1024  # tokens
    max_total_len: int = 2048  # tokens, prompt + output (a conversation's whole context)


@dataclass(frozen=True)
class MultiTurn:
    """Conversations instead of single requests: turn k+1 is sent once turn k's reply has
    finished, its prompt the previous prompt, the reply and the next user message
    (runners/conversations.py). A level's concurrency counts conversations in flight."""

    num_turns: int = 4  # user turns of a synthesised conversation (a dataset has its own)
    max_turns: int | None = None  # at most this many turns of a dataset's conversation


@dataclass(frozen=True)
class Workload:
    """What load a trial drives. Every trial of a study gets the same prompts (same seed)."""

    input_len: LengthDistribution = field(default_factory=LengthDistribution)
    output_len: LengthDistribution = field(default_factory=lambda: LengthDistribution(mean=128))
    prompts_file: Path | None = None  # JSONL: {"prompt": str | [ids], "output_len": int?}
    levels: tuple[LoadLevel, ...] = (LoadLevel(max_concurrency=16),)
    num_requests: int | None = 128  # per level; None = run for duration_s
    duration_s: float | None = None  # per level, when num_requests is None
    num_warmup_requests: int = 8
    seed: int = 0
    slo: SLO = field(default_factory=SLO)
    vocab_size: int = 32000  # token ids are drawn below this when prompts are synthesised
    request_timeout_s: float = 600.0
    max_failed_fraction: float = 0.05  # a level with more failed requests is not a measurement
    profile: bool = False  # capture a torch-profiler trace in a window after the levels
    profile_num_requests: int = 32
    startup_timeout_s: float = 900.0
    # When set, the levels are found, not given: the highest load within the SLO, bracketed
    # on one running server (`CapacitySearch`, run by runners/engine.py); `levels` is then
    # unused.
    capacity: CapacitySearch | None = None
    repeats: int = 1  # measurements of each level on the same server (same prompts)
    quality: QualityEval | None = None  # an output-quality evaluation after the levels
    # The model directory whose tokenizer.json builds synthesised text prompts and counts text
    # prompts' tokens (runners/tokenizer.py); None: token-id prompts, estimated text lengths.
    tokenizer_dir: Path | None = None
    dataset: DatasetSource | None = None  # prompts from a conversation dataset
    multi_turn: MultiTurn | None = None  # conversations of several turns
    # Gamma shape of the gaps between rate-level arrivals (a level's own `burstiness` wins):
    # 1 = Poisson, lower = burstier, as `vllm bench serve --burstiness`.
    burstiness: float = 1.0
    shared_prefix: SharedPrefix | None = None  # prompts that start with a shared prefix
    trace: TraceReplay | None = None  # requests and arrival times from a trace file

    def burstiness_of(self, level: LoadLevel) -> float:
        return level.burstiness if level.burstiness is not None else self.burstiness

    def describe(self) -> str:
        """One line on the workload's shape, for the study's parameters and the report."""
        def length(dist: LengthDistribution) -> str:
            if dist.kind == "fixed":
                return str(dist.mean)
            if dist.kind == "uniform":
                return f"{dist.low}-{dist.high}"
            return f"{dist.kind}({dist.mean})"

        if self.trace is not None:
            parts = [f"trace {self.trace.path.name}"]
        elif self.dataset is not None:
            parts = [f"dataset {self.dataset.path.name} ({self.dataset.format})"]
        elif self.prompts_file is not None:
            parts = [f"prompts {self.prompts_file.name}, output {length(self.output_len)}"]
        else:
            parts = [f"input {length(self.input_len)}, output {length(self.output_len)} tokens"]
        if self.shared_prefix is not None:
            parts.append(self.shared_prefix.describe() + " (before the input)")
        if self.multi_turn is not None:
            turns = (f"up to {self.multi_turn.max_turns}" if self.dataset is not None
                     and self.multi_turn.max_turns else
                     "the dataset's" if self.dataset is not None else
                     str(self.multi_turn.num_turns))
            parts.append(f"multi-turn, {turns} turns")
        if self.burstiness != 1.0:
            parts.append(f"burstiness {self.burstiness:g}")
        return "; ".join(parts)
