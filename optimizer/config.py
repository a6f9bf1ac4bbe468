"""The study file: one YAML naming the model, workload, SLO, objective, space, budget and stores.

Parsed once into a typed, frozen `StudyConfig`; every error is one line naming the field and
the fix (`ConfigError`, exit code 2). Environment variables are read here and nowhere else.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

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

ObjectiveName = Literal["goodput", "throughput", "tpot", "ttft"]
OBJECTIVE_DIRECTIONS: dict[str, str] = {
    "goodput": "maximize",  # requests/s meeting the SLO (vllm bench serve's request_goodput)
    "throughput": "maximize",  # output tokens/s
    "tpot": "minimize",  # p99 time per output token, ms
    "ttft": "minimize",  # p99 time to first token, ms
}
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
DEFAULT_TRACKING_URI = "sqlite:///mlruns/mlflow.db"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(_Strict):
    path: str = Field(min_length=1)  # local dir with config.json, bundled shape or hub id
    load_format: Literal["auto", "dummy"] = "auto"
    skip_tokenizer_init: bool = False
    served_model_name: str = "model"


class LengthSpec(_Strict):
    kind: Literal["fixed", "uniform", "normal", "lognormal"] = "fixed"
    mean: int = Field(default=512, ge=1)
    low: int | None = Field(default=None, ge=1)
    high: int | None = Field(default=None, ge=1)
    std: float = Field(default=0.0, ge=0)

    @model_validator(mode="after")
    def _range(self) -> LengthSpec:
        if self.low is not None and self.high is not None and self.low > self.high:
            raise ValueError(f"low ({self.low}) must be <= high ({self.high})")
        if self.kind == "uniform" and (self.low is None or self.high is None):
            raise ValueError("a uniform length needs both low and high")
        return self


class LevelSpec(_Strict):
    request_rate: float | None = Field(default=None, gt=0)  # requests/s; None = all at once
    concurrency: int | None = Field(default=None, ge=1)

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
    low: float = Field(gt=0)  # the lightest load probed
    high: float = Field(gt=0)  # the heaviest load of interest
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
    prompts_file: Path | None = None
    levels: list[LevelSpec] = Field(default_factory=lambda: [LevelSpec(concurrency=16)],
                                    min_length=1, max_length=32)
    num_requests: int | None = Field(default=128, ge=1)
    duration_s: float | None = Field(default=None, gt=0)
    warmup_requests: int = Field(default=8, ge=0)
    seed: int = 0
    request_timeout_s: float = Field(default=600.0, gt=0)
    max_failed_fraction: float = Field(default=0.05, ge=0, le=1)
    startup_timeout_s: float = Field(default=900.0, gt=0)
    stall_timeout_s: float = Field(default=120.0, gt=0)  # no token this long = a hung engine
    profile: bool = False
    capacity: CapacitySpec | None = None  # bracket the load within the SLO; levels unused
    repeats: int = Field(default=1, ge=1, le=10)  # measurements of each level (noise)
    # A trial whose objective varies more than this across repeats (max-min over median) is
    # flagged unstable.
    max_spread: float = Field(default=0.10, gt=0)

    _coerce_lengths = field_validator("input_len", "output_len", mode="before")(
        classmethod(lambda cls, v: _length(v)))

    @model_validator(mode="after")
    def _bound(self) -> WorkloadSpec:
        if self.num_requests is None and self.duration_s is None:
            raise ValueError("set num_requests or duration_s to bound each load level")
        return self


class SLOSpec(_Strict):
    ttft_p99_ms: float | None = Field(default=None, gt=0)
    tpot_p99_ms: float | None = Field(default=None, gt=0)
    e2el_ms: float | None = Field(default=None, gt=0)


class BudgetSpec(_Strict):
    trials: int | None = Field(default=None, ge=1)
    wall_hours: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _some(self) -> BudgetSpec:
        if self.trials is None and self.wall_hours is None:
            raise ValueError("set trials and/or wall_hours")
        return self


class SimulatedSpec(_Strict):
    hardware: str = "h200"  # a preset under runners/hardware_profiles/
    num_gpus: int = Field(default=2, ge=1, le=64)  # GPUs declared to Ray
    startup_time_scale: float = Field(default=0.01, gt=0, le=1)
    seed: int = 0


class SamplerSpec(_Strict):
    name: Literal["tpe", "random", "gp", "nsga2"] = "tpe"
    seed: int | None = 0
    n_startup_trials: int = Field(default=6, ge=0)


class PrunerSpec(_Strict):
    # bottleneck: MarginPruner + classifier verdicts (`pruning.BottleneckPruner`);
    # median: `pruning.MarginPruner` alone; none: every trial runs all its levels.
    name: Literal["bottleneck", "median", "none"] = "bottleneck"
    n_startup_trials: int = Field(default=4, ge=0)
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
    cache_root: Path | None = None  # VLLM_CACHE_ROOT shared by every trial
    extra_args: list[str] = Field(default_factory=list)


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
    results_dir: Path | None = None  # default: results/<name>
    storage: str | None = None  # Optuna RDB URL; default sqlite under results_dir
    tracking_uri: str | None = None  # MLflow; default sqlite:///mlruns/mlflow.db
    env: dict[str, str] = Field(default_factory=dict)  # added to every trial's engine
    fixed_flags: dict[str, Any] = Field(default_factory=dict)  # vLLM flags every trial gets
    max_parallel_trials: int | None = Field(default=None, ge=1)
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
    got = err.get("input")
    got_text = "" if isinstance(got, dict | list) or got is None else f" but got {got!r}"
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
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = " ".join(str(getattr(exc, "problem", None) or exc).split())  # one line
        raise ConfigError(f"{path.name}: not valid YAML{where}: {problem[:200]}; fix the "
                          "syntax.") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path.name}: not UTF-8 text; save the study file as UTF-8.") from None
    return parse_study(data, path.name, path.resolve())
