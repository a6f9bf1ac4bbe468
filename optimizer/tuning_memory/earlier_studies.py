"""The tuning memory: earlier studies read back from the MLflow store (their parent runs'
fingerprint and `best.*` tags), the warm start that offers their best configs as seed trials,
and the rows `nightshift history` prints. Never a measured value: a seed is measured anew.
docs/tuning-memory.md states what it does and never does."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from optimizer.tracking.tags import TAG_KIND, TAG_PARENT
from optimizer.tuning_memory.fingerprint import Fingerprint, compatibility

if TYPE_CHECKING:
    from mlflow import MlflowClient

    from search_spaces import ResolvedSpace

logger = logging.getLogger(__name__)

# Experiments other tools of nightshift write that are no studies: `nightshift regress`'s.
FOREIGN_EXPERIMENT_PREFIXES = ("nightshift-regress",)
# `warm_start: auto` seeds from this many compatible studies at most, the newest first: each
# seed costs one trial of the budget.
MAX_AUTO_SEEDS = 3
SEED_SOURCE_PREFIX = "warm_start:"  # a warm seed's `seed.source`: warm_start:<study>
TAG_SEED_SOURCE = "seed.source"
TAG_WARM_START = "warm_start"  # the study run's tag: which studies seeded it, which not and why


@dataclass(frozen=True)
class EarlierStudy:
    """One study's parent run as the store holds it."""

    name: str
    run_id: str
    experiment_id: str
    started_ms: int  # the parent run's start, ms since the epoch
    status: str  # the run's: FINISHED, KILLED (stopped before its budget), RUNNING, FAILED
    fingerprint: Fingerprint | None  # None: the study was run before fingerprints
    missing: frozenset[str]  # fields its stored fingerprint lacks (unknown)
    tags: Mapping[str, str]
    params: Mapping[str, str]
    metrics: Mapping[str, float]

    @property
    def date(self) -> str:
        return datetime.fromtimestamp(self.started_ms / 1000, UTC).strftime("%Y-%m-%d %H:%M")

    @property
    def best_changes(self) -> dict[str, Any] | None:
        """The best config's params that differ from the measured defaults (`best.changes`,
        written at the study's end); None where it has none (unfinished, nothing measured,
        the defaults never measured)."""
        return _json_object(self.tags.get("best.changes"))

    @property
    def model(self) -> str:
        return (self.fingerprint.model if self.fingerprint and self.fingerprint.model
                else self.params.get("model", ""))


def read_studies(client: MlflowClient, *, exclude: str | None = None) -> list[EarlierStudy]:
    """Every study's parent run in the store, newest first: the experiments of
    `nightshift regress` (FOREIGN_EXPERIMENT_PREFIXES) and the study `exclude` left out."""
    experiments: list[Any] = []
    token: str | None = None
    while True:
        page = client.search_experiments(max_results=1000, page_token=token)
        experiments.extend(page)
        token = page.token
        if not token:
            break
    ids = [str(e.experiment_id) for e in experiments
           if not str(e.name).startswith(FOREIGN_EXPERIMENT_PREFIXES) and e.name != exclude]
    out: list[EarlierStudy] = []
    for i in range(0, len(ids), 100):
        token = None
        while True:
            runs = client.search_runs(ids[i:i + 100], filter_string=f"tags.`{TAG_KIND}` = 'study'",
                                      max_results=1000, page_token=token)
            out.extend(_earlier(run) for run in runs)
            token = runs.token
            if not token:
                break
    return sorted((s for s in out if s.name != exclude), key=lambda s: -s.started_ms)


def _earlier(run: Any) -> EarlierStudy:
    tags = dict(run.data.tags)
    fingerprint, missing = None, frozenset[str]()
    data = _json_object(tags.get("fingerprint.json"))
    if data is not None:
        try:
            fingerprint, missing = Fingerprint.from_dict(data)
        except TypeError:  # a field of the wrong shape: read as no fingerprint
            fingerprint = None
    return EarlierStudy(
        name=str(tags.get("nightshift.study") or run.info.run_name), run_id=str(run.info.run_id),
        experiment_id=str(run.info.experiment_id),
        started_ms=int(run.info.start_time or 0), status=str(run.info.status),
        fingerprint=fingerprint, missing=missing, tags=tags, params=dict(run.data.params),
        metrics=dict(run.data.metrics))


def _json_object(text: str | None) -> dict[str, Any] | None:
    if not text:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


# -- warm start -------------------------------------------------------------------------------


@dataclass(frozen=True)
class WarmSeed:
    """An earlier study's best config, to be measured here as a seed trial."""

    params: Mapping[str, Any]  # a full config of this study's space
    source: str  # `warm_start:<study>`


@dataclass(frozen=True)
class WarmStart:
    seeds: tuple[WarmSeed, ...]
    lines: tuple[str, ...]  # one per study considered: used (and why) or skipped (and why)

    def summary(self) -> str:
        return " | ".join(self.lines) if self.lines else "no earlier study in the store"


def plan_warm_start(setting: str | Sequence[str], here: Fingerprint,
                    studies: Sequence[EarlierStudy], *, space: ResolvedSpace,
                    fixed_flags: Mapping[str, Any],
                    seed_trials: Sequence[Mapping[str, Any]] = ()) -> WarmStart:
    """The seeds `warm_start` gives: `auto`, the best of up to MAX_AUTO_SEEDS compatible
    studies, newest first; a list of names, those studies' bests whatever their fingerprints
    (the differences are reported); `off`, none. A study's best becomes this space's defaults
    with its changes applied, and is dropped where this space cannot express it or its rules
    refuse it, where the study's fixed flags differ, or where it repeats the defaults, a seed of
    the study file or an earlier warm seed. `studies` must be newest first (`read_studies`);
    a name not among them raises ValueError."""
    if setting == "off":
        return WarmStart((), ("warm_start: off",))
    named = list(setting) if not isinstance(setting, str) else []
    by_name = {s.name: s for s in studies}
    for name in named:
        if name not in by_name:
            raise ValueError(name)
    chosen = [by_name[n] for n in named] if named else list(studies)
    defaults = dict(space.defaults())
    taken = {_key(defaults): "the defaults"}
    for index, seed in enumerate(seed_trials):
        taken.setdefault(_key(seed), f"seed_trials[{index}]")
    seeds: list[WarmSeed] = []
    lines: list[str] = []
    for study in chosen:
        if not named and len(seeds) >= MAX_AUTO_SEEDS:
            lines.append(f"skipped {study.name}: {MAX_AUTO_SEEDS} newer compatible studies "
                         "seed this one already")
            continue
        why = ""
        if study.fingerprint is None:
            if not named:
                lines.append(f"skipped {study.name}: it recorded no fingerprint (run before "
                             "the tuning memory); name it in warm_start to use it anyway")
                continue
            why = "named; it recorded no fingerprint"
        else:
            compat = compatibility(here, study.fingerprint, study.missing)
            if not compat.is_compatible and not named:
                lines.append(f"skipped {study.name}: " + "; ".join(compat.reasons[:3]) +
                             (f" (+{len(compat.reasons) - 3} more)"
                              if len(compat.reasons) > 3 else ""))
                continue
            if named:
                why = "named" + ("; differs: " + "; ".join(compat.reasons)
                                 if compat.reasons else "; compatible fingerprint")
            else:
                why = (f"compatible fingerprint {study.fingerprint.hash}")
            if compat.notes:
                why += "; " + "; ".join(compat.notes)
        changes = study.best_changes
        if changes is None:
            lines.append(f"skipped {study.name}: it recorded no best config against measured "
                         "defaults (unfinished, or nothing measured)")
            continue
        if not changes:
            lines.append(f"skipped {study.name}: its best is the vLLM defaults, which run "
                         "here first anyway")
            continue
        problem = _expressible(changes, space, fixed_flags)
        params = {**defaults, **changes}
        if problem is None:
            found = space.check(params)
            problem = f"this space's rules refuse it: {found[0]}" if found else None
        if problem is not None:
            lines.append(f"skipped {study.name}: its best ({_show(changes)}) {problem}")
            continue
        key = _key(params)
        if key in taken:
            lines.append(f"skipped {study.name}: its best ({_show(changes)}) is "
                         f"{taken[key]} already")
            continue
        taken[key] = f"the warm seed from {study.name}"
        seeds.append(WarmSeed(params, SEED_SOURCE_PREFIX + study.name))
        lines.append(f"seeded from {study.name} ({study.date}, best {_show(changes)}): {why}")
    if not chosen:
        lines.append("no earlier study in the store")
    return WarmStart(tuple(seeds), tuple(lines))


def _expressible(changes: Mapping[str, Any], space: ResolvedSpace,
                 fixed_flags: Mapping[str, Any]) -> str | None:
    known = {p.name for p in space.params} | set(space.defaults())
    for name, value in changes.items():
        if name not in known:
            return f"sets {name}, which this space does not search"
        if name in fixed_flags and fixed_flags[name] != value:
            return f"sets {name}={value!r} but fixed_flags fixes it to {fixed_flags[name]!r}"
    return None


def _key(params: Mapping[str, Any]) -> str:
    return json.dumps(dict(params), sort_keys=True, default=str)


def _show(changes: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(changes.items())) or "the defaults"


# -- history ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class HistoryRow:
    """One earlier study as `nightshift history` prints it."""

    study: str
    date: str  # UTC, when its run started
    status: str
    engine_version: str
    card: str
    fingerprint: str  # its hash, "" when it recorded none
    change: str  # the best config's change from the defaults
    metric: str  # the best's figure with its bracket, and the gain with what bounds it
    conclusion: str


def history_rows(studies: Iterable[EarlierStudy]) -> list[HistoryRow]:
    rows = []
    for s in studies:
        fp = s.fingerprint
        gain = s.tags.get("best.gain", "")
        metric = s.tags.get("best.metric", "")
        if s.tags.get("confirm"):
            gain = (gain + "; " if gain else "") + "confirm: " + s.tags["confirm"]
        rows.append(HistoryRow(
            study=s.name, date=s.date, status=s.status,
            engine_version=(fp.engine_version if fp and fp.engine_version else "unknown"),
            card=fp.card if fp else (f"{s.params.get('num_gpus', '?')} x "
                                     f"{s.params.get('gpu', 'unknown GPUs')}"),
            fingerprint=fp.hash if fp else "",
            change=s.tags.get("best.change", ""),
            metric="; ".join(p for p in (metric, gain) if p),
            conclusion=s.tags.get("conclusion", "") or s.tags.get("no_baseline", "")))
    return rows


def select(studies: Sequence[EarlierStudy], *, model: str | None = None,
           fingerprint_hash: str | None = None,
           like: Fingerprint | None = None) -> list[EarlierStudy]:
    """The studies of `model` (the study file's model.path, or its architecture), with the
    fingerprint hash `fingerprint_hash`, or compatible with `like`; all when none is given."""
    out = list(studies)
    if model is not None:
        wanted = model.lower()
        out = [s for s in out if s.model.lower() == wanted or (
            s.fingerprint is not None and (s.fingerprint.architecture or "").lower() == wanted)]
    if fingerprint_hash is not None:
        out = [s for s in out if s.fingerprint is not None
               and s.fingerprint.hash.startswith(fingerprint_hash.lower())]
    if like is not None:
        out = [s for s in out if s.fingerprint is not None
               and compatibility(like, s.fingerprint, s.missing).is_compatible]
    return out


@dataclass(frozen=True)
class TrialConclusion:
    """One trial of an earlier study, as `nightshift history --trials` lists it."""

    number: int
    state: str
    conclusion: str
    seed_source: str = ""


def trial_conclusions(client: MlflowClient, study: EarlierStudy) -> list[TrialConclusion]:
    """The study's trial runs (confirmation runs apart), by trial number."""
    out: list[TrialConclusion] = []
    token: str | None = None
    while True:
        runs = client.search_runs([study.experiment_id],
                                  filter_string=f"tags.`{TAG_KIND}` = 'trial' and "
                                                f"tags.`{TAG_PARENT}` = '{study.run_id}'",
                                  max_results=1000, page_token=token)
        for run in runs:
            tags = run.data.tags
            number = tags.get("nightshift.trial", "")
            out.append(TrialConclusion(
                int(number) if number.isdigit() else -1, tags.get("state", ""),
                tags.get("conclusion", ""), tags.get(TAG_SEED_SOURCE, "")))
        token = runs.token
        if not token:
            return sorted(out, key=lambda t: t.number)
