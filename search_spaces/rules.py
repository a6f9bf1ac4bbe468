"""The rule engine: conditions on the hardware, the model and earlier params, and what they do.

A rule is static when its `when` names only `hardware.*`/`model.*` keys: `SearchSpace.resolve`
applies it once (remove, keep, max, min or fix values). A rule naming `params.*` is conditional:
`ResolvedSpace.sample` evaluates it for every trial and may only `fix` a later param, because
Optuna needs a param's distribution to be the same in every trial. Built-in rules encode what
vLLM 0.26 rejects or crashes on, and values the study's workload cannot tell apart (a capture
size above its concurrency, a prefill threshold above its longest prompt); tuning opinions
belong in the YAML files (docs/knobs.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from decimal import ROUND_CEILING, Decimal
from typing import Any, Literal

from search_spaces.known_facts import KnownFact, applicable, bundled_facts
from search_spaces.params import ParamSpec
from search_spaces.values import (
    MISSING,
    contains,
    did_you_mean,
    is_number,
    is_scalar,
    lookup,
    same,
    show,
)

Op = Literal["eq", "ne", "in", "not_in", "lt", "le", "gt", "ge"]
Action = Literal["remove", "keep", "max", "min", "fix"]
RuleKind = Literal["static", "conditional"]

OPS: tuple[Op, ...] = ("eq", "ne", "in", "not_in", "lt", "le", "gt", "ge")
ACTIONS: tuple[Action, ...] = ("remove", "keep", "max", "min", "fix")
_SYMBOLS: dict[str, str] = {
    "eq": "==", "ne": "!=", "in": "in", "not_in": "not in",
    "lt": "<", "le": "<=", "gt": ">", "ge": ">=",
}
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
    "model.num_params": "number",
    "model.real_weights": "flag",  # false when the study loads dummy weights (load_format)
    "workload.shares_prefix": "flag",  # requests share a prompt prefix the cache could reuse
    "workload.max_concurrency": "number",  # the largest concurrency of any level; None: uncapped
    "workload.max_prompt_tokens": "number",  # the longest prompt the workload sends
    "engine.vllm_version": "text",  # "0.26.0", "simulated 0.26.0"; the known facts read it
}
CONTEXT_ENUMS: dict[str, tuple[str, ...]] = {
    "hardware.interconnect": ("nvlink", "pcie", "none"),
    "hardware.hardware_class": ("hopper", "ampere", "24gb", "other", "none"),
}

FP8_KV_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")
# The online fp8 methods: runners/vllm/facts.py's FP8_ONLINE_QUANTIZATIONS, copied because
# search_spaces may not import runners; tests/runners/test_vllm_flags.py holds the two equal.
FP8_QUANTIZATIONS = ("fp8", "fp8_per_tensor", "fp8_per_block", "fp8_per_channel")
# Methods that quantize bf16 weights while loading; the rest read a pre-quantized checkpoint.
ON_THE_FLY_QUANTIZATIONS = (*FP8_QUANTIZATIONS, "bitsandbytes")
# --quantization values a checkpoint of each quant_method accepts.
CHECKPOINT_QUANTIZATIONS: dict[str, tuple[str, ...]] = {
    "awq": ("awq", "awq_marlin"),
    "gptq": ("gptq", "gptq_marlin"),
    "fp8": ("fp8",),
    "compressed-tensors": ("compressed-tensors",),
    "bitsandbytes": ("bitsandbytes",),
}


class RuleError(ValueError):
    """A malformed rule, or one that empties a param; `space.py` re-raises it as `SpaceError`."""


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


# ----------------------------------------------------------------------------- parsing

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


# ----------------------------------------------------------------------------- applying


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


# ----------------------------------------------------------------------------- built-ins

StaticBuiltin = Callable[[Mapping[str, Any], Mapping[str, ParamSpec]], "Rule | None"]


def _tp_fits_gpus(context: Mapping[str, Any], specs: Mapping[str, ParamSpec]) -> Rule | None:
    num_gpus = lookup(context, "hardware.num_gpus")
    if not is_number(num_gpus):
        return None
    # A host without a GPU still resolves to 1: the simulated engine runs single-GPU configs.
    cap = max(1, int(num_gpus))
    return Rule(
        name="parallel-sizes-fit-gpus",
        reason=f"vLLM needs one GPU per rank and this host has {int(num_gpus)}",
        when=(), action="max", is_builtin=True,
        targets=tuple((p, cap) for p in
                      ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")),
    )


def _tp_divides_heads(context: Mapping[str, Any], specs: Mapping[str, ParamSpec]) -> Rule | None:
    heads = lookup(context, "model.num_attention_heads")
    spec = specs.get("tensor_parallel_size")
    if not is_number(heads) or heads <= 0 or spec is None or spec.type != "categorical":
        return None
    bad = tuple(c for c in spec.choices
                if isinstance(c, int) and not isinstance(c, bool) and c > 0 and heads % c)
    if not bad:
        return None
    return Rule(
        name="tp-divides-attention-heads",
        reason=f"vLLM shards attention heads evenly; the model has {int(heads)} heads",
        when=(), action="remove", targets=(("tensor_parallel_size", bad),), is_builtin=True,
    )


def _quantization_matches_checkpoint(
    context: Mapping[str, Any], specs: Mapping[str, ParamSpec]
) -> Rule | None:
    method = lookup(context, "model.quant_method")
    spec = specs.get("quantization")
    if method is MISSING or spec is None or spec.type != "categorical":
        return None
    if method:
        allowed = CHECKPOINT_QUANTIZATIONS.get(str(method), (str(method),))
        reason = (f"the checkpoint is pre-quantized ({method}): vLLM accepts only its own "
                  "method, and on-the-fly fp8 needs bf16 weights")
    else:
        allowed = ON_THE_FLY_QUANTIZATIONS
        reason = ("awq, gptq and compressed-tensors read pre-quantized weights and this "
                  "checkpoint has none")
    bad = tuple(c for c in spec.choices
                if isinstance(c, str) and c != "none" and c not in allowed)
    if not bad:
        return None
    return Rule(name="quantization-matches-checkpoint", reason=reason, when=(), action="remove",
                targets=(("quantization", bad),), is_builtin=True)


def _fp8_needs_sm89(context: Mapping[str, Any], specs: Mapping[str, ParamSpec]) -> Rule | None:
    return Rule(
        name="fp8-needs-sm89",
        reason="fp8 KV cache and fp8 weights need fp8 tensor cores (SM 8.9+, Ada or Hopper)",
        when=(Condition("hardware.compute_capability", "lt", 8.9),),
        action="remove", is_builtin=True,
        targets=(("kv_cache_dtype", FP8_KV_DTYPES), ("quantization", FP8_QUANTIZATIONS)),
    )


def model_context_len(context: Mapping[str, Any]) -> int | None:
    """The context vLLM derives for the model (its max_model_len when none is given), tokens:
    `model.max_model_len` where the context has that key (None there: not known), else
    `model.max_position_embeddings`; None where neither is known."""
    model = context.get("model")
    has_key = isinstance(model, Mapping) and "max_model_len" in model
    value = lookup(context, "model.max_model_len" if has_key else
                   "model.max_position_embeddings")
    return int(value) if is_number(value) else None


def _max_model_len_within_model(
    context: Mapping[str, Any], specs: Mapping[str, ParamSpec]
) -> Rule | None:
    limit = model_context_len(context)
    if limit is None:
        return None
    return Rule(
        name="max-model-len-within-model",
        reason=f"vLLM rejects a max_model_len above the {int(limit)} tokens it derives from the "
               "model's config.json",
        when=(), action="max", targets=(("max_model_len", int(limit)),), is_builtin=True,
    )


def _is_sm90(context: Mapping[str, Any]) -> bool | None:
    capability = lookup(context, "hardware.compute_capability")
    if not is_number(capability):
        return None
    return bool(9.0 <= capability < 10.0)


def _flash_attn_no_e5m2(context: Mapping[str, Any], specs: Mapping[str, ParamSpec]) -> Rule | None:
    backend, kv = specs.get("attention_backend"), specs.get("kv_cache_dtype")
    if not _is_sm90(context) or backend is None or kv is None:
        return None
    if not contains(backend.choices, "FLASH_ATTN") or not contains(kv.choices, "fp8_e5m2"):
        return None
    # Off SM90 the conditional rule below fixes the KV dtype for FLASH_ATTN instead; here fp8
    # (e4m3) stays valid with FA3, and a choice cannot be dropped for one backend only.
    return Rule(
        name="flash-attn-no-fp8-e5m2",
        reason="FLASH_ATTN never takes fp8_e5m2; search e5m2 in a space without FLASH_ATTN",
        when=(), action="remove", targets=(("kv_cache_dtype", ("fp8_e5m2",)),), is_builtin=True,
    )


def _numbers_above_cover(choices: Sequence[Any], bound: float) -> tuple[Any, ...]:
    """The numeric choices above the smallest one that is >= `bound` (all of them cover it)."""
    numbers = sorted(c for c in choices if is_number(c) and not isinstance(c, bool))
    cover = next((c for c in numbers if c >= bound), None)
    return () if cover is None else tuple(c for c in numbers if c > cover)


def _capture_within_concurrency(
    context: Mapping[str, Any], specs: Mapping[str, ParamSpec]
) -> Rule | None:
    concurrency = lookup(context, "workload.max_concurrency")
    spec = specs.get("max_cudagraph_capture_size")
    if not is_number(concurrency) or spec is None or spec.type != "categorical":
        return None
    bad = _numbers_above_cover(spec.choices, concurrency)
    if not bad:
        return None
    # A decode step holds at most one token per running request (without speculative tokens),
    # so a decode batch never exceeds the concurrency; the sizes above the first choice that
    # covers it only add graphs for mixed prefill batches, at capture time and memory.
    return Rule(
        name="capture-size-within-concurrency",
        reason=f"the workload runs at most {int(concurrency)} requests at once, so no decode "
               "batch needs a larger CUDA graph; one capture size covering it is kept",
        when=(), action="remove", targets=(("max_cudagraph_capture_size", bad),),
        is_builtin=True,
    )


def _threshold_within_prompts(
    context: Mapping[str, Any], specs: Mapping[str, ParamSpec]
) -> Rule | None:
    longest = lookup(context, "workload.max_prompt_tokens")
    spec = specs.get("long_prefill_token_threshold")
    if not is_number(longest) or spec is None or spec.type != "categorical":
        return None
    # vLLM 0.26 caps a request's tokens per step at the threshold only when 0 < threshold <
    # the tokens left to prefill (v1/core/sched/scheduler.py:507 and :861).
    numbers = [c for c in spec.choices if isinstance(c, int | float) and not isinstance(c, bool)]
    bad = tuple(c for c in numbers if c > 0 and c >= longest)
    if not bad:
        return None
    return Rule(
        name="prefill-threshold-below-longest-prompt",
        reason=f"the longest prompt is {int(longest)} tokens; a threshold at or above it never "
               "splits a prefill and runs as 0 (off)",
        when=(), action="remove", targets=(("long_prefill_token_threshold", bad),),
        is_builtin=True,
    )


def known_fact_rules(context: Mapping[str, Any], specs: Mapping[str, ParamSpec]) -> list[Rule]:
    """One `remove` rule per measured fact (search_spaces/known_facts.py) that holds for the
    context's hardware class and vLLM version and names a value of the space. The context's
    `known_facts` (the bundled and the user's, as the runtime loads them) stands in for the
    bundled table; `known_facts_ignore` lists the ids the study file overrides."""
    given = context.get("known_facts")
    facts: tuple[KnownFact, ...] = tuple(given) if given is not None else bundled_facts()
    rules = []
    for fact in applicable(facts, context, tuple(context.get("known_facts_ignore") or ())):
        spec = specs.get(fact.param)
        if fact.effect != "exclude" or spec is None or spec.type != "categorical" or \
                not contains(spec.choices, fact.value):
            continue
        evidence = fact.evidence.get("figures") or fact.evidence.get("study") or "measured"
        rules.append(Rule(
            name=f"known-fact:{fact.id}",
            reason=f"measured pathological on {fact.hardware_class} with vLLM "
                   f"{fact.vllm_version}: {evidence} ({fact.source}; a study file's "
                   f"known_facts.ignore overrides it)",
            when=(), action="remove", targets=((fact.param, (fact.value,)),), is_builtin=True))
    return rules


STATIC_BUILTINS: tuple[StaticBuiltin, ...] = (
    _tp_fits_gpus,
    _tp_divides_heads,
    _quantization_matches_checkpoint,
    _fp8_needs_sm89,
    _max_model_len_within_model,
    _flash_attn_no_e5m2,
    _capture_within_concurrency,
    _threshold_within_prompts,
)

# (reader, target): conditional built-ins fix `target` from `reader`, so it must come first.
BUILTIN_ORDER: tuple[tuple[str, str], ...] = (
    ("tensor_parallel_size", "data_parallel_size"),
    ("attention_backend", "kv_cache_dtype"),
    ("enforce_eager", "cudagraph_mode"),
    ("spec_method", "spec_tokens"),
)


# Built-ins that unset a child param while its parent is off: a config that turns the parent on
# sets the child too, as one change (`PARAM_PARENTS`, which a report's one-knob table reads).
_CHILD_RULES: tuple[Rule, ...] = (
    Rule(
        name="spec-tokens-need-a-method",
        reason="vLLM rejects --spec-tokens without a speculative method "
               "(config/speculative.py:730)",
        when=(Condition("params.spec_method", "eq", "none"),),
        action="fix", targets=(("spec_tokens", None),), is_builtin=True,
    ),
)
# child -> parent: a param that exists only with its parent set.
PARAM_PARENTS: dict[str, str] = {target: rule.when[0].param for rule in _CHILD_RULES
                                 for target, _ in rule.targets}


def conditional_builtins(context: Mapping[str, Any]) -> list[Rule]:
    rules = [
        Rule(
            name="flex-attention-no-fp8-kv",
            reason="FLEX_ATTENTION takes no fp8 KV cache",
            when=(Condition("params.attention_backend", "eq", "FLEX_ATTENTION"),),
            action="fix", targets=(("kv_cache_dtype", "auto"),), is_builtin=True,
        ),
        Rule(
            name="eager-means-no-cudagraphs",
            reason="--enforce-eager turns CUDA graphs off, so cudagraph_mode has no effect",
            when=(Condition("params.enforce_eager", "eq", True),),
            action="fix", targets=(("cudagraph_mode", "NONE"),), is_builtin=True,
        ),
        *_CHILD_RULES,
    ]
    num_gpus = lookup(context, "hardware.num_gpus")
    if is_number(num_gpus) and num_gpus >= 1:
        # A replica is TP GPUs; once TP takes more than half the host, one replica is all that
        # fits. (Smaller TPs with too many replicas are refused before launch, as any config
        # needing more GPUs than the host has.)
        rules.append(Rule(
            name="replicas-fit-gpus",
            reason=f"each data-parallel replica needs tensor_parallel_size GPUs and this host "
                   f"has {int(num_gpus)}",
            when=(Condition("params.tensor_parallel_size", "gt", num_gpus / 2),),
            action="fix", targets=(("data_parallel_size", 1),), is_builtin=True,
        ))
    if _is_sm90(context) is False:
        rules.insert(0, Rule(
            name="flash-attn-fp8-kv-needs-sm90",
            reason="FLASH_ATTN takes an fp8 KV cache only with FA3, which runs on SM90 only",
            when=(Condition("params.attention_backend", "eq", "FLASH_ATTN"),),
            action="fix", targets=(("kv_cache_dtype", "auto"),), is_builtin=True,
        ))
    return rules


def builtin_names() -> set[str]:
    names = {"parallel-sizes-fit-gpus", "tp-divides-attention-heads",
             "quantization-matches-checkpoint", "fp8-needs-sm89", "max-model-len-within-model",
             "flash-attn-no-fp8-e5m2", "default-outside-space", "replicas-fit-gpus",
             "capture-size-within-concurrency", "prefill-threshold-below-longest-prompt"}
    names.update(r.name for r in conditional_builtins({"hardware.compute_capability": 8.0}))
    return names


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
