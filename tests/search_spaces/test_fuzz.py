"""Arbitrary YAML-shaped data into the loader: a SpaceError or a resolvable space, nothing else."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from search_spaces import SpaceError, parse_space
from search_spaces.known_flags import KNOWN_FLAGS
from tests.search_spaces.test_space import CONTEXTS

# Words the loader looks for, so generated data gets past the first checks often enough.
_WORDS = [
    "name", "description", "parameters", "rules", "type", "choices", "low", "high", "log",
    "step", "default", "help", "categorical", "int", "float", "vllm", "when", "reason", "remove",
    "keep", "max", "min", "fix", "eq", "ne", "in", "not_in", "lt", "le", "gt", "ge", "auto",
    "none", "fp8", "fp8_e5m2", "FLASH_ATTN", "FLEX_ATTENTION", "awq", "pcie",
    "hardware.num_gpus", "hardware.compute_capability", "hardware.interconnect",
    "model.num_attention_heads", "model.quant_method", *[f"params.{f}" for f in KNOWN_FLAGS],
    *KNOWN_FLAGS,
]
_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(_WORDS), st.text(max_size=8),
)
_keys = st.one_of(st.sampled_from(_WORDS), st.text(max_size=6), st.integers(-3, 3), st.none())
_yamlish = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.dictionaries(_keys, inner, max_size=6),
    ),
    max_leaves=25,
)


def _pool(name: str) -> st.SearchStrategy[Any]:
    """Values that are valid for the flag, plus the odd neighbour that is not."""
    flag = KNOWN_FLAGS[name]
    if flag.kind == "enum":
        return st.sampled_from([*flag.enum, None])
    if flag.kind == "bool":
        return st.sampled_from([True, False, None])
    if flag.kind == "int":
        return st.one_of(st.sampled_from([1, 2, 4, 8, 64, 256, 1024, 8192, 32768]),
                         st.integers(0, 70))
    return st.one_of(st.sampled_from([0.5, 0.85, 0.9, 0.92, 0.95, 1.0]),
                     st.floats(0.0, 1.0, allow_nan=False))


@st.composite
def _param(draw: st.DrawFn, name: str) -> dict[str, Any]:
    """A parameter spec that is valid or one mutation away from valid."""
    flag = KNOWN_FLAGS[name]
    ranged = flag.kind in ("int", "float") and not flag.is_categorical_only and draw(st.booleans())
    spec: dict[str, Any]
    if ranged:
        low = draw(st.integers(1, 64)) if flag.kind == "int" else draw(st.sampled_from([0.5, 0.8]))
        step = draw(st.sampled_from([None, 1, 2, 8] if flag.kind == "int" else [None, 0.01, 0.05]))
        span = draw(st.integers(1, 20)) * (step or 1) if flag.kind == "int" or step else 0.1
        spec = {"type": flag.kind, "low": low, "high": round(low + span, 6)}
        if step is not None:
            spec["step"] = step
        elif draw(st.booleans()):
            spec["log"] = True
        spec["default"] = draw(st.one_of(st.just("vllm"), st.just(low), _pool(name)))
    else:
        choices = draw(st.lists(_pool(name), min_size=1, max_size=4, unique_by=repr))
        spec = {"type": "categorical", "choices": choices,
                "default": draw(st.one_of(st.just("vllm"), st.sampled_from(choices), _pool(name)))}
    if draw(st.integers(0, 7)) == 5:  # one mutation: a wrong value or a missing key
        key = draw(st.sampled_from(["type", "choices", "low", "high", "log", "step", "default",
                                    "help", "typo"]))
        if draw(st.booleans()):
            spec.pop(key, None)
        else:
            spec[key] = draw(_yamlish)
    return spec


_CONTEXT_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "hardware.num_gpus": st.integers(0, 8),
    "hardware.compute_capability": st.sampled_from([0.0, 8.0, 8.9, 9.0, 10.0]),
    "hardware.interconnect": st.sampled_from(["nvlink", "pcie", "none"]),
    "model.num_attention_heads": st.sampled_from([14, 28, 32]),
    "model.quant_method": st.sampled_from([None, "awq", "gptq"]),
}


@st.composite
def _rule(draw: st.DrawFn, names: list[str]) -> dict[str, Any]:
    if len(names) >= 2 and draw(st.booleans()):
        # A conditional rule in the accepted shape: an earlier param fixes a later one.
        first, second = sorted(draw(st.lists(st.integers(0, len(names) - 1), min_size=2,
                                             max_size=2, unique=True)))
        reader, target = names[first], names[second]
        return {"name": draw(st.text("xyz", min_size=1, max_size=4)), "reason": "why",
                "when": {f"params.{reader}": draw(_pool(reader))},
                "fix": {target: draw(_pool(target))}}
    when: dict[str, Any] = {}
    for _ in range(draw(st.integers(0, 2))):
        if names and draw(st.booleans()) is True:
            param = draw(st.sampled_from(names))
            when[f"params.{param}"] = draw(_pool(param))
        else:
            key = draw(st.sampled_from(sorted(_CONTEXT_VALUES)))
            op = draw(st.sampled_from(["eq", "ne", "lt", "ge", "in"]))
            value = draw(_CONTEXT_VALUES[key])
            when[key] = value if op == "eq" else {op: [value] if op == "in" else value}
    action = draw(st.sampled_from(["remove", "keep", "max", "min", "fix"]))
    targets: dict[str, Any] = {}
    for param in draw(st.lists(st.sampled_from(names or ["max_num_seqs"]), max_size=2)):
        pool = _pool(param) if param in KNOWN_FLAGS else _scalars
        targets[param] = draw(st.lists(pool, min_size=1, max_size=3)) if action in (
            "remove", "keep") else draw(pool)
    rule = {"name": draw(st.text("abc-", min_size=1, max_size=4)), "reason": "why",
            "when": when, action: targets}
    if draw(st.integers(0, 7)) == 5:
        rule[draw(st.sampled_from(["name", "reason", "when", action, "max"]))] = draw(_yamlish)
    return rule


@st.composite
def _spaces(draw: st.DrawFn) -> Any:
    if draw(st.integers(0, 19)) == 7:  # not 0: Hypothesis favours the low end
        return draw(_yamlish)
    names = draw(st.lists(st.sampled_from(sorted(KNOWN_FLAGS)), min_size=1, max_size=4,
                          unique=True))
    params = {name: draw(_param(name)) for name in names}
    data: dict[Any, Any] = {"parameters": params}
    if draw(st.integers(0, 3)) != 3:
        data["rules"] = draw(st.lists(_rule(names), min_size=1, max_size=3))
    if draw(st.integers(0, 19)) == 7:
        data[draw(_keys)] = draw(_yamlish)
    return data


@settings(max_examples=1000, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(_spaces())
def test_loader_raises_only_space_error(data: Any) -> None:
    try:
        space = parse_space(data, source="fuzz.yaml")
    except SpaceError as exc:
        assert "\n" not in str(exc), "errors are one line"
        assert str(exc).startswith("fuzz.yaml: "), "errors name the file"
        return
    for context in (CONTEXTS["h200"], CONTEXTS["2x4090_pcie"], CONTEXTS["no_gpu"]):
        try:
            resolved = space.resolve(context)
        except SpaceError as exc:
            assert "\n" not in str(exc)
            continue
        defaults = resolved.defaults()
        assert resolved.check(defaults) == [], "a resolved space always holds its baseline"
        resolved.distributions()
        resolved.to_flags(defaults)
        resolved.size()
