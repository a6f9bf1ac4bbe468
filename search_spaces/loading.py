"""A search space from YAML: `load_space` (a file, or a bundled space by name) and `parse_space`
(already-parsed YAML) check every field against the flags a space may search
(`search_spaces.known_flags`) and raise one `SpaceError` line naming the file, the field and the
fix; `bundled_spaces` and `recommend_space` name the spaces shipped with nightshift."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from decimal import Decimal
from pathlib import Path
from typing import Any, cast

import yaml

from search_spaces.bounded_yaml import load_yaml, yaml_message
from search_spaces.errors import SpaceError, fail, sentence
from search_spaces.known_flags import HOST_DEFAULTS, KNOWN_FLAGS, value_problem, vllm_default
from search_spaces.params import ParamSpec, ParamType, Value
from search_spaces.rules.builtin import BUILTIN_ORDER, builtin_names
from search_spaces.rules.parsing import parse_rule
from search_spaces.rules.rule import Rule, RuleError
from search_spaces.space import SearchSpace
from search_spaces.values import contains, did_you_mean, is_number, is_scalar, on_grid, show

BUNDLED_DIR = Path(__file__).parent
PARAM_TYPES: tuple[ParamType, ...] = ("categorical", "int", "float")
_TOP_KEYS = ("name", "description", "parameters", "rules")
_PARAM_KEYS = ("type", "choices", "low", "high", "log", "step", "default", "help")
_RANGE_KEYS = ("low", "high", "log", "step")
_MAX_SPACE_CHARS = 1_000_000


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
        fail(source, f"over {_MAX_SPACE_CHARS:,} characters, far more than a search space "
                      "holds; check that this is the space YAML")
    try:
        data = load_yaml(text)
    except yaml.YAMLError as exc:
        raise SpaceError(yaml_message(exc, source, text)) from exc
    except RecursionError as exc:
        raise SpaceError(f"{source}: YAML nested too deeply; flatten it.") from exc
    return parse_space(data, source=source, default_name=path.stem)


def _locate(path_or_name: str | Path) -> Path:
    if isinstance(path_or_name, str) and not path_or_name:
        fail("load_space", "expected a bundled space name or a .yaml path but got ''")
    path = Path(path_or_name)
    looks_like_path = isinstance(path_or_name, Path) or path.suffix in (".yaml", ".yml") or (
        len(path.parts) > 1)
    if path.is_file():
        return path
    if looks_like_path:
        fail(str(path), "no such file; pass an existing .yaml path or a bundled name "
                         f"({', '.join(bundled_spaces())})")
    bundled = BUNDLED_DIR / f"{path_or_name}.yaml"
    if not bundled.is_file():
        fail("load_space", f"unknown space {show(str(path_or_name))}"
                            f"{did_you_mean(str(path_or_name), bundled_spaces())} "
                            f"(bundled: {', '.join(bundled_spaces())}; or pass a .yaml path)")
    return bundled


def parse_space(data: object, source: str = "<space>", default_name: str = "space") -> SearchSpace:
    """A space from already-parsed YAML (a mapping); every problem raises a one-line SpaceError."""
    if not isinstance(data, Mapping):
        fail(source, f"expected a mapping with {', '.join(_TOP_KEYS)} but got {show(data)}")
    for key in data:
        if key not in _TOP_KEYS:
            fail(source, f"unknown top-level key {show(key)}{did_you_mean(key, _TOP_KEYS)} "
                          f"(allowed: {', '.join(_TOP_KEYS)})")
    name = data.get("name", default_name)
    if not isinstance(name, str) or not name.strip() or "\n" in name:
        fail(source, f"name must be a one-line string but got {show(name)}")
    description = data.get("description", "")
    if not isinstance(description, str):
        fail(source, f"description must be a string but got {show(description)}")
    raw_params = data.get("parameters")
    if not isinstance(raw_params, Mapping) or not raw_params:
        fail(source, "parameters must be a non-empty mapping of vLLM flag name: spec but got "
                      f"{show(raw_params)}")
    specs: dict[str, ParamSpec] = {}
    for param_name, raw in raw_params.items():
        spec = _parse_param(param_name, raw, source)
        specs[spec.name] = spec
    order = list(specs)
    for reader, target in BUILTIN_ORDER:
        if reader in specs and target in specs and order.index(reader) > order.index(target):
            fail(source, f"parameters.{reader} must be declared before parameters.{target}: "
                          f"built-in rules fix {target} from {reader}; move it up")
    raw_rules = data.get("rules", [])
    if raw_rules is None:
        raw_rules = []
    if not isinstance(raw_rules, list):
        fail(source, f"rules must be a list of rules but got {show(raw_rules)}")
    rules: list[Rule] = []
    seen = set(builtin_names())
    for index, raw_rule in enumerate(raw_rules):
        try:
            rule = parse_rule(raw_rule, f"rules[{index}]", specs, value_problem)
        except RuleError as exc:
            raise SpaceError(f"{source}: {sentence(exc)}") from exc
        if rule.name in seen:
            fail(source, f"rules[{index}].name {show(rule.name)} is already taken (by an "
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
        fail(source, f"parameters.{label} is not a vLLM 0.26 engine flag this loader knows"
                      f"{hint} (use snake_case names such as max_num_seqs)")
    where = f"parameters.{name}"
    if not isinstance(raw, Mapping):
        fail(source, f"{where} must be a mapping with type, choices or low/high, default and "
                      f"help but got {show(raw)}")
    for key in raw:
        if key not in _PARAM_KEYS:
            fail(source, f"{where} has unknown key {show(key)}{did_you_mean(key, _PARAM_KEYS)} "
                          f"(allowed: {', '.join(_PARAM_KEYS)})")
    flag = KNOWN_FLAGS[name]
    kind = raw.get("type")
    if kind not in PARAM_TYPES:
        fail(source, f"{where}.type must be one of {', '.join(PARAM_TYPES)} but got "
                      f"{show(kind)}{did_you_mean(kind, PARAM_TYPES)}")
    param_type = cast(ParamType, kind)
    if param_type != "categorical" and (flag.kind in ("bool", "enum") or flag.is_categorical_only):
        fail(source, f"{where}.type must be categorical for this flag but got {param_type}; "
                      "list its values under choices")
    if param_type == "float" and flag.kind == "int":
        fail(source, f"{where}.type must be int or categorical (vLLM takes an integer) but got "
                      "float")
    help_text = raw.get("help", "")
    if not isinstance(help_text, str) or "\n" in help_text.strip():
        fail(source, f"{where}.help must be a one-line string but got {show(help_text)}")
    spec = ParamSpec(name=name, type=param_type, help=help_text.strip())
    if param_type == "categorical":
        spec = _parse_choices(spec, raw, where, source)
    else:
        spec = _parse_range(spec, raw, where, source)
    return _parse_default(spec, raw, where, source)


def _parse_choices(spec: ParamSpec, raw: Mapping[Any, Any], where: str, source: str) -> ParamSpec:
    for key in _RANGE_KEYS:
        if key in raw:
            fail(source, f"{where}.{key} applies to int/float params; a categorical param "
                          "lists choices")
    choices = raw.get("choices")
    if not isinstance(choices, list) or not choices:
        fail(source, f"{where}.choices must be a non-empty list but got {show(choices)}")
    kept: list[Value] = []
    for index, choice in enumerate(choices):
        problem = value_problem(spec.name, choice) if is_scalar(choice) else (
            f"must be a scalar but got {show(choice)}")
        if problem is not None:
            fail(source, f"{where}.choices[{index}] {problem}")
        if contains(kept, choice):
            fail(source, f"{where}.choices[{index}] repeats {show(choice)}; list each value once")
        kept.append(cast(Value, choice))
    return replace(spec, choices=tuple(kept))


def _parse_range(spec: ParamSpec, raw: Mapping[Any, Any], where: str, source: str) -> ParamSpec:
    if "choices" in raw:
        fail(source, f"{where}.choices applies to categorical params; an {spec.type} param "
                      "takes low and high")
    bounds: dict[str, float] = {}
    for key in ("low", "high"):
        value = raw.get(key)
        if spec.type == "int" and not (isinstance(value, int) and not isinstance(value, bool)):
            fail(source, f"{where}.{key} must be an integer but got {show(value)}")
        if not is_number(value):
            fail(source, f"{where}.{key} must be a finite number but got {show(value)}")
        problem = value_problem(spec.name, value)
        if problem is not None:
            fail(source, f"{where}.{key} {problem}")
        bounds[key] = cast(float, value)
    low, high = bounds["low"], bounds["high"]
    if low >= high:
        fail(source, f"{where}.low must be < high but got low={low}, high={high}; swap them or "
                      "use a categorical param with one choice")
    log = raw.get("log", False)
    if not isinstance(log, bool):
        fail(source, f"{where}.log must be true or false but got {show(log)}")
    if log and low <= 0:
        fail(source, f"{where}.log needs low > 0 but got low={low}; raise low or drop log")
    step = raw.get("step")
    if step is not None:
        if spec.type == "int" and not (isinstance(step, int) and not isinstance(step, bool)):
            fail(source, f"{where}.step must be an integer but got {show(step)}")
        if not is_number(step) or step <= 0:
            fail(source, f"{where}.step must be a positive number but got {show(step)}")
        if log and step != 1:
            fail(source, f"{where}.step cannot combine with log (Optuna samples log ranges "
                          "continuously); drop one")
        if not on_grid(high, low, step):
            fail(source, f"{where}.high must be low + k*step but got low={low}, high={high}, "
                          f"step={step}; adjust high")
        if spec.type == "float" and Decimal(str(high - low)) / Decimal(str(step)) > 10**9:
            fail(source, f"{where}.step {step} makes over a billion values; use a larger step")
    if spec.type == "int":
        return replace(spec, low=int(low), high=int(high), log=log,
                       step=int(step) if step is not None and step != 1 else None)
    return replace(spec, low=float(low), high=float(high), log=log,
                   step=float(step) if step is not None else None)


def _parse_default(spec: ParamSpec, raw: Mapping[Any, Any], where: str, source: str) -> ParamSpec:
    default = raw.get("default", "vllm")
    if default == "vllm" and isinstance(default, str):
        resolvable = vllm_default(spec.name) is not None or spec.name in HOST_DEFAULTS
        if spec.type != "categorical" and not resolvable:
            fail(source, f"{where}.default 'vllm' has no known value for an {spec.type} param; "
                          "give a literal default")
        return replace(spec, default=None, is_vllm_default=True)
    problem = value_problem(spec.name, default) if is_scalar(default) else (
        f"must be a scalar or 'vllm' but got {show(default)}")
    if problem is None and spec.type != "categorical" and not is_number(default):
        problem = f"must be a number for an {spec.type} param but got {show(default)}"
    if problem is None and spec.type == "int" and not isinstance(default, int):
        problem = f"must be an integer but got {show(default)}"
    if problem is not None:
        fail(source, f"{where}.default {problem}")
    if spec.type != "categorical":
        problem = spec.range_default_problem(cast(float, default))
        if problem is not None:
            fail(source, f"{where}.default {problem}")
    return replace(spec, default=cast(Value, default), is_vllm_default=False)
