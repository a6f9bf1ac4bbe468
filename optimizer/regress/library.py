"""The benchmark library `nightshift regress` re-measures: its YAML schema (strict pydantic, as
the study file's), loading with one-line errors, and appending a case (`export --to-library`).
A case reuses the study file's `model`, `workload`, `slo` and `simulated` sections and their
loaders (`StudyConfig.workload`), so a library case measures what a study trial measured."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from optimizer.config import StudyConfig
from optimizer.config.fields import MAX_FILE_BYTES, StrictSpec, registered
from optimizer.config.schema import StudySpec
from optimizer.config.sections import ModelSpec, SimulatedSpec, SLOSpec
from optimizer.config.store_checks import refuse_problem, tracking_uri_problem
from optimizer.config.validation_errors import format_validation_error
from optimizer.config.workload_spec import WorkloadSpec
from optimizer.errors import ConfigError, translate
from optimizer.results.objectives import OBJECTIVES
from optimizer.run.engines import RUNNERS
from runners.atomic import write_atomic
from runners.workload import SLO_BOUNDS_TEXT
from search_spaces.bounded_yaml import load_yaml, yaml_message

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
_ENV_RE = re.compile(r"^[A-Z_][A-Z0-9_]*$")
MAX_SAMPLES = 1000

Direction = Literal["maximize", "minimize"]
# The figures a reference may hold: name -> (better direction, the `BenchmarkMetrics` field read
# at the case's headline level, as `vllm bench serve` names it).
FIGURES: dict[str, tuple[Direction, str]] = {
    "goodput": ("maximize", "request_goodput"),
    "request_throughput": ("maximize", "request_throughput"),
    "output_throughput": ("maximize", "output_throughput"),
    "ttft_p50_ms": ("minimize", "median_ttft_ms"),
    "ttft_p99_ms": ("minimize", "p99_ttft_ms"),
    "tpot_p50_ms": ("minimize", "median_tpot_ms"),
    "tpot_p99_ms": ("minimize", "p99_tpot_ms"),
    "itl_p50_ms": ("minimize", "median_itl_ms"),
    "e2el_p50_ms": ("minimize", "median_e2el_ms"),
}
# What `export --to-library` records: the figures a study's headline level always has.
DEFAULT_FIGURES = ("goodput", "output_throughput", "tpot_p50_ms", "ttft_p99_ms")


def _check_name(value: str) -> str:
    if not _NAME_RE.match(value):
        raise ValueError("must be 1-100 letters, digits, '.', '_' or '-'")
    return value


class FigureRef(StrictSpec):
    """One reference figure: its samples (each round x repeat), or a mean with the 95%
    interval of that mean and the count it came from."""

    samples: list[float] | None = Field(default=None, min_length=1, max_length=MAX_SAMPLES)
    mean: float | None = Field(default=None, ge=0)
    ci_low: float | None = Field(default=None, ge=0)
    ci_high: float | None = Field(default=None, ge=0)
    n: int | None = Field(default=None, ge=1, le=MAX_SAMPLES)

    @field_validator("samples", mode="before")
    @classmethod
    def _numbers(cls, v: Any) -> Any:  # an int sample (a YAML `3`) is a number too
        return [float(x) if isinstance(x, int) and not isinstance(x, bool) else x
                for x in v] if isinstance(v, list) else v

    @model_validator(mode="after")
    def _one_form(self) -> FigureRef:
        if self.samples is not None:
            if any(x < 0 for x in self.samples):
                raise ValueError("samples must be >= 0")
            if self.mean is not None or self.ci_low is not None or self.ci_high is not None:
                raise ValueError("give samples, or mean with ci_low/ci_high and n, not both")
            return self
        if self.mean is None:
            raise ValueError("give samples (a list), or mean with ci_low, ci_high and n")
        if (self.ci_low is None) != (self.ci_high is None):
            raise ValueError("give both ci_low and ci_high, or neither")
        if self.ci_low is not None and self.ci_high is not None and not \
                self.ci_low <= self.mean <= self.ci_high:
            raise ValueError(f"ci_low <= mean <= ci_high must hold but got {self.ci_low:g}, "
                             f"{self.mean:g}, {self.ci_high:g}")
        if self.ci_low is not None and (self.n or 1) < 2:
            raise ValueError("an interval needs n >= 2 (the samples it came from)")
        return self

    @property
    def values(self) -> list[float]:
        return list(self.samples) if self.samples is not None else [float(self.mean or 0.0)]

    @property
    def center(self) -> float:
        """The geometric mean of the samples (the mean where only that is given); the arithmetic
        mean where a sample is 0."""
        if self.samples is None:
            return float(self.mean or 0.0)
        if all(x > 0 for x in self.samples):
            return math.exp(sum(math.log(x) for x in self.samples) / len(self.samples))
        return sum(self.samples) / len(self.samples)


class Reference(StrictSpec):
    vllm_version: str = Field(min_length=1, max_length=64)  # e.g. 0.26.0
    card: str = Field(min_length=1, max_length=200)  # e.g. NVIDIA H200
    date: str = Field(min_length=1, max_length=40)  # ISO date of the measurement
    figures: dict[str, FigureRef] = Field(min_length=1)
    source: str = ""  # where it came from, e.g. "study qwen7b, trial 12 + 2 confirmation runs"

    @field_validator("vllm_version", "date", mode="before")
    @classmethod
    def _text(cls, v: Any) -> Any:  # YAML reads 2026-12-04 as a date and 0.26 as a float
        return str(v) if not isinstance(v, str | list | dict) and v is not None else v

    @field_validator("figures")
    @classmethod
    def _known(cls, v: dict[str, FigureRef]) -> dict[str, FigureRef]:
        for name in v:
            registered("figures", name, FIGURES)
        return v


class LibraryConfig(StrictSpec):
    """One config a case holds: vLLM-style snake_case flags (as `export` writes them), its
    environment, and its reference measurement."""

    name: str
    flags: dict[str, Any] = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict)
    reference: Reference | None = None  # None: measured, reported, but nothing to compare

    _name = field_validator("name")(classmethod(lambda cls, v: _check_name(v)))

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for key in v:
            if not _ENV_RE.match(key):
                raise ValueError(f"{key!r} is not an environment variable name")
        return v

    @field_validator("flags")
    @classmethod
    def _flags(cls, v: dict[str, Any]) -> dict[str, Any]:
        for key in v:
            if not re.match(r"^[a-z][a-z0-9_]*(\.[A-Za-z0-9_.]+)?$", key):
                raise ValueError(f"{key!r} is not a vLLM flag in snake_case (as `nightshift "
                                 "export` writes them, e.g. max_num_seqs)")
        return v


class CaseSpec(StrictSpec):
    name: str
    model: ModelSpec
    workload: Annotated[WorkloadSpec, Field(default_factory=WorkloadSpec)]
    slo: Annotated[SLOSpec, Field(default_factory=SLOSpec)]
    engine: str = "auto"  # a key of `engines.RUNNERS`, or "auto"
    simulated: Annotated[SimulatedSpec, Field(default_factory=lambda: SimulatedSpec(num_gpus=1))]
    # Picks the headline level where the workload has several (as a study's objective does).
    objective: str = "goodput"
    # Engine starts per config, interleaved (defaults, best, defaults, best, ...); each start
    # measures the level `repeats` times on the same server.
    rounds: int = Field(default=2, ge=1, le=20)
    repeats: int = Field(default=1, ge=1, le=10)
    configs: list[LibraryConfig] = Field(min_length=1, max_length=16)

    _name = field_validator("name")(classmethod(lambda cls, v: _check_name(v)))

    @field_validator("engine")
    @classmethod
    def _engine(cls, v: str) -> str:
        return registered("engine", v, RUNNERS, also=("auto",))

    @field_validator("objective")
    @classmethod
    def _objective(cls, v: str) -> str:
        return registered("objective", v, OBJECTIVES)

    @model_validator(mode="after")
    def _case(self) -> CaseSpec:
        if self.workload.capacity is not None:
            raise ValueError("workload.capacity: regress re-measures fixed load levels; give "
                             "workload.levels instead of a capacity search")
        if "repeats" in self.workload.model_fields_set:
            raise ValueError("workload.repeats: set the case's repeats instead (one place)")
        if OBJECTIVES[self.objective].needs_slo and not self.slo.is_set:
            raise ValueError(f"objective {self.objective} needs {SLO_BOUNDS_TEXT}; set one, "
                             "or objective: throughput")
        names = [c.name for c in self.configs]
        if len(set(names)) != len(names):
            raise ValueError(f"configs: names must differ but got {names}")
        for config in self.configs:
            if config.reference is None:
                continue
            if "goodput" in config.reference.figures and not self.slo.is_set:
                raise ValueError(f"configs {config.name}: a goodput reference needs the case's "
                                 "slo; set slo or drop the goodput figure")
        return self

    def study_config(self, source: Path | None = None) -> StudyConfig:
        """The case as the study file it came from: the loaders that turn `model`, `workload`
        and `slo` into a runner's `Workload` and `EngineConfig` are the study's own."""
        spec = StudySpec.model_validate({
            "name": self.name, "model": self.model,
            "workload": self.workload.model_copy(update={"repeats": self.repeats}),
            "slo": self.slo, "objective": self.objective, "budget": {"trials": 1},
            "engine": self.engine, "simulated": self.simulated,
            # Regress compares speed; the quality gate is the study's business.
            "quality": {"enabled": "off"}})
        return StudyConfig(spec, source)


class LibrarySpec(StrictSpec):
    name: str
    # A figure regressed when it is worse than its reference by more than this fraction AND
    # its interval excludes no change.
    threshold: float = Field(default=0.05, gt=0, lt=1)
    tracking_uri: str | None = None  # MLflow; default as a study's
    cases: list[CaseSpec] = Field(min_length=1, max_length=256)

    _name = field_validator("name")(classmethod(lambda cls, v: _check_name(v)))

    _tracking_uri = field_validator("tracking_uri")(
        classmethod(lambda cls, v: refuse_problem(v, tracking_uri_problem)))

    @model_validator(mode="after")
    def _unique(self) -> LibrarySpec:
        names = [c.name for c in self.cases]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise ValueError(f"cases: two cases are named {dup!r}; rename one")
        return self


def _read_yaml(path: Path) -> Any:
    if not path.is_file():
        raise ConfigError(f"{path}: no such library file; pass the path of a library YAML "
                          "(see docs/regress.md).")
    raw = path.read_bytes()[:MAX_FILE_BYTES + 1]
    if len(raw) > MAX_FILE_BYTES:
        raise ConfigError(f"{path.name}: over {MAX_FILE_BYTES:,} bytes, far more than a "
                          "library holds; check that this is the library YAML.")
    try:
        text = raw.decode("utf-8")
        return load_yaml(text)
    except UnicodeDecodeError as exc:
        raise translate(exc, f"{path.name}: not UTF-8 text; save the library as UTF-8.") from exc
    except yaml.YAMLError as exc:
        raise translate(exc, yaml_message(exc, path.name, text)) from exc


def parse_library(data: Any, source: str = "library.yaml") -> LibrarySpec:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping with name and cases at the top level, "
                          f"got {type(data).__name__}; see docs/regress.md.")
    try:
        return LibrarySpec.model_validate(data)
    except ValidationError as exc:
        raise translate(exc, format_validation_error(exc, source, LibrarySpec,
                                                     "docs/regress.md")) from exc


def load_library(path: Path) -> LibrarySpec:
    """Read and validate a library; ConfigError (one line, exit 2) on any problem."""
    data = _read_yaml(path)
    if data is None:
        raise ConfigError(f"{path.name}: the file is empty; see docs/regress.md for a library.")
    return parse_library(data, path.name)


def append_case(path: Path, case: Mapping[str, Any], library_name: str) -> str:
    """Add `case` to the library at `path` (created when absent; a case of the same name is
    replaced), validated as a whole before the file is written. Returns what was done."""
    data: dict[str, Any]
    if path.exists():
        loaded = _read_yaml(path)
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path.name}: not a library (no mapping at the top level); "
                              "give another --to-library file.")
        data = loaded
        parse_library(data, path.name)  # the file as it is must be valid before we add to it
    else:
        data = {"name": library_name, "threshold": 0.05, "cases": []}
    cases = list(data.get("cases") or [])
    replaced = any(c.get("name") == case["name"] for c in cases if isinstance(c, dict))
    cases = [c for c in cases if not (isinstance(c, dict) and c.get("name") == case["name"])]
    cases.append(dict(case))
    data["cases"] = cases
    parse_library(data, path.name)  # what we write is a valid library
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, yaml.safe_dump(data, sort_keys=False, default_flow_style=False))
    return "replaced" if replaced else "added"


def with_new_references(path: Path, references: Mapping[str, Mapping[str, Mapping[str, Any]]],
                        out: Path) -> None:
    """The library at `path` written to `out` with the references of the configs named in
    `references` (case -> config -> reference mapping) replaced: the next run compares with
    this one. Validated as a whole before it is written."""
    data = _read_yaml(path)
    for case in data.get("cases") or []:
        for config in case.get("configs") or []:
            new = references.get(case.get("name"), {}).get(config.get("name"))
            if new is not None:
                config["reference"] = dict(new)
    parse_library(data, out.name)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, yaml.safe_dump(data, sort_keys=False, default_flow_style=False))
