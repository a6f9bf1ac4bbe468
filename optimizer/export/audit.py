"""`nightshift audit`: read a complete `vllm serve` launch (argv, environment, `--config` file)
before tuning it, and report what costs performance or does nothing, each with the reason and
the expected cost. The first rule of the tuning practice: a forgotten `--enforce-eager` costs
more than every kernel tweak together.

Flags are checked against the flag table (`search_spaces.engine.tables`) of the installed vLLM's
release, or of `--vllm-version` where none is installed (else 0.26.0): one bundled per release
0.26-0.34 (made from each wheel by `scripts/vllm_flag_table.py`). A flag that release does not
take is named with the release that removed or renamed it, as the tables say.
"""

from __future__ import annotations

import difflib
import json
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from optimizer.errors import ConfigError, translate
from runners.atomic import write_atomic
from runners.credentials import redact_env
from runners.vllm.flags import flag_table, installed_version
from search_spaces.engine.facts import ENV_PREFIXES, kv_cache_is_fp8
from search_spaces.engine.releases import env_change, flag_change, refused_env_value
from search_spaces.engine.tables import (
    UnknownVersionError,
    VllmFlags,
    bundled_flags,
    version_key,
)

Severity = Literal["error", "warning", "info"]
# Variables vLLM removed and now silently ignores: what to use instead.
REMOVED_ENV = {
    "VLLM_ATTENTION_BACKEND": "--attention-backend NAME (removed around vLLM 0.16)",
    "VLLM_TORCH_PROFILER_DIR": "--profiler-config '{\"profiler\": \"torch\", "
                               "\"torch_profiler_dir\": DIR}' (removed around vLLM 0.16)",
    "VLLM_USE_V1": "nothing: V1 is the only engine (removed in 0.11)",
}
# Measured on the lent H200 (docs/h200-study.md, Qwen2.5-7B shape, 64 concurrent, vLLM 0.26).
EAGER_COST = ("measured on an H200: 2.4-3x the TPOT (6.5 -> 16-27 ms) and 50-65% less "
              "throughput than CUDA graphs")


@dataclass(frozen=True)
class Finding:
    code: str  # stable: enforce-eager, ignored-env, nccl-debug, profiling-on, ...
    severity: Severity
    message: str  # what and why
    cost: str  # the expected cost
    fix: Mapping[str, Any] = field(default_factory=dict)  # flag (snake_case) -> fixed value


@dataclass(frozen=True)
class Launch:
    """A parsed `vllm serve` launch: flags in snake_case, as vLLM's parser would read them."""

    model: str
    flags: Mapping[str, Any]
    env: Mapping[str, str]
    unknown: tuple[str, ...] = ()  # options vLLM would refuse
    config_file: str | None = None
    config_false_keys: tuple[str, ...] = ()  # `key: false` in the --config YAML (dropped)
    flag_source: str = ""


def table_of(declared: str | None) -> VllmFlags:
    """The table a launch is checked against: the installed vLLM's release; where none is
    installed, `declared` (`--vllm-version`), else 0.26.0. ConfigError (one line) for a declared
    version that contradicts the installed one or that no table is bundled for."""
    here = installed_version()
    # One release whatever its local tag, as `vllm.version` is checked (engine_choice).
    if declared is not None and here is not None and version_key(declared) != version_key(here):
        raise ConfigError(f"audit --vllm-version: {declared!r:.40} but vLLM {here} is installed "
                          "here, and its flags are the ones that launch meets; leave "
                          "--vllm-version out or run where that release is installed.")
    try:
        return flag_table(here or declared)
    except UnknownVersionError as exc:
        raise translate(exc, f"audit --vllm-version: {exc}.") from exc


def _serve_args(argv: Sequence[str]) -> list[str]:
    """The arguments after `vllm serve` (or `python -m vllm.entrypoints... serve`)."""
    args = list(argv)
    for i, token in enumerate(args):
        if token == "serve":
            return args[i + 1:]
        if token.endswith("vllm.entrypoints.openai.api_server"):
            return args[i + 1:]
    raise ConfigError(f"audit: expected a `vllm serve MODEL ...` command but got "
                      f"{shlex.join(args)[:120]!r}; pass it after `--`.")


def _value(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def parse_launch(argv: Sequence[str], env: Mapping[str, str],
                 table: VllmFlags | None = None) -> Launch:
    table = table or flag_table()
    args = _serve_args(argv)
    flags: dict[str, Any] = {}
    unknown: list[str] = []
    model = ""
    i = 0
    while i < len(args):
        token = args[i]
        i += 1
        if not token.startswith("-"):
            if not model:
                model = token
            continue
        if token.startswith("-O") and not token.startswith("--"):  # -O0..3 / -O.level=N
            flags["optimization_level"] = token[2:].lstrip(".=") or (args[i] if i < len(args)
                                                                    else "")
            continue
        name, _, inline = token.lstrip("-").partition("=")
        base = name.split(".")[0]  # -cc.cudagraph_mode=NONE, --compilation-config.mode=0
        base = table.aliases.get(f"-{base}", base) if not token.startswith("--") else base
        negated = base.startswith("no-") and base[3:] in table.bool_flags
        if negated:
            base = base[3:]
        if base not in table.names:
            unknown.append(token)
            continue
        key = base.replace("-", "_") + (name[len(name.split(".")[0]):] if "." in name else "")
        if base in table.bool_flags and not inline:
            flags[key] = not negated
        elif inline:
            flags[key] = _value(inline)
        elif i < len(args):
            flags[key] = _value(args[i])
            i += 1
    model = model or str(flags.pop("model", ""))
    config_file = flags.get("config")
    false_keys: tuple[str, ...] = ()
    if isinstance(config_file, str):
        data = _config_file(Path(config_file))
        if isinstance(data, Mapping):
            false_keys = tuple(str(k) for k, v in data.items() if v is False)
            for k, v in data.items():
                flags.setdefault(str(k).replace("-", "_"), v)  # the CLI wins over the file
    return Launch(model=model, flags=flags,
                  env={k: v for k, v in env.items() if k.startswith(ENV_PREFIXES)},
                  unknown=tuple(unknown), config_file=config_file if isinstance(
                      config_file, str) else None, config_false_keys=false_keys,
                  flag_source=table.source)


def _config_file(path: Path) -> Mapping[str, Any]:
    """The launch's `--config` YAML as vLLM reads it: a mapping of flags; ConfigError (one
    line) where vLLM would refuse it."""
    where = f"the launch's --config {str(path)!r:.120}"
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist here"
        raise ConfigError(f"{where} {what}, so vLLM would refuse the launch; give the config "
                          "file (run audit where the launch runs, for a relative path).")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise translate(exc, f"{where} cannot be read as YAML ({type(exc).__name__}); give a "
                        "YAML mapping of flags.", into=ConfigError) from exc
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where} holds a {type(data).__name__}, not a mapping of flags; "
                          "vLLM would refuse it: give `flag: value` lines.")
    return data


def _is_true(value: Any) -> bool:
    return value is True or str(value).lower() in ("1", "true", "yes")


def audit(launch: Launch, *, table: VllmFlags | None = None,
          interconnect: str | None = None, compute_capability: float | None = None,
          max_request_tokens: int | None = None) -> list[Finding]:
    """What the launch gets wrong, most expensive first. Hardware facts and the workload's
    longest request are optional: the checks that need them are skipped without."""
    table = table or bundled_flags()
    flags, env, out = launch.flags, launch.env, []
    for token in launch.unknown:
        name = token.lstrip("-").split("=")[0]
        change = flag_change(name.removeprefix("no-"), table.version)
        if change is not None and change.change != "added later":
            fix = {name.removeprefix("no-").replace("-", "_"): None}
            if change.new_name is not None:
                out.append(Finding("renamed-flag", "error",
                                   f"{token}: {change.sentence}; vLLM {table.version} takes "
                                   f"--{change.new_name}.", "vLLM refuses to start.", fix))
            else:
                out.append(Finding("removed-flag", "error",
                                   f"{token}: {change.sentence}, so vLLM {table.version} "
                                   "refuses it; leave it out.", "vLLM refuses to start.", fix))
            continue
        close = difflib.get_close_matches(name, sorted(table.names), n=1)
        later = f" ({change.sentence})" if change is not None else ""
        out.append(Finding("unknown-flag", "error",
                           f"{token}: not a flag of vLLM {table.version}{later}"
                           + (f"; did you mean --{close[0]}?" if close else "."),
                           "vLLM refuses to start."))
    if _is_true(flags.get("enforce_eager")):
        out.append(Finding(
            "enforce-eager", "error",
            "--enforce-eager turns off CUDA graphs and torch.compile: a debugging switch. "
            "Every decode step then pays a kernel launch per op.", EAGER_COST,
            {"enforce_eager": False}))
    mode = str(flags.get("compilation_config.cudagraph_mode", "")).upper()
    if mode == "NONE":
        out.append(Finding("cudagraphs-off", "error",
                           "compilation_config.cudagraph_mode NONE disables CUDA graphs.",
                           EAGER_COST))
    for name, instead in REMOVED_ENV.items():
        if name in env:
            out.append(Finding("ignored-env", "warning",
                               f"{name}={env[name]} is ignored by vLLM {table.version}; use "
                               f"{instead}.", "the setting it was meant to make is not made"))
    for name in sorted(env):
        refused = refused_env_value(name, env[name], table.version)
        if refused is not None:
            out.append(Finding("removed-env", "error", f"{name}={env[name]}: {refused}.",
                               "vLLM refuses to start."))
            continue
        if name in table.removed_env:
            out.append(Finding("removed-env", "error",
                               f"{name}={env[name]}: vLLM {table.version} names it removed and "
                               f"refuses to start: {table.removed_env[name] or 'unset it.'}",
                               "vLLM refuses to start."))
            continue
        if name.startswith("VLLM_") and name not in table.env_vars and name not in REMOVED_ENV:
            # A release that stopped (or starts) reading it is named from the tables; only a
            # name no release reads gets a guess at the one meant.
            stopped = env_change(name, table.version)
            close = difflib.get_close_matches(name, sorted(table.env_vars), n=1)
            why = f": {stopped}." if stopped is not None else \
                (f"; did you mean {close[0]}?" if close else ".")
            out.append(Finding("unknown-env", "warning",
                               f"{name} is not read by vLLM {table.version}{why}",
                               "the setting it was meant to make is not made"))
    if env.get("NCCL_DEBUG", "").upper() in ("INFO", "TRACE"):
        out.append(Finding("nccl-debug", "warning",
                           f"NCCL_DEBUG={env['NCCL_DEBUG']} logs every collective: a "
                           "debugging setting left on.",
                           "log volume and a little latency per all-reduce with TP > 1"))
    if flags.get("profiler_config") or env.get("VLLM_TORCH_PROFILER_DIR"):
        out.append(Finding("profiling-on", "warning",
                           "the torch profiler is configured: /start_profile is reachable "
                           "and a profiled window slows serving sharply.",
                           "measured on an H200: TPOT 12.8 ms vs 6.5 ms while profiling",
                           {"profiler_config": None}))
    if flags.get("enable_prefix_caching") is False:
        out.append(Finding("prefix-caching-off", "warning",
                           "prefix caching is disabled: shared prompt prefixes (system "
                           "prompts, chat history) are recomputed on every request.",
                           "TTFT and prefill compute in proportion to the shared prefix",
                           {"enable_prefix_caching": True}))
    max_len = flags.get("max_model_len")
    if max_request_tokens and isinstance(max_len, int) and max_len > 4 * max_request_tokens:
        fixed = 1 << (max(1, 2 * max_request_tokens) - 1).bit_length()
        out.append(Finding("max-model-len-oversized", "info",
                           f"--max-model-len {max_len} is {max_len / max_request_tokens:.0f}x "
                           f"the workload's longest request ({max_request_tokens} tokens).",
                           "CUDA graph and scheduler sizing for lengths never used; a "
                           "smaller value starts faster", {"max_model_len": fixed}))
    for key in launch.config_false_keys:
        out.append(Finding("config-false-dropped", "warning",
                           f"{launch.config_file}: `{key}: false` is dropped by vLLM's "
                           f"--config reader, so the default stays; write `no-{key}: true`.",
                           "the setting it was meant to make is not made"))
    tp = int(flags.get("tensor_parallel_size") or 1)
    if interconnect == "pcie" and tp > 1:
        out.append(Finding("tp-over-pcie", "warning",
                           f"--tensor-parallel-size {tp} on GPUs linked only by PCIe: each "
                           "layer's all-reduce crosses the PCIe bus.",
                           "often slower than TP 1; use --data-parallel-size replicas "
                           "when the model fits one GPU",
                           {"tensor_parallel_size": 1, "data_parallel_size": tp}))
    uses_fp8 = kv_cache_is_fp8(flags.get("kv_cache_dtype")) or \
        str(flags.get("quantization", "")).startswith("fp8")
    if compute_capability is not None and 0 < compute_capability < 8.9 and uses_fp8:
        out.append(Finding("fp8-unsupported", "error",
                           f"fp8 KV cache or weights on a GPU of compute capability "
                           f"{compute_capability:g}: fp8 tensor cores need 8.9 (Ada, Hopper).",
                           "vLLM refuses to start, or falls back to slow emulation"))
    order = {"error": 0, "warning": 1, "info": 2}
    return sorted(out, key=lambda f: order[f.severity])


def report_json(launch: Launch, findings: Sequence[Finding]) -> str:
    return json.dumps({"model": launch.model, "flags": dict(launch.flags),
                       "env": dict(launch.env), "checked_against": launch.flag_source,
                       "findings": [asdict(f) for f in findings]}, indent=2, default=str)


def read_pid(pid: int) -> tuple[list[str], dict[str, str]]:
    """A running server's argv and environment, from /proc."""
    base = Path("/proc") / str(pid)
    try:
        argv = [a for a in (base / "cmdline").read_bytes().decode().split("\0") if a]
        pairs = (base / "environ").read_bytes().decode(errors="replace").split("\0")
    except OSError as exc:
        raise translate(exc, f"--pid {pid}: cannot read /proc/{pid} ({exc.strerror}); give the "
                        "pid of a running vllm serve you may inspect.", into=ConfigError) from exc
    env = dict(p.split("=", 1) for p in pairs if "=" in p)
    return argv, env


def read_launch_file(path: Path) -> tuple[list[str], dict[str, str]]:
    """A shell launcher: `export`ed variables and the `vllm serve` line (no shell runs it)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise translate(exc, f"--from-file {path}: {exc.strerror}; give a readable launcher.",
                        into=ConfigError) from exc
    except UnicodeDecodeError as exc:
        raise translate(exc, f"--from-file {path}: not UTF-8 text; give the shell launcher that "
                        "starts the server.") from exc
    env: dict[str, str] = {}
    command = ""
    for line in text.replace("\\\n", " ").splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        try:
            words = shlex.split(stripped, comments=True)
        except ValueError as exc:  # an unclosed quote
            raise translate(exc, f"--from-file {path}: cannot split {stripped[:60]!r} into "
                            f"words ({exc}); fix the line's quoting.", into=ConfigError) from exc
        if words and words[0] == "export":
            for word in words[1:]:
                if "=" in word:
                    k, v = word.split("=", 1)
                    env[k] = v
        elif "serve" in words or any(w.endswith("api_server") for w in words):
            lead = [w for w in words if "=" in w and w.split("=")[0].isupper()]
            for word in lead:  # VAR=x vllm serve ...
                k, v = word.split("=", 1)
                env[k] = v
            command = stripped
            words = [w for w in words if w not in lead and w != "exec"]
            return words, env
    raise ConfigError(f"--from-file {path}: no `vllm serve` line found{command}; give the "
                      "launcher that starts the server.")


def measurable(findings: Sequence[Finding]) -> list[Finding]:
    """Findings whose fix is a change of searchable flags (the ones `--measure` pairs)."""
    from search_spaces import KNOWN_FLAGS

    return [f for f in findings
            if f.fix and all(k in KNOWN_FLAGS and v is not None for k, v in f.fix.items())]


def paired_study(template: Mapping[str, Any], launch: Launch, findings: Sequence[Finding],
                 out_dir: Path) -> Path:
    """A study file measuring the launch as is (the baseline) against each fix alone: a
    search space of exactly the flags the fixes change, the as-is value as each default, one
    seed trial per fix. Everything else of the launch is a fixed flag."""
    from search_spaces import KNOWN_FLAGS, vllm_default

    fixes = measurable(findings)
    if not fixes:
        raise ConfigError("audit --measure: no finding has a fix that is a flag change; "
                          "nothing to measure.")
    changed = {k for f in fixes for k in f.fix}
    as_is = {k: v for k, v in launch.flags.items() if k in KNOWN_FLAGS}
    parameters: dict[str, Any] = {}
    for key in sorted(changed):
        current = as_is.get(key, vllm_default(key))
        choices = [current] + [f.fix[key] for f in fixes if key in f.fix
                               and f.fix[key] != current]
        parameters[key] = {"type": "categorical", "choices": list(dict.fromkeys(choices)),
                           "default": current, "help": "audit: as launched vs fixed"}
    space = out_dir / "audit_space.yaml"
    out_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(space, yaml.safe_dump({"name": "audit", "description": "as launched vs each fix",
                                        "parameters": parameters}))
    study = dict(template)
    study.update(
        name=f"{template['name']}-audit", search_space=str(space.resolve()),
        results_dir=str((out_dir / "results").resolve()), storage=None,
        fixed_flags={k: v for k, v in as_is.items() if k not in changed},
        seed_trials=[dict(f.fix) for f in fixes], budget={"trials": 1 + len(fixes)},
        # Its budget is the launch and each fix: no seed of an earlier study takes a place.
        pruner={"name": "none"}, confirm_rounds=0, warm_start="off",
        # A secret is named (${NAME}, read back from the environment), never written.
        env=redact_env({**template.get("env", {}), **{
            k: v for k, v in launch.env.items() if k not in REMOVED_ENV}}))
    path = out_dir / "audit_study.yaml"
    write_atomic(path, yaml.safe_dump(study, sort_keys=False))
    return path

