"""Hardware templates: the tuning practice's folklore per hardware class (templates/hardware.yaml)
as seed trials over a resolved space, each either a full config or a stated reason it is skipped.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from search_spaces.bounded_yaml import load_yaml
from search_spaces.errors import SpaceError
from search_spaces.params import Value
from search_spaces.resolved import ResolvedSpace
from search_spaces.values import contains, show

TEMPLATES_FILE = Path(__file__).parent / "templates" / "hardware.yaml"
_KEYS = ("name", "label", "claim", "params")


@dataclass(frozen=True)
class Template:
    """One piece of folklore: what it changes from vLLM's defaults, on one hardware class."""

    name: str  # "hopper": the tag is `template:<name>`
    hardware_class: str  # a HardwareProfile.hardware_class
    label: str  # "the Hopper template", for conclusions
    claim: str  # "fp8 weights + fp8 KV cache + a 32768-token budget"
    # param -> value, or alternatives (the first the space holds is taken)
    params: Mapping[str, Value | tuple[Value, ...]] = field(default_factory=dict)

    @property
    def source(self) -> str:
        """The `seed.source` tag of its trial."""
        return f"template:{self.name}"

    @property
    def title(self) -> str:
        """`the Hopper template (fp8 weights + ...)`: how its conclusion names it."""
        return f"{self.label} ({self.claim})"


@dataclass(frozen=True)
class TemplateSeed:
    """A template over a resolved space: its full config, or why it is skipped."""

    template: Template
    params: Mapping[str, Value] | None  # None: skipped
    skipped_because: str = ""


def load_templates(hardware_class: str, path: Path = TEMPLATES_FILE) -> tuple[Template, ...]:
    """The templates for one hardware class (none for a class the file does not name)."""
    source = path.name
    try:
        data = load_yaml(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SpaceError(f"{source}: cannot read the hardware templates ({exc}); reinstall "
                         "nightshift or set templates: off.") from exc
    if not isinstance(data, Mapping):
        raise SpaceError(f"{source}: expected a mapping of hardware class: templates but got "
                         f"{show(data)}.")
    out: list[Template] = []
    for index, raw in enumerate(data.get(hardware_class) or ()):
        where = f"{source}: {hardware_class}[{index}]"
        if not isinstance(raw, Mapping) or set(raw) != set(_KEYS):
            raise SpaceError(f"{where} must have exactly {', '.join(_KEYS)} but got "
                             f"{show(raw)}.")
        params = raw["params"]
        if not isinstance(params, Mapping) or not params:
            raise SpaceError(f"{where}.params must be a non-empty mapping but got "
                             f"{show(params)}.")
        out.append(Template(
            name=str(raw["name"]), hardware_class=hardware_class, label=str(raw["label"]),
            claim=str(raw["claim"]),
            params={str(k): tuple(v) if isinstance(v, list) else cast(Value, v)
                    for k, v in params.items()}))
    return tuple(out)


def template_seeds(space: ResolvedSpace, templates: tuple[Template, ...],
                   fixed_flags: Mapping[str, Any] = {}) -> list[TemplateSeed]:
    """Each template as a full config over the space's defaults, or skipped with the reason:
    a param the space does not search, a value its domain or a rule refuses (naming the rule
    that removed it), or a value the study's fixed flags contradict."""
    defaults = space.defaults()
    by_name = {p.name: p for p in space.params}
    out: list[TemplateSeed] = []
    for template in templates:
        params: dict[str, Value] = dict(defaults)
        problem = ""
        for name, wanted in template.params.items():
            options = wanted if isinstance(wanted, tuple) else (wanted,)
            spec = by_name.get(name)
            if spec is None:
                problem = f"space {space.name} does not search {name}"
                break
            held = [o for o in options if spec.contains(o)]
            if name in fixed_flags and not contains(options, fixed_flags[name]):
                problem = (f"fixed_flags sets {name}={show(fixed_flags[name])} for every trial "
                           f"and the template needs {_either(options)}")
                break
            if not held:
                problem = f"{name}={_either(options)} is not in its domain " \
                          f"{spec.describe_domain()}{_removed_by(space, name)}"
                break
            params[name] = held[0]
        if not problem:
            problems = space.check(params)
            problem = problems[0] if problems else ""
        if problem:
            out.append(TemplateSeed(template, None, f"{template.title} skipped: {problem}"))
        else:
            out.append(TemplateSeed(template, params))
    return out


def _either(options: tuple[Value, ...]) -> str:
    return " or ".join(str(o) for o in options)


def _removed_by(space: ResolvedSpace, name: str) -> str:
    """`; rule X removed it (reason)` where a static rule changed the param's domain."""
    for rule in space.applied_rules:
        if rule.kind == "static" and f"{name}:" in rule.effect:
            return f"; rule {rule.name} removed it ({rule.reason})"
    return ""
