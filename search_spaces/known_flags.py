"""The vLLM engine flags a search space may vary, by snake_case name: the domain a space may give
each (`KNOWN_FLAGS`), vLLM's value for each left unset (`vllm_default`: the release's flag table,
`search_spaces.engine`), and a config turned into engine flags (`to_flags`).

A space resolves against the release its caller states as plain data in `context["engine"]`
(a bundled table's or an installed parser's `VllmFlags.engine_facts()`): its flags, defaults and
value sets then win, and a flag it lacks is not searched; without it, the bundled table of
`DEFAULT_VERSION` (vLLM 0.26.0) states them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast

from search_spaces.engine.facts import FP8_ONLINE_QUANTIZATIONS, vllm_scheduler_defaults
from search_spaces.engine.render import bool_flag
from search_spaces.engine.tables import bundled_flags
from search_spaces.errors import SpaceError
from search_spaces.params import Value
from search_spaces.rules.builtin import model_default_len
from search_spaces.values import did_you_mean, is_number, is_scalar, lookup, show

FlagKind = Literal["bool", "int", "float", "enum"]
_INT_CEILING = 2**53  # larger ints lose precision in Optuna's float internal representation

# The values vLLM's table states for a choice flag, as `DEFAULT_VERSION` takes them.
_BASE = bundled_flags()
KV_CACHE_DTYPES = _BASE.types["kv-cache-dtype"].choices
DTYPES = _BASE.types["dtype"].choices
SCHEDULING_POLICIES = _BASE.types["scheduling-policy"].choices
# The table does not list these (--attention-backend takes a registry name, cudagraph_mode is a
# field of --compilation-config, --quantization's methods may come from a plugin): the values a
# space may search, each one vLLM 0.26 takes (the rules know what each needs).
ATTENTION_BACKENDS = ("auto", "FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION")
QUANTIZATIONS = ("none", *FP8_ONLINE_QUANTIZATIONS, "awq", "awq_marlin", "gptq", "gptq_marlin",
                 "bitsandbytes", "compressed-tensors")
CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
# Speculative methods that need no draft model (config/speculative.py:713-718); suffix also
# needs the optional arctic-inference package (config/speculative.py:1053), so no bundled
# space searches it.
SPEC_METHODS = ("none", "ngram", "ngram_gpu", "suffix")


@dataclass(frozen=True)
class FlagSpec:
    """The domain a space may give one engine flag (each value one vLLM takes)."""

    kind: FlagKind
    enum: tuple[str, ...] = ()
    low: float | None = None  # smallest valid value
    high: float | None = None  # largest valid value
    is_low_exclusive: bool = False
    no_flag: tuple[str, ...] = ()  # values that mean "pass no flag"
    is_categorical_only: bool = False  # only a few values are valid: rules drop the rest
    cli_name: str | None = None  # when the flag is not --<name> (nested config keys)


# Engine flags a space may search, by snake_case name, with the domain a space may give each;
# their defaults and negation are the flag table's (`vllm_default`, `to_flags`).
KNOWN_FLAGS: dict[str, FlagSpec] = {
    "attention_backend": FlagSpec("enum", ATTENTION_BACKENDS, no_flag=("auto",)),
    "kv_cache_dtype": FlagSpec("enum", KV_CACHE_DTYPES, no_flag=("auto",)),
    "quantization": FlagSpec("enum", QUANTIZATIONS, no_flag=("none",)),
    "dtype": FlagSpec("enum", DTYPES, no_flag=("auto",)),
    "tensor_parallel_size": FlagSpec("int", low=1, high=1024, is_categorical_only=True),
    "pipeline_parallel_size": FlagSpec("int", low=1, high=1024, is_categorical_only=True),
    "data_parallel_size": FlagSpec("int", low=1, high=1024, is_categorical_only=True),
    "max_num_batched_tokens": FlagSpec("int", low=1),
    "max_num_seqs": FlagSpec("int", low=1),
    "max_model_len": FlagSpec("int", low=1),
    "gpu_memory_utilization": FlagSpec("float", low=0.0, high=1.0, is_low_exclusive=True),
    "enforce_eager": FlagSpec("bool"),
    "block_size": FlagSpec("int", low=1, high=1024),
    "enable_prefix_caching": FlagSpec("bool"),
    "enable_chunked_prefill": FlagSpec("bool"),
    "max_num_partial_prefills": FlagSpec("int", low=1),
    "max_long_partial_prefills": FlagSpec("int", low=1),
    "long_prefill_token_threshold": FlagSpec("int", low=0),
    "cudagraph_mode": FlagSpec("enum", CUDAGRAPH_MODES,
                               cli_name="compilation_config.cudagraph_mode"),
    "max_cudagraph_capture_size": FlagSpec("int", low=1),
    "async_scheduling": FlagSpec("bool"),
    "scheduling_policy": FlagSpec("enum", SCHEDULING_POLICIES),
    "stream_interval": FlagSpec("int", low=1),
    "spec_method": FlagSpec("enum", SPEC_METHODS, no_flag=("none",)),
    "spec_tokens": FlagSpec("int", low=1),
    "cpu_offload_gb": FlagSpec("float", low=0.0, high=4096.0),  # GiB per GPU
    "kv_cache_memory_bytes": FlagSpec("int", low=1),
    "num_gpu_blocks_override": FlagSpec("int", low=1),
    "disable_custom_all_reduce": FlagSpec("bool"),
    "enable_expert_parallel": FlagSpec("bool"),
    "calculate_kv_scales": FlagSpec("bool"),
}

# Params whose vLLM default depends on the host (`vllm_default`).
HOST_DEFAULTS = ("max_num_batched_tokens", "max_num_seqs", "max_model_len")


def engine_key(name: str) -> str:
    """The flag a known param sets, as the engine's flag tables spell it: `max_num_seqs` ->
    `max-num-seqs`, `cudagraph_mode` -> `compilation-config.cudagraph_mode`."""
    head, dot, tail = (KNOWN_FLAGS[name].cli_name or name).partition(".")
    return head.replace("_", "-") + dot + tail


def engine_release(context: Mapping[str, Any]) -> tuple[str | None, frozenset[str] | None,
                                                  Mapping[str, Any], Mapping[str, Any]]:
    """The vLLM release the space resolves for, as the caller states it in `context["engine"]`
    (the optimizer passes the release's flag table as plain data, an installed parser's for a
    release no table is bundled for): its version, its flags (kebab-case; None: not stated,
    every known flag holds), its defaults and its value sets (flag -> allowed values, for a
    flag with a closed set). `engine.host_defaults` holds the release's scheduler defaults for
    the host (max_num_seqs, max_num_batched_tokens), read by `vllm_default`."""
    version, flags = lookup(context, "engine.vllm_version"), lookup(context, "engine.flags")
    defaults, choices = lookup(context, "engine.defaults"), lookup(context, "engine.choices")
    return (version if isinstance(version, str) else None,
            frozenset(flags) if isinstance(flags, list | tuple | set | frozenset) else None,
            defaults if isinstance(defaults, Mapping) else {},
            choices if isinstance(choices, Mapping) else {})


def _vllm_default(name: str, context: Mapping[str, Any]) -> Value:
    """What vLLM does with no flag, as a value of the param; None where only "no flag" says it
    (or vLLM decides at start-up). The release in `context["engine"]` states its own defaults;
    one it does not state, and every one without it, is the bundled table's of
    `DEFAULT_VERSION`. The host-dependent ones come from `engine.host_defaults` (the release's
    for this host), else from vLLM 0.26's rule for the context's GPU, and the model's context."""
    if name in HOST_DEFAULTS:
        host = lookup(context, "engine.host_defaults")
        if isinstance(host, Mapping) and is_number(host.get(name)):
            return cast(Value, host[name])
        if name == "max_model_len":
            return model_default_len(context)
        memory_gib = lookup(context, "hardware.gpu_memory_gib")
        gpu_name = lookup(context, "hardware.gpu_name")
        return vllm_scheduler_defaults(float(memory_gib) if is_number(memory_gib) else 0.0,
                                       gpu_name if isinstance(gpu_name, str) else "")[name]
    flag = KNOWN_FLAGS.get(name)
    if flag is None:
        return None
    _, _, engine_defaults, _ = engine_release(context)
    key = engine_key(name)
    value = (engine_defaults if key in engine_defaults else _BASE.defaults).get(key)
    if value is None:
        return flag.no_flag[0] if flag.no_flag else None
    return cast(Value, value) if is_scalar(value) else None


def vllm_default(name: str, context: Mapping[str, Any] | None = None) -> Value:
    """vLLM's value for a flag left unset (on the host `context` describes; of the release its
    `engine` states, else of `DEFAULT_VERSION`)."""
    return _vllm_default(name, context or {})


def value_problem(name: str, value: object) -> str | None:
    """Why `value` is not valid for the flag `name`, or None; None always is (no flag)."""
    flag = KNOWN_FLAGS[name]
    if value is None:
        return None
    if flag.kind == "bool":
        return None if isinstance(value, bool) else f"must be true or false but got {show(value)}"
    if flag.kind == "enum":
        if isinstance(value, str) and value in flag.enum:
            return None
        return (f"must be one of {', '.join(flag.enum)} but got {show(value)}"
                f"{did_you_mean(value, flag.enum)}")
    if flag.kind == "int" and not (isinstance(value, int) and not isinstance(value, bool)):
        return f"must be an integer but got {show(value)}"
    if not is_number(value):
        return f"must be a finite number but got {show(value)}"
    number = cast(float, value)
    low = flag.low
    high = flag.high if flag.high is not None else (_INT_CEILING if flag.kind == "int" else 1e15)
    if low is not None and (number < low or (flag.is_low_exclusive and number == low)):
        relation = ">" if flag.is_low_exclusive else ">="
        return f"must be {relation} {low:g} but got {show(value)}"
    if number > high:
        return f"must be <= {high:g} but got {show(value)}"
    return None


def to_flags(params: Mapping[str, Value],
             defaults: Mapping[str, Value] | None = None) -> dict[str, Value]:
    """Engine flags by snake_case name, dropping values that mean "pass no flag".

    None, `none`/`auto` and a boolean equal to vLLM's default are dropped; a boolean whose vLLM
    default is true becomes `no_<name>: True` (`engine.render.bool_flag`), since a YAML `false`
    is silently ignored by vLLM.
    Nested config keys come out dotted (`compilation_config.cudagraph_mode`). The caller adds
    `--` and kebab-case at the process boundary. `defaults`: the release's (a resolved space's
    `vllm_defaults`); without, the bundled table's of `DEFAULT_VERSION`.
    """
    flags: dict[str, Value] = {}
    for name, value in params.items():
        flag = KNOWN_FLAGS.get(name)
        if flag is None:
            raise SpaceError(f"to_flags: {show(name)} is not a known vLLM 0.26 engine flag"
                             f"{did_you_mean(name, KNOWN_FLAGS)}.")
        if value is None or (isinstance(value, str) and value in flag.no_flag):
            continue
        if isinstance(value, bool):
            # None: decided at start-up (async_scheduling)
            default = vllm_default(name) if defaults is None else defaults.get(name)
            if default is not None and value == default:
                continue
            # The table's rule: a boolean whose default is on or decided at start-up says its
            # False as `--no-<flag>`.
            flags.update(bool_flag(name, value, is_negatable=default is not False))
            continue
        flags[flag.cli_name or name] = value
    return flags
