"""Search spaces as YAML data, their loader and validation, and hardware-aware rules."""

from search_spaces.params import ParamSpec
from search_spaces.rules import PARAM_PARENTS, AppliedRule, Condition, Rule
from search_spaces.space import (
    HOST_DEFAULTS,
    KNOWN_FLAGS,
    ResolvedSpace,
    SearchSpace,
    SpaceError,
    bundled_spaces,
    changed_params,
    effective_params,
    load_space,
    parse_space,
    recommend_space,
    to_flags,
    vllm_default,
)

__all__ = [
    "HOST_DEFAULTS",
    "KNOWN_FLAGS",
    "PARAM_PARENTS",
    "AppliedRule",
    "Condition",
    "ParamSpec",
    "ResolvedSpace",
    "Rule",
    "SearchSpace",
    "SpaceError",
    "bundled_spaces",
    "changed_params",
    "effective_params",
    "load_space",
    "parse_space",
    "recommend_space",
    "to_flags",
    "vllm_default",
]
