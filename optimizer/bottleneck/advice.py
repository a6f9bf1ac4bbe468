"""The conclusion built on a verdict: `advice` (what to do next, never what the config already
does) and `sentence` ("change -> metric -> conclusion" in one line)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from optimizer.bottleneck.evidence import is_prefix_caching, is_true
from optimizer.bottleneck.verdict import Label, Verdict
from runners.base import EngineConfig
from search_spaces.engine.facts import EngineFlags

_ADVICE: Final[Mapping[Label, str]] = {
    "communication-bound": "prefer a smaller tensor_parallel_size (replicas instead)",
    "at-physical-limit": "this is the hardware's limit for this batch; stop tuning this config",
    "unknown": "profile the trial to tell",
}


# The batch reached its cap when its most running requests came this close to max_num_seqs:
# the gauge is sampled about once a second, so a batch pinned at the cap can read a little under.
_AT_CAP_FRACTION: Final = 0.9


def _batch_advice(ev: Mapping[str, float]) -> str:
    """A memory-bound level with the bytes per token already cut: more sequences per weight
    read, which a larger max_num_seqs gives only where the batch reached it; a batch below it
    followed the load (the arrival rate, and the SLO that the next load up missed), and a
    larger cap changes nothing."""
    running, cap = ev.get("max_num_requests_running"), ev.get("max_num_seqs")
    if running is None or cap is None or not cap > 0:
        unknown = "the running count was not measured" if running is None else \
            "its max_num_seqs is not known"
        return (f"a larger max_num_seqs helps only where the batch reaches it ({unknown}); "
                "replicas (data_parallel_size) add capacity, not capacity per GPU")
    if running >= _AT_CAP_FRACTION * cap:
        kv = ev.get("max_kv_cache_usage_perc")
        room = f" with the KV cache {kv:.0%} full" if kv is not None else \
            "; where the KV cache has room"
        return (f"read the weights for more sequences per step: the batch reached "
                f"{running:.0f} of max_num_seqs {cap:.0f}{room}, a larger max_num_seqs "
                "raises it; or add replicas (data_parallel_size)")
    return (f"the batch followed the load (at most {running:.0f} running of max_num_seqs "
            f"{cap:.0f}): no cap held it, so a larger max_num_seqs changes nothing; more "
            "capacity per GPU needs faster steps at this batch (kernels, attention backend), "
            "and replicas (data_parallel_size) add capacity, not capacity per GPU")


def _prefill_levers(prefix_caching: bool | None) -> list[str]:
    """Fewer prefill FLOPs: shorter prompts, and prefix caching of shared prompts only where
    the config has it off (vLLM 0.26 turns it on by default)."""
    levers = ["shorter prompts"]
    if prefix_caching is False:
        levers.insert(0, "prefix caching of shared prompts (enable_prefix_caching, off in this "
                         "config)")
    return levers


def _ridge_advice(ev: Mapping[str, float], *, fp8_weights: bool, fp8_kv: bool,
                  prefix_caching: bool | None) -> str:
    """At the ridge neither ceiling is shown to bind more: fp8 weights come first, as they
    raise the FLOP ceiling (fp8 tensor cores) and cut the weight bytes at once; they leave the
    FLOPs as they are. The utilisations are time averages over the level (neither ceiling binds
    throughout at 47% and 44%), and decode attention's KV reads add to a step's time rather
    than overlap its GEMMs, so a lever on one side still shortens the steps, by that side's
    share of them."""
    if not fp8_weights:
        return ("raise the FLOP ceiling and cut bytes at once: fp8 weights (quantization fp8) "
                "halve the weight bytes read and, on a card with fp8 tensor cores, double the "
                "GEMMs' FLOP ceiling")
    levers = []
    if not fp8_kv and ev.get("kv_read_share", 1.0) >= 0.1:
        levers.append("an fp8 KV cache (kv_cache_dtype fp8) for the KV bytes")
    levers.append(" or ".join(_prefill_levers(prefix_caching)) + " for the prefill FLOPs")
    return ("each lever cuts only its side's share of the step: " + "; ".join(levers)
            + "; replicas (data_parallel_size) add capacity, not capacity per GPU")


def _limit_advice(ev: Mapping[str, float], *, fp8_weights: bool, fp8_kv: bool,
                  quantization: str = "") -> str:
    """Within 1.25x of a ceiling no config of the same bytes and FLOPs per token gets far, but
    the ceiling binds the precision as well as the GPU: fp8 weights raise the bf16 FLOP ceiling
    of a card with fp8 tensor cores, and fp8 weights or an fp8 KV cache read fewer bytes under
    the bandwidth one. "Stop tuning" only where neither lever is left. At the ridge both
    ceilings bind. `quantization`: the config's method; another than fp8 (a 4-bit checkpoint's)
    reads fewer weight bytes than fp8 would."""
    at_ridge = ev.get("is_at_ridge") == 1.0
    is_flop = "compute_utilization" in ev and (
        (ev.get("compute_utilization") or 0.0) >= (ev.get("bandwidth_utilization") or 0.0)
        or at_ridge)
    if is_flop and not fp8_weights and ev.get("is_fp8_capable") == 1.0:
        # The bf16 ceiling is not this card's: its fp8 tensor cores run about twice it.
        return ("this is the bf16 FLOP ceiling's limit for this batch, not the GPU's: "
                "fp8 weights (quantization fp8) raise the ceiling on this GPU")
    bytes_levers = []
    if not is_flop or at_ridge:
        if not fp8_weights and not quantization:
            bytes_levers.append(("bf16 weights", "fp8 weights (quantization fp8)"))
        # fp8 KV halves only the KV part of the bytes: named where that part is worth it.
        if not fp8_kv and ev.get("kv_read_share", 1.0) >= 0.1:
            bytes_levers.append(("a bf16 KV cache", "an fp8 KV cache (kv_cache_dtype fp8)"))
    if bytes_levers:
        now = " and ".join(held for held, _ in bytes_levers)
        return (f"the bandwidth ceiling binds the bytes read, here of {now}: "
                + " or ".join(lever for _, lever in bytes_levers)
                + " read fewer bytes per token")
    return _ADVICE["at-physical-limit"]


def advice(verdict: Verdict, *,
           config: EngineConfig | Mapping[str, Any] | None = None) -> str:
    """What to do next, given the verdict; never what the config already does. `config` (an
    `EngineConfig` or its flags) adds what the verdict's evidence does not say (quantization
    method, memory utilisation, max_num_seqs); without it the evidence's fp8/eager facts rule
    out the levers already pulled."""
    flags: Mapping[str, Any] = {}
    if isinstance(config, EngineConfig):
        flags = config.flags
    elif config is not None:
        flags = config
    ev = verdict.evidence
    engine = EngineFlags(flags)
    quantization = engine.quantization
    fp8_weights = ev.get("is_fp8_weights") == 1.0 or engine.weights_are_fp8()
    fp8_kv = ev.get("is_fp8_kv") == 1.0 or engine.kv_cache_is_fp8
    # A card without fp8 tensor cores (SM < 8.9) has no fp8 lever: the built-in rule
    # fp8-needs-sm89 takes fp8 weights and KV out of its space, so none is advised.
    if ev.get("is_fp8_capable") == 0.0:
        fp8_weights = fp8_kv = True
    eager = ev.get("is_enforce_eager") == 1.0 or is_true(flags.get("enforce_eager") or False)
    # Prefix caching: the flags where they set it, else the verdict's fact, else vLLM's default.
    is_set = bool({"enable_prefix_caching", "no_enable_prefix_caching"} & set(flags))
    prefix_caching = is_prefix_caching(flags) if is_set or "is_prefix_caching" not in ev \
        else ev["is_prefix_caching"] == 1.0
    label = verdict.label
    if label == "unknown" and ev.get("is_unphysical") == 1.0:
        return "measure a longer window (more requests per level) to tell"
    if label == "at-physical-limit":
        return _limit_advice(ev, fp8_weights=fp8_weights, fp8_kv=fp8_kv,
                             quantization=quantization)
    if label == "launch-bound":
        if eager:
            return "keep CUDA graphs on"
        if (ev.get("num_runtime_jit_compiles") or 0) > 0:
            fix = ("use quantization fp8 (precompiled kernels) instead of "
                   f"{quantization}" if quantization.startswith("fp8_per") else
                   "warm up the shapes it serves or pick kernels that need no compile")
            return f"kernels were JIT-compiled while serving: {fix}"
        return "cut host overhead: CUDA graph capture sizes covering the batch, scheduling"
    if label == "compute-bound":
        # fp8 leaves the FLOPs per token as they are: it raises the ceiling, on fp8 tensor
        # cores only (an A100 runs fp8 weights' GEMMs in bf16, and its space has no fp8).
        if not fp8_weights and ev.get("is_fp8_capable") == 1.0:
            return ("raise the FLOP ceiling: fp8 weights (quantization fp8) run the GEMMs on "
                    "this GPU's fp8 tensor cores at about twice the bf16 rate, for the same "
                    "FLOPs per token")
        levers = [*_prefill_levers(prefix_caching), "or more GPUs (data_parallel_size)"]
        if not fp8_weights:  # the card's fp8 tensor cores not known: fp8 said conditionally
            return ("fewer prefill FLOPs: " + ", ".join(levers) + "; fp8 weights (quantization "
                    "fp8) raise the FLOP ceiling only on a GPU with fp8 tensor cores, which "
                    "this verdict does not say")
        return "only fewer prefill FLOPs help now: " + ", ".join(levers)
    if label == "memory-bound":
        levers = []
        if not fp8_weights:
            levers.append("fp8 weights (quantization fp8)")
        # fp8 KV halves only the KV part of the bytes: named where that part is worth it.
        if not fp8_kv and ev.get("kv_read_share", 1.0) >= 0.1:
            levers.append("an fp8 KV cache (kv_cache_dtype fp8)")
        if levers:
            return "read fewer bytes per token: " + " or ".join(levers)
        return _batch_advice(ev)
    if label == "compute-and-memory-bound":
        return _ridge_advice(ev, fp8_weights=fp8_weights, fp8_kv=fp8_kv,
                             prefix_caching=prefix_caching)
    if label == "kv-capacity-bound":
        levers = []
        if not fp8_kv:
            levers.append("kv_cache_dtype fp8")
        gmu = flags.get("gpu_memory_utilization")
        if gmu is None or float(gmu) < 0.95:
            levers.append("a higher gpu_memory_utilization")
        if not fp8_weights:
            levers.append("fp8 weights (more memory left for KV)")
        levers.append("a smaller max_num_seqs")
        return "give the KV cache room: " + ", ".join(levers)
    if label == "unknown" and ev.get("gpu_busy_fraction") is not None:
        return "compare kernel times with a faster config at this load"
    return _ADVICE[label]


def sentence(params_change: str | Mapping[str, Any], metric_change: str,
             verdict: Verdict, *, config: Mapping[str, Any] | None = None) -> str:
    """"change -> metric -> conclusion" in one line, e.g. `enforce_eager=True: TPOT p99 18.8 ms
    (+165% vs best): launch-bound (GPU busy 19% of the kernel span) at 9.9 req/s, the highest
    load that met the SLO; keep CUDA graphs on.` (the load where the verdict names one)."""
    change = params_change if isinstance(params_change, str) else ", ".join(
        f"{k}={v}" for k, v in params_change.items())
    head = f"{change}: " if change else ""
    metric = f"{metric_change}: " if metric_change else ""
    detail = f" ({verdict.detail})" if verdict.detail else ""
    load = f" at {verdict.load}" if verdict.load else ""
    # `config`: the trial's flags, so the advice knows what the verdict's evidence does not
    # (a 4-bit quantization method, a memory utilisation) and never offers what it already does.
    return f"{head}{metric}{verdict.label}{detail}{load}; {advice(verdict, config=config)}."
