"""`SearchSpace`, a validated space as its YAML declares it, and its resolution for one host, model
and vLLM release: vLLM's defaults resolved and added to each domain, the flags the release lacks
dropped, the static rules applied and the conditional ones kept for sampling (`resolve`, which
gives a `ResolvedSpace`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from decimal import Decimal
from typing import Any, cast

from search_spaces.errors import SpaceError, fail, sentence
from search_spaces.known_flags import (
    HOST_DEFAULTS,
    KNOWN_FLAGS,
    engine_key,
    engine_release,
    vllm_default,
)
from search_spaces.params import ParamSpec, Value
from search_spaces.resolved import ResolvedSpace
from search_spaces.rules.applying import apply_static
from search_spaces.rules.builtin import (
    STATIC_BUILTINS,
    conditional_builtins,
    known_fact_rules,
)
from search_spaces.rules.rule import AppliedRule, Rule, RuleError, could_hold
from search_spaces.values import contains, is_number, same


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
            raise SpaceError(f"{self.source}: {sentence(exc)}") from exc

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
                                 vllm_defaults={n: vllm_default(n, context)
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
        version, flags, _, choices = engine_release(context)
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
        default = vllm_default(spec.name, context) if spec.is_vllm_default else spec.default
        where = f"parameters.{spec.name}.default"
        if spec.type == "categorical":
            choices = spec.choices
            if not contains(choices, default):
                choices = _insert_choice(choices, default)
            return replace(spec, choices=choices, default=default)
        if not is_number(default):
            fail(self.source, f"{where} 'vllm' needs model.max_model_len in the "
                               "context for an int range; pass the model or a literal default")
        number = cast(float, default)
        problem = spec.range_default_problem(number)
        if problem is not None:
            fail(self.source, f"{where} {problem}")
        low, high = cast(float, spec.low), cast(float, spec.high)
        if spec.type == "int":
            return replace(spec, low=int(min(low, number)), high=int(max(high, number)),
                           default=int(number))
        return replace(spec, low=min(low, number), high=max(high, number), default=float(number))


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
