"""Where each rule of `classify` fires (docs/bottleneck.md gives the reason for every
number)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final


@dataclass(frozen=True)
class Thresholds:
    """Where each rule fires; docs/bottleneck.md gives the reason for every number."""

    at_limit_roofline_fraction: float = 0.8  # measured step within 1.25x of the roofline
    kv_full_perc: float = 0.95  # KV cache usage, 0-1
    communication_share: float = 0.25  # of kernel time
    tp_slowdown: float = 1.15  # TPOT at TP>1 over the TP=1 reference
    launch_busy_fraction: float = 0.4  # GPU busy over the kernel span
    # NVML's share of time with a kernel running, sampled in the unprofiled measured window; at or
    # over this, the profiled window's gaps are the profiler's own host overhead, not the engine's.
    launch_max_gpu_util_pct: float = 80.0
    eager_roofline_fraction: float = 0.35  # without a trace: eager and this far off the roofline
    compute_gemm_share: float = 0.8
    compute_busy_fraction: float = 0.8
    compute_gpu_util_pct: float = 90.0  # without a trace, with a compute-dominated roofline
    memory_dominance: float = 2.0  # bytes term over FLOPs term that makes busy GEMMs memory-bound
    memory_util_pct: float = 50.0  # without a roofline: NVML memory-controller busy
    # The step-mix roofline (time-averaged utilisation of the FLOP and bandwidth ceilings):
    # at or over this, the dominant ceiling is what the level is bound by.
    bound_fraction: float = 0.4
    # The roofline's resolution at the ridge: where the FLOP term over the byte term (the
    # arithmetic intensity over the ridge point) lies within [1 / (1 + m), 1 + m], the figures
    # do not tell which ceiling binds, and the label names both (compute-and-memory-bound).
    # 0.1: the operating point's load is known to the capacity search's tolerance (5-10%), and
    # the ratio moves with the load (1.8x as fast near that config's capacity: the FLOP term is
    # proportional to it, the weights are read once a step); the byte count leaves activations out
    # (vLLM's estimator, as the simulated engine models it, counts 8.5-12.7% more bytes on the
    # simulated 512/128 Qwen2.5-7B mix at 36-45 req/s). docs/bottleneck.md, rule 5b.
    ridge_margin: float = 0.1
    # Below `bound_fraction` on both: the GPU idled between kernels while it had work when
    # NVML saw a kernel running less than this share of the time (or eager / runtime JIT).
    launch_idle_gpu_util_pct: float = 50.0
    # Little's law at the level: fewer requests than this in flight on average is a load that
    # leaves the engine idle, which no ceiling explains.
    min_requests_in_flight: float = 1.0


DEFAULT_THRESHOLDS: Final = Thresholds()
