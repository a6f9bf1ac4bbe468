"""`ResolvedSpace`, a space for one host and model: it samples configs into an Optuna trial, yields
the vLLM-defaults baseline, checks a config, counts its configs and turns a config into engine
flags."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from decimal import Decimal
from typing import Any, cast

import optuna
from optuna.distributions import BaseDistribution, CategoricalChoiceType

from search_spaces.errors import SpaceError
from search_spaces.known_flags import to_flags
from search_spaces.params import ParamSpec, Value
from search_spaces.rules.rule import AppliedRule, Rule
from search_spaces.values import is_number, same, show


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


def _decimals(step: float) -> int:
    """Decimal places of a step as written (0.01 -> 2), for rounding sampled floats."""
    exponent = Decimal(str(step)).normalize().as_tuple().exponent
    return max(0, -exponent) if isinstance(exponent, int) else 0
