"""Search spaces as YAML data, their loader and validation, and hardware-aware rules."""

from search_spaces.params import ParamSpec
from search_spaces.rules import AppliedRule, Condition, Rule
from search_spaces.space import (
    KNOWN_FLAGS,
    ResolvedSpace,
    SearchSpace,
    SpaceError,
    bundled_spaces,
    load_space,
    parse_space,
    recommend_space,
    to_flags,
    vllm_default,
)

__all__ = [
    "KNOWN_FLAGS",
    "AppliedRule",
    "Condition",
    "ParamSpec",
    "ResolvedSpace",
    "Rule",
    "SearchSpace",
    "SpaceError",
    "bundled_spaces",
    "load_space",
    "parse_space",
    "recommend_space",
    "to_flags",
    "vllm_default",
]
