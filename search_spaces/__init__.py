"""Search spaces as YAML data, their loader and validation, and hardware-aware rules; beneath
them, `search_spaces.engine`, vLLM's flag tables and facts (one per release)."""

from search_spaces.effective import changed_params, effective_params
from search_spaces.errors import SpaceError
from search_spaces.known_flags import HOST_DEFAULTS, KNOWN_FLAGS, to_flags, vllm_default
from search_spaces.loading import bundled_spaces, load_space, parse_space, recommend_space
from search_spaces.params import ParamSpec
from search_spaces.resolved import ResolvedSpace
from search_spaces.rules import PARAM_PARENTS, AppliedRule, Condition, Rule
from search_spaces.space import SearchSpace

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
