"""The study file read and validated once into a typed `StudyConfig`, with paths resolved against
the file's directory; every problem is one line naming the field and the fix (`ConfigError`, exit
code 2). Environment variables are read here and nowhere else."""

from __future__ import annotations

import os
import shlex
from functools import cached_property
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from optimizer.config.fields import MAX_FILE_BYTES
from optimizer.config.schema import StudySpec
from optimizer.config.validation_errors import format_validation_error
from optimizer.errors import ConfigError, one_line, translate
from optimizer.results.baseline_words import BaselineWords, baseline_name, baseline_words
from optimizer.results.objectives import OBJECTIVES
from runners.credentials import redact_env
from runners.load_level import LoadLevel
from runners.workload import QualityEval, TraceReplay, Workload
from search_spaces.bounded_yaml import load_yaml, yaml_message

DEFAULT_TRACKING_URI = "sqlite:///mlruns/mlflow.db"


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
        self.tracking_uri = spec.tracking_uri or default_tracking_uri()
        self.prompts_file = _resolve(base, spec.workload.prompts_file) \
            if spec.workload.prompts_file else None
        self.trace_file = _resolve(base, spec.workload.trace.path) \
            if spec.workload.trace else None
        self.dataset_file = _resolve(base, spec.workload.dataset.path) \
            if spec.workload.dataset else None

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
    def baseline_words(self) -> BaselineWords:
        """How every phrase names the baseline (`baseline_words`): the vLLM defaults, or
        them + the fixed flags."""
        return baseline_words(self.spec.fixed_flags)

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
        return [OBJECTIVES[o].direction for o in self.objectives]

    @property
    def is_multi_objective(self) -> bool:
        return len(self.objectives) > 1

    @property
    def quality_skip_reason(self) -> str | None:
        """Why the study scores no output quality (shown wherever quality is); None when it
        does (optimizer/results/quality_gate.py)."""
        if self.spec.quality.enabled == "off":
            return "skipped: quality.enabled is off"
        if self.spec.model.load_format == "dummy":
            return "skipped: dummy weights"
        if self.spec.model.skip_tokenizer_init:
            return "skipped: no tokenizer (model.skip_tokenizer_init)"
        return None

    @property
    def quality_eval(self) -> QualityEval | None:
        """The evaluation each trial's workload carries; None when the gate is skipped."""
        if self.quality_skip_reason is not None:
            return None
        return self.spec.quality.evaluation()

    @property
    def tokenizer_dir(self) -> Path | None:
        """The model directory whose tokenizer.json the load generator uses; None where the
        server takes token ids or the model has no tokenizer here (runners/tokenizer.py)."""
        from runners.model_info import resolve_model_dir
        from runners.tokenizer import tokenizer_dir_for

        directory = resolve_model_dir(self.spec.model.path)
        return tokenizer_dir_for(directory.resolve() if directory is not None else None,
                                 skip_tokenizer_init=self.spec.model.skip_tokenizer_init)

    @property
    def tokenizer_note(self) -> str:
        """Which tokenizer the load generator uses, or why none, in a sentence."""
        from runners.model_info import resolve_model_dir
        from runners.tokenizer import why_no_tokenizer

        directory = self.tokenizer_dir
        if directory is not None:
            return (f"prompts: text, counted with the model's tokenizer "
                    f"({directory / 'tokenizer.json'})")
        model_dir = resolve_model_dir(self.spec.model.path)
        return why_no_tokenizer(model_dir, skip_tokenizer_init=self.spec.model.skip_tokenizer_init
                                ) or "no tokenizer"

    @cached_property
    def workload(self) -> Workload:
        """What every trial of the study measures, built once: its token ids are drawn below
        the model's vocabulary where its config.json is here (else 32000), a trace's default
        level is its recorded mean rate (the trace read once, here)."""
        w = self.spec.workload
        levels = tuple(level.load_level() for level in w.levels)
        num_requests = w.num_requests
        trace = None
        if w.trace is not None and self.trace_file is not None:
            trace = w.trace.replay(self.trace_file)
            if "num_requests" not in w.model_fields_set:
                num_requests = None  # the whole trace
            if "levels" not in w.model_fields_set:  # one level: as recorded, x time_scale
                levels = (LoadLevel(request_rate_rps=_trace_rate(
                    trace, num_requests, self.source_name) * w.trace.time_scale),)
        return Workload(
            tokenizer_dir=self.tokenizer_dir,
            dataset=w.dataset.source(self.dataset_file)
            if w.dataset is not None and self.dataset_file is not None else None,
            multi_turn=w.multi_turn.multi_turn() if w.multi_turn is not None else None,
            input_len=w.input_len.distribution(),
            output_len=w.output_len.distribution(),
            prompts_file=self.prompts_file,
            levels=levels,
            num_requests=num_requests,
            duration_s=w.duration_s,
            num_warmup_requests=w.warmup_requests,
            seed=w.seed,
            slo=self.spec.slo.slo(),
            vocab_size=_vocab_size(self.spec.model.path),
            request_timeout_s=w.request_timeout_s,
            max_failed_fraction=w.max_failed_fraction,
            profile=w.profile,
            startup_timeout_s=w.startup_timeout_s,
            repeats=w.repeats,
            quality=self.quality_eval,
            capacity=w.capacity.search() if w.capacity is not None else None,
            burstiness=w.burstiness,
            shared_prefix=w.shared_prefix.shared_prefix() if w.shared_prefix else None,
            trace=trace,
        )

    def to_dict(self) -> dict[str, Any]:
        """The study as JSON data, for what is written (study.json, an audit's study): each
        secret in `env` is named, never its value (runners/credentials.py)."""
        data: dict[str, Any] = self.spec.model_dump(mode="json")
        data["env"] = redact_env(data.get("env") or {})
        return data

    def with_overrides(self, *, tracking_uri: str | None = None, storage: str | None = None,
                       trials: int | None = None) -> StudyConfig:
        """The same study with command-line overrides applied (None leaves a value as is)."""
        update: dict[str, Any] = {}
        if tracking_uri is not None:
            update["tracking_uri"] = tracking_uri
        if storage is not None:
            update["storage"] = storage
        if trials is not None:
            update["budget"] = {**self.spec.budget.model_dump(), "trials": trials}
        if not update:
            return self
        # Checked as the study file's own values are (a copy would take them unchecked).
        data = {**self.spec.model_dump(exclude_unset=True), **update}
        try:
            spec = StudySpec.model_validate(data)
        except ValidationError as exc:
            message = format_validation_error(exc, "command line")
            for option, key in (("--trials", "budget.trials"), ("--storage", "storage"),
                                ("--tracking-uri", "tracking_uri")):
                message = message.replace(f"command line: {key}:", f"{option}:")
            raise translate(exc, message) from exc
        return StudyConfig(spec, self.source)


def resume_command(study: Path | str | None, *, dry_run: bool = False,
                   storage: str | None = None, tracking_uri: str | None = None,
                   ray_address: str | None = None, trials: int | None = None) -> str:
    """The `nightshift start` that resumes this study, with every option given that decides
    which study, stores, engine or cluster it runs on (`--storage` left out would open or
    create a study elsewhere), quoted for a POSIX shell. The one renderer of every "resume
    with" line; display options (`--verbose`, `--no-progress`) are left out."""
    argv = ["nightshift", "start", str(study if study is not None else "STUDY.yaml")]
    if dry_run:
        argv.append("--dry-run")
    for option, value in (("--storage", storage), ("--tracking-uri", tracking_uri),
                          ("--ray-address", ray_address), ("--trials", trials)):
        if value is not None:
            argv += [option, str(value)]
    return shlex.join(argv)


def _trace_rate(trace: TraceReplay, num_requests: int | None, source: str) -> float:
    """The mean rate of the trace's replayed lines, requests/s (`check_before_start` has read
    the file already; a file changed since is refused here in one line)."""
    from runners.arrivals import read_trace, trace_rate_rps

    try:
        entries = read_trace(trace.path, trace.timestamp_unit_s, trace.max_gap_s)
        return trace_rate_rps([e.arrival_s for e in entries[:num_requests or len(entries)]])
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise translate(exc, f"{source}: workload.trace: {one_line(exc)}.",
                        into=ConfigError) from exc


def default_tracking_uri() -> str:
    """Where MLflow is when neither a study file nor the command line says: the environment's
    MLFLOW_TRACKING_URI, else DEFAULT_TRACKING_URI."""
    return os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


def engine_env(cfg: StudyConfig, name: str, default: str = "") -> str:
    """A variable as the engine sees it when started from here: the study's `env`, else this
    process's environment (which the engine inherits)."""
    value = cfg.spec.env.get(name)
    return value if value is not None else os.environ.get(name, default)


def _vocab_size(model: str) -> int:
    """The model's vocabulary where its config.json is here, else 32000 (a hub id; a config
    that cannot be read, which `check_before_start` refuses in one line)."""
    from runners.model_info import load_model_info

    try:
        info = load_model_info(model)
    except ValueError:
        return 32000
    return info.vocab_size if info is not None else 32000


def _resolve(base: Path, p: Path) -> Path:
    p = p.expanduser()
    return p if p.is_absolute() else base / p


def parse_study(data: Any, source: str = "study.yaml", path: Path | None = None) -> StudyConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of study settings at the top level, "
                          f"got {type(data).__name__}; see examples/quickstart.yaml.")
    try:
        spec = StudySpec.model_validate(data)
    except ValidationError as exc:
        raise translate(exc, format_validation_error(exc, source)) from exc
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
        raise translate(exc, f"{path.name}: cannot read the study file ({type(exc).__name__}); "
                        "check its permissions.", into=ConfigError) from exc
    if len(raw) > MAX_FILE_BYTES:
        raise ConfigError(f"{path.name}: over {MAX_FILE_BYTES:,} bytes, far more than a study "
                          "file holds; check that this is the study YAML.")
    try:
        text = raw.decode("utf-8")
        data = load_yaml(text)
    except yaml.YAMLError as exc:
        raise translate(exc, yaml_message(exc, path.name, text)) from exc
    except UnicodeDecodeError as exc:
        raise translate(exc, f"{path.name}: not UTF-8 text; save the study file as "
                        "UTF-8.") from exc
    except RecursionError as exc:
        raise translate(exc, f"{path.name}: nested too deeply; a study file is a few levels "
                        "deep.", into=ConfigError) from exc
    if data is None:
        raise ConfigError(f"{path.name}: the file is empty; see examples/quickstart.yaml for "
                          "a study.")
    return parse_study(data, path.name, path.resolve())
