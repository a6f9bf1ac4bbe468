"""What a trial ran, read back from its record (`launched`: the argv that ran), and what a
deployment of it passes: the flags, the extra args, the model, the environment."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from optimizer.config import StudyConfig
from optimizer.results.trial_record import (
    TrialRecord,
)
from runners.credentials import redact_argv
from runners.model_info import BUNDLED_CHECKPOINTS, bundled_shape_of
from runners.simulated.launcher import is_simulated_argv
from runners.vllm.flags import flag_table
from search_spaces.engine.facts import ENV_PREFIXES
from search_spaces.engine.render import to_argv
from search_spaces.engine.tables import flag_name

# Variables that describe where a trial ran, not how the engine is configured.
# VLLM_FORCE_AOT_LOAD (startup.verify_warm) would make a deployment's first start fail.
_PLACEMENT_ENV = frozenset({"CUDA_VISIBLE_DEVICES", "VLLM_CACHE_ROOT", "VLLM_SERVER_DEV_MODE",
                            "VLLM_FORCE_AOT_LOAD"})


def trial_env(env: Mapping[str, str], benchmark_only: Mapping[str, str] = {}
              ) -> dict[str, str]:
    """The engine-relevant variables of a trial's recorded `env` (VLLM_*, NCCL_*, ...), less
    those that only placed the trial and `benchmark_only` (the study's start-up savers, which
    hold for nightshift's greedy load but not for a deployment's: docs/startup-cost.md)."""
    return {k: str(v) for k, v in sorted(env.items())
            if k.startswith(ENV_PREFIXES) and k not in _PLACEMENT_ENV
            and benchmark_only.get(k) != str(v)}


@dataclass(frozen=True)
class Launched:
    """What a trial's recorded command line gave the engine besides its config's flags (the
    record's `flags`, which the launcher rendered into it): read back from the argv that ran,
    never from today's study file."""

    served_model_name: str
    load_format: str  # "dummy": measured with dummy weights
    is_skip_tokenizer_init: bool
    # `vllm.extra_args` as they ran (secrets redacted at the runner); None where the argv does
    # not carry them (the simulated engine takes none).
    extra_args: tuple[str, ...] | None


# What `VllmLauncher.command` puts between `serve MODEL` and the config's flags, or after them
# for its own measurement: never a deployment's. Each with the number of values it takes.
_LAUNCHER_OPTIONS = {"--host": 1, "--port": 1, "--served-model-name": 1, "--load-format": 1,
                     "--skip-tokenizer-init": 0, "--enable-mfu-metrics": 0,
                     "--profiler-config": 1}


def _num_values(value: object) -> int:
    """argv words `flag_args` gives a flag's value after the flag itself."""
    if isinstance(value, bool):
        return 0
    if isinstance(value, list | tuple):
        return len(value)
    return 1


def launched(record: TrialRecord) -> Launched | None:
    """The launch as the trial's recorded argv says it ran; None for a record without one
    (never launched, or written before argv was recorded). A vLLM argv is `... serve MODEL`,
    the launcher's options, the config's flags (`record.flags`), the launcher's measuring
    flags, then `vllm.extra_args` (runners/vllm/launcher.py); the simulated engine's carries
    its launch as JSON (runners/simulated/launcher.py)."""
    argv = list(record.argv)
    if not argv:
        return None
    if is_simulated_argv(argv) and "--config-json" in argv[:-1]:
        payload = json.loads(argv[argv.index("--config-json") + 1])
        return Launched(str(payload.get("served_model_name") or "model"),
                        str(payload.get("load_format") or "auto"), False, None)
    if "serve" not in argv[:-1]:
        return None
    words = argv[argv.index("serve") + 2:]
    options = dict(_LAUNCHER_OPTIONS)
    configured = {f"--{prefix}{flag_name(k)}": _num_values(v) for k, v in record.flags.items()
                  for prefix in ("", "no-")}
    given: dict[str, str] = {}
    index = 0
    while index < len(words):
        name, eq, inline = words[index].partition("=")
        count = options.pop(name, None)
        if count is None:
            count = configured.pop(name, None)
            if count is None:
                break  # the first word neither the launcher nor the config wrote: extra_args
        elif count and not eq:
            given[name] = words[index + 1] if index + 1 < len(words) else ""
        else:
            given[name] = inline if eq else "true"
        index += 1 + (0 if eq else count)
    return Launched(given.get("--served-model-name", "model"),
                    given.get("--load-format", "auto"), "--skip-tokenizer-init" in given,
                    tuple(words[index:]))


def serve_argv(model: str, flags: Mapping[str, Any], extra_args: Sequence[str] = ()) -> list[str]:
    """`vllm serve MODEL` with snake_case `flags` rendered by the one flag renderer, then the
    study's `vllm.extra_args` verbatim (as the runner passed them)."""
    return ["vllm", "serve", model, *to_argv(flags, flag_table()), *extra_args]


# Files a checkpoint's weights are in (Hugging Face, PyTorch, GGUF, TensorFlow, Flax).
_WEIGHT_SUFFIXES = frozenset({".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5",
                              ".msgpack"})


def local_model_path(given: str, study_dir: Path) -> Path | None:
    """The local file or folder `given` (model.path) names, absolute: as given, else relative
    to the working directory (where the trials' engines took it from), else to the study
    file's folder; None for a hub id or bundled shape (no such path)."""
    path = Path(given).expanduser()
    for candidate in ((path,) if path.is_absolute() else (Path.cwd() / path, study_dir / path)):
        if candidate.exists():
            return candidate.resolve()
    return None


def has_weights(folder: Path) -> bool:
    """Whether a model folder holds weight files (`*.safetensors`, `*.bin`, ...) at its top."""
    try:
        return any(p.suffix in _WEIGHT_SUFFIXES and p.is_file() for p in folder.iterdir())
    except OSError:
        return False


def deploy_model(cfg: StudyConfig) -> tuple[str, str]:
    """The model a deployment serves and, where it is not what the study measured, why: a
    local path as an absolute one (a relative one names another folder, or a hub id, wherever
    the launch runs from), and where its folder holds no weights (config only: the study
    measured dummy weights), that it must be pointed at the checkpoint; a hub id as given; for
    a bundled shape (config.json only, measured with dummy weights), the real checkpoint it
    stands for."""
    given = cfg.spec.model.path
    local = local_model_path(given, cfg.base_dir)
    if local is not None:
        if local.is_dir() and not has_weights(local):
            return str(local), ("model: config only (the folder holds no weight files; "
                                "the study measured dummy weights): point this at the "
                                "checkpoint")
        return str(local), ""
    shape = bundled_shape_of(given)
    if shape is None:
        return given, ""
    checkpoint = BUNDLED_CHECKPOINTS.get(shape)
    if checkpoint is None:
        return given, (f"model: {given!r} is a bundled shape (config.json only): replace it "
                       "with the checkpoint of that shape you serve")
    return checkpoint, (f"model: the study measured the bundled shape {shape!r} (config.json "
                        f"only, dummy weights), which stands for {checkpoint}; any checkpoint "
                        "of that shape runs the same")


def deploy_flags(cfg: StudyConfig, record: TrialRecord, ran: Launched | None,
                 weights: str | None = None) -> tuple[dict[str, Any], list[str]]:
    """What a deployment passes besides the model (snake_case): the flags the trial ran with,
    as its record holds them (the study's `fixed_flags` of that day included), without the
    benchmark's artefacts (dummy weights, no tokenizer), with a served name only where the
    launch gave one other than nightshift's own (`model`). `ran`: the launch as its argv
    says (`launched`); None for a record without one, which falls back to today's study file.
    `weights`: "real" or "dummy" as the study ran (its stored fingerprint)."""
    flags = {k: v for k, v in record.flags.items() if k not in _RESERVED}
    model = cfg.spec.model
    served = ran.served_model_name if ran is not None else \
        model.served_model_name if "served_model_name" in model.model_fields_set else "model"
    if served != "model":
        flags = {"served_model_name": served, **flags}
    load_format = ran.load_format if ran is not None else model.load_format
    is_dummy = weights == "dummy" if weights is not None else load_format == "dummy"
    no_tokenizer = ran.is_skip_tokenizer_init if ran is not None and ran.extra_args is not None \
        else model.skip_tokenizer_init
    notes = []
    if is_dummy or no_tokenizer:
        # Benchmark artefacts: speed does not depend on weight values or the tokenizer.
        notes.append("measured with dummy weights and token-id prompts; serves real weights as is")
    elif load_format not in ("auto", "dummy"):
        flags = {"load_format": load_format, **flags}
    return flags, notes


def deploy_extra_args(cfg: StudyConfig, ran: Launched | None) -> tuple[list[str], str]:
    """The `vllm.extra_args` a deployment passes last, as the trial ran them, secrets named
    and never written (runners/credentials.py); and a note where they come from today's study
    file instead (a record without an argv, or a simulated trial, whose engine took none)."""
    if ran is not None and ran.extra_args is not None:
        return redact_argv(ran.extra_args), ""
    args = redact_argv(cfg.spec.vllm.extra_args)
    if not args:
        return [], ""
    why = "the simulated engine ran without them" if ran is not None else \
        "the trial's record holds no vllm serve command line"
    return args, f"vllm.extra_args from today's study file ({why})"


# Flags the runner owns or adds for its own measurement: never part of a deployment.
_RESERVED = frozenset({"host", "port", "served_model_name", "load_format", "skip_tokenizer_init",
                       "model"})
