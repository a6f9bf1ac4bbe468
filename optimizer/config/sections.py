"""The study file's sections besides the workload and the study itself: the model, the SLO,
the quality gate, the budget, the simulated engine, the sampler and pruner, Ray, vLLM's extra
arguments and cache, the start-up savers, the known facts; and the checks of a single `env`
variable or secret flag."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from optimizer.config.fields import MAX_SEED, FilePath, StrictSpec, registered, yaml_off
from optimizer.config.flag_checks import extra_args_problem
from optimizer.search.pruners import PRUNERS
from optimizer.search.samplers import SAMPLERS
from runners.credentials import API_KEY_ENV, SECRET_FLAGS, is_secret_flag
from runners.workload import SLO, QualityEval


class ModelSpec(StrictSpec):
    path: str = Field(min_length=1)  # local dir with config.json, bundled shape or hub id
    load_format: Literal["auto", "dummy"] = "auto"
    skip_tokenizer_init: bool = False
    # What requests name the model (`--served-model-name`): one printable word.
    served_model_name: str = Field(default="model", min_length=1, max_length=200,
                                   pattern=r"^[^\s\x00-\x1f\x7f]+$")



class QualitySpec(StrictSpec):
    """The quality gate (optimizer/results/quality_gate.py). The limits are provisional until
    measured on real weights (docs/quality.md): a limit set to null is not checked."""

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

    def evaluation(self) -> QualityEval:
        """The evaluation a trial's workload carries (the limits are the gate's, not the run's)."""
        return QualityEval(num_prompts=self.num_prompts, max_tokens=self.max_tokens,
                           top_k=self.top_k)

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


class SLOSpec(StrictSpec):
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

    def slo(self) -> SLO:
        return SLO(**self.model_dump())

    @property
    def is_set(self) -> bool:
        """Whether any bound is set, so goodput is defined (`SLO.is_set`)."""
        return self.slo().is_set


class BudgetSpec(StrictSpec):
    trials: int | None = Field(default=None, ge=1, le=100_000)
    wall_hours: float | None = Field(default=None, gt=0, le=24 * 365)

    @model_validator(mode="after")
    def _some(self) -> BudgetSpec:
        if self.trials is None and self.wall_hours is None:
            raise ValueError("set trials and/or wall_hours")
        return self


class SimulatedSpec(StrictSpec):
    hardware: str = "h200"  # a preset under runners/hardware_profiles/
    num_gpus: int = Field(default=2, ge=1, le=64)  # GPUs declared to Ray
    startup_time_scale: float = Field(default=0.01, gt=0, le=1)
    seed: int = Field(default=0, ge=0, le=MAX_SEED)


class SamplerSpec(StrictSpec):
    # A key of `samplers.SAMPLERS`. "screen" (the informed start, then TPE) since issue 36:
    # bench/search_efficiency.py shows it best of random, TPE and the screen (bench/README.md).
    name: str = "screen"
    seed: int | None = Field(default=0, ge=0, le=MAX_SEED)
    n_startup_trials: int = Field(default=6, ge=0, le=100_000)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return registered("sampler.name", v, SAMPLERS)


class PrunerSpec(StrictSpec):
    name: str = "bottleneck"  # a key of `pruning.PRUNERS`
    n_startup_trials: int = Field(default=4, ge=0, le=100_000)
    min_relative_gap: float = Field(default=0.10, ge=0, le=1)  # prune only when this much worse

    @field_validator("name", mode="before")
    @classmethod
    def _name(cls, v: Any) -> str:
        # `off` (YAML's false) is a guess at `none`: the message lists the names.
        return registered("pruner.name", yaml_off(v), PRUNERS)


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


class RaySpec(StrictSpec):
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


def secret_flag_fix(flag: str) -> str:
    """Why a secret flag is refused in a study, and what to do instead."""
    kebab = "--" + flag.partition("=")[0].lstrip("-").replace("_", "-")
    variable = SECRET_FLAGS[kebab]
    if variable == API_KEY_ENV:
        return (f"{kebab} is set by nightshift, which gives each trial's engine its own random "
                "key; remove it")
    return (f"{kebab} would put a secret on the engine's command line, where every local user "
            f"reads it (ps); remove it and set env.{variable} (or export {variable}), which "
            "the engine reads from its environment")


class VllmSpec(StrictSpec):
    # VLLM_CACHE_ROOT shared by every trial
    cache_root: FilePath | None = None
    # Passed verbatim after the flags: only flags of vLLM that nightshift neither sets nor
    # searches (checked by `extra_args_problem`).
    extra_args: list[str] = Field(default_factory=list, max_length=256)
    # The vLLM release the trials run, where this machine cannot say (no vLLM installed: a
    # Ray cluster's driver, or a dry run): its bundled flag table picks the space's flags and
    # checks fixed_flags, and the simulated engine takes that release's parser. Where vLLM is
    # installed it must be that release. None: the installed release, else 0.26.0.
    version: str | None = Field(default=None, max_length=40)

    @field_validator("version")
    @classmethod
    def _version(cls, v: str | None) -> str | None:
        from search_spaces.engine.tables import bundled_versions, has_table

        if v is not None and not has_table(v):
            raise ValueError(f"vllm.version: no flag table is bundled for vLLM {v!r:.40}; give "
                             f"one of {', '.join(bundled_versions())}, or leave it out to use "
                             "the installed vLLM's")
        return v

    @field_validator("extra_args")
    @classmethod
    def _extra_args(cls, v: list[str]) -> list[str]:
        for index, token in enumerate(v):
            if is_secret_flag(token):
                raise ValueError(f"vllm.extra_args[{index}]: {secret_flag_fix(token)}")
        problem = extra_args_problem(v)
        if problem is not None:
            raise ValueError(problem)
        return v


# Start-up savers a study may turn on (docs/startup-cost.md): each leaves the measured config
# unchanged, by vLLM 0.26's source, under the condition named. name -> the env it sets.
STARTUP_SAVERS: dict[str, dict[str, str]] = {
    # Greedy requests never take FlashInfer's top-k/top-p sampler (v1/worker/gpu/sample/
    # sampler.py:231-246): off, the start-up skips building it (a first start JIT-builds it).
    # nightshift's load generator sends temperature 0 only (runners/loadgen/client.py
    # send_request).
    "flashinfer_sampler_off": {"VLLM_USE_FLASHINFER_SAMPLER": "0"},
}


class StartupSpec(StrictSpec):
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


class KnownFactsSpec(StrictSpec):
    # Ids of measured facts (search_spaces/facts/known_facts.yaml, the user's file; `nightshift
    # hw` lists them) this study does not apply: their values stay in its space.
    ignore: list[str] = Field(default_factory=list, max_length=256)
