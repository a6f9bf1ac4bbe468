"""A rule from its YAML mapping, checked against the space's declared params and the context keys
a rule may test (`CONTEXT_KEYS`); every problem is one `RuleError` line naming the field."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from search_spaces.params import ParamSpec
from search_spaces.rules.rule import ACTIONS, OPS, Action, Condition, Op, Rule, RuleError
from search_spaces.values import did_you_mean, is_number, is_scalar, show

_RULE_KEYS = ("name", "reason", "when", *ACTIONS)

# What the caller may put in the context; "number" keys take ordering operators, "flag" keys
# are true or false. `workload.*` and `model.real_weights` come from the study file
# (optimizer/run/space_context.py's `space_context`); a key left out makes a rule testing it
# not apply.
CONTEXT_KEYS: dict[str, Literal["number", "text", "flag"]] = {
    "hardware.num_gpus": "number",
    "hardware.compute_capability": "number",  # smallest on the host, e.g. 9.0, 8.9, 8.0
    "hardware.gpu_memory_gib": "number",  # smallest on the host
    "hardware.interconnect": "text",
    "hardware.hardware_class": "text",
    "hardware.gpu_name": "text",
    "model.num_attention_heads": "number",
    "model.num_key_value_heads": "number",
    "model.quant_method": "text",  # None for an unquantized checkpoint
    "model.max_position_embeddings": "number",
    "model.max_model_len": "number",  # the context vLLM derives from config.json (RoPE scaling)
    # vLLM's max_model_len with none given: the above, or a LongRoPE model's original length
    "model.default_max_model_len": "number",
    "model.num_params": "number",
    "model.real_weights": "flag",  # false when the study loads dummy weights (load_format)
    "workload.shares_prefix": "flag",  # requests share a prompt prefix the cache could reuse
    "workload.max_concurrency": "number",  # the largest concurrency of any level; None: uncapped
    "workload.max_prompt_tokens": "number",  # the longest prompt the workload sends
    # the longest prompt plus the longest output of one request: what max_model_len must hold
    "workload.max_request_tokens": "number",
    "engine.vllm_version": "text",  # "0.26.0", "simulated 0.26.0"; the known facts read it
}
CONTEXT_ENUMS: dict[str, tuple[str, ...]] = {
    "hardware.interconnect": ("nvlink", "pcie", "none"),
    "hardware.hardware_class": ("hopper", "blackwell", "ampere", "24gb", "other", "none"),
}

ValueProblem = Callable[[str, object], "str | None"]


def parse_rule(
    raw: object,
    where: str,
    specs: Mapping[str, ParamSpec],
    value_problem: ValueProblem,
) -> Rule:
    """A rule from its YAML mapping, checked against the declared params (in declaration order)."""
    if not isinstance(raw, Mapping):
        raise RuleError(f"{where} must be a mapping with name, reason, when and one action "
                        f"but got {show(raw)}")
    for key in raw:
        if key not in _RULE_KEYS:
            raise RuleError(f"{where} has unknown key {show(key)}{did_you_mean(key, _RULE_KEYS)} "
                            f"(allowed: {', '.join(_RULE_KEYS)})")
    name = raw.get("name")
    if not isinstance(name, str) or not name.strip() or "\n" in name:
        raise RuleError(f"{where}.name must be a one-line string but got {show(name)}")
    where = f"{where} ({name})"
    reason = raw.get("reason")
    if not isinstance(reason, str) or not reason.strip() or "\n" in reason.strip():
        raise RuleError(f"{where}.reason must be a one-line string saying why but got "
                        f"{show(reason)}")
    when = parse_when(raw.get("when"), f"{where}.when", specs, value_problem)
    actions = [a for a in ACTIONS if a in raw]
    if len(actions) != 1:
        raise RuleError(f"{where} needs exactly one action of {', '.join(ACTIONS)} but has "
                        f"{len(actions)}")
    action = actions[0]
    targets = _parse_targets(raw[action], action, f"{where}.{action}", specs, value_problem)
    rule = Rule(name=name.strip(), reason=reason.strip(), when=when, action=action,
                targets=targets)
    if rule.is_conditional:
        _check_conditional(rule, where, list(specs))
    return rule


def parse_when(
    raw: object, where: str, specs: Mapping[str, ParamSpec], value_problem: ValueProblem
) -> tuple[Condition, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, Mapping):
        raise RuleError(f"{where} must be a mapping of key: value or key: {{op: value}} but got "
                        f"{show(raw)}")
    conditions: list[Condition] = []
    for key, spec in raw.items():
        if not isinstance(key, str):
            raise RuleError(f"{where} keys must be strings but got {show(key)}")
        field = f"{where}.{key}"
        if key.startswith("params."):
            param = key.removeprefix("params.")
            if param not in specs:
                raise RuleError(f"{field} names a param this space does not declare"
                                f"{did_you_mean(param, specs)}")
        elif key not in CONTEXT_KEYS:
            hint = (f"; did you mean 'params.{key}'?" if key in specs
                    else did_you_mean(key, CONTEXT_KEYS))
            raise RuleError(f"{field} is not a context key (hardware.*, model.* or params.*)"
                            f"{hint}")
        if isinstance(spec, Mapping):
            if not spec:
                raise RuleError(f"{field} needs at least one operator of {', '.join(OPS)}")
            for op, value in spec.items():
                if op not in OPS:
                    raise RuleError(f"{field} has unknown operator {show(op)}"
                                    f"{did_you_mean(op, OPS)} (allowed: {', '.join(OPS)})")
                conditions.append(_condition(key, op, value, field, specs, value_problem))
        elif isinstance(spec, list | tuple):
            raise RuleError(f"{field} is a list; write {{in: [...]}} to match any of several")
        else:
            conditions.append(_condition(key, "eq", spec, field, specs, value_problem))
    return tuple(conditions)


def _condition(
    key: str, op: Op, value: object, field: str,
    specs: Mapping[str, ParamSpec], value_problem: ValueProblem,
) -> Condition:
    if op in ("in", "not_in"):
        if not isinstance(value, list | tuple) or not value:
            raise RuleError(f"{field}.{op} must be a non-empty list but got {show(value)}")
        values = tuple(value)
    else:
        values = (value,)
    for v in values:
        if not is_scalar(v):
            raise RuleError(f"{field}.{op} values must be scalars but got {show(v)}")
    ordering = op in ("lt", "le", "gt", "ge")
    if key.startswith("params."):
        param = key.removeprefix("params.")
        spec = specs[param]
        if ordering:
            numeric = spec.type != "categorical" or all(
                is_number(c) or c is None for c in spec.choices)
            if not numeric or not is_number(value):
                raise RuleError(f"{field}.{op} needs a number and a numeric param but got "
                                f"{show(value)}")
        else:
            for v in values:
                problem = value_problem(param, v)
                if problem is not None:
                    raise RuleError(f"{field}.{op}: {param} {problem}")
    elif CONTEXT_KEYS[key] == "number":
        for v in values:
            if not is_number(v):
                raise RuleError(f"{field}.{op} must be a number but got {show(v)}")
    elif CONTEXT_KEYS[key] == "flag":
        if ordering:
            raise RuleError(f"{field} is true or false; use eq, ne, in or not_in, not {op}")
        for v in values:
            if not isinstance(v, bool):
                raise RuleError(f"{field}.{op} must be true or false but got {show(v)}")
    else:
        if ordering:
            raise RuleError(f"{field} is text; use eq, ne, in or not_in, not {op}")
        allowed = CONTEXT_ENUMS.get(key)
        for v in values:
            if not (v is None or isinstance(v, str)):
                raise RuleError(f"{field}.{op} must be a string but got {show(v)}")
            if allowed is not None and v not in allowed:
                raise RuleError(f"{field}.{op} must be one of {', '.join(allowed)} but got "
                                f"{show(v)}{did_you_mean(v, allowed)}")
    return Condition(key=key, op=op, value=values if op in ("in", "not_in") else value)


def _parse_targets(
    raw: object, action: Action, where: str,
    specs: Mapping[str, ParamSpec], value_problem: ValueProblem,
) -> tuple[tuple[str, Any], ...]:
    if not isinstance(raw, Mapping) or not raw:
        raise RuleError(f"{where} must be a non-empty mapping of param: value but got {show(raw)}")
    targets: list[tuple[str, Any]] = []
    for param, arg in raw.items():
        field = f"{where}.{param}"
        if not isinstance(param, str) or param not in specs:
            raise RuleError(f"{where} names {show(param)}, which this space does not declare"
                            f"{did_you_mean(param, specs)}")
        spec = specs[param]
        if action in ("remove", "keep"):
            values = tuple(arg) if isinstance(arg, list | tuple) else (arg,)
            if spec.type != "categorical":
                raise RuleError(f"{field}: {action} applies to categorical params; use max/min "
                                f"for {spec.type} ranges")
            if not values:
                raise RuleError(f"{field} must list at least one value")
            for v in values:
                problem = value_problem(param, v) if is_scalar(v) else "must be a scalar"
                if problem is not None:
                    raise RuleError(f"{field}: {param} {problem}")
            targets.append((param, values))
        elif action in ("max", "min"):
            numeric = spec.type != "categorical" or all(
                is_number(c) or c is None for c in spec.choices)
            if not is_number(arg) or not numeric:
                raise RuleError(f"{field}: {action} needs a number and a numeric param but got "
                                f"{show(arg)}")
            targets.append((param, arg))
        else:
            problem = value_problem(param, arg) if is_scalar(arg) else "must be a scalar"
            if problem is None and spec.type != "categorical" and not is_number(arg):
                problem = f"must be a number for a {spec.type} param but got {show(arg)}"
            if problem is not None:
                raise RuleError(f"{field}: {param} {problem}")
            targets.append((param, arg))
    return tuple(targets)


def _check_conditional(rule: Rule, where: str, order: Sequence[str]) -> None:
    if rule.action != "fix":
        raise RuleError(f"{where} reads params.* so it may only fix later params (Optuna needs "
                        f"each param's choices to stay the same), not {rule.action}")
    for target, _ in rule.targets:
        for param in rule.params_read:
            if order.index(param) >= order.index(target):
                raise RuleError(f"{where} fixes {target} from params.{param}, which is declared "
                                f"later; declare {param} before {target}")
