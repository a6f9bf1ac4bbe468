"""Search spaces: the YAML loader and its validation, resolution against hardware, and sampling.

`load_space` reads and checks a YAML file into a `SearchSpace`; `SearchSpace.resolve(context)`
applies the rules for one host and model and gives a `ResolvedSpace`, which samples configs into
an Optuna trial, yields the vLLM-defaults baseline, and turns a config into engine flags.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from decimal import Decimal
from pathlib import Path
from typing import Any, Literal, NoReturn, cast

import optuna
import yaml
from optuna.distributions import (
    BaseDistribution,
    CategoricalChoiceType,
)

from search_spaces.bounded_yaml import YamlLimitError, load_yaml
from search_spaces.params import ParamSpec, ParamType, Value
from search_spaces.rules import (
    BUILTIN_ORDER,
    STATIC_BUILTINS,
    AppliedRule,
    Rule,
    RuleError,
    apply_static,
    builtin_names,
    conditional_builtins,
    could_hold,
    known_fact_rules,
    model_context_len,
    parse_rule,
)
from search_spaces.values import (
    contains,
    did_you_mean,
    is_number,
    is_scalar,
    lookup,
    on_grid,
    same,
    show,
)

FlagKind = Literal["bool", "int", "float", "enum"]

BUNDLED_DIR = Path(__file__).parent
PARAM_TYPES: tuple[ParamType, ...] = ("categorical", "int", "float")
_TOP_KEYS = ("name", "description", "parameters", "rules")
_PARAM_KEYS = ("type", "choices", "low", "high", "log", "step", "default", "help")
_RANGE_KEYS = ("low", "high", "log", "step")
_MAX_SPACE_CHARS = 1_000_000
_INT_CEILING = 2**53  # larger ints lose precision in Optuna's float internal representation

ATTENTION_BACKENDS = ("auto", "FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16")
QUANTIZATIONS = (
    "none", "fp8", "fp8_per_tensor", "fp8_per_block", "fp8_per_channel", "awq", "awq_marlin",
    "gptq", "gptq_marlin", "bitsandbytes", "compressed-tensors",
)
CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
# Speculative methods that need no draft model (config/speculative.py:713-718); suffix also
# needs the optional arctic-inference package (config/speculative.py:1053), so no bundled
# space searches it.
SPEC_METHODS = ("none", "ngram", "ngram_gpu", "suffix")


class SpaceError(ValueError):
    """A search space that cannot be loaded or resolved; the message is one line naming the file,
    the field and the fix."""


@dataclass(frozen=True)
class FlagSpec:
    """What vLLM 0.26 accepts for one engine flag."""

    kind: FlagKind
    enum: tuple[str, ...] = ()
    low: float | None = None  # smallest valid value
    high: float | None = None  # largest valid value
    is_low_exclusive: bool = False
    no_flag: tuple[str, ...] = ()  # values that mean "pass no flag"
    is_categorical_only: bool = False  # only a few values are valid: rules drop the rest
    cli_name: str | None = None  # when the flag is not --<name> (nested config keys)


# vLLM 0.26 engine flags a space may search, by snake_case name, with the domain a space may
# give each. search_spaces may not import runners, so the few vLLM facts the space needs to
# resolve `default: vllm` and to render a config (the defaults below, a nested flag's name) are
# kept here; tests/runners/test_vllm_flags.py holds them equal to runners/vllm's flag table and
# engine facts (names, types, defaults, negation, host defaults, the fp8 methods). A newer
# release is passed in as plain data (`context["engine"]`, from its flag table): its flags,
# defaults and value sets then win, and a flag it lacks is not searched (`_for_release`).
KNOWN_FLAGS: dict[str, FlagSpec] = {
    "attention_backend": FlagSpec("enum", ATTENTION_BACKENDS, no_flag=("auto",)),
    "kv_cache_dtype": FlagSpec("enum", KV_CACHE_DTYPES, no_flag=("auto",)),
    "quantization": FlagSpec("enum", QUANTIZATIONS, no_flag=("none",)),
    "dtype": FlagSpec("enum", ("auto", "half", "float16", "bfloat16", "float", "float32"),
                      no_flag=("auto",)),
    "tensor_parallel_size": FlagSpec("int", low=1, high=1024, is_categorical_only=True),
    "pipeline_parallel_size": FlagSpec("int", low=1, high=1024, is_categorical_only=True),
    "data_parallel_size": FlagSpec("int", low=1, high=1024, is_categorical_only=True),
    "max_num_batched_tokens": FlagSpec("int", low=1),
    "max_num_seqs": FlagSpec("int", low=1),
    "max_model_len": FlagSpec("int", low=1),
    "gpu_memory_utilization": FlagSpec("float", low=0.0, high=1.0, is_low_exclusive=True),
    "enforce_eager": FlagSpec("bool"),
    "block_size": FlagSpec("int", low=1, high=1024),
    "enable_prefix_caching": FlagSpec("bool"),
    "enable_chunked_prefill": FlagSpec("bool"),
    "max_num_partial_prefills": FlagSpec("int", low=1),
    "max_long_partial_prefills": FlagSpec("int", low=1),
    "long_prefill_token_threshold": FlagSpec("int", low=0),
    "cudagraph_mode": FlagSpec("enum", CUDAGRAPH_MODES,
                               cli_name="compilation_config.cudagraph_mode"),
    "max_cudagraph_capture_size": FlagSpec("int", low=1),
    "async_scheduling": FlagSpec("bool"),
    "scheduling_policy": FlagSpec("enum", ("fcfs", "priority")),
    "stream_interval": FlagSpec("int", low=1),
    "spec_method": FlagSpec("enum", SPEC_METHODS, no_flag=("none",)),
    "spec_tokens": FlagSpec("int", low=1),
    "cpu_offload_gb": FlagSpec("float", low=0.0, high=4096.0),  # GiB per GPU
    "kv_cache_memory_bytes": FlagSpec("int", low=1),
    "num_gpu_blocks_override": FlagSpec("int", low=1),
    "disable_custom_all_reduce": FlagSpec("bool"),
    "enable_expert_parallel": FlagSpec("bool"),
    "calculate_kv_scales": FlagSpec("bool"),
}

# vLLM's own defaults that do not depend on the host; the rest are in `_vllm_default`.
_VLLM_DEFAULTS: dict[str, Value] = {
    "attention_backend": "auto",
    "kv_cache_dtype": "auto",
    "quantization": "none",
    "dtype": "auto",
    "tensor_parallel_size": 1,
    "pipeline_parallel_size": 1,
    "data_parallel_size": 1,
    "gpu_memory_utilization": 0.92,
    "enforce_eager": False,
    "enable_prefix_caching": True,
    "enable_chunked_prefill": True,
    "max_num_partial_prefills": 1,
    "max_long_partial_prefills": 1,
    "cudagraph_mode": "FULL_AND_PIECEWISE",
    "scheduling_policy": "fcfs",
    "stream_interval": 1,
    "long_prefill_token_threshold": 0,
    "spec_method": "none",
    "disable_custom_all_reduce": False,
    "enable_expert_parallel": False,
    "calculate_kv_scales": False,
}
# Params whose vLLM default depends on the host (`_vllm_default`).
HOST_DEFAULTS = ("max_num_batched_tokens", "max_num_seqs", "max_model_len")


def _sentence(message: object) -> str:
    text = str(message)
    return text if text.endswith((".", "?")) else f"{text}."


def _fail(source: str, message: str) -> NoReturn:
    raise SpaceError(f"{source}: {_sentence(message)}")


def _is_high_end(context: Mapping[str, Any]) -> bool:
    """vLLM's own test for its larger scheduler defaults: >= 70 GiB per GPU and not an A100."""
    memory_gib = lookup(context, "hardware.gpu_memory_gib")
    gpu_name = lookup(context, "hardware.gpu_name")
    if not is_number(memory_gib) or memory_gib < 70:
        return False
    return not (isinstance(gpu_name, str) and "A100" in gpu_name)


def engine_key(name: str) -> str:
    """The flag a known param sets, as the engine's flag tables spell it: `max_num_seqs` ->
    `max-num-seqs`, `cudagraph_mode` -> `compilation-config.cudagraph_mode`."""
    head, dot, tail = (KNOWN_FLAGS[name].cli_name or name).partition(".")
    return head.replace("_", "-") + dot + tail


def _engine(context: Mapping[str, Any]) -> tuple[str | None, frozenset[str] | None,
                                                  Mapping[str, Any], Mapping[str, Any]]:
    """The vLLM release the space resolves for, as the caller states it in `context["engine"]`
    (search_spaces may not import runners: the optimizer passes the release's flag table as
    plain data): its version, its flags (kebab-case; None: not stated, every known flag holds),
    its defaults and its value sets (flag -> allowed values, for a flag with a closed set).
    `engine.host_defaults` holds the release's scheduler defaults for the host
    (max_num_seqs, max_num_batched_tokens), read by `_vllm_default`."""
    version, flags = lookup(context, "engine.vllm_version"), lookup(context, "engine.flags")
    defaults, choices = lookup(context, "engine.defaults"), lookup(context, "engine.choices")
    return (version if isinstance(version, str) else None,
            frozenset(flags) if isinstance(flags, list | tuple | set | frozenset) else None,
            defaults if isinstance(defaults, Mapping) else {},
            choices if isinstance(choices, Mapping) else {})


def _vllm_default(name: str, context: Mapping[str, Any]) -> Value:
    """What vLLM does with no flag, as a value of the param; None where only "no flag" says it.
    The release in `context["engine"]` states its own defaults; without one, vLLM 0.26's."""
    _, _, engine_defaults, _ = _engine(context)
    key = engine_key(name) if name in KNOWN_FLAGS else name
    if name not in HOST_DEFAULTS and key in engine_defaults:
        value = engine_defaults[key]
        flag = KNOWN_FLAGS[name]
        if value is None:
            return flag.no_flag[0] if flag.no_flag else None
        if is_scalar(value):
            return cast(Value, value)
    host = lookup(context, "engine.host_defaults")  # the release's, for this host
    if name in HOST_DEFAULTS and isinstance(host, Mapping) and is_number(host.get(name)):
        return cast(Value, host[name])
    if name == "max_num_batched_tokens":
        return 8192 if _is_high_end(context) else 2048
    if name == "max_num_seqs":
        return 1024 if _is_high_end(context) else 256
    if name == "max_model_len":
        return model_context_len(context)
    return _VLLM_DEFAULTS.get(name)


def vllm_default(name: str, context: Mapping[str, Any] | None = None) -> Value:
    """vLLM's value for a flag left unset (on the host `context` describes; of the release its
    `engine` states, else of 0.26)."""
    return _vllm_default(name, context or {})


def effective_params(params: Mapping[str, Value],
                     defaults: Mapping[str, Value]) -> dict[str, Value]:
    """The values a config runs with, as far as they are known here: an unset param (None)
    takes vLLM's default from `defaults` (a resolved space's `vllm_defaults`, host-dependent
    ones included), and the largest CUDA-graph capture size is the one vLLM 0.26 ends with
    (config/vllm.py:1780-1880): 0 without CUDA graphs (`enforce_eager`, `cudagraph_mode`
    NONE); unset, min(max_num_seqs x (1 + draft tokens) x 2, 512); at most
    max_num_batched_tokens; then cut down to the last size of vLLM's own capture list. Not
    modelled: `performance_mode: interactivity` and sequence parallelism with TP > 1 (neither
    is searched). What stays None is decided by vLLM at start-up (async_scheduling) or
    unknown (a suffix method without a draft count)."""
    out = {k: (defaults.get(k) if v is None else v) for k, v in params.items()}
    if "max_cudagraph_capture_size" in out:
        out["max_cudagraph_capture_size"] = _capture_size(out, defaults)
    return out


def changed_params(params: Mapping[str, Value], reference: Mapping[str, Value],
                   defaults: Mapping[str, Value]) -> list[str]:
    """The params `params` sets differently from `reference` where setting one back to the
    reference's value would change what vLLM runs with (`effective_params`): an explicit
    value equal to vLLM's default is no change, and neither is a capture size that CUDA
    graphs off make moot. A param one side lacks is vLLM's default there. Sorted by name."""
    keys = sorted(set(params) | set(reference))
    mine = {k: params.get(k) for k in keys}
    theirs = {k: reference.get(k) for k in keys}
    runs = effective_params(mine, defaults)
    return [k for k in keys if repr(mine[k]) != repr(theirs[k])
            and repr(runs[k]) != repr(effective_params({**mine, k: theirs[k]}, defaults)[k])]


def _capture_size(values: Mapping[str, Value], defaults: Mapping[str, Value]) -> int | None:
    def known(name: str) -> int | None:
        value = values.get(name, defaults.get(name))
        return int(value) if isinstance(value, int | float) and not isinstance(value, bool) \
            else None

    if values.get("enforce_eager", defaults.get("enforce_eager")) is True or \
            values.get("cudagraph_mode", defaults.get("cudagraph_mode")) == "NONE":
        return 0
    size, seqs, budget = known("max_cudagraph_capture_size"), known("max_num_seqs"), \
        known("max_num_batched_tokens")
    if size is None:
        method = values.get("spec_method", defaults.get("spec_method"))
        drafts = 0 if method in (None, "none") else known("spec_tokens")
        if seqs is None or drafts is None:
            return None
        size = min(seqs * (1 + drafts) * 2, 512)
    if budget is not None:
        size = min(size, budget)
    # vLLM's capture list (config/vllm.py:1820-1843) and the cut to its last size (:1857-1880).
    sizes = [i for i in (1, 2, 4) if i <= size]
    sizes += list(range(8, min(size + 1, 256), 8))
    if size >= 256:
        sizes += list(range(256, size + 1, 16))
    if budget is not None and budget <= size:
        sizes.append(budget)
    return max(sizes) if sizes else 0


def value_problem(name: str, value: object) -> str | None:
    """Why `value` is not valid for the flag `name`, or None; None always is (no flag)."""
    flag = KNOWN_FLAGS[name]
    if value is None:
        return None
    if flag.kind == "bool":
        return None if isinstance(value, bool) else f"must be true or false but got {show(value)}"
    if flag.kind == "enum":
        if isinstance(value, str) and value in flag.enum:
            return None
        return (f"must be one of {', '.join(flag.enum)} but got {show(value)}"
                f"{did_you_mean(value, flag.enum)}")
    if flag.kind == "int" and not (isinstance(value, int) and not isinstance(value, bool)):
        return f"must be an integer but got {show(value)}"
    if not is_number(value):
        return f"must be a finite number but got {show(value)}"
    number = cast(float, value)
    low = flag.low
    high = flag.high if flag.high is not None else (_INT_CEILING if flag.kind == "int" else 1e15)
    if low is not None and (number < low or (flag.is_low_exclusive and number == low)):
        relation = ">" if flag.is_low_exclusive else ">="
        return f"must be {relation} {low:g} but got {show(value)}"
    if number > high:
        return f"must be <= {high:g} but got {show(value)}"
    return None


# ----------------------------------------------------------------------------- loading


def bundled_spaces() -> list[str]:
    """Names of the spaces shipped with nightshift, for `load_space(name)`."""
    return sorted(p.stem for p in BUNDLED_DIR.glob("*.yaml"))


def recommend_space(hardware_class: str) -> str:
    """The bundled space tuned for a `HardwareProfile.hardware_class`."""
    return {"hopper": "hopper", "ampere": "ampere", "24gb": "consumer_24gb"}.get(
        hardware_class, "default")


def load_space(path_or_name: str | Path) -> SearchSpace:
    """A space from a YAML file, or a bundled one by name (`hopper`); raises `SpaceError`."""
    path = _locate(path_or_name)
    source = path.name if path.parent == BUNDLED_DIR else str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpaceError(f"{source}: cannot read the search space ({type(exc).__name__}: "
                         f"{show(str(exc), 120)}); check the path and permissions.") from exc
    if len(text) > _MAX_SPACE_CHARS:
        _fail(source, f"over {_MAX_SPACE_CHARS:,} characters, far more than a search space "
                      "holds; check that this is the space YAML")
    try:
        data = load_yaml(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        if isinstance(exc, YamlLimitError):
            raise SpaceError(f"{source}{where}: {_sentence(problem)}") from exc
        raise SpaceError(f"{source}: not valid YAML{where} ({show(str(problem), 80)}); fix "
                         "the syntax.") from exc
    except RecursionError as exc:
        raise SpaceError(f"{source}: YAML nested too deeply; flatten it.") from exc
    return parse_space(data, source=source, default_name=path.stem)


def _locate(path_or_name: str | Path) -> Path:
    if isinstance(path_or_name, str) and not path_or_name:
        _fail("load_space", "expected a bundled space name or a .yaml path but got ''")
    path = Path(path_or_name)
    looks_like_path = isinstance(path_or_name, Path) or path.suffix in (".yaml", ".yml") or (
        len(path.parts) > 1)
    if path.is_file():
        return path
    if looks_like_path:
        _fail(str(path), "no such file; pass an existing .yaml path or a bundled name "
                         f"({', '.join(bundled_spaces())})")
    bundled = BUNDLED_DIR / f"{path_or_name}.yaml"
    if not bundled.is_file():
        _fail("load_space", f"unknown space {show(str(path_or_name))}"
                            f"{did_you_mean(str(path_or_name), bundled_spaces())} "
                            f"(bundled: {', '.join(bundled_spaces())}; or pass a .yaml path)")
    return bundled


def parse_space(data: object, source: str = "<space>", default_name: str = "space") -> SearchSpace:
    """A space from already-parsed YAML (a mapping); every problem raises a one-line SpaceError."""
    if not isinstance(data, Mapping):
        _fail(source, f"expected a mapping with {', '.join(_TOP_KEYS)} but got {show(data)}")
    for key in data:
        if key not in _TOP_KEYS:
            _fail(source, f"unknown top-level key {show(key)}{did_you_mean(key, _TOP_KEYS)} "
                          f"(allowed: {', '.join(_TOP_KEYS)})")
    name = data.get("name", default_name)
    if not isinstance(name, str) or not name.strip() or "\n" in name:
        _fail(source, f"name must be a one-line string but got {show(name)}")
    description = data.get("description", "")
    if not isinstance(description, str):
        _fail(source, f"description must be a string but got {show(description)}")
    raw_params = data.get("parameters")
    if not isinstance(raw_params, Mapping) or not raw_params:
        _fail(source, "parameters must be a non-empty mapping of vLLM flag name: spec but got "
                      f"{show(raw_params)}")
    specs: dict[str, ParamSpec] = {}
    for param_name, raw in raw_params.items():
        spec = _parse_param(param_name, raw, source)
        specs[spec.name] = spec
    order = list(specs)
    for reader, target in BUILTIN_ORDER:
        if reader in specs and target in specs and order.index(reader) > order.index(target):
            _fail(source, f"parameters.{reader} must be declared before parameters.{target}: "
                          f"built-in rules fix {target} from {reader}; move it up")
    raw_rules = data.get("rules", [])
    if raw_rules is None:
        raw_rules = []
    if not isinstance(raw_rules, list):
        _fail(source, f"rules must be a list of rules but got {show(raw_rules)}")
    rules: list[Rule] = []
    seen = set(builtin_names())
    for index, raw_rule in enumerate(raw_rules):
        try:
            rule = parse_rule(raw_rule, f"rules[{index}]", specs, value_problem)
        except RuleError as exc:
            raise SpaceError(f"{source}: {_sentence(exc)}") from exc
        if rule.name in seen:
            _fail(source, f"rules[{index}].name {show(rule.name)} is already taken (by an "
                          "earlier or built-in rule); rename it")
        seen.add(rule.name)
        rules.append(rule)
    return SearchSpace(name=name.strip(), description=description.strip(),
                       params=tuple(specs.values()), rules=tuple(rules), source=source)


def _parse_param(name: object, raw: object, source: str) -> ParamSpec:
    if not isinstance(name, str) or name not in KNOWN_FLAGS:
        hint = did_you_mean(name, KNOWN_FLAGS)
        label = name if isinstance(name, str) and name.isprintable() and len(name) < 60 else (
            show(name))
        _fail(source, f"parameters.{label} is not a vLLM 0.26 engine flag this loader knows"
                      f"{hint} (use snake_case names such as max_num_seqs)")
    where = f"parameters.{name}"
    if not isinstance(raw, Mapping):
        _fail(source, f"{where} must be a mapping with type, choices or low/high, default and "
                      f"help but got {show(raw)}")
    for key in raw:
        if key not in _PARAM_KEYS:
            _fail(source, f"{where} has unknown key {show(key)}{did_you_mean(key, _PARAM_KEYS)} "
                          f"(allowed: {', '.join(_PARAM_KEYS)})")
    flag = KNOWN_FLAGS[name]
    kind = raw.get("type")
    if kind not in PARAM_TYPES:
        _fail(source, f"{where}.type must be one of {', '.join(PARAM_TYPES)} but got "
                      f"{show(kind)}{did_you_mean(kind, PARAM_TYPES)}")
    param_type = cast(ParamType, kind)
    if param_type != "categorical" and (flag.kind in ("bool", "enum") or flag.is_categorical_only):
        _fail(source, f"{where}.type must be categorical for this flag but got {param_type}; "
                      "list its values under choices")
    if param_type == "float" and flag.kind == "int":
        _fail(source, f"{where}.type must be int or categorical (vLLM takes an integer) but got "
                      "float")
    help_text = raw.get("help", "")
    if not isinstance(help_text, str) or "\n" in help_text.strip():
        _fail(source, f"{where}.help must be a one-line string but got {show(help_text)}")
    spec = ParamSpec(name=name, type=param_type, help=help_text.strip())
    if param_type == "categorical":
        spec = _parse_choices(spec, raw, where, source)
    else:
        spec = _parse_range(spec, raw, where, source)
    return _parse_default(spec, raw, where, source)


def _parse_choices(spec: ParamSpec, raw: Mapping[Any, Any], where: str, source: str) -> ParamSpec:
    for key in _RANGE_KEYS:
        if key in raw:
            _fail(source, f"{where}.{key} applies to int/float params; a categorical param "
                          "lists choices")
    choices = raw.get("choices")
    if not isinstance(choices, list) or not choices:
        _fail(source, f"{where}.choices must be a non-empty list but got {show(choices)}")
    kept: list[Value] = []
    for index, choice in enumerate(choices):
        problem = value_problem(spec.name, choice) if is_scalar(choice) else (
            f"must be a scalar but got {show(choice)}")
        if problem is not None:
            _fail(source, f"{where}.choices[{index}] {problem}")
        if contains(kept, choice):
            _fail(source, f"{where}.choices[{index}] repeats {show(choice)}; list each value once")
        kept.append(cast(Value, choice))
    return replace(spec, choices=tuple(kept))


def _parse_range(spec: ParamSpec, raw: Mapping[Any, Any], where: str, source: str) -> ParamSpec:
    if "choices" in raw:
        _fail(source, f"{where}.choices applies to categorical params; an {spec.type} param "
                      "takes low and high")
    bounds: dict[str, float] = {}
    for key in ("low", "high"):
        value = raw.get(key)
        if spec.type == "int" and not (isinstance(value, int) and not isinstance(value, bool)):
            _fail(source, f"{where}.{key} must be an integer but got {show(value)}")
        if not is_number(value):
            _fail(source, f"{where}.{key} must be a finite number but got {show(value)}")
        problem = value_problem(spec.name, value)
        if problem is not None:
            _fail(source, f"{where}.{key} {problem}")
        bounds[key] = cast(float, value)
    low, high = bounds["low"], bounds["high"]
    if low >= high:
        _fail(source, f"{where}.low must be < high but got low={low}, high={high}; swap them or "
                      "use a categorical param with one choice")
    log = raw.get("log", False)
    if not isinstance(log, bool):
        _fail(source, f"{where}.log must be true or false but got {show(log)}")
    if log and low <= 0:
        _fail(source, f"{where}.log needs low > 0 but got low={low}; raise low or drop log")
    step = raw.get("step")
    if step is not None:
        if spec.type == "int" and not (isinstance(step, int) and not isinstance(step, bool)):
            _fail(source, f"{where}.step must be an integer but got {show(step)}")
        if not is_number(step) or step <= 0:
            _fail(source, f"{where}.step must be a positive number but got {show(step)}")
        if log and step != 1:
            _fail(source, f"{where}.step cannot combine with log (Optuna samples log ranges "
                          "continuously); drop one")
        if not on_grid(high, low, step):
            _fail(source, f"{where}.high must be low + k*step but got low={low}, high={high}, "
                          f"step={step}; adjust high")
        if spec.type == "float" and Decimal(str(high - low)) / Decimal(str(step)) > 10**9:
            _fail(source, f"{where}.step {step} makes over a billion values; use a larger step")
    if spec.type == "int":
        return replace(spec, low=int(low), high=int(high), log=log,
                       step=int(step) if step is not None and step != 1 else None)
    return replace(spec, low=float(low), high=float(high), log=log,
                   step=float(step) if step is not None else None)


def _parse_default(spec: ParamSpec, raw: Mapping[Any, Any], where: str, source: str) -> ParamSpec:
    default = raw.get("default", "vllm")
    if default == "vllm" and isinstance(default, str):
        resolvable = spec.name in _VLLM_DEFAULTS or spec.name in HOST_DEFAULTS
        if spec.type != "categorical" and not resolvable:
            _fail(source, f"{where}.default 'vllm' has no known value for an {spec.type} param; "
                          "give a literal default")
        return replace(spec, default=None, is_vllm_default=True)
    problem = value_problem(spec.name, default) if is_scalar(default) else (
        f"must be a scalar or 'vllm' but got {show(default)}")
    if problem is None and spec.type != "categorical" and not is_number(default):
        problem = f"must be a number for an {spec.type} param but got {show(default)}"
    if problem is None and spec.type == "int" and not isinstance(default, int):
        problem = f"must be an integer but got {show(default)}"
    if problem is not None:
        _fail(source, f"{where}.default {problem}")
    if spec.type != "categorical":
        _check_range_default(spec, cast(float, default), f"{where}.default", source)
    return replace(spec, default=cast(Value, default), is_vllm_default=False)


def _check_range_default(spec: ParamSpec, default: float, where: str, source: str) -> None:
    """A range can grow to take its default only along its own grid (and above 0 when log)."""
    low, high = cast(float, spec.low), cast(float, spec.high)
    if spec.log and default <= 0:
        _fail(source, f"{where} must be > 0 for a log range but got {default}")
    if spec.step is not None:
        anchor = low if default >= low else high
        if not on_grid(default, anchor, spec.step):
            _fail(source, f"{where} {default} is not on the grid {low} + k*{spec.step}; pick "
                          "low and step so that it is")


def _insert_choice(choices: tuple[Value, ...], value: Value) -> tuple[Value, ...]:
    """Add vLLM's default deterministically: "no flag" first, in numeric order, else last."""
    if value is None:
        return (None, *choices)
    numbers = [c for c in choices if c is not None]
    if is_number(value) and numbers and all(is_number(c) for c in numbers) and numbers == sorted(
            cast(list[float], numbers)):
        position = next((i for i, c in enumerate(choices)
                         if c is not None and cast(float, c) > cast(float, value)), len(choices))
        return (*choices[:position], value, *choices[position:])
    return (*choices, value)


# ----------------------------------------------------------------------------- spaces


@dataclass(frozen=True)
class SearchSpace:
    """A validated space as declared in YAML, before it meets a host and a model."""

    name: str
    description: str
    params: tuple[ParamSpec, ...]  # declaration order: the order of sampling
    rules: tuple[Rule, ...]  # from the YAML; built-ins are added by `resolve`
    source: str = "<space>"  # file name, for messages

    @property
    def param_names(self) -> list[str]:
        return [p.name for p in self.params]

    def resolve(self, context: Mapping[str, Any] | None = None) -> ResolvedSpace:
        """Apply defaults and static rules for one host and model.

        `context` holds `hardware` and `model` (mappings or objects such as HardwareProfile and
        ModelInfo) or flat dotted keys (`hardware.num_gpus`); a key left out makes every rule
        that tests it not apply. Raises `SpaceError` when a rule leaves a param with no value.
        """
        try:
            return self._resolve(context or {})
        except RuleError as exc:
            raise SpaceError(f"{self.source}: {_sentence(exc)}") from exc

    def _resolve(self, context: Mapping[str, Any]) -> ResolvedSpace:
        applied: list[AppliedRule] = []
        params = self._for_release(context, applied)
        specs = {p.name: self._with_default(p, context) for p in params}
        static: list[Rule] = []
        for builtin in STATIC_BUILTINS:
            rule = builtin(context, specs)
            if rule is not None:
                static.append(rule)
        static.extend(known_fact_rules(context, specs))
        static.extend(r for r in self.rules if not r.is_conditional)
        for rule in static:
            if rule.context_holds(context):
                effect = apply_static(rule, specs)
                if effect:
                    applied.append(AppliedRule(rule.name, rule.reason, effect, "static"))
        for name, spec in specs.items():
            if not spec.contains(spec.default):
                nearest = _nearest(spec, spec.default)
                applied.append(AppliedRule(
                    "default-outside-space",
                    "a rule removed vLLM's default; the baseline uses the nearest allowed value",
                    f"{name}: {spec.default} -> {nearest}", "static"))
                specs[name] = replace(spec, default=nearest)
        conditional: list[Rule] = []
        for rule in [*conditional_builtins(context), *self.rules]:
            if not rule.is_conditional or not rule.context_holds(context):
                continue
            targets = [(t, v) for t, v in rule.targets if t in specs]
            if not targets or any(p not in specs for p in rule.params_read):
                continue
            moot = all(specs[t].is_fixed and same(specs[t].fixed_value, v) for t, v in targets)
            if moot or not could_hold(rule, specs):
                continue
            conditional.append(rule)
            fixes = ", ".join(f"{t} fixed to {v}" for t, v in targets)
            applied.append(AppliedRule(rule.name, rule.reason,
                                       f"when {rule.describe_when(params_only=True)}: {fixes}",
                                       "conditional"))
        resolved = ResolvedSpace(name=self.name, params=tuple(specs.values()),
                                 conditional_rules=tuple(conditional),
                                 applied_rules=tuple(applied), source=self.source,
                                 vllm_defaults={n: _vllm_default(n, context)
                                                for n in [*specs, *HOST_DEFAULTS]})
        problem = resolved.token_budget_problem(None)
        if problem is not None:
            raise SpaceError(f"{self.source}: {problem}; raise the max_num_batched_tokens "
                             "choices or lower the max_num_seqs values (its choices, or a "
                             "rule's fix).")
        return resolved

    def _for_release(self, context: Mapping[str, Any],
                     applied: list[AppliedRule]) -> list[ParamSpec]:
        """The params the release in `context["engine"]` can take: a flag it lacks is not
        searched (its params drop out), and a value outside its value set is not tried."""
        version, flags, _, choices = _engine(context)
        if flags is None:
            return list(self.params)
        kept: list[ParamSpec] = []
        release = f"vLLM {version}" if version else "this vLLM"
        for spec in self.params:
            key = engine_key(spec.name)
            if key.partition(".")[0] not in flags:
                applied.append(AppliedRule(
                    "not-a-flag-of-release", f"{release} has no --{key.partition('.')[0]}",
                    f"{spec.name}: not searched", "static"))
                continue
            allowed = choices.get(key)
            no_flag = KNOWN_FLAGS[spec.name].no_flag
            if spec.type == "categorical" and isinstance(allowed, list | tuple) and allowed:
                taken = {str(a) for a in allowed}
                dropped = [c for c in spec.choices if c not in no_flag and str(c) not in taken]
                if dropped and len(dropped) < len(spec.choices):
                    spec = replace(spec, choices=tuple(c for c in spec.choices
                                                       if c not in dropped))
                    applied.append(AppliedRule(
                        "not-a-value-of-release",
                        f"{release}'s --{key} does not take {', '.join(map(str, dropped))}",
                        f"{spec.name}: {', '.join(map(str, dropped))} removed", "static"))
            kept.append(spec)
        return kept

    def _with_default(self, spec: ParamSpec, context: Mapping[str, Any]) -> ParamSpec:
        """`spec` with its default resolved and added to its domain, so the baseline can run."""
        default = _vllm_default(spec.name, context) if spec.is_vllm_default else spec.default
        where = f"parameters.{spec.name}.default"
        if spec.type == "categorical":
            choices = spec.choices
            if not contains(choices, default):
                choices = _insert_choice(choices, default)
            return replace(spec, choices=choices, default=default)
        if not is_number(default):
            _fail(self.source, f"{where} 'vllm' needs model.max_model_len in the "
                               "context for an int range; pass the model or a literal default")
        number = cast(float, default)
        _check_range_default(spec, number, where, self.source)
        low, high = cast(float, spec.low), cast(float, spec.high)
        if spec.type == "int":
            return replace(spec, low=int(min(low, number)), high=int(max(high, number)),
                           default=int(number))
        return replace(spec, low=min(low, number), high=max(high, number), default=float(number))


def _decimals(step: float) -> int:
    """Decimal places of a step as written (0.01 -> 2), for rounding sampled floats."""
    exponent = Decimal(str(step)).normalize().as_tuple().exponent
    return max(0, -exponent) if isinstance(exponent, int) else 0


def _nearest(spec: ParamSpec, value: Value) -> Value:
    """The allowed value closest to `value` (ties go low); the first choice for text."""
    if spec.type == "categorical":
        numbers = [c for c in spec.choices if is_number(c)]
        if is_number(value) and numbers:
            target = cast(float, value)
            return min(numbers, key=lambda c: (abs(cast(float, c) - target), cast(float, c)))
        return spec.choices[0]
    low, high = cast(float, spec.low), cast(float, spec.high)
    clamped = min(max(cast(float, value), low), high)
    if spec.step is not None:
        steps = round((Decimal(str(clamped)) - Decimal(str(low))) / Decimal(str(spec.step)))
        clamped = min(float(Decimal(str(low)) + steps * Decimal(str(spec.step))), high)
    return int(clamped) if spec.type == "int" else float(clamped)


def to_flags(params: Mapping[str, Value],
             defaults: Mapping[str, Value] | None = None) -> dict[str, Value]:
    """Engine flags by snake_case name, dropping values that mean "pass no flag".

    None, `none`/`auto` and a boolean equal to vLLM's default are dropped; a boolean whose vLLM
    default is true becomes `no_<name>: True`, since a YAML `false` is silently ignored by vLLM.
    Nested config keys come out dotted (`compilation_config.cudagraph_mode`). The caller adds
    `--` and kebab-case at the process boundary. `defaults`: the release's (a resolved space's
    `vllm_defaults`); without, vLLM 0.26's.
    """
    flags: dict[str, Value] = {}
    for name, value in params.items():
        flag = KNOWN_FLAGS.get(name)
        if flag is None:
            raise SpaceError(f"to_flags: {show(name)} is not a known vLLM 0.26 engine flag"
                             f"{did_you_mean(name, KNOWN_FLAGS)}.")
        if value is None or (isinstance(value, str) and value in flag.no_flag):
            continue
        if isinstance(value, bool):
            # None: decided at start-up (async_scheduling)
            default = (_VLLM_DEFAULTS if defaults is None else defaults).get(name)
            if default is not None and value == default:
                continue
            flags[name if value else f"no_{name}"] = True
            continue
        flags[flag.cli_name or name] = value
    return flags


@dataclass(frozen=True)
class ResolvedSpace:
    """A space for one host and model: what `sample` suggests, and the rules that shaped it."""

    name: str
    params: tuple[ParamSpec, ...]  # resolved domains, in sampling order; defaults resolved
    conditional_rules: tuple[Rule, ...]  # evaluated per trial; built-ins first
    applied_rules: tuple[AppliedRule, ...]  # every rule that changed this space, for the log
    source: str = "<space>"
    vllm_defaults: Mapping[str, Value] = field(default_factory=dict)  # before any rule
    # The study's fixed flags: every trial and the baseline run them; those the space
    # searched are single-valued params now (`with_fixed`).
    study_fixed: Mapping[str, Value] = field(default_factory=dict)

    def with_fixed(self, fixed: Mapping[str, Any]) -> tuple[ResolvedSpace, list[str]]:
        """This space with the study's fixed flags taken out of the search: a param the study
        fixes keeps that one value in every config, the baseline included. Returns the space
        and one line per param taken out, for the log. Raises `SpaceError` when a fixed value
        breaks vLLM's token budget against what the space still searches."""
        specs = []
        removed: list[str] = []
        for spec in self.params:
            if spec.name in fixed:
                value = cast(Value, fixed[spec.name])
                removed.append(f"fixed_flags.{spec.name}={value}: {spec.name} is not searched "
                               f"(space {self.name} had {spec.describe_domain()}); every trial "
                               "and the baseline run it")
                spec = replace(spec, type="categorical", choices=(value,), low=None,
                               high=None, log=False, step=None, default=value,
                               is_vllm_default=False)
            specs.append(spec)
        space = replace(self, params=tuple(specs),
                        study_fixed={k: cast(Value, v) for k, v in fixed.items()})
        problem = space.token_budget_problem(None)
        if problem is not None:
            raise SpaceError(f"fixed_flags: {problem}; change the fixed value or the space's "
                             "range.")
        return space, removed

    def _active_fix(self, name: str, values: Mapping[str, Any]) -> Rule | None:
        """The first conditional rule that fixes `name` given the earlier values."""
        for rule in self.conditional_rules:
            if any(t == name for t, _ in rule.targets) and rule.params_hold(values):
                return rule
        return None

    def _walk(self, choose: Any) -> dict[str, Value]:
        values: dict[str, Value] = {}
        for spec in self.params:
            rule = self._active_fix(spec.name, values)
            if spec.name in self.study_fixed:  # the study's word is final; `check` says when
                values[spec.name] = self.study_fixed[spec.name]  # it breaks a rule
            elif rule is not None:
                values[spec.name] = rule.fix_value(spec.name)
            elif spec.is_fixed:
                values[spec.name] = spec.fixed_value
            else:
                values[spec.name] = choose(spec)
        return values

    def sample(self, trial: optuna.trial.BaseTrial) -> dict[str, Value]:
        """Suggest every param in declaration order; fixed params are returned, not suggested.

        Each param always has the same distribution (Optuna requires it), so a conditional rule
        fixes a param outright instead of narrowing its choices.
        """

        def suggest(spec: ParamSpec) -> Value:
            if spec.type == "categorical":
                return trial.suggest_categorical(
                    spec.name, cast(list[CategoricalChoiceType], list(spec.choices)))
            low, high = cast(float, spec.low), cast(float, spec.high)
            if spec.type == "int":
                return trial.suggest_int(spec.name, int(low), int(high),
                                         step=int(spec.step or 1), log=spec.log)
            value = trial.suggest_float(spec.name, low, high, step=spec.step, log=spec.log)
            if spec.step is not None:
                # 0.9099999999999999 -> 0.91: the flag and the logs show the grid value.
                value = round(value, _decimals(spec.step))
            return value

        return self._walk(suggest)

    def unsampled(self, params: Mapping[str, Any]) -> list[str]:
        """The params `sample` would have suggested that `params` lacks: non-empty for a trial
        whose sampling was cut short (its daemon died between two suggestions)."""
        missing: list[str] = []

        def recorded(spec: ParamSpec) -> Value:
            if spec.name not in params:
                missing.append(spec.name)
            return params.get(spec.name)

        self._walk(recorded)
        return missing

    def defaults(self) -> dict[str, Value]:
        """The vLLM-defaults baseline as a full config; pass it to `study.enqueue_trial`."""
        return self._walk(lambda spec: spec.default)

    def distributions(self) -> dict[str, BaseDistribution]:
        """The distribution of every param `sample` may suggest (fixed ones are left out)."""
        return {p.name: p.distribution() for p in self.params if not p.is_fixed}

    def fixed(self) -> dict[str, Value]:
        """Params the static rules left with a single value."""
        return {p.name: p.fixed_value for p in self.params if p.is_fixed}

    def to_flags(self, params: Mapping[str, Value]) -> dict[str, Value]:
        """Flags for `params`, leaving out every value equal to vLLM's own default for this host
        and model: the defaults baseline launches as a plain `vllm serve MODEL`, and every
        trial's command line shows only what it changes."""
        changed = {k: v for k, v in params.items()
                   if self.vllm_defaults.get(k) is None or v != self.vllm_defaults[k]
                   or isinstance(v, bool) != isinstance(self.vllm_defaults[k], bool)}
        return to_flags(changed, self.vllm_defaults)

    def token_budget_problem(self, params: Mapping[str, Any] | None) -> str | None:
        """vLLM needs max_num_batched_tokens >= max_num_seqs; None when that holds."""
        by_name = {p.name: p for p in self.params}

        def extreme(name: str, pick: Any) -> float | None:
            if params is not None and name in params:
                value = params[name]
            elif params is None and name in by_name:
                spec = by_name[name]
                numbers = [c for c in spec.choices if is_number(c)] if (
                    spec.type == "categorical") else [spec.low, spec.high]
                # A conditional rule sets its value outright, outside the domain if it says so.
                numbers += [v for r in self.conditional_rules for t, v in r.targets
                            if t == name and is_number(v)]
                value = pick(numbers) if numbers else None
            elif name in self.study_fixed:
                value = self.study_fixed[name]
            else:
                value = self.vllm_defaults.get(name)
            return cast(float, value) if is_number(value) else None

        tokens, seqs = extreme("max_num_batched_tokens", min), extreme("max_num_seqs", max)
        if tokens is None or seqs is None or tokens >= seqs:
            return None
        return (f"max_num_batched_tokens can be {tokens:g} while max_num_seqs is {seqs:g}, but "
                "vLLM needs max_num_batched_tokens >= max_num_seqs")

    def check(self, params: Mapping[str, Any]) -> list[str]:
        """Why `params` is not a config this space could produce; empty when it is."""
        problems: list[str] = []
        names = {p.name for p in self.params}
        for name in params:
            if name not in names:
                problems.append(f"{show(name)} is not a param of space {self.name}")
        for spec in self.params:
            if spec.name not in params:
                problems.append(f"{spec.name} is missing")
                continue
            value = params[spec.name]
            rule = self._active_fix(spec.name, params)
            if rule is not None:
                fixed = rule.fix_value(spec.name)
                if not same(value, fixed):
                    problems.append(
                        f"{spec.name}={show(value)} breaks rule {rule.name}: it must be {fixed} "
                        f"when {rule.describe_when(params_only=True)} ({rule.reason})")
            elif not spec.contains(value):
                problems.append(f"{spec.name}={show(value)} is outside its domain "
                                f"{spec.describe_domain()}")
        problem = self.token_budget_problem(params)
        if problem is not None:
            problems.append(problem)
        return problems

    def size(self) -> int | None:
        """How many distinct configs the space holds; None when a param is continuous."""
        readers = {p for r in self.conditional_rules for p in r.params_read}
        targets = {t for r in self.conditional_rules for t, _ in r.targets}
        coupled = [p for p in self.params if p.name in readers | targets]
        independent = 1
        for spec in self.params:
            if spec in coupled:
                continue
            count = spec.count()
            if count is None:
                return None
            independent *= count
        if any(p.type != "categorical" and p.name in readers for p in coupled):
            # Reading a range param would need enumerating it; count it without the rules.
            total = 1
            for spec in coupled:
                count = spec.count()
                if count is None:
                    return None
                total *= count
            return total * independent
        for spec in coupled:
            if spec.count() is None:
                return None
        return self._count_coupled(coupled, 0, {}) * independent

    def _count_coupled(self, coupled: list[ParamSpec], index: int, values: dict[str, Any]) -> int:
        if index == len(coupled):
            return 1
        spec = coupled[index]
        rule = self._active_fix(spec.name, values)
        if rule is not None or spec.is_fixed:
            values[spec.name] = rule.fix_value(spec.name) if rule else spec.fixed_value
            total = self._count_coupled(coupled, index + 1, values)
        elif spec.type == "categorical":
            total = 0
            for choice in spec.choices:
                values[spec.name] = choice
                total += self._count_coupled(coupled, index + 1, values)
        else:
            total = cast(int, spec.count()) * self._count_coupled(coupled, index + 1, values)
        values.pop(spec.name, None)
        return total

    def to_dict(self) -> dict[str, Any]:
        """Everything needed to reproduce the space, JSON-ready, for MLflow."""
        return {
            "name": self.name,
            "source": self.source,
            "params": {p.name: p.to_dict() for p in self.params},
            "defaults": self.defaults(),
            "conditional_rules": [r.to_dict() for r in self.conditional_rules],
            "applied_rules": [r.to_dict() for r in self.applied_rules],
            "size": self.size(),
        }


__all__ = [
    "KNOWN_FLAGS",
    "AppliedRule",
    "FlagSpec",
    "ResolvedSpace",
    "SearchSpace",
    "SpaceError",
    "Value",
    "bundled_spaces",
    "load_space",
    "parse_space",
    "recommend_space",
    "to_flags",
]
