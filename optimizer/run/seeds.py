"""The trials queued before the search's own, as `nightshift start` plans them: the study file's
`seed_trials` (`seed_trial_params`), the hardware templates (`template_trial_params`) and the
warm start from earlier studies in the tracking store (`warm_start`,
optimizer/tuning_memory/earlier_studies.py)."""

from __future__ import annotations

import logging
from typing import Any

from optimizer.config import StudyConfig
from optimizer.errors import ConfigError, translate
from optimizer.results.trial_record import ATTR_SEED_SOURCE, ATTR_SEED_TITLE
from optimizer.tracking.tracker import Tracker
from optimizer.tuning_memory.earlier_studies import WarmStart, plan_warm_start, read_studies
from optimizer.tuning_memory.fingerprint import Fingerprint
from search_spaces import ResolvedSpace, SpaceError
from search_spaces.seeds import load_templates, template_seeds

logger = logging.getLogger(__name__)


def warm_start(cfg: StudyConfig, tracker: Tracker, fingerprint: Fingerprint,
               space: ResolvedSpace, seed_trials: list[dict[str, Any]]) -> WarmStart:
    """The seeds of the study's `warm_start` from the tracking store
    (optimizer/tuning_memory/earlier_studies.py). A store that cannot be read skips an `auto` warm
    start (said so); a study named in the study file that the store does not hold is bad input."""
    setting = cfg.spec.warm_start
    if setting == "off":
        return WarmStart((), ("off",))
    try:
        studies = read_studies(tracker.client, exclude=cfg.name)
    except Exception as exc:  # MLflow raises many types; all mean "cannot read the store"
        if setting != "auto":
            raise translate(exc, f"warm_start: the tracking store {cfg.tracking_uri} could "
                            f"not be read ({type(exc).__name__}); fix it or set warm_start: "
                            "auto or off.", into=ConfigError) from exc
        logger.warning("warm start skipped: the tracking store could not be read (%s: %s)",
                       type(exc).__name__, str(exc)[:200])
        return WarmStart((), ("skipped: the tracking store could not be read",))
    try:
        plan = plan_warm_start(setting, fingerprint, studies, space=space,
                               fixed_flags=cfg.spec.fixed_flags, seed_trials=seed_trials)
    except ValueError as exc:
        names = ", ".join(sorted({s.name for s in studies})[:10]) or "none"
        raise translate(exc, f"warm_start: no study named {exc.args[0]!r} in the tracking "
                        f"store {cfg.tracking_uri} (studies there: {names}); fix the name or "
                        "set warm_start: auto.", into=ConfigError) from exc
    return plan  # its lines reach the log with the start's other notes, once


def template_trial_params(cfg: StudyConfig, space: ResolvedSpace, hardware_class: str,
                          ) -> tuple[list[tuple[dict[str, Any], dict[str, str]]], list[str]]:
    """The hardware class's templates as (config, tags) seed trials, and one note per template:
    queued, or skipped with the reason (never dropped silently). None with `templates: off`."""
    if cfg.spec.templates == "off":
        return [], []
    try:
        templates = load_templates(hardware_class)
    except SpaceError as exc:
        raise translate(exc, f"templates: {exc}") from exc
    trials: list[tuple[dict[str, Any], dict[str, str]]] = []
    notes: list[str] = []
    for seed in template_seeds(space, templates, cfg.spec.fixed_flags):
        if seed.params is None:
            notes.append(seed.skipped_because)
            continue
        trials.append((dict(seed.params), {ATTR_SEED_SOURCE: seed.template.source,
                                           ATTR_SEED_TITLE: seed.template.title}))
        notes.append(f"{seed.template.title}: queued after the defaults (and any warm-start "
                     f"seeds), tagged {ATTR_SEED_SOURCE}={seed.template.source}")
    return trials, notes


def seed_trial_params(cfg: StudyConfig, space: ResolvedSpace) -> list[dict[str, Any]]:
    """`seed_trials` as full configs (each over the defaults baseline), refused with the first
    problem when one is not a config of the space."""
    defaults = space.defaults()
    out: list[dict[str, Any]] = []
    for index, changes in enumerate(cfg.spec.seed_trials):
        for name, value in changes.items():
            fixed = cfg.spec.fixed_flags.get(name)
            if name in cfg.spec.fixed_flags and value != fixed:
                raise ConfigError(f"seed_trials[{index}].{name}: fixed_flags fixes it to "
                                  f"{fixed!r} for every trial; drop it from the seed or from "
                                  "fixed_flags.")
        params = {**defaults, **changes}
        problems = space.check(params)
        if problems:
            raise ConfigError(f"seed_trials[{index}]: {problems[0]}; change it to a value of "
                              f"search space {space.name!r}.")
        out.append(params)
    return out
