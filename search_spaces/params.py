"""One searched engine flag as the space holds it (`ParamSpec`): its domain, its default, and
its Optuna distribution."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Literal, cast

from optuna.distributions import (
    BaseDistribution,
    CategoricalChoiceType,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)

from search_spaces.values import contains, is_number, on_grid

Value = str | int | float | bool | None
ParamType = Literal["categorical", "int", "float"]


@dataclass(frozen=True)
class ParamSpec:
    """One searched engine flag: its domain, its default and a line of help."""

    name: str  # vLLM's snake_case name, e.g. max_num_seqs
    type: ParamType
    choices: tuple[Value, ...] = ()  # categorical only, in declaration order
    low: int | float | None = None  # int/float only, inclusive
    high: int | float | None = None  # int/float only, inclusive
    log: bool = False
    step: int | float | None = None  # None: continuous float, 1 for int
    default: Value = None  # the literal default; the resolved one after `resolve`
    is_vllm_default: bool = True  # `default: vllm`, resolved against the context
    help: str = ""

    @property
    def is_fixed(self) -> bool:
        if self.type == "categorical":
            return len(self.choices) == 1
        return self.low == self.high

    @property
    def fixed_value(self) -> Value:
        return self.choices[0] if self.type == "categorical" else self.low

    def contains(self, value: object) -> bool:
        if self.type == "categorical":
            return contains(self.choices, value)
        if not is_number(value) or self.low is None or self.high is None:
            return False
        if self.type == "int" and not isinstance(value, int):
            return False
        number = cast(float, value)
        if not self.low <= number <= self.high:
            return False
        if self.step is None:
            return True
        # Optuna's own tolerance: it samples 0.85 + 6 * 0.01 as 0.9099999999999999.
        steps = (number - self.low) / self.step
        return abs(steps - round(steps)) < 1e-8

    def distribution(self) -> BaseDistribution:
        if self.type == "categorical":
            return CategoricalDistribution(cast(list[CategoricalChoiceType], list(self.choices)))
        low, high = cast(float, self.low), cast(float, self.high)
        if self.type == "int":
            return IntDistribution(int(low), int(high), log=self.log, step=int(self.step or 1))
        return FloatDistribution(low, high, log=self.log, step=self.step)

    def count(self) -> int | None:
        """How many values the domain holds; None for a continuous float range."""
        if self.type == "categorical":
            return len(self.choices)
        if self.low is None or self.high is None:
            return None
        if self.low == self.high:
            return 1
        if self.type == "int":
            return (int(self.high) - int(self.low)) // int(self.step or 1) + 1
        if self.step is None:
            return None
        span = (Decimal(str(self.high)) - Decimal(str(self.low))) / Decimal(str(self.step))
        return int(span) + 1

    def range_default_problem(self, default: float) -> str | None:
        """Why a range cannot grow to take `default`, or None: only along its own grid (and
        above 0 when log)."""
        low, high = cast(float, self.low), cast(float, self.high)
        if self.log and default <= 0:
            return f"must be > 0 for a log range but got {default}"
        if self.step is not None and not on_grid(default, low if default >= low else high,
                                                 self.step):
            return (f"{default} is not on the grid {low} + k*{self.step}; pick low and step so "
                    "that it is")
        return None

    def describe_domain(self) -> str:
        if self.type == "categorical":
            return "[" + ", ".join(str(c) for c in self.choices) + "]"
        suffix = (f" step {self.step}" if self.step is not None else "") + (
            " log" if self.log else "")
        return f"[{self.low}, {self.high}]{suffix}"

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"type": self.type}
        if self.type == "categorical":
            d["choices"] = list(self.choices)
        else:
            d.update(low=self.low, high=self.high, log=self.log, step=self.step)
        d["default"] = "vllm" if self.is_vllm_default and self.default is None else self.default
        d["is_fixed"] = self.is_fixed
        d["help"] = self.help
        return d
