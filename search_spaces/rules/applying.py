"""A static rule applied to a space's params: values removed or kept, a range bounded or a param
fixed, on the grid Optuna samples; a rule that leaves a param no value raises `RuleError`."""

from __future__ import annotations

from dataclasses import replace
from decimal import ROUND_CEILING, Decimal
from typing import Any

from search_spaces.params import ParamSpec
from search_spaces.rules.rule import Rule, RuleError
from search_spaces.values import contains, is_number


def apply_static(rule: Rule, specs: dict[str, ParamSpec]) -> str:
    """Apply `rule` to `specs` in place; the effect text, empty when nothing changed."""
    effects: list[str] = []
    for param, arg in rule.targets:
        spec = specs.get(param)
        if spec is None:  # built-in rules name params a space need not declare
            continue
        changed = _apply_one(rule, spec, arg)
        if changed != spec:
            effects.append(f"{param}: {_describe_change(spec, changed)}")
            specs[param] = changed
    return "; ".join(effects)


def _apply_one(rule: Rule, spec: ParamSpec, arg: Any) -> ParamSpec:
    if spec.type == "categorical":
        choices = spec.choices
        if rule.action == "remove":
            kept = tuple(c for c in choices if not contains(arg, c))
        elif rule.action == "keep":
            kept = tuple(c for c in choices if contains(arg, c))
        elif rule.action == "max":
            kept = tuple(c for c in choices if not is_number(c) or c <= arg)
        elif rule.action == "min":
            kept = tuple(c for c in choices if not is_number(c) or c >= arg)
        else:
            kept = (arg,)
        if not kept:
            raise RuleError(f"rule {rule.name!r} leaves {spec.name} with no value (it had "
                            f"{', '.join(str(c) for c in choices)}); relax the rule or widen "
                            "the choices")
        return replace(spec, choices=kept)
    if spec.low is None or spec.high is None:
        raise RuleError(f"{spec.name} is a {spec.type} param without bounds")
    if rule.action == "fix":
        return replace(spec, low=arg, high=arg, step=None)
    low, high = Decimal(str(spec.low)), Decimal(str(spec.high))
    bound = Decimal(str(arg))
    step = Decimal(str(spec.step if spec.step is not None else 1 if spec.type == "int" else 0))
    if rule.action == "max" and bound < high:
        high = bound
        if step and high >= low:  # snap down onto the grid low + k*step that Optuna samples
            high = low + ((high - low) // step) * step
    elif rule.action == "min" and bound > low:
        if step and bound <= high:  # snap up onto the same grid, so high stays on it
            low = low + ((bound - low) / step).to_integral_value(ROUND_CEILING) * step
        else:
            low = bound
    if low > high or (spec.log and low <= 0):
        raise RuleError(f"rule {rule.name!r} leaves {spec.name} with no value (range "
                        f"[{spec.low}, {spec.high}] against {rule.action} {arg}); relax the rule "
                        "or widen the range")
    if spec.type == "int":
        return replace(spec, low=int(low), high=int(high))
    return replace(spec, low=float(low), high=float(high))


def _describe_change(before: ParamSpec, after: ParamSpec) -> str:
    if before.type == "categorical":
        removed = [c for c in before.choices if not contains(after.choices, c)]
        if len(after.choices) == 1:
            return f"fixed to {after.choices[0]}" + (
                f" (removed {', '.join(str(c) for c in removed)})" if removed else "")
        return f"removed {', '.join(str(c) for c in removed)}"
    if after.low == after.high:
        return f"fixed to {after.low}"
    return f"range [{before.low}, {before.high}] -> [{after.low}, {after.high}]"
