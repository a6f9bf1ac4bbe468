"""`classify`: the pure function from `Evidence` to a `Verdict`, its rules in order
(docs/bottleneck.md gives them, and the reason for every number). The labels and the `Verdict`
are in `optimizer.bottleneck.verdict`, where each rule fires in `optimizer.bottleneck.thresholds`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Final

from optimizer.bottleneck.evidence import Evidence
from optimizer.bottleneck.ridge import Side, ridge_side
from optimizer.bottleneck.thresholds import DEFAULT_THRESHOLDS, Thresholds
from optimizer.bottleneck.verdict import Label, Source, Verdict


def _num(values: Mapping[str, float | None]) -> dict[str, float]:
    return {k: float(v) for k, v in values.items() if v is not None}


def _verdict(label: Label, rf: float | None, evidence: Mapping[str, float | None],
             detail: str, why: str, sources: Sequence[Source]) -> Verdict:
    used = ", ".join(sources)
    return Verdict(label=label, roofline_fraction=rf, evidence=_num(evidence),
                   reason=f"{label}: {why} (from {used}).", detail=detail,
                   sources=tuple(sources))


# Figures every verdict carries when measured, whatever rule decided: the two utilisations (and
# vLLM's), and the config facts `advice` must not contradict.
_CONTEXT_FIELDS: Final = ("compute_utilization", "bandwidth_utilization",
                          "vllm_compute_utilization", "vllm_bandwidth_utilization",
                          "prefill_flop_share", "kv_read_share", "requests_in_flight",
                          "num_runtime_jit_compiles",
                          "is_fp8_weights", "is_fp8_kv", "is_prefix_caching",
                          "is_enforce_eager",
                          "is_fp8_capable", "window_s",
                          "max_num_requests_running", "max_num_seqs")


def classify(evidence: Evidence, thresholds: Thresholds = DEFAULT_THRESHOLDS) -> Verdict:
    """The first rule that the evidence supports, in this order: kv-capacity-bound,
    at-physical-limit, communication-bound, launch-bound, then compute-bound, memory-bound or,
    where the two roofline figures lie within `ridge_margin` of each other,
    compute-and-memory-bound; else unknown. Each rule has a form for partial evidence (no
    trace: telemetry, metrics, config). The verdict's evidence also carries the level's
    utilisations (and their ratio, `compute_over_memory`) and fp8/eager facts."""
    verdict = _classify(evidence, thresholds)
    extra: dict[str, float] = {}
    for name in _CONTEXT_FIELDS:
        value = getattr(evidence, name)
        if value is not None and name not in verdict.evidence:
            extra[name] = float(value)
    ratio = _mix_ratio(evidence)
    if ratio is not None and "compute_over_memory" not in verdict.evidence:
        extra["compute_over_memory"] = ratio
    load = _load(evidence)
    return replace(verdict, evidence={**verdict.evidence, **extra}, load=load,
                   reason=_with_where(verdict, evidence, load))


def _load(e: Evidence) -> str:
    """The load a verdict describes, as `sentence` shows it: the operating point, or the
    lightest load probed when none met the SLO (said so)."""
    if e.load and e.is_within_slo is True:
        return f"{e.load}, the highest load that met the SLO"
    if e.load and e.is_within_slo is False:
        return f"{e.load}, the lightest load probed, which missed the SLO (no load met it)"
    return e.load


def _with_where(verdict: Verdict, e: Evidence, load: str) -> str:
    """The reason with the load it describes and, where the trace decided, where the profile
    was taken, both inside the one sentence: `label: why at <load> (from trace; the trace taken
    inside the stream at the operating point)` or `(...; the trace taken after the load levels,
    at <its load>)`."""
    head, sep, sources = verdict.reason.rpartition(" (from ")
    if not sep:
        return verdict.reason
    at = f" at {load}" if load else ""
    trace = ""
    if "trace" in verdict.sources:
        if e.is_profile_in_stream:
            trace = f"; the trace taken inside the stream at {e.profile_load or load}, in " \
                "steady state"
        else:
            where = e.profile_load or "a load of its own"
            trace = f"; the trace taken after the load levels, at {where}"
    return f"{head}{at}{sep}{sources.removesuffix(').')}{trace})."


def _classify(evidence: Evidence, thresholds: Thresholds) -> Verdict:
    e, t = evidence, thresholds
    rf = e.roofline_fraction()
    terms = e.roofline()
    rf_ev: dict[str, float | None] = {"roofline_fraction": rf}

    # A full KV cache that preempts or lets the queue grow caps the batch, however fast each
    # step is; it has its own levers (KV dtype, memory utilisation), so it is named first.
    kv = e.max_kv_cache_usage_perc
    pressure = (e.num_preemptions or 0.0) > 0 or bool(e.is_waiting_rising)
    if kv is not None and kv >= t.kv_full_perc and pressure:
        return _verdict(
            "kv-capacity-bound", rf,
            {"max_kv_cache_usage_perc": kv, "num_preemptions": e.num_preemptions,
             "is_waiting_rising": float(e.is_waiting_rising) if e.is_waiting_rising is not None
             else None},
            f"KV cache {kv:.0%} full, {_pressure(e)}",
            f"the KV cache was {kv:.0%} full with {_pressure(e)}", ["metrics"])

    # Over 100% of a ceiling no GPU runs: the figures, not the hardware, are wrong (a window
    # too short to measure a rate, or inputs that disagree). No label is built on them.
    if rf is not None and rf > 1.0:
        return _unphysical(e, rf)

    if rf is not None and rf >= t.at_limit_roofline_fraction and e.has_mix:
        flop = f"{flop_precision(e.is_fp8_weights, e.is_fp8_capable)} FLOP"
        if _mix_side(e, t) == "ridge":
            # Both ceilings within the margin: the detail names both, and the advice treats
            # the FLOP ceiling as binding too (fp8 weights raise it and halve the weights read).
            return _verdict("at-physical-limit", rf, {**rf_ev, "is_at_ridge": 1.0},
                            f"{e.compute_utilization:.0%} of the {flop} ceiling and "
                            f"{e.bandwidth_utilization:.0%} of the bandwidth ceiling, at the "
                            "ridge",
                            f"the level ran at {e.compute_utilization:.0%} of the FLOP ceiling "
                            f"and {e.bandwidth_utilization:.0%} of the bandwidth ceiling",
                            ["roofline", "metrics"])
        ceiling = _dominant_ceiling(e)
        if ceiling == "FLOP":
            ceiling = flop
        return _verdict("at-physical-limit", rf, rf_ev, f"{rf:.0%} of the {ceiling} ceiling",
                        f"the level ran at {e.compute_utilization:.0%} of the FLOP ceiling and "
                        f"{e.bandwidth_utilization:.0%} of the bandwidth ceiling",
                        ["roofline", "metrics"])
    if rf is not None and rf >= t.at_limit_roofline_fraction:
        return _verdict("at-physical-limit", rf, rf_ev, f"{rf:.0%} of the roofline",
                        f"a decode step takes {e.tpot_ms:.3g} ms, within "
                        f"{1 / rf:.2f}x of the roofline", ["roofline", "metrics"])

    if e.communication_share is not None and e.communication_share > t.communication_share:
        share = e.communication_share
        return _verdict("communication-bound", rf,
                        {"communication_share": share, **rf_ev,
                         "tensor_parallel_size": e.tensor_parallel_size},
                        f"communication {share:.0%} of kernel time",
                        f"collectives take {share:.0%} of GPU kernel time", ["trace"])
    if (e.tensor_parallel_size > 1 and e.tpot_ms is not None and e.tp1_tpot_ms is not None
            and e.tp1_tpot_ms > 0 and e.tpot_ms > t.tp_slowdown * e.tp1_tpot_ms):
        ratio = e.tpot_ms / e.tp1_tpot_ms
        return _verdict("communication-bound", rf,
                        {"tp_slowdown": ratio, "tpot_ms": e.tpot_ms, "tp1_tpot_ms": e.tp1_tpot_ms,
                         "tensor_parallel_size": e.tensor_parallel_size},
                        f"TPOT {ratio:.2f}x the TP=1 reference",
                        f"TP={e.tensor_parallel_size} decodes {ratio:.2f}x slower than TP=1 at "
                        "the same load", ["metrics", "config"])

    busy = e.gpu_busy_fraction
    util = e.gpu_util_mean_pct
    # The trace comes from a profiled window, whose host-side overhead widens the gaps between
    # kernels; NVML, sampled while the load ran unprofiled, says whether they exist without it.
    profiler_gaps = busy is not None and busy < t.launch_busy_fraction and \
        util is not None and util >= t.launch_max_gpu_util_pct
    if busy is not None and busy < t.launch_busy_fraction and not profiler_gaps:
        return _verdict("launch-bound", rf,
                        {"gpu_busy_fraction": busy, "median_gap_us": e.median_gap_us,
                         "is_enforce_eager": _flag(e.is_enforce_eager), **rf_ev},
                        f"GPU busy {busy:.0%} of the kernel span",
                        f"the GPU was busy only {busy:.0%} of the kernel span, idle between "
                        "kernels", ["trace"])
    if e.has_mix and rf is not None:
        return _classify_mix(e, t, rf, busy, util, profiler_gaps)
    if (busy is None and e.is_enforce_eager and rf is not None
            and rf < t.eager_roofline_fraction):
        return _verdict("launch-bound", rf, {"is_enforce_eager": 1.0, **rf_ev},
                        f"eager mode at {rf:.0%} of the roofline",
                        f"enforce_eager runs {rf:.0%} of the roofline with no trace to show "
                        "the gaps", ["config", "roofline"])

    gemm = e.gemm_share
    if (gemm is not None and busy is not None and gemm > t.compute_gemm_share
            and busy > t.compute_busy_fraction):
        ev = {"gemm_share": gemm, "gpu_busy_fraction": busy, **rf_ev}
        # Decode GEMMs at a small batch stream weights: busy GEMMs are then memory-bound.
        if terms is not None and terms.memory_s > t.memory_dominance * terms.compute_s:
            return _verdict("memory-bound", rf,
                            {**ev, "memory_over_compute": terms.memory_s / terms.compute_s},
                            f"GEMM {gemm:.0%} of a {busy:.0%}-busy GPU, streaming weights",
                            f"GEMMs fill {gemm:.0%} of a {busy:.0%}-busy GPU but the roofline "
                            "is bandwidth-dominated", ["trace", "roofline"])
        return _verdict("compute-bound", rf, ev,
                        f"GEMM {gemm:.0%} of kernel time, GPU busy {busy:.0%}",
                        f"GEMMs fill {gemm:.0%} of a GPU busy {busy:.0%} of the time",
                        ["trace"])
    if busy is None and terms is not None and not terms.is_memory_dominated and \
            (util is None or util >= t.compute_gpu_util_pct):
        sources: list[Source] = ["roofline"] if util is None else ["roofline", "telemetry"]
        ratio = terms.compute_s / terms.memory_s
        ev3 = {"compute_over_memory": ratio, "gpu_util_mean_pct": util, **rf_ev}
        if ridge_side(terms.compute_s, terms.memory_s, t.ridge_margin) == "ridge":
            return _at_ridge(rf, ev3, ratio, t, "the decode roofline's", sources)
        return _verdict("compute-bound", rf, ev3, "FLOPs dominate the roofline",
                        "the roofline's FLOP term exceeds its byte term", sources)

    if terms is not None and terms.is_memory_dominated:
        ev2 = {"memory_over_compute": terms.memory_s / terms.compute_s,
               "gpu_busy_fraction": busy, "gpu_util_mean_pct": e.gpu_util_mean_pct,
               "decode_batch": e.decode_batch, **rf_ev}
        at = f" at {rf:.0%} of it" if rf is not None else ""
        used: list[Source] = ["roofline", "trace"] if busy is not None else ["roofline"]
        gaps = ""
        if profiler_gaps:
            used.append("telemetry")
            gaps = (f"; the profiled window's gaps (GPU busy {busy:.0%}) are the profiler's: "
                    f"unprofiled, a kernel ran {util:.0f}% of the time")
        if ridge_side(terms.compute_s, terms.memory_s, t.ridge_margin) == "ridge":
            ratio = terms.compute_s / terms.memory_s
            return _at_ridge(rf, {**ev2, "compute_over_memory": ratio}, ratio, t,
                             "the decode roofline's", used, gaps)
        return _verdict("memory-bound", rf, ev2, f"bandwidth roofline{at}",
                        f"reading weights and KV dominates the decode roofline{at}{gaps}", used)
    if terms is None and e.mem_util_mean_pct is not None \
            and e.mem_util_mean_pct >= t.memory_util_pct:
        return _verdict("memory-bound", rf, {"mem_util_mean_pct": e.mem_util_mean_pct},
                        f"memory controller busy {e.mem_util_mean_pct:.0f}%",
                        f"the memory controller was busy {e.mem_util_mean_pct:.0f}% of the "
                        "time", ["telemetry"])

    missing = [name for name, present in (("trace", e.has_trace), ("telemetry", e.has_telemetry),
                                          ("metrics", e.has_metrics),
                                          ("roofline", terms is not None)) if not present]
    have: list[Source] = [s for s in ("trace", "telemetry", "metrics", "roofline")
                          if s not in missing]
    why = "no rule fired"
    if missing:
        why += f"; missing {', '.join(missing)}"
    return Verdict(label="unknown", roofline_fraction=rf, evidence=_num(rf_ev),
                   reason=f"unknown: {why} (from {', '.join(have) or 'nothing'}).",
                   detail="not enough evidence", sources=tuple(have))


# A level's window shorter than this measures no rate: a few requests' start and end decide it.
MIN_RATE_WINDOW_S: Final = 1.0


def _mix_ratio(e: Evidence) -> float | None:
    """The step mix's FLOP term over its byte term (compute over bandwidth utilisation)."""
    if not e.has_mix or not (e.bandwidth_utilization or 0.0) > 0:
        return None
    return (e.compute_utilization or 0.0) / (e.bandwidth_utilization or 1.0)


def _mix_side(e: Evidence, t: Thresholds) -> Side:
    return ridge_side(e.compute_utilization or 0.0, e.bandwidth_utilization or 0.0,
                      t.ridge_margin)


def _at_ridge(rf: float | None, evidence: Mapping[str, float | None], ratio: float,
              t: Thresholds, figures: str, sources: Sequence[Source], note: str = "",
              detail: str = "") -> Verdict:
    """compute-and-memory-bound: the FLOP and byte terms within `ridge_margin` of each other,
    which the roofline's figures cannot order (docs/bottleneck.md, rule 5b)."""
    return _verdict("compute-and-memory-bound", rf, evidence,
                    detail or f"at the ridge: FLOP term {ratio:.2f}x the byte term",
                    f"{figures} FLOP term is {ratio:.2f}x its byte term, within the "
                    f"{t.ridge_margin:.0%} the roofline resolves: at the ridge point, neither "
                    f"ceiling shown to bind more than the other{note}", sources)


def flop_precision(is_fp8_weights: bool | float | None,
                   is_fp8_capable: bool | float | None) -> str:
    """The precision of the FLOP ceiling a level is measured against: fp8 where its weights
    are fp8 on a card with fp8 tensor cores, else bf16 (`roofline.step_roofline`'s peak)."""
    return "fp8" if is_fp8_weights and is_fp8_capable else "bf16"


def _unphysical(e: Evidence, rf: float) -> Verdict:
    """`unknown`, where the level's figures put it over 100% of a ceiling: why, with the
    window where it was too short to measure a rate."""
    over = (f"{e.compute_utilization:.0%} of the FLOP ceiling, {e.bandwidth_utilization:.0%} "
            "of the bandwidth ceiling") if e.has_mix else f"{rf:.0%} of the roofline"
    if e.window_s is not None and e.window_s < MIN_RATE_WINDOW_S:
        why = (f"its {e.window_s:.2g} s window is too short to measure a rate (at least "
               f"{MIN_RATE_WINDOW_S:g} s)")
        detail = f"over 100% of a ceiling from a {e.window_s:.2g} s window: too short"
    else:
        why = "its figures are inconsistent (the rate measured or the roofline's inputs)"
        detail = "over 100% of a ceiling: figures inconsistent"
    used: list[Source] = ["roofline", "metrics"]
    return Verdict(label="unknown", roofline_fraction=rf,
                   evidence=_num({"roofline_fraction": rf, "window_s": e.window_s,
                                  "is_unphysical": 1.0}),
                   reason=f"unknown: the level's figures put it at {over}, which no GPU runs: "
                          f"{why}; no label is built on them (from {', '.join(used)}).",
                   detail=detail, sources=tuple(used))


def _dominant_ceiling(e: Evidence) -> str:
    return "FLOP" if (e.compute_utilization or 0.0) >= (e.bandwidth_utilization or 0.0) \
        else "bandwidth"


def _mix_figures(e: Evidence) -> str:
    return (f"{e.compute_utilization:.0%} of the FLOP ceiling, {e.bandwidth_utilization:.0%} of "
            "the bandwidth ceiling")


def _classify_mix(e: Evidence, t: Thresholds, rf: float, busy: float | None,
                  util: float | None, profiler_gaps: bool) -> Verdict:
    """The rules on the step-mix roofline, below the physical limit, once kv-capacity,
    communication and a trace's launch gaps have been ruled out."""
    cu, bu = e.compute_utilization or 0.0, e.bandwidth_utilization or 0.0
    rf_ev: dict[str, float | None] = {"roofline_fraction": rf, "compute_utilization": cu,
                                      "bandwidth_utilization": bu}
    sources: list[Source] = ["roofline", "metrics"]
    if busy is not None:
        sources.append("trace")  # it showed no launch gaps (or only the profiler's)
    note = ""
    if profiler_gaps:
        sources.append("telemetry")
        note = (f"; the profiled window's gaps (GPU busy {busy:.0%}) are the profiler's: "
                f"unprofiled, a kernel ran {util:.0f}% of the time")
    is_far = rf < t.bound_fraction
    in_flight = e.requests_in_flight
    had_work = in_flight is None or in_flight >= t.min_requests_in_flight
    jit = e.num_runtime_jit_compiles or 0.0
    is_gpu_busy = util is not None and util >= t.launch_max_gpu_util_pct
    is_gpu_idle = util is not None and util < t.launch_idle_gpu_util_pct
    # Far below both ceilings with work waiting, and a sign that the GPU waited on the host:
    # Python launching kernels (eager), kernels compiled while serving, or NVML saw it idle.
    signs = [s for s, on in (("eager mode", bool(e.is_enforce_eager)),
                             (f"{jit:.0f} kernels JIT-compiled while serving", jit > 0),
                             (f"NVML saw a kernel running {util or 0:.0f}% of the time",
                              is_gpu_idle)) if on]
    if is_far and had_work and busy is None and not is_gpu_busy and signs:
        used: list[Source] = ["roofline", "config"]
        if util is not None:
            used.insert(1, "telemetry")
        return _verdict(
            "launch-bound", rf,
            {**rf_ev, "gpu_util_mean_pct": util, "is_enforce_eager": _flag(e.is_enforce_eager),
             "num_runtime_jit_compiles": jit if jit else None,
             "requests_in_flight": in_flight},
            f"{signs[0]}, {rf:.0%} of the {_dominant_ceiling(e)} ceiling",
            f"with work waiting the level reached only {_mix_figures(e)}; "
            + "; ".join(signs), used)
    side = _mix_side(e, t)
    share = e.prefill_flop_share
    if not is_far and side == "ridge":
        ratio = cu / bu
        return _at_ridge(rf, {**rf_ev, "prefill_flop_share": share, "compute_over_memory": ratio},
                         ratio, t, f"the step mix ran at {_mix_figures(e)}; its", sources,
                         note, f"at the ridge: {cu:.0%} of the FLOP ceiling, {bu:.0%} of the "
                         "bandwidth ceiling")
    if not is_far and side == "compute":
        mix = f"prefill {share:.0%} of the FLOPs, " if share is not None else ""
        return _verdict("compute-bound", rf, {**rf_ev, "prefill_flop_share": share},
                        f"{mix}{cu:.0%} of the FLOP ceiling",
                        f"the step mix ran at {_mix_figures(e)}{note}", sources)
    if not is_far:
        return _verdict("memory-bound", rf, {**rf_ev, "prefill_flop_share": share},
                        f"{bu:.0%} of the bandwidth ceiling, {cu:.0%} of FLOPs",
                        f"the step mix ran at {_mix_figures(e)}{note}", sources)
    # Far below both ceilings and no sign of host gaps: no ceiling explains the level.
    if not had_work:
        why = (f"the load left the engine idle ({in_flight:.2f} requests in flight on "
               f"average) at {_mix_figures(e)}")
    elif is_gpu_busy or (busy is not None and busy >= t.launch_busy_fraction):
        seen = f"NVML saw a kernel running {util:.0f}% of the time" if is_gpu_busy \
            else f"the trace shows the GPU busy {busy:.0%} of the kernel span"
        why = (f"the GPU was busy ({seen}) yet the level reached only {_mix_figures(e)}: its "
               "kernels run well below the hardware's rates for this mix")
    else:
        why = f"the level reached only {_mix_figures(e)} and no other evidence explains it"
    have: list[Source] = ["roofline", "metrics"]
    if util is not None:
        have.append("telemetry")
    if busy is not None:
        have.append("trace")
    return Verdict(label="unknown", roofline_fraction=rf,
                   evidence=_num({**rf_ev, "gpu_util_mean_pct": util,
                                  "gpu_busy_fraction": busy, "requests_in_flight": in_flight}),
                   reason=f"unknown: {why} (from {', '.join(have)}).",
                   detail=f"below both ceilings: {_mix_figures(e)}", sources=tuple(have))


def _pressure(e: Evidence) -> str:
    parts = []
    if e.num_preemptions:
        parts.append(f"{e.num_preemptions:.0f} preemptions")
    if e.is_waiting_rising:
        parts.append("the queue rising")
    return " and ".join(parts)


def _flag(value: bool | None) -> float | None:
    return None if value is None else float(value)
