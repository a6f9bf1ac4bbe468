"""A study's fingerprint (what it ran on, what it ran, under which SLO) and the one rule that
says whether two studies are compatible: whether an earlier study's best config is worth a seed
trial here; the workload in words (`describe_workload`); what a resume may not change
(`resume_changes`). Pure: no store, no files; `fingerprint_of`
(optimizer/tuning_memory/fingerprint_of.py) builds one from a study, the tuning memory's other
modules (optimizer/tuning_memory/earlier_studies.py) read and write. docs/tuning-memory.md
states the rules."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

FINGERPRINT_VERSION = 1
# Mean input/output lengths and the heaviest offered load may differ by up to this factor.
LENGTH_RATIO = 2.0
LOAD_RATIO = 2.0
GPU_MEMORY_RATIO = 1.1  # the same card model in a variant with other memory (MIG, NVL) is not
# Workload fields other engineers' features add to the study file (issue 23): read by name when
# present, recorded as null when the study file has no such field or leaves it unset.
WORKLOAD_EXTRAS = ("burstiness", "shared_prefix", "trace", "dataset", "multi_turn")


@dataclass(frozen=True)
class Fingerprint:
    """One study's fingerprint. A field holding None is unknown (the compatibility rule refuses
    it) except the WORKLOAD_EXTRAS and the SLO's, where None means "not set"."""

    version: int = FINGERPRINT_VERSION
    engine: str | None = None  # "vllm" or "simulated"
    # vLLM's, or "simulated 0.26.0"; reported by tuning memory, compared on resume
    engine_version: str | None = None
    gpu_model: str | None = None  # NVML's name, "NVIDIA H200"
    gpu_count: int | None = None  # GPUs a study may use (Ray's, for the simulated engine)
    gpu_memory_gib: float | None = None  # GiB, the smallest card
    compute_capability: float | None = None  # 9.0
    interconnect: str | None = None  # "nvlink", "pcie", "none"
    model: str | None = None  # the study file's model.path; reported, not compared
    architecture: str | None = None  # config.json's architectures[0]
    model_shape: str | None = None  # layers, hidden, heads, KV heads, MLP, vocab
    num_params: int | None = None  # parameters of that shape
    dtype: str | None = None  # the checkpoint's
    quant_method: str | None = None  # "fp8", "awq", ... ; "none" when not quantized
    weights: str | None = None  # "real" or "dummy" (model.load_format)
    # "fixed:512", "uniform:128-1024", ...; for prompts from a file the lengths its requests
    # ask, "trace:100-900 mean 480"; reported
    input_len: str | None = None
    # "fixed", "uniform", "normal", "lognormal"; "trace", "dataset", "prompts_file" where the
    # prompts come from that file and the mean is its requests' (REPLAYED_KINDS)
    input_len_kind: str | None = None
    input_len_mean: float | None = None  # tokens
    output_len: str | None = None  # reported
    output_len_kind: str | None = None
    output_len_mean: float | None = None  # tokens
    prompts_file: str | None = None  # its file name; None when prompts are synthesised
    arrival: str | None = None  # "levels:concurrency", "levels:request_rate", "capacity:..."
    peak_load: float | None = None  # the heaviest level or capacity high (requests or req/s)
    burstiness: Any = None
    shared_prefix: Any = None
    trace: Any = None
    dataset: Any = None
    multi_turn: Any = None
    # The study's fixed_flags: part of its baseline, so of what "a change from the defaults"
    # means there ({} when none).
    fixed_flags: Any = None
    slo_ttft_p99_ms: float | None = None
    slo_tpot_p99_ms: float | None = None
    slo_e2el_ms: float | None = None
    objectives: tuple[str, ...] = ()  # reported, not compared
    # The workload in words and numbers, as the export header states it
    # (`describe_workload`); reported. None in a fingerprint stored before it existed.
    workload_text: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["objectives"] = list(self.objectives)
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> tuple[Fingerprint, frozenset[str]]:
        """The fingerprint a stored dict holds, and the names of the fields it lacks (an older
        version's, or a hand-written one): those are unknown to `compatibility`."""
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in known}
        if isinstance(kwargs.get("objectives"), list):
            kwargs["objectives"] = tuple(str(o) for o in kwargs["objectives"])
        missing = frozenset(known - set(data))
        return cls(**kwargs), missing

    @property
    def hash(self) -> str:
        """12 hex digits over every compared field: equal hashes are compatible studies
        (compatible ones may still differ in hash, the rule having tolerances)."""
        data = {k: v for k, v in self.to_dict().items() if k not in REPORTED_ONLY}
        digest = hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode())
        return digest.hexdigest()[:12]

    @property
    def card(self) -> str:
        """`2 x NVIDIA H200 (nvlink)`, as `history` shows it."""
        if self.gpu_model is None:
            return "unknown GPUs"
        link = f" ({self.interconnect})" if self.interconnect not in (None, "none") else ""
        return f"{self.gpu_count or '?'} x {self.gpu_model}{link}"

    def tags(self) -> dict[str, str]:
        """MLflow tags of the study's parent run: `fingerprint.hash`, one `fingerprint.<field>`
        per scalar that is set, and `fingerprint.json` (the whole, read back by the memory)."""
        out = {"fingerprint.hash": self.hash, "fingerprint.json": self.to_json()}
        for key, value in self.to_dict().items():
            if value is None or isinstance(value, dict | list):
                continue
            out[f"fingerprint.{key}"] = str(value)[:250]
        return out


# Fields recorded for the reader but never a reason to refuse a study.
REPORTED_ONLY = frozenset({"version", "engine_version", "model", "objectives", "input_len",
                           "output_len", "workload_text"})
# Length kinds of prompts from a file: the lengths are its requests' (`replayed_lengths`). A
# fingerprint from a file with another kind was written before they were: its lengths are the
# study file's unused input_len/output_len, so never compared with replayed ones.
REPLAYED_KINDS = frozenset({"trace", "dataset", "prompts_file"})
# Fields where None is a value ("not set"), not "unknown".
# peak_load: None is a rate level with no rate (all requests at once).
_NONE_IS_A_VALUE = frozenset({*WORKLOAD_EXTRAS, "prompts_file", "slo_ttft_p99_ms",
                              "slo_tpot_p99_ms", "slo_e2el_ms", "peak_load"})
_RATIO = {"input_len_mean": LENGTH_RATIO, "output_len_mean": LENGTH_RATIO,
          "peak_load": LOAD_RATIO, "gpu_memory_gib": GPU_MEMORY_RATIO}


@dataclass(frozen=True)
class Compatibility:
    """Whether an earlier study's conclusions apply here, and why not."""

    is_compatible: bool
    reasons: tuple[str, ...]  # one per field that differs or is unknown
    notes: tuple[str, ...]  # differences that do not count (vLLM version, objectives)


def compatibility(here: Fingerprint, there: Fingerprint,
                  missing_there: frozenset[str] = frozenset()) -> Compatibility:
    """`there` (an earlier study) against `here`, field by field (docs/tuning-memory.md):
    equal for every field but the mean lengths, the peak load and the GPU memory, which may
    differ by their ratio; a field unknown on either side (None where None is not a value, or
    absent from the stored fingerprint) is a reason, never a guess."""
    reasons: list[str] = []
    skipped = _unrecorded_lengths(here, there)
    for f in fields(Fingerprint):
        name = f.name
        if name in REPORTED_ONLY or name in skipped:
            continue
        a, b = getattr(here, name), getattr(there, name)
        if name in missing_there:
            reasons.append(f"{name}: unknown there (its fingerprint has no such field)")
            continue
        if name not in _NONE_IS_A_VALUE and (a is None or b is None):
            side = "here" if a is None else "there"
            reasons.append(f"{name}: unknown {side}")
            continue
        ratio = _RATIO.get(name)
        if ratio is not None and (a is None or b is None):
            if a is not None or b is not None:
                reasons.append(f"{name}: {_show(b)} there, {_show(a)} here")
        elif ratio is not None:
            if not _within(float(a), float(b), ratio):
                reasons.append(f"{name}: {_show(b)} there, {_show(a)} here "
                               f"(more than {ratio:g}x apart)")
        elif _norm(a) != _norm(b):
            reasons.append(f"{name}: {_show(b)} there, {_show(a)} here")
    notes: list[str] = []
    if here.engine_version != there.engine_version:
        notes.append(f"engine version {there.engine_version or 'unknown'} there, "
                     f"{here.engine_version or 'unknown'} here")
    if tuple(here.objectives) != tuple(there.objectives):
        notes.append(f"objective {','.join(there.objectives) or 'unknown'} there, "
                     f"{','.join(here.objectives) or 'unknown'} here")
    return Compatibility(not reasons, tuple(reasons), tuple(notes))


_LENGTHS = frozenset({"input_len_kind", "input_len_mean", "output_len_kind", "output_len_mean"})


def _unrecorded_lengths(here: Fingerprint, there: Fingerprint) -> frozenset[str]:
    """The length fields not to compare. Prompts from a trace, dataset or prompts file (the file
    compared by digest or name) whose lengths both fingerprints recorded compare them, the
    requests' real lengths; where one was written before they were recorded, its lengths are
    the study file's unused input_len/output_len: none is compared (two such older ones
    compare their output lengths, as they always did, not the input_len a file made unused)."""
    if not (_prompts_from_a_file(here) and _prompts_from_a_file(there)):
        return frozenset()
    recorded = [_has_replayed_lengths(fp) for fp in (here, there)]
    if all(recorded):
        return frozenset()
    return _LENGTHS if any(recorded) else frozenset({"input_len_kind", "input_len_mean"})


def _prompts_from_a_file(fingerprint: Fingerprint) -> bool:
    return fingerprint.prompts_file is not None or fingerprint.trace is not None or \
        fingerprint.dataset is not None


def _has_replayed_lengths(fingerprint: Fingerprint | Mapping[str, Any]) -> bool:
    kind = fingerprint.get("input_len_kind") if isinstance(fingerprint, Mapping) else \
        fingerprint.input_len_kind
    return kind in REPLAYED_KINDS


def _within(a: float, b: float, ratio: float) -> bool:
    if not (math.isfinite(a) and math.isfinite(b)) or a <= 0 or b <= 0:
        return a == b
    return max(a, b) / min(a, b) <= ratio


def _norm(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _show(value: Any) -> str:
    if value is None:
        return "not set"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value) if not isinstance(value, dict | list) else _norm(value)


# -- the workload in words ------------------------------------------------------------------


def rounded_load(load: float) -> str:
    """A load as a header states it: a count whole (`1024`), a rate to 3 significant digits
    (`4.65`, not the `4.65483` a trace's mean rate is stored as)."""
    if float(load).is_integer():
        return str(int(load))
    return f"{float(f'{load:.3g}'):g}"


def describe_workload(fingerprint: Fingerprint) -> str:
    """The workload in words and numbers, as the export header states it: what a trace,
    dataset or prompts file replays (its requests, their input and output lengths, the rate),
    else the distributions the study file gives and the load. A fingerprint stored before the
    replayed lengths were recorded says it has none, never the unused input_len/output_len."""
    if fingerprint.workload_text is not None:
        return fingerprint.workload_text
    fp = fingerprint
    peak = f" up to {rounded_load(fp.peak_load)}" if fp.peak_load is not None else ""
    if _prompts_from_a_file(fp) and not _has_replayed_lengths(fp):
        source = "trace" if fp.trace is not None else "dataset" if fp.dataset is not None \
            else f"prompts {fp.prompts_file}"
        return (f"{source}, its lengths not recorded (a study fingerprinted before they "
                f"were), {fp.arrival}{peak}")
    return f"input {fp.input_len} tokens, output {fp.output_len} tokens, {fp.arrival}{peak}"



# -- a resume: the study file against the study it resumes ----------------------------------

# What a resumed study must still be, by what the study file calls it: a trial measured under
# one of these is not comparable with one measured under another (its defaults trial is the
# baseline of every gain), and a changed model changes the search space Optuna keeps.
RESUME_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("engine", ("engine",)),
    # Another vLLM release may move capacities (0.28 changed how the KV budget is sized:
    # docs/vllm-versions.md): new trials would be compared with a defaults trial of the old
    # release.
    # Compared only where both are known (a driver without vLLM whose study names none).
    ("vLLM release (vllm.version, or the installed vLLM)", ("engine_version",)),
    ("hardware", ("gpu_model", "gpu_count", "gpu_memory_gib", "compute_capability",
                  "interconnect")),
    ("model", ("model", "architecture", "model_shape", "num_params", "dtype", "quant_method")),
    ("weights (model.load_format)", ("weights",)),
    ("workload", ("input_len", "input_len_kind", "input_len_mean", "output_len",
                  "output_len_kind", "output_len_mean", "prompts_file", "arrival", "peak_load",
                  *WORKLOAD_EXTRAS)),
    ("slo", ("slo_ttft_p99_ms", "slo_tpot_p99_ms", "slo_e2el_ms")),
    ("fixed_flags", ("fixed_flags",)),
)


# Resume fields compared only where both fingerprints know them.
_KNOWN_BOTH_SIDES = frozenset({"engine_version"})


def _release(engine_version: Any) -> str:
    """`simulated 0.26.0`, `0.26.0+cu128`, `0.26` -> the release they name, as
    `vllm.version` is checked against the installed vLLM (`version_key`: a local tag, a
    rebuild for another CUDA, is the same release)."""
    from search_spaces.engine.tables import version_key

    text = str(engine_version)
    engine, _, version = text.rpartition(" ")
    key = version_key(version)
    return f"{engine} {'.'.join(map(str, key + (0,) * (3 - len(key))))}" if key else text


def resume_changes(stored: Mapping[str, Any], here: Fingerprint) -> list[str]:
    """What the study file changed from the study it would resume (`stored`: the fingerprint
    the study kept at its last start), one "group field: there -> here" per changed group, in
    RESUME_GROUPS order (the first changed field of each group); [] when it resumes the same
    study. Exact, no tolerance: every new trial would be compared with the stored defaults
    trial. A field the stored fingerprint lacks (a study written before it existed) is not
    compared."""
    now = here.to_dict()
    # A study from a file fingerprinted before its lengths were recorded stored the study
    # file's unused input_len/output_len: they say nothing of what it ran (the file itself is
    # compared, by digest for a trace or dataset, by name for a prompts file).
    unrecorded = {"input_len", "output_len", *_LENGTHS} if (
        any(stored.get(k) is not None for k in ("trace", "dataset", "prompts_file"))
        and not _has_replayed_lengths(stored) and _has_replayed_lengths(here)) else set()
    out: list[str] = []
    for group, names in RESUME_GROUPS:
        changed = [n for n in names if n in stored and n not in unrecorded
                   and not (n in _KNOWN_BOTH_SIDES and None in (stored[n], now.get(n)))
                   and (_release(stored[n]) != _release(now.get(n)) if n == "engine_version"
                        else _norm(stored[n]) != _norm(now.get(n)))]
        if changed:  # the first field says it (a new model changes its shape, its size, ...)
            name = changed[0]
            head = group.split()[0]
            label = group if head == name or len(names) == 1 else \
                f"{head}.{name.removeprefix(head + '_')}" if head in ("workload", "slo") else \
                f"{head} {name}"  # the study file's own name where it has one
            out.append(f"{label}: {_show(stored[name])} -> {_show(now.get(name))}")
    return out
