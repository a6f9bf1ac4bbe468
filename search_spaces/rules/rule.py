"""A rule as data: `Condition` (one test of its `when`), `Rule` (a named, reasoned change to the
space) and `AppliedRule` (what one did to a resolved space), with `could_hold`.

A rule is static when its `when` names only `hardware.*`/`model.*` keys: `SearchSpace.resolve`
applies it once (remove, keep, max, min or fix values). A rule naming `params.*` is conditional:
`ResolvedSpace.sample` evaluates it for every trial and may only `fix` a later param, because
Optuna needs a param's distribution to be the same in every trial.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from search_spaces.params import ParamSpec
from search_spaces.values import MISSING, contains, is_number, lookup, same, show

Op = Literal["eq", "ne", "in", "not_in", "lt", "le", "gt", "ge"]
Action = Literal["remove", "keep", "max", "min", "fix"]
RuleKind = Literal["static", "conditional"]

OPS: tuple[Op, ...] = ("eq", "ne", "in", "not_in", "lt", "le", "gt", "ge")
ACTIONS: tuple[Action, ...] = ("remove", "keep", "max", "min", "fix")
_SYMBOLS: dict[str, str] = {
    "eq": "==", "ne": "!=", "in": "in", "not_in": "not in",
    "lt": "<", "le": "<=", "gt": ">", "ge": ">=",
}


class RuleError(ValueError):
    """A malformed rule, or one that empties a param; the space re-raises it as `SpaceError`."""


@dataclass(frozen=True)
class Condition:
    """One test in a rule's `when`: `key op value`."""

    key: str  # "hardware.compute_capability", "params.attention_backend"
    op: Op
    value: Any  # a scalar; a tuple of scalars for in/not_in

    @property
    def is_param(self) -> bool:
        return self.key.startswith("params.")

    @property
    def param(self) -> str:
        return self.key.removeprefix("params.")

    def holds(self, actual: Any) -> bool:
        if actual is MISSING:
            return False
        if self.op == "eq":
            return same(actual, self.value)
        if self.op == "ne":
            return not same(actual, self.value)
        if self.op == "in":
            return contains(self.value, actual)
        if self.op == "not_in":
            return not contains(self.value, actual)
        if actual is None:
            return False
        if not is_number(actual):
            raise RuleError(
                f"{self.key} is {show(actual)} in the context but {self.op} needs a number; "
                "pass a number for it"
            )
        bound = float(self.value)
        if self.op == "lt":
            return bool(actual < bound)
        if self.op == "le":
            return bool(actual <= bound)
        if self.op == "gt":
            return bool(actual > bound)
        return bool(actual >= bound)

    def describe(self) -> str:
        value = self.value
        if isinstance(value, tuple):
            value = "[" + ", ".join(str(v) for v in value) + "]"
        return f"{self.key} {_SYMBOLS[self.op]} {value}"


@dataclass(frozen=True)
class Rule:
    """A named, reasoned change to the space, applied when every condition in `when` holds."""

    name: str
    reason: str  # one line, logged with every application
    when: tuple[Condition, ...]
    action: Action
    targets: tuple[tuple[str, Any], ...]  # param -> values (remove/keep), bound (max/min), value
    is_builtin: bool = False

    @property
    def is_conditional(self) -> bool:
        return any(c.is_param for c in self.when)

    @property
    def params_read(self) -> tuple[str, ...]:
        return tuple(c.param for c in self.when if c.is_param)

    def context_holds(self, context: Mapping[str, Any]) -> bool:
        """Whether the hardware/model part of `when` holds; a missing key means it does not."""
        try:
            return all(c.holds(lookup(context, c.key)) for c in self.when if not c.is_param)
        except RuleError as exc:
            raise RuleError(f"rule {self.name!r}: {exc}") from exc

    def params_hold(self, params: Mapping[str, Any]) -> bool:
        return all(
            c.holds(params.get(c.param, MISSING)) for c in self.when if c.is_param
        )

    def fix_value(self, param: str) -> Any:
        return dict(self.targets)[param]

    def describe_when(self, params_only: bool = False) -> str:
        parts = [c.describe() for c in self.when if c.is_param or not params_only]
        return " and ".join(parts) if parts else "always"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "reason": self.reason,
            "when": self.describe_when(),
            "action": self.action,
            "targets": {k: list(v) if isinstance(v, tuple) else v for k, v in self.targets},
            "is_builtin": self.is_builtin,
        }


@dataclass(frozen=True)
class AppliedRule:
    """What a rule did to one resolved space, for the run log and MLflow."""

    name: str
    reason: str
    effect: str  # "tensor_parallel_size: removed 4, 8"
    kind: RuleKind

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "reason": self.reason, "effect": self.effect, "kind": self.kind}


def could_hold(rule: Rule, specs: Mapping[str, ParamSpec]) -> bool:
    """Whether some values of the resolved params could make the rule's params part hold."""
    for condition in rule.when:
        if not condition.is_param:
            continue
        spec = specs.get(condition.param)
        if spec is None:
            return False
        if spec.type == "categorical":
            try:
                if not any(condition.holds(c) for c in spec.choices):
                    return False
            except RuleError:
                continue
    return True
