"""How a study becomes its fingerprint (`fingerprint_of`): the host's GPUs, the model's shape,
the study file's workload, SLO and fixed flags, and, where the prompts come from a trace, dataset
or prompts file, the lengths its requests ask and the file's digest (the only reads of a file).
The fingerprint itself and the rules on it are optimizer/tuning_memory/fingerprint.py."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optimizer.tuning_memory.fingerprint import WORKLOAD_EXTRAS, Fingerprint, rounded_load

if TYPE_CHECKING:
    from optimizer.config import StudyConfig
    from runners.hardware import HardwareProfile
    from runners.model_info import ModelInfo


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
