"""The study file: one YAML naming the model, workload, SLO, objective, space, budget and stores.

Parsed once into a typed, frozen `StudyConfig`; every error is one line naming the field and
the fix (`ConfigError`, exit code 2). Environment variables are read here and nowhere else.
"""

from __future__ import annotations

import contextlib
import difflib
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Final, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from optimizer.errors import ConfigError
from runners.base import SLO, LengthDistribution, LoadLevel, Workload
from runners.capacity import CapacitySearch
from runners.vllm.flags import VllmFlags
from search_spaces.bounded_yaml import YamlLimitError, load_yaml

ObjectiveName = Literal["goodput", "throughput", "tpot", "ttft"]
OBJECTIVE_DIRECTIONS: dict[str, str] = {
    "goodput": "maximize",  # requests/s meeting the SLO (vllm bench serve's request_goodput)
    "throughput": "maximize",  # output tokens/s
    "tpot": "minimize",  # p99 time per output token, ms
    "ttft": "minimize",  # p99 time to first token, ms
}
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
DEFAULT_TRACKING_URI = "sqlite:///mlruns/mlflow.db"

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

# Flags nightshift sets on every engine itself, and the study key that says what they become.
# Each entry: what to write instead, as a clause.
OWNED_FLAGS: dict[str, str] = {
    "model": "set model.path instead",
    "host": "remove it: nightshift binds every engine to 127.0.0.1",
    "port": "remove it: nightshift gives every engine a free port",
    "uds": "remove it: nightshift talks to every engine over TCP on 127.0.0.1",
    "headless": "remove it: nightshift measures through the API server",
    "served-model-name": "set model.served_model_name instead",
    "load-format": "set model.load_format instead",
    "skip-tokenizer-init": "set model.skip_tokenizer_init instead",
    "profiler-config": "set workload.profile instead",
    "config": "set fixed_flags instead (a --config file could override what nightshift sets)",
    "api-key": "remove it: nightshift's load generator sends no API key",
}
_TRACKING_SCHEMES = ("", "file", "sqlite", "postgresql", "mysql", "mssql", "http", "https",
                     "databricks", "databricks-uc", "uc")
_STORAGE_BACKENDS = ("sqlite", "postgresql", "mysql", "mariadb", "oracle", "mssql")
_NUMBER_RE = re.compile(r"^-?\d+(\.\d*)?([eE][-+]?\d+)?$")


class _Strict(BaseModel):
    # strict: no `true` for an int, no "5" for a number; allow_inf_nan: no .inf or .nan.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class ModelSpec(_Strict):
    path: str = Field(min_length=1)  # local dir with config.json, bundled shape or hub id
    load_format: Literal["auto", "dummy"] = "auto"
    skip_tokenizer_init: bool = False
    served_model_name: str = "model"


class LengthSpec(_Strict):
    kind: Literal["fixed", "uniform", "normal", "lognormal"] = "fixed"
    mean: int = Field(default=512, ge=1, le=MAX_TOKENS)  # tokens
    low: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    high: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    std: float = Field(default=0.0, ge=0, le=MAX_TOKENS)

    @property
    def longest(self) -> int:
        """The longest length this can draw, as far as it is bounded: `high`, else the mean
        (a normal or lognormal tail without `high` is not bounded)."""
        return self.high if self.high is not None else self.mean

    @model_validator(mode="after")
    def _range(self) -> LengthSpec:
        if self.low is not None and self.high is not None and self.low > self.high:
            raise ValueError(f"low ({self.low}) must be <= high ({self.high})")
        if self.kind == "uniform" and (self.low is None or self.high is None):
            raise ValueError("a uniform length needs both low and high")
        return self


class LevelSpec(_Strict):
    request_rate: float | None = Field(default=None, gt=0, le=MAX_RATE_RPS)  # None = all at once
    concurrency: int | None = Field(default=None, ge=1, le=MAX_CONCURRENCY)

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
    # No probe sends new requests after this long (in-flight ones finish), whatever
    # num_requests: a light probe (few requests/s) must not take minutes.
    probe_duration_s: float = Field(default=30.0, gt=0, le=3600)

    @model_validator(mode="after")
    def _bracket(self) -> CapacitySpec:
        if self.low >= self.high:
            raise ValueError(f"low ({self.low:g}) must be below high ({self.high:g})")
        if self.axis == "concurrency" and (self.low != int(self.low) or
                                           self.high != int(self.high)):
            raise ValueError("concurrency bounds are whole numbers of requests")
        if not math.isfinite(self.high):
            raise ValueError("high must be finite")
        return self


def _length(value: Any) -> Any:
    return {"kind": "fixed", "mean": value} if isinstance(value, int) else value


class WorkloadSpec(_Strict):
    input_len: Annotated[LengthSpec, Field(default_factory=lambda: LengthSpec(mean=512))]
    output_len: Annotated[LengthSpec, Field(default_factory=lambda: LengthSpec(mean=128))]
    prompts_file: Annotated[Path | None, Field(strict=False)] = None
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

    _coerce_lengths = field_validator("input_len", "output_len", mode="before")(
        classmethod(lambda cls, v: _length(v)))

    @model_validator(mode="after")
    def _bound(self) -> WorkloadSpec:
        if self.num_requests is None and self.duration_s is None:
            raise ValueError("set num_requests or duration_s to bound each load level")
        if self.prompts_file is None:
            count = max(self.num_requests or 0, self.warmup_requests)
            tokens = count * self.input_len.longest
            if tokens > MAX_PROMPT_TOKENS_PER_LEVEL:
                raise ValueError(
                    f"{count} requests of up to {self.input_len.longest} prompt tokens make "
                    f"{tokens:,} tokens a level, over the {MAX_PROMPT_TOKENS_PER_LEVEL:,} the "
                    "load generator holds in memory; lower num_requests or input_len")
        return self


class SLOSpec(_Strict):
    ttft_p99_ms: float | None = Field(default=None, gt=0)
    tpot_p99_ms: float | None = Field(default=None, gt=0)
    e2el_ms: float | None = Field(default=None, gt=0)


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
    name: Literal["tpe", "random", "gp", "nsga2"] = "tpe"
    seed: int | None = Field(default=0, ge=0, le=MAX_SEED)
    n_startup_trials: int = Field(default=6, ge=0, le=100_000)


class PrunerSpec(_Strict):
    # bottleneck: MarginPruner + classifier verdicts (`pruning.BottleneckPruner`);
    # median: `pruning.MarginPruner` alone; none: every trial runs all its levels.
    name: Literal["bottleneck", "median", "none"] = "bottleneck"
    n_startup_trials: int = Field(default=4, ge=0, le=100_000)
    min_relative_gap: float = Field(default=0.10, ge=0, le=1)  # prune only when this much worse


class RaySpec(_Strict):
    """Where trials may run on a shared Ray cluster (`nightshift start --ray-address`)."""

    address: str | None = None  # "auto" or ray://host:10001; None = a local Ray in-process
    # Run only on nodes of this GPU model (Ray's accelerator_type label, e.g. "H100").
    accelerator_type: str | None = None
    # Custom resources a trial's worker needs, e.g. {"tuning_pool": 1}.
    resources: dict[str, float] = Field(default_factory=dict)

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


class VllmSpec(_Strict):
    # VLLM_CACHE_ROOT shared by every trial
    cache_root: Annotated[Path | None, Field(strict=False)] = None
    # Passed verbatim after the flags: only flags of vLLM that nightshift neither sets nor
    # searches (checked by `extra_args_problem`).
    extra_args: list[str] = Field(default_factory=list, max_length=256)

    @field_validator("extra_args")
    @classmethod
    def _extra_args(cls, v: list[str]) -> list[str]:
        problem = extra_args_problem(v)
        if problem is not None:
            raise ValueError(problem)
        return v


class StudySpec(_Strict):
    name: str
    model: ModelSpec
    workload: Annotated[WorkloadSpec, Field(default_factory=WorkloadSpec)]
    slo: Annotated[SLOSpec, Field(default_factory=SLOSpec)]
    objective: ObjectiveName | list[ObjectiveName] = "goodput"
    search_space: str = "auto"  # bundled name, path, or "auto" (by hardware class)
    budget: BudgetSpec
    # "auto": vLLM where a GPU and vllm are present, else the simulated engine (said loudly).
    engine: Literal["vllm", "simulated", "auto"] = "vllm"
    simulated: Annotated[SimulatedSpec, Field(default_factory=SimulatedSpec)]
    sampler: Annotated[SamplerSpec, Field(default_factory=SamplerSpec)]
    pruner: Annotated[PrunerSpec, Field(default_factory=PrunerSpec)]
    vllm: Annotated[VllmSpec, Field(default_factory=VllmSpec)]
    ray: Annotated[RaySpec, Field(default_factory=RaySpec)]
    results_dir: Annotated[Path | None, Field(strict=False)] = None  # default: results/<name>
    storage: str | None = None  # Optuna RDB URL; default sqlite under results_dir
    tracking_uri: str | None = None  # MLflow; default sqlite:///mlruns/mlflow.db
    env: dict[str, str] = Field(default_factory=dict)  # added to every trial's engine
    fixed_flags: dict[str, Any] = Field(default_factory=dict)  # vLLM flags every trial gets
    max_parallel_trials: int | None = Field(default=None, ge=1, le=1024)
    # Configs measured right after the defaults baseline, before the sampler's own: each names
    # only the params it changes (the rest stay at the defaults) and is checked against the
    # space. For coverage a short study must have, or a config the user already suspects.
    seed_trials: list[dict[str, Any]] = Field(default_factory=list, max_length=256)
    retries: int = Field(default=1, ge=0, le=5)  # re-queues of a trial lost to infrastructure
    # At the end, the best config and the defaults are measured again, interleaved (A B A B
    # for 2 rounds), and the gain is stated with its confidence interval. 0 = skip.
    confirm_rounds: int = Field(default=2, ge=0, le=10)

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v: str) -> str:
        if not _NAME_RE.match(v):
            raise ValueError(
                "must be 1-100 letters, digits, '.', '_' or '-' (it becomes a directory name)")
        return v

    @field_validator("objective")
    @classmethod
    def _objective(cls, v: Any) -> Any:
        if isinstance(v, list) and (not 1 <= len(v) <= 2 or len(set(v)) != len(v)):
            raise ValueError("give one objective or a pair of distinct ones")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for key in v:
            if not re.match(r"^[A-Z_][A-Z0-9_]*$", key):
                raise ValueError(f"{key!r} is not an environment variable name")
        return v

    @field_validator("fixed_flags")
    @classmethod
    def _fixed_flags(cls, v: dict[str, Any]) -> dict[str, Any]:
        for name, value in v.items():
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
    def _goodput_needs_slo(self) -> StudySpec:
        objectives = self.objective if isinstance(self.objective, list) else [self.objective]
        no_slo = self.slo.ttft_p99_ms is None and self.slo.tpot_p99_ms is None
        if "goodput" in objectives and no_slo:
            raise ValueError("objective goodput needs slo.ttft_p99_ms and/or slo.tpot_p99_ms")
        return self


class StudyConfig:
    """The validated study, with paths resolved against the study file's directory."""

    def __init__(self, spec: StudySpec, source: Path | None = None) -> None:
        self.spec = spec
        self.source = source
        base = source.parent if source is not None else Path.cwd()
        self.base_dir = base
        self.results_dir = _resolve(base, spec.results_dir) if spec.results_dir else \
            Path("results") / spec.name
        self.storage_url = spec.storage or f"sqlite:///{self.results_dir / 'optuna.db'}"
        self.tracking_uri = (spec.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
                             or DEFAULT_TRACKING_URI)
        self.prompts_file = _resolve(base, spec.workload.prompts_file) \
            if spec.workload.prompts_file else None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def source_name(self) -> str:
        """The study file's name, for messages."""
        return self.source.name if self.source is not None else "study.yaml"

    @property
    def baseline_name(self) -> str:
        return baseline_name(self.spec.fixed_flags)

    @property
    def engine_fixed_flags(self) -> dict[str, Any]:
        """`fixed_flags` as engine flags: a searchable flag rendered as the space renders it
        (`cudagraph_mode` -> `compilation_config.cudagraph_mode`, `enable_prefix_caching:
        false` -> `no_enable_prefix_caching`), any other flag as written."""
        from search_spaces import KNOWN_FLAGS, to_flags

        out: dict[str, Any] = {}
        for name, value in self.spec.fixed_flags.items():
            if name in KNOWN_FLAGS:
                out.update(to_flags({name: value}))
            else:
                out[name] = value
        return out

    @property
    def objectives(self) -> list[str]:
        o = self.spec.objective
        return list(o) if isinstance(o, list) else [o]

    @property
    def directions(self) -> list[str]:
        return [OBJECTIVE_DIRECTIONS[o] for o in self.objectives]

    @property
    def is_multi_objective(self) -> bool:
        return len(self.objectives) > 1

    def workload(self, vocab_size: int = 32000) -> Workload:
        w = self.spec.workload
        return Workload(
            input_len=_dist(w.input_len),
            output_len=_dist(w.output_len),
            prompts_file=self.prompts_file,
            levels=tuple(LoadLevel(request_rate_rps=lv.request_rate,
                                   max_concurrency=lv.concurrency) for lv in w.levels),
            num_requests=w.num_requests,
            duration_s=w.duration_s,
            num_warmup_requests=w.warmup_requests,
            seed=w.seed,
            slo=SLO(ttft_p99_ms=self.spec.slo.ttft_p99_ms,
                    tpot_p99_ms=self.spec.slo.tpot_p99_ms,
                    e2el_ms=self.spec.slo.e2el_ms),
            vocab_size=vocab_size,
            request_timeout_s=w.request_timeout_s,
            max_failed_fraction=w.max_failed_fraction,
            profile=w.profile,
            startup_timeout_s=w.startup_timeout_s,
            repeats=w.repeats,
            capacity=CapacitySearch(axis=w.capacity.axis, low=w.capacity.low,
                                    high=w.capacity.high, tolerance=w.capacity.tolerance,
                                    max_probes=w.capacity.max_probes,
                                    probe_duration_s=w.capacity.probe_duration_s)
            if w.capacity else None,
        )

    def to_dict(self) -> dict[str, Any]:
        return self.spec.model_dump(mode="json")

    def with_overrides(self, *, tracking_uri: str | None = None, storage: str | None = None,
                       trials: int | None = None) -> StudyConfig:
        """The same study with command-line overrides applied (None leaves a value as is)."""
        update: dict[str, Any] = {}
        if tracking_uri is not None:
            update["tracking_uri"] = tracking_uri
        if storage is not None:
            update["storage"] = storage
        if trials is not None:
            if trials < 1:
                raise ConfigError(f"--trials must be >= 1 but got {trials}.")
            update["budget"] = self.spec.budget.model_copy(update={"trials": trials})
        if not update:
            return self
        return StudyConfig(self.spec.model_copy(update=update), self.source)


def _dist(spec: LengthSpec) -> LengthDistribution:
    return LengthDistribution(kind=spec.kind, mean=spec.mean, low=spec.low, high=spec.high,
                              std=spec.std)


def _resolve(base: Path, p: Path) -> Path:
    p = p.expanduser()
    return p if p.is_absolute() else base / p


def _loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not str(part).startswith(("function-", "literal[", "list[")):
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def _fields_at(loc: tuple[int | str, ...]) -> list[str]:
    """The valid keys of the model at a location, for did-you-mean suggestions."""
    model: Any = StudySpec
    for part in loc:
        if isinstance(part, int) or model is None:
            continue
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        ann = field.annotation
        candidates = [ann, *getattr(ann, "__args__", ())]
        model = next((c for c in candidates if isinstance(c, type)
                      and issubclass(c, BaseModel)), None)
    return list(getattr(model, "model_fields", {}).keys()) if model else []


def format_validation_error(exc: ValidationError, source: str) -> str:
    """One line for the first problem: file, field, what was wrong, how to fix it."""
    errors = exc.errors()
    # A typo'd key also makes its intended key "missing": report the typo, it is the cause.
    err = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    loc = tuple(err["loc"])
    where = _loc(loc)
    if err["type"] == "extra_forbidden":
        key = str(loc[-1])
        valid = _fields_at(loc[:-1])
        close = difflib.get_close_matches(key, valid, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"valid keys: {', '.join(valid)}."
        return f"{source}: unknown key {where!r}; {hint}"
    if err["type"] == "missing":
        return f"{source}: {where} is required; add it (see examples/quickstart.yaml)."
    msg = str(err["msg"]).removeprefix("Value error, ")
    end = "" if msg.endswith((".", "?")) else "."
    if msg.startswith(where.split("[")[0]) and err["type"] == "value_error":
        return f"{source}: {msg}{end}"  # the check named the field itself (fixed_flags.x: ...)
    if where == "(top level)" and err["type"] == "value_error":
        return f"{source}: {msg}{end}"
    got = err.get("input")
    got_text = "" if isinstance(got, dict | list) or got is None else f" but got {got!r:.80}"
    return f"{source}: {where}: {msg}{got_text}."


def parse_study(data: Any, source: str = "study.yaml", path: Path | None = None) -> StudyConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of study settings at the top level, "
                          f"got {type(data).__name__}; see examples/quickstart.yaml.")
    try:
        spec = StudySpec.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, source)) from None
    return StudyConfig(spec, path)


def load_study(path: Path) -> StudyConfig:
    """Read and validate a study file; raises ConfigError (one line) on any problem."""
    if not path.is_file():
        raise ConfigError(f"{path}: no such study file; pass the path of a study YAML "
                          "(e.g. examples/quickstart.yaml).")
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{path.name}: cannot read the study file ({type(exc).__name__}); "
                          "check its permissions.") from None
    if len(raw) > MAX_FILE_BYTES:
        raise ConfigError(f"{path.name}: over {MAX_FILE_BYTES:,} bytes, far more than a study "
                          "file holds; check that this is the study YAML.")
    try:
        text = raw.decode("utf-8")
        data = load_yaml(text)
    except yaml.reader.ReaderError as exc:
        line = text.count("\n", 0, exc.position) + 1
        raise ConfigError(f"{path.name}: not valid YAML at line {line}: character "
                          f"#x{exc.character:04x} is not allowed in YAML text; remove it."
                          ) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = " ".join(str(getattr(exc, "problem", None) or exc).split())  # one line
        if isinstance(exc, YamlLimitError):
            raise ConfigError(f"{path.name}{where}: {problem[:200]}.") from None
        raise ConfigError(f"{path.name}: not valid YAML{where}: {problem[:200]}; fix the "
                          "syntax.") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path.name}: not UTF-8 text; save the study file as UTF-8.") from None
    except RecursionError:
        raise ConfigError(f"{path.name}: nested too deeply; a study file is a few levels "
                          "deep.") from None
    if data is None:
        raise ConfigError(f"{path.name}: the file is empty; see examples/quickstart.yaml for "
                          "a study.")
    return parse_study(data, path.name, path.resolve())


# -- checks of single fields (pure: no file system) --------------------------------------------


def _snake(kebab: str) -> str:
    return kebab.replace("-", "_")


def fixed_flag_problem(name: object, value: object,
                       table: VllmFlags | None = None) -> str | None:
    """Why `fixed_flags.<name>: <value>` would not run, or None: a flag of vLLM (any flag of the
    installed vLLM, else of 0.26; or of `table`) with a value of its type, or a
    simulated-engine fault."""
    from runners.simulated.faults import FAULT_PREFIX
    from runners.vllm.flags import flag_name, flag_table, value_problem
    from search_spaces import KNOWN_FLAGS
    from search_spaces.space import value_problem as space_value_problem

    if not isinstance(name, str) or not name.isprintable() or len(name) > 100:
        return f"fixed_flags: keys are vLLM flag names such as max_num_seqs but got {name!r:.60}"
    where = f"fixed_flags.{name}"
    if name.startswith(FAULT_PREFIX):
        return _fault_problem(name, value)
    table = table or flag_table()
    kebab = table.resolve(name)
    if name.replace("_", "-") in OWNED_FLAGS:
        return f"{where}: nightshift sets --{name.replace('_', '-')} itself; " \
               f"{OWNED_FLAGS[name.replace('_', '-')]}"
    # A space's own name counts only where it stands for a nested setting (cudagraph_mode ->
    # compilation_config.cudagraph_mode); any other name must be a flag of the table.
    if kebab is None and (name not in KNOWN_FLAGS or KNOWN_FLAGS[name].cli_name is None):
        close = difflib.get_close_matches(name, list(KNOWN_FLAGS), n=1) or \
            [_snake(c) for c in [table.closest(name)] if c is not None]
        hint = f"did you mean {close[0]!r}?" if close else "see `vllm serve --help`."
        version = ".".join(table.version.split(".")[:2])
        return f"{where}: not a vLLM {version} engine flag; {hint}"
    if "-" in name:
        return f"{where}: spell vLLM flags in snake_case here ({_snake(name)})"
    if kebab is not None:
        problem, shown = value_problem(table.types[kebab], value), kebab
    else:  # a space's own name for a nested setting (cudagraph_mode)
        problem = space_value_problem(name, value)
        shown = flag_name(KNOWN_FLAGS[name].cli_name or name)
    if problem is not None:
        return f"{where}: {problem}; give a value --{shown} accepts"
    return None


def _fault_problem(name: str, value: object) -> str | None:
    from dataclasses import fields

    from runners.simulated.faults import FAULT_PREFIX, Faults

    kinds = {f"{FAULT_PREFIX}{f.name}": str(f.type) for f in fields(Faults)}
    where = f"fixed_flags.{name}"
    if name not in kinds:
        close = difflib.get_close_matches(name, list(kinds), n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"valid: {', '.join(sorted(kinds))}."
        return f"{where}: not a simulated-engine fault; {hint}"
    kind = kinds[name]
    if value is None:
        return None
    if kind.startswith("bool"):
        ok = isinstance(value, bool)
    elif kind.startswith("int"):
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    else:
        ok = isinstance(value, int | float) and not isinstance(value, bool) and \
            math.isfinite(value) and value >= 0
    if not ok:
        want = {"bool": "true or false", "int": "a whole number >= 0"}.get(
            kind.split(" ")[0], "a finite number >= 0")
        return f"{where}: must be {want} but got {value!r:.60}"
    try:
        Faults.from_mapping({name: value})
    except ValueError as exc:
        return f"{where}: {str(exc).rstrip('.')}"
    return None


def _arg_flag(token: str) -> str | None:
    """The flag an `extra_args` token names, as written (`--max-num-seqs`, `-tp`); None for a
    value."""
    if not token.startswith("-") or token == "-" or _NUMBER_RE.match(token):
        return None
    if re.match(r"^-O(\d|\.|=|$)", token):  # -O3, -O.level=3: vLLM's optimization level
        return "optimization-level"
    if token.startswith("--"):
        return token[2:].split("=", 1)[0].split(".", 1)[0]
    return token.split("=", 1)[0].split(".", 1)[0]


def extra_args_problem(args: list[str]) -> str | None:
    """Why `vllm.extra_args` would not run as meant, or None: each flag is one of vLLM's, not
    one nightshift sets itself or searches (extra_args come last, so theirs would win)."""
    from runners.vllm.flags import flag_table
    from search_spaces import KNOWN_FLAGS

    table = flag_table()
    for index, token in enumerate(args):
        where = f"vllm.extra_args[{index}]"
        if not token or "\n" in token or "\0" in token or len(token) > 10_000:
            return f"{where}: expected one command-line word but got {token!r:.60}"
        written = _arg_flag(token)
        if written is None:
            if index == 0:
                return f"{where}: {token!r:.60} is not a flag; extra_args start with a --flag"
            continue
        if written.startswith("-"):  # a short alias such as -tp
            kebab = table.aliases.get(written)
        elif written.startswith("no-") and table.resolve(written[3:]) is not None:
            kebab = table.resolve(written[3:])
        else:
            kebab = table.resolve(written)
        if kebab is None:
            close = table.closest(written.lstrip("-"))
            hint = f"did you mean --{close}?" if close else "see `vllm serve --help`."
            version = ".".join(table.version.split(".")[:2])
            return f"{where}: {token!r:.60} is not a flag of vLLM {version}; {hint}"
        if kebab in OWNED_FLAGS:
            return f"{where}: nightshift sets --{kebab} itself; {OWNED_FLAGS[kebab]}"
        if _snake(kebab) in KNOWN_FLAGS:
            return (f"{where}: --{kebab} is a flag nightshift searches, and extra_args (passed "
                    f"last) would override every trial's value; set fixed_flags.{_snake(kebab)} "
                    "to fix it instead")
        problem = _extra_value_problem(args, index, written, kebab)
        if problem is not None:
            return f"{where}: {problem}"
    return None


def _extra_value_problem(args: list[str], index: int, written: str, kebab: str) -> str | None:
    """Why the value `args[index]` gives its flag would be refused by vLLM's parser, or None.
    Checked where the table knows the type: a boolean takes no value; an int, float or choice
    flag takes one (`--x=v` or the next word). Dotted (`--x.y=v`) and `-O3` forms pass."""
    from runners.vllm.flags import flag_table, value_problem

    token = args[index]
    if "." in token.split("=", 1)[0] or written == "optimization-level":
        return None
    flag = flag_table().types[kebab]
    following = args[index + 1] if index + 1 < len(args) else None
    is_value_next = following is not None and _arg_flag(following) is None
    if flag.kind == "bool" or written.startswith("no-"):
        if "=" in token or is_value_next:
            shown = token if "=" in token else f"{token} {following}"
            return f"--{written} takes no value but got {shown!r:.60}; drop the value"
        return None
    if flag.kind not in ("int", "float", "choice"):
        return None
    raw = token.split("=", 1)[1] if "=" in token else (following if is_value_next else None)
    if raw is None:
        return f"--{kebab} needs a value; give it as --{kebab}=VALUE or as the next word"
    value: object = raw
    if flag.kind == "float" or (flag.kind == "int" and re.fullmatch(r"-?\d+", raw)):
        with contextlib.suppress(ValueError):  # a word stays a word: refused below
            value = int(raw) if flag.kind == "int" else float(raw)
    problem = value_problem(flag, value)
    return None if problem is None else f"--{kebab} {problem}"


def storage_problem(url: str) -> str | None:
    """Why `storage` is not an Optuna RDB URL nightshift can use, or None (parse, scheme and
    driver only: nothing is created or connected to)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):
        return (f"storage: {url!r:.80} is not a database URL; give one such as "
                "sqlite:///results/optuna.db")
    backend = parsed.get_backend_name()
    if backend not in _STORAGE_BACKENDS:
        return (f"storage: {backend!r} is not a database Optuna stores to (valid: "
                f"{', '.join(_STORAGE_BACKENDS)}); give one such as sqlite:///results/optuna.db")
    if backend == "sqlite" and (not parsed.database or parsed.database == ":memory:"):
        return ("storage: an in-memory SQLite database loses the study when the daemon ends; "
                "give a file such as sqlite:///results/optuna.db")
    try:
        parsed.get_dialect().import_dbapi()
    except Exception as exc:  # NoSuchModuleError, ImportError: per dialect
        return (f"storage: the {parsed.drivername} driver is not installed here "
                f"({type(exc).__name__}); install it or use sqlite:///results/optuna.db")
    return None


_CONNECT_TIMEOUT_S: Final = 10  # a database server that does not answer in this long is down


def server_storage_problem(url: str) -> str | None:
    """Why a database server named by `storage` cannot be used, or None: one connection is
    opened and closed (nothing is created). A SQLite file is left alone here: connecting would
    create it, and `_check_parent` covers it."""
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        return None
    timeout = {"postgresql": "connect_timeout", "mysql": "connect_timeout",
               "mariadb": "connect_timeout"}.get(parsed.get_backend_name())
    engine = create_engine(parsed, connect_args={timeout: _CONNECT_TIMEOUT_S} if timeout else {})
    try:
        with engine.connect():
            return None
    except Exception as exc:  # OperationalError, InterfaceError, ...: per driver
        detail = " ".join(str(getattr(exc, "orig", None) or exc).split())[:120]
        return (f"storage: cannot connect to {parsed.render_as_string(hide_password=True)} "
                f"({detail}); start the database server or use sqlite:///results/optuna.db")
    finally:
        engine.dispose()


def tracking_uri_problem(uri: str) -> str | None:
    """Why `tracking_uri` is not an MLflow store, or None (parse and scheme only)."""
    from urllib.parse import urlparse

    try:
        parsed = urlparse(uri)
    except ValueError:
        return f"tracking_uri: {uri!r:.80} is not a URI; give sqlite:///mlruns/mlflow.db"
    scheme = parsed.scheme.split("+")[0]
    if scheme not in _TRACKING_SCHEMES:
        return (f"tracking_uri: MLflow does not store to scheme {parsed.scheme!r:.40}; give "
                "sqlite:///mlruns/mlflow.db or an http(s):// tracking server")
    if scheme == "sqlite" and not uri.startswith("sqlite:///"):
        return ("tracking_uri: a SQLite URI is sqlite:///relative/path.db or "
                "sqlite:////absolute/path.db (three or four slashes)")
    if scheme == "sqlite" and not uri.removeprefix("sqlite:///").strip():
        return "tracking_uri: the SQLite URI names no file; give sqlite:///mlruns/mlflow.db"
    if scheme in ("http", "https") and not parsed.hostname:
        return f"tracking_uri: {uri!r:.80} names no host; give http://HOST:PORT"
    return None


def baseline_name(fixed_flags: Mapping[str, Any]) -> str:
    """What the baseline trial runs: vLLM's defaults, plus the study's fixed flags (which every
    trial gets) when it has any."""
    if not fixed_flags:
        return "vLLM defaults"
    shown = ", ".join(f"{k}={v}" for k, v in list(fixed_flags.items())[:6])
    more = f" (+{len(fixed_flags) - 6} more)" if len(fixed_flags) > 6 else ""
    return f"vLLM defaults + your fixed flags ({shown}{more})"


# -- checks against the file system and the model, before `start` writes anything -------------


def check_before_start(cfg: StudyConfig) -> None:
    """What `nightshift start` checks before it writes or starts anything: the stores can be
    made where they are named (without making them), the prompts file reads as the load
    generator reads it, and the workload fits the model. Raises ConfigError (one line)."""
    for problem in (storage_problem(cfg.storage_url), tracking_uri_problem(cfg.tracking_uri)):
        if problem is not None:
            raise ConfigError(f"{cfg.source_name}: {problem}.")
    problem = server_storage_problem(cfg.storage_url)
    if problem is not None:
        raise ConfigError(f"{cfg.source_name}: {problem}.")
    made_by_us = [cfg.results_dir, Path("mlruns")]
    if cfg.storage_url.startswith("sqlite:///"):
        _check_parent("storage", Path(cfg.storage_url.removeprefix("sqlite:///")), made_by_us,
                      cfg.source_name)
    if cfg.tracking_uri.startswith("sqlite:///"):
        _check_parent("tracking_uri", Path(cfg.tracking_uri.removeprefix("sqlite:///")),
                      made_by_us, cfg.source_name)
    longest_prompt = cfg.spec.workload.input_len.longest
    if cfg.prompts_file is not None:
        longest_prompt = _check_prompts_file(cfg.prompts_file, cfg.source_name)
    _check_fits_model(cfg, longest_prompt)


def _check_parent(field: str, path: Path, made_by_us: list[Path], source: str) -> None:
    parent = path.expanduser().absolute().parent
    # nightshift makes the store's own directory (`.../mlruns/`), never a missing path above
    # it: a typo there would otherwise become a new directory tree.
    if parent.is_dir() or parent.parent.is_dir():
        return
    for ours in made_by_us:
        ours = ours.expanduser().absolute()
        if parent == ours or ours in parent.parents:
            return  # nightshift makes its own results and mlruns directories
    raise ConfigError(f"{source}: {field}: neither directory {str(parent)!r:.120} nor its "
                      "parent exists; create it or name a file in an existing directory.")


def _check_prompts_file(path: Path, source: str) -> int:
    from runners.loadgen import check_prompts_file

    where = f"{source}: workload.prompts_file"
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "does not exist"
        raise ConfigError(f"{where}: {str(path)!r:.120} {what}; give a JSONL file with one "
                          "{\"prompt\": ...} object a line.")
    if path.stat().st_size > MAX_PROMPTS_FILE_BYTES:
        raise ConfigError(f"{where}: {str(path)!r:.120} is over {MAX_PROMPTS_FILE_BYTES:,} "
                          "bytes; a benchmark needs a sample of prompts, not a corpus.")
    try:
        longest = check_prompts_file(path)
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read {str(path)!r:.120} ({type(exc).__name__}); "
                          "check its permissions.") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{where}: {str(path)!r:.120} is not UTF-8 text; give a JSONL "
                          "file.") from None
    except (ValueError, TypeError) as exc:
        message = " ".join(str(exc).split())[:300].rstrip(".")
        raise ConfigError(f"{where}: {message}.") from None
    return longest


def _human_int(value: object) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT]?)", value)
        if m:
            scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
                     "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[m.group(2)]
            return int(float(m.group(1)) * scale)
    return None


def _has_rope_scaling(model_path: str) -> bool:
    import json

    from runners.model_info import resolve_model_dir

    directory = resolve_model_dir(model_path)
    if directory is None:
        return False
    config = json.loads((directory / "config.json").read_text())
    sections = [config, config.get("text_config") or {}]
    return any(isinstance(c, dict) and c.get("rope_scaling") for c in sections)


def _check_fits_model(cfg: StudyConfig, longest_prompt: int) -> None:
    """A request's prompt and output must fit the engine's context (vLLM refuses it otherwise,
    and every request of every trial would fail)."""
    from runners.model_info import load_model_info

    fixed = _human_int(cfg.spec.fixed_flags.get("max_model_len"))
    if fixed is not None and fixed > 0:
        limit, why = fixed, "fixed_flags.max_model_len"
    else:
        try:
            model = load_model_info(cfg.spec.model.path)
        except (OSError, ValueError, TypeError, KeyError):
            return  # a model the runtime cannot read either: it says so itself
        if model is None or _has_rope_scaling(cfg.spec.model.path):
            # A hub id: not known offline. RoPE scaling: vLLM derives a longer context from
            # it than max_position_embeddings, by rules this check does not repeat.
            return
        limit, why = model.max_position_embeddings, f"{model.name}'s max_position_embeddings"
    longest = longest_prompt + cfg.spec.workload.output_len.longest
    if longest > limit:
        raise ConfigError(
            f"{cfg.source_name}: workload: a prompt of up to {longest_prompt} tokens plus an "
            f"output of up to {cfg.spec.workload.output_len.longest} is {longest} tokens, over "
            f"the max_model_len of {limit} ({why}); shorten input_len/output_len or raise "
            "fixed_flags.max_model_len.")
