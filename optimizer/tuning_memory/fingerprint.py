"""A study's fingerprint (what it ran on, what it ran, under which SLO) and the one rule that
says whether two studies are compatible: whether an earlier study's best config is worth a seed
trial here. Pure: no store, no files; the tuning memory's other modules
(optimizer/tuning_memory/earlier_studies.py) read and write. docs/tuning-memory.md states the
rules."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from optimizer.config import StudyConfig
    from runners.hardware import HardwareProfile
    from runners.model_info import ModelInfo

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
    engine_version: str | None = None  # vLLM's, or "simulated 0.26.0"; reported, not compared
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


# -- building one ---------------------------------------------------------------------------


def fingerprint_of(cfg: StudyConfig, *, engine: str, engine_version: str | None,
                   hardware: HardwareProfile | None, model: ModelInfo | None,
                   num_gpus: int | None = None) -> Fingerprint:
    """The fingerprint of the study `cfg` resolves to: on `hardware` (None: unknown), with
    `model`'s shape (None: unknown, a hub id read offline), `num_gpus` the GPUs the study may
    use (default: the host's)."""
    spec = cfg.spec
    w = spec.workload
    hw: dict[str, Any] = {}
    if hardware is not None and hardware.has_gpu:
        hw = {"gpu_model": hardware.gpu_name,
              "gpu_count": int(num_gpus if num_gpus is not None else hardware.num_gpus),
              "gpu_memory_gib": round(float(hardware.gpu_memory_gib), 1),
              "compute_capability": float(hardware.compute_capability),
              "interconnect": str(hardware.interconnect)}
    mdl: dict[str, Any] = {}
    if model is not None:
        mdl = {"architecture": model.architecture,
               "model_shape": (f"L{model.num_hidden_layers} H{model.hidden_size} "
                               f"A{model.num_attention_heads} KV{model.num_key_value_heads} "
                               f"D{model.head_dim} I{model.intermediate_size} "
                               f"V{model.vocab_size}"),
               "num_params": int(model.num_params), "dtype": str(model.dtype),
               "quant_method": str(model.quant_method or "none")}
    peak: float | None
    rates: list[float | None] = []
    if w.capacity is not None:
        arrival, peak = f"capacity:{w.capacity.axis}", float(w.capacity.high)
    elif getattr(w, "trace", None) is not None:
        # A trace replays by rate: without `levels`, one level at its recorded mean rate.
        rates = [lv.request_rate_rps for lv in cfg.workload.levels]
        arrival = "trace:request_rate"
        peak = None if any(r is None for r in rates) else max(r for r in rates if r is not None)
    else:
        arrival, peak = _levels_arrival(w.levels)
    extras = {name: _plain(getattr(w, name, None)) for name in WORKLOAD_EXTRAS}
    if isinstance(extras.get("trace"), dict) and extras["trace"].get("max_gap_s") is None:
        extras["trace"].pop("max_gap_s", None)  # unset: as fingerprints were before it
    # The gamma shape each rate level draws its gaps with (a level's own wins over the
    # workload's); None where no level has a rate (burstiness never applies).
    default_shape = float(getattr(w, "burstiness", None) or 1.0)
    shapes: list[float] = sorted({
        default_shape if (shape := getattr(lv, "burstiness", None)) is None else float(shape)
        for lv in w.levels if lv.request_rate is not None})
    extras["burstiness"] = None if not shapes else shapes[0] if len(shapes) == 1 else shapes
    # Two studies of one trace or dataset file replay the same requests only if its content is
    # the same: its digest is compared, not its name alone.
    for name, path in (("trace", getattr(cfg, "trace_file", None)),
                       ("dataset", getattr(cfg, "dataset_file", None))):
        if isinstance(extras.get(name), dict) and path is not None:
            extras[name]["sha256"] = _digest(path)
    lengths: dict[str, Any] = {
        "input_len": _length_text(w.input_len), "input_len_kind": str(w.input_len.kind),
        "input_len_mean": float(_mean(w.input_len)),
        "output_len": _length_text(w.output_len), "output_len_kind": str(w.output_len.kind),
        "output_len_mean": float(_mean(w.output_len))}
    peak_text = f" up to {rounded_load(peak)}" if peak is not None else ""
    load_text = f"{arrival}{peak_text}"
    if rates and all(r is not None for r in rates):  # a trace's levels: the rates replayed
        load_text = "at " + ", ".join(f"{r:.3g}" for r in rates if r is not None) + " req/s"
    prompts_file = Path(w.prompts_file).name if w.prompts_file is not None else None
    source = _file_source(cfg)
    if source is None:
        text = (f"input {lengths['input_len']} tokens, output {lengths['output_len']} tokens, "
                f"{arrival}{peak_text}")
    else:
        lengths, text = _replayed(cfg, source, load_text)
    return Fingerprint(
        engine=engine, engine_version=engine_version, **hw,
        model=spec.model.path, **mdl,
        weights="dummy" if spec.model.load_format == "dummy" else "real",
        **lengths, prompts_file=prompts_file, arrival=arrival, peak_load=peak, **extras,
        fixed_flags=_plain(dict(spec.fixed_flags)),
        slo_ttft_p99_ms=spec.slo.ttft_p99_ms, slo_tpot_p99_ms=spec.slo.tpot_p99_ms,
        slo_e2el_ms=spec.slo.e2el_ms, objectives=tuple(cfg.objectives), workload_text=text)


# Requests a level bound by time builds and cycles (runners/levels.py `_DURATION_POOL`): the
# lengths of a file's requests are read over as many.
_DURATION_POOL = 4096


def _file_source(cfg: StudyConfig) -> tuple[str, str] | None:
    """Where a study's prompts come from when not synthesised: (its length kind, the words
    naming the file), else None."""
    w = cfg.spec.workload
    if getattr(w, "trace", None) is not None and cfg.trace_file is not None:
        return "trace", f"trace {cfg.trace_file.name}"
    if getattr(w, "dataset", None) is not None and cfg.dataset_file is not None:
        first = " (first turns)" if getattr(w, "multi_turn", None) is not None else ""
        return "dataset", f"dataset {cfg.dataset_file.name}{first}"
    if w.prompts_file is not None:
        return "prompts_file", f"prompts {Path(w.prompts_file).name}"
    return None


def _replayed(cfg: StudyConfig, source: tuple[str, str], load_text: str
              ) -> tuple[dict[str, Any], str]:
    """The length fields and the workload's words where the prompts come from a file: the
    lengths its requests ask (`replayed_lengths`); unknown (None) where the file cannot be read
    here, which the compatibility rule refuses rather than guess."""
    from runners.loadgen.requests import replayed_lengths

    kind, name = source
    workload = cfg.workload
    if workload.trace is not None:  # replayed once: the whole trace or its first requests
        num = workload.num_requests or len(workload.trace.entries)
    else:
        num = workload.num_requests or _DURATION_POOL
    try:
        replayed = replayed_lengths(workload, num)
    except (OSError, UnicodeDecodeError, ValueError):
        replayed = None
    if replayed is None:
        return ({"input_len": f"{kind}:unknown", "input_len_kind": kind, "input_len_mean": None,
                 "output_len": f"{kind}:unknown", "output_len_kind": kind,
                 "output_len_mean": None},
                f"{name}: lengths unknown (the file could not be read here), {load_text}")
    sent, got = replayed.input, replayed.output
    count = f"{replayed.num_requests} requests" if workload.trace is not None else \
        f"{replayed.num_requests} requests a level" if workload.num_requests else \
        "requests cycled for a time"
    text = (f"{name}: {count}, input {sent.min_tokens}-{sent.max_tokens} tokens "
            f"(mean {sent.mean_tokens:.0f}), output {got.min_tokens}-{got.max_tokens} "
            f"(mean {got.mean_tokens:.0f}), {load_text}")
    return ({"input_len": f"{kind}:{sent.min_tokens}-{sent.max_tokens} "
                          f"mean {sent.mean_tokens:.0f}",
             "input_len_kind": kind, "input_len_mean": round(sent.mean_tokens, 1),
             "output_len": f"{kind}:{got.min_tokens}-{got.max_tokens} "
                           f"mean {got.mean_tokens:.0f}",
             "output_len_kind": kind, "output_len_mean": round(got.mean_tokens, 1)}, text)


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


def _levels_arrival(levels: Sequence[Any]) -> tuple[str, float | None]:
    """Fixed levels: paced by rate (any level has one) or closed-loop by concurrency, and the
    heaviest level on that axis (None when a rate level is unbounded: all at once)."""
    rates = [lv.request_rate for lv in levels]
    if any(r is not None for r in rates):
        if any(r is None for r in rates):
            return "levels:request_rate", None
        return "levels:request_rate", float(max(r for r in rates if r is not None))
    return "levels:concurrency", float(max(lv.concurrency or 0 for lv in levels))


def _digest(path: Path) -> str | None:
    """The first 12 hex digits of the file's sha256; None where it cannot be read."""
    import hashlib

    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()[:12]
    except OSError:
        return None


def _mean(spec: Any) -> float:
    """The mean length a distribution draws, as far as the study file states it: a uniform
    range's midpoint, else `mean` (runners/loadgen/requests.py keeps it the mean, before
    clipping)."""
    if spec.kind == "uniform" and spec.low is not None and spec.high is not None:
        return (float(spec.low) + float(spec.high)) / 2
    return float(spec.mean)


def _length_text(spec: Any) -> str:
    kind = str(spec.kind)
    if kind == "fixed":
        return f"fixed:{spec.mean}"
    if kind == "uniform":
        return f"uniform:{spec.low}-{spec.high}"
    return f"{kind}:{spec.mean}" + (f"~{spec.std:g}" if spec.std else "")


def _plain(value: Any) -> Any:
    """A JSON-safe form of a study-file value (a pydantic model, a path, a list of them)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, Path):
        return value.name
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        return _plain(dump(mode="json"))
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return str(value)


# -- a resume: the study file against the study it resumes ----------------------------------

# What a resumed study must still be, by what the study file calls it: a trial measured under
# one of these is not comparable with one measured under another (its defaults trial is the
# baseline of every gain), and a changed model changes the search space Optuna keeps.
RESUME_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("engine", ("engine",)),
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
                   and _norm(stored[n]) != _norm(now.get(n))]
        if changed:  # the first field says it (a new model changes its shape, its size, ...)
            name = changed[0]
            head = group.split()[0]
            label = group if head == name else \
                f"{head}.{name.removeprefix(head + '_')}" if head in ("workload", "slo") else \
                f"{head} {name}"  # the study file's own name where it has one
            out.append(f"{label}: {_show(stored[name])} -> {_show(now.get(name))}")
    return out
