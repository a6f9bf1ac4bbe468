"""The study file's schema: `StudySpec`, its sections (`sections`, `workload_spec`) and the
checks between them; the plug-in names checked against their registries (samplers, pruners,
runners, objectives). Building a `StudySpec` validates; `optimizer.config.loading` turns its
errors into one line."""

from __future__ import annotations

import os
import re
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from optimizer.config.fields import NAME_RE, FilePath, StrictSpec, registered, yaml_off
from optimizer.config.flag_checks import (
    HUMAN_READABLE_INT_FLAGS,
    _arg_flag,
    fixed_flag_problem,
    human_readable_int,
)
from optimizer.config.sections import (
    STARTUP_SAVERS,
    BudgetSpec,
    KnownFactsSpec,
    ModelSpec,
    PrunerSpec,
    QualitySpec,
    RaySpec,
    SamplerSpec,
    SimulatedSpec,
    SLOSpec,
    StartupSpec,
    VllmSpec,
    env_problem,
    secret_flag_fix,
)
from optimizer.config.store_checks import (
    refuse_problem,
    storage_problem,
    tracking_uri_problem,
)
from optimizer.config.workload_spec import WorkloadSpec
from optimizer.errors import cause_of
from optimizer.results.objectives import OBJECTIVES
from optimizer.run.engines import RUNNERS
from runners.credentials import API_KEY_ENV, is_secret_flag
from runners.workload import SLO_BOUNDS_TEXT


class StudySpec(StrictSpec):
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
        classmethod(lambda cls, v: yaml_off(v)))
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
        if not NAME_RE.match(v):
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
                if not NAME_RE.match(name):
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
    def _fixed_flags(cls, v: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        v = dict(v)
        # Against the release vllm.version names (validated before: it comes first), else the
        # installed vLLM's table, else 0.26's.
        vllm = info.data.get("vllm")
        version = vllm.version if isinstance(vllm, VllmSpec) else None
        table = None
        if version is not None:
            from search_spaces.engine.tables import bundled_flags

            table = bundled_flags(version)
        for name, value in v.items():
            if is_secret_flag("--" + name.replace("_", "-")):
                raise ValueError(f"fixed_flags.{name}: {secret_flag_fix(name)}")
            if name in HUMAN_READABLE_INT_FLAGS and isinstance(value, str):
                # vLLM takes "4k" here: read it as vLLM does, so the study holds the integer.
                try:
                    v[name] = value = human_readable_int(value)
                except ValueError as exc:
                    raise ValueError(f"fixed_flags.{name}: {value!r:.40} is not an integer or "
                                     "vLLM's form of one (4k = 4000, 4K = 4096)") from exc
            problem = fixed_flag_problem(name, value, table)
            if problem is not None:
                raise ValueError(problem) from cause_of(problem)
        return v

    @field_validator("seed_trials")
    @classmethod
    def _seed_trials(cls, v: list[dict[str, Any]]) -> list[dict[str, Any]]:
        # A name no space can hold is a typo: caught here, with the name it was likely meant
        # to be (the space checks the rest once it is resolved for the host).
        from search_spaces import KNOWN_FLAGS
        from search_spaces.values import did_you_mean

        for index, seed in enumerate(v):
            for name in seed:
                if name not in KNOWN_FLAGS:
                    hint = did_you_mean(name, KNOWN_FLAGS) or \
                        "; name params of the search space, as its YAML spells them"
                    raise ValueError(f"seed_trials[{index}]: {name!r:.60} is not a param "
                                     f"nightshift searches{hint}")
        return v

    _storage = field_validator("storage")(
        classmethod(lambda cls, v: refuse_problem(v, storage_problem)))
    _tracking_uri = field_validator("tracking_uri")(
        classmethod(lambda cls, v: refuse_problem(v, tracking_uri_problem)))

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
    def _levels_within_wall_budget(self) -> StudySpec:
        """A level planned to take longer than the study's whole wall budget (its duration_s,
        or num_requests / request_rate: the load generator sleeps to each arrival) never
        ends a trial within it; the day a level may take is `WorkloadSpec`'s own bound."""
        w, wall_hours = self.workload, self.budget.wall_hours
        if wall_hours is None or w.trace is not None or w.capacity is not None:
            return self
        if w.duration_s is not None:
            if w.duration_s > wall_hours * 3600:
                raise ValueError(
                    f"workload.duration_s: each level sends for {w.duration_s / 3600:,.1f} h, "
                    f"over the study's whole budget.wall_hours of {wall_hours:g} h; shorten "
                    "duration_s or raise budget.wall_hours")
            return self
        for index, level in enumerate(w.levels):
            if level.request_rate is None or w.num_requests is None:
                continue
            span_s = w.num_requests / level.request_rate
            if span_s > wall_hours * 3600:
                raise ValueError(
                    f"workload.levels[{index}]: {w.num_requests} requests at "
                    f"{level.request_rate:g} requests/s take {span_s / 3600:,.1f} h to send, "
                    f"over the study's whole budget.wall_hours of {wall_hours:g} h; raise "
                    "request_rate, lower num_requests or raise budget.wall_hours")
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
        # A request is good when it meets every bound set, e2el's included, as `vllm bench
        # serve --goodput ttft:MS tpot:MS e2el:MS` counts it (runners/loadgen/metrics.py).
        for name in objectives:
            if OBJECTIVES[name].needs_slo and not self.slo.is_set:
                raise ValueError(f"objective {name} needs {SLO_BOUNDS_TEXT}")
        return self
