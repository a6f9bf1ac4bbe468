"""The rule engine: conditions on the hardware, the model and earlier params, and what they do.

`rule` (the types: `Condition`, `Rule`, `AppliedRule`), `parsing` (a rule from YAML, the
context keys it may test), `applying` (a static rule applied to the params) and `builtin` (the
rules every space gets: what vLLM rejects or crashes on, the measured known facts).
"""

from search_spaces.rules.builtin import PARAM_PARENTS
from search_spaces.rules.rule import AppliedRule, Condition, Rule, RuleError

__all__ = ["PARAM_PARENTS", "AppliedRule", "Condition", "Rule", "RuleError"]
