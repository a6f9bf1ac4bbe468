"""The built-in rules: what vLLM rejects or crashes on (each with where vLLM says so; a
max_model_len below the workload's longest request among them), values the study's workload
cannot tell apart (a capture size above its concurrency, a prefill threshold above its longest
prompt), and the measured known facts (`known_fact_rules`); tuning opinions belong in the YAML
files (docs/knobs.md). vLLM's own facts (fp8 KV dtypes, which quantization a checkpoint takes)
are asked of `search_spaces.engine.facts`."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from search_spaces.engine.facts import (
    CHECKPOINT_QUANTIZATIONS,
    FP8_ONLINE_QUANTIZATIONS,
    ON_THE_FLY_QUANTIZATIONS,
    kv_cache_is_fp8,
)
from search_spaces.known_facts import KnownFact, applicable, bundled_facts
from search_spaces.params import ParamSpec
from search_spaces.rules.rule import Condition, Rule
from search_spaces.values import MISSING, contains, is_number, lookup

StaticBuiltin = Callable[[Mapping[str, Any], Mapping[str, ParamSpec]], "Rule | None"]


def _tp_fits_gpus(context: Mapping[str, Any], specs: Mapping[str, ParamSpec]) -> Rule | None:
    num_gpus = lookup(context, "hardware.num_gpus")
    if not is_number(num_gpus):
        return None
    # A host without a GPU still resolves to 1: the simulated engine runs single-GPU configs.
    cap = max(1, int(num_gpus))
    return Rule(
        name="parallel-sizes-fit-gpus",
        reason=f"vLLM needs one GPU per rank and this host has {int(num_gpus)}",
        when=(), action="max", is_builtin=True,
        targets=tuple((p, cap) for p in
                      ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")),
    )


def _remove_choices_by(
    context: Mapping[str, Any], specs: Mapping[str, ParamSpec], bound_key: str, param: str,
    pick: Callable[[Sequence[Any], float], Sequence[Any]], *, name: str, reason: str,
) -> Rule | None:
    """The `remove` rule for the choices of the categorical `param` that `pick` finds out of
    bounds against the context's number at `bound_key`, `reason` naming it as `{bound}`; None
    where that number is not known, `param` is not categorical, or `pick` finds none."""
    bound = lookup(context, bound_key)
    spec = specs.get(param)
    if not is_number(bound) or spec is None or spec.type != "categorical":
        return None
    bad = tuple(pick(spec.choices, bound))
    if not bad:
        return None
    return Rule(name=name, reason=reason.format(bound=int(bound)), when=(), action="remove",
                targets=((param, bad),), is_builtin=True)


def _tp_divides_heads(context: Mapping[str, Any], specs: Mapping[str, ParamSpec]) -> Rule | None:
    return _remove_choices_by(
        context, specs, "model.num_attention_heads", "tensor_parallel_size",
        lambda choices, heads: () if heads <= 0 else [
            c for c in choices if isinstance(c, int) and not isinstance(c, bool) and c > 0
            and heads % c],
        name="tp-divides-attention-heads",
        reason="vLLM shards attention heads evenly; the model has {bound} heads")


def _quantization_matches_checkpoint(
    context: Mapping[str, Any], specs: Mapping[str, ParamSpec]
) -> Rule | None:
    method = lookup(context, "model.quant_method")
    spec = specs.get("quantization")
    if method is MISSING or spec is None or spec.type != "categorical":
        return None
    if method:
        allowed = CHECKPOINT_QUANTIZATIONS.get(str(method), (str(method),))
        reason = (f"the checkpoint is pre-quantized ({method}): vLLM accepts only its own "
                  "method, and on-the-fly fp8 needs bf16 weights")
    else:
        allowed = ON_THE_FLY_QUANTIZATIONS
        reason = ("awq, gptq and compressed-tensors read pre-quantized weights and this "
                  "checkpoint has none")
    bad = tuple(c for c in spec.choices
                if isinstance(c, str) and c != "none" and c not in allowed)
    if not bad:
        return None
    return Rule(name="quantization-matches-checkpoint", reason=reason, when=(), action="remove",
                targets=(("quantization", bad),), is_builtin=True)


def _fp8_needs_sm89(context: Mapping[str, Any], specs: Mapping[str, ParamSpec]) -> Rule | None:
    kv = specs.get("kv_cache_dtype")
    fp8_kv = tuple(c for c in (kv.choices if kv is not None else ()) if kv_cache_is_fp8(c))
    return Rule(
        name="fp8-needs-sm89",
        reason="fp8 KV cache and fp8 weights need fp8 tensor cores (SM 8.9+, Ada or Hopper)",
        when=(Condition("hardware.compute_capability", "lt", 8.9),),
        action="remove", is_builtin=True,
        targets=(("kv_cache_dtype", fp8_kv), ("quantization", FP8_ONLINE_QUANTIZATIONS)),
    )


def model_context_len(context: Mapping[str, Any]) -> int | None:
    """The context vLLM derives for the model, the largest max_model_len it accepts, tokens:
    `model.max_model_len` where the context has that key (None there: not known), else
    `model.max_position_embeddings`; None where neither is known."""
    model = context.get("model")
    has_key = isinstance(model, Mapping) and "max_model_len" in model
    value = lookup(context, "model.max_model_len" if has_key else
                   "model.max_position_embeddings")
    return int(value) if is_number(value) else None


def model_default_len(context: Mapping[str, Any]) -> int | None:
    """vLLM's max_model_len with none given, tokens: `model.default_max_model_len` where the
    context has that key (a LongRoPE model's original length, below its derived context;
    None there: not known), else the derived context (`model_context_len`)."""
    model = context.get("model")
    if isinstance(model, Mapping) and "default_max_model_len" in model:
        value = model["default_max_model_len"]
        return int(value) if is_number(value) else None
    return model_context_len(context)


def _max_model_len_within_model(
    context: Mapping[str, Any], specs: Mapping[str, ParamSpec]
) -> Rule | None:
    limit = model_context_len(context)
    if limit is None:
        return None
    return Rule(
        name="max-model-len-within-model",
        reason=f"vLLM rejects a max_model_len above the {int(limit)} tokens it derives from the "
               "model's config.json",
        when=(), action="max", targets=(("max_model_len", int(limit)),), is_builtin=True,
    )


def _is_sm90(context: Mapping[str, Any]) -> bool | None:
    capability = lookup(context, "hardware.compute_capability")
    if not is_number(capability):
        return None
    return bool(9.0 <= capability < 10.0)


def _flash_attn_no_e5m2(context: Mapping[str, Any], specs: Mapping[str, ParamSpec]) -> Rule | None:
    backend, kv = specs.get("attention_backend"), specs.get("kv_cache_dtype")
    if not _is_sm90(context) or backend is None or kv is None:
        return None
    if not contains(backend.choices, "FLASH_ATTN") or not contains(kv.choices, "fp8_e5m2"):
        return None
    # Off SM90 the conditional rule below fixes the KV dtype for FLASH_ATTN instead; here fp8
    # (e4m3) stays valid with FA3, and a choice cannot be dropped for one backend only.
    return Rule(
        name="flash-attn-no-fp8-e5m2",
        reason="FLASH_ATTN never takes fp8_e5m2; search e5m2 in a space without FLASH_ATTN",
        when=(), action="remove", targets=(("kv_cache_dtype", ("fp8_e5m2",)),), is_builtin=True,
    )


def _numbers_above_cover(choices: Sequence[Any], bound: float) -> tuple[Any, ...]:
    """The numeric choices above the smallest one that is >= `bound` (all of them cover it)."""
    numbers = sorted(c for c in choices if is_number(c) and not isinstance(c, bool))
    cover = next((c for c in numbers if c >= bound), None)
    return () if cover is None else tuple(c for c in numbers if c > cover)


def _capture_within_concurrency(
    context: Mapping[str, Any], specs: Mapping[str, ParamSpec]
) -> Rule | None:
    # A decode step holds at most one token per running request (without speculative tokens),
    # so a decode batch never exceeds the concurrency; the sizes above the first choice that
    # covers it only add graphs for mixed prefill batches, at capture time and memory.
    return _remove_choices_by(
        context, specs, "workload.max_concurrency", "max_cudagraph_capture_size",
        _numbers_above_cover, name="capture-size-within-concurrency",
        reason="the workload runs at most {bound} requests at once, so no decode batch needs "
               "a larger CUDA graph; one capture size covering it is kept")


def _threshold_within_prompts(
    context: Mapping[str, Any], specs: Mapping[str, ParamSpec]
) -> Rule | None:
    # vLLM 0.26 caps a request's tokens per step at the threshold only when 0 < threshold <
    # the tokens left to prefill (v1/core/sched/scheduler.py:507 and :861).
    return _remove_choices_by(
        context, specs, "workload.max_prompt_tokens", "long_prefill_token_threshold",
        lambda choices, longest: [
            c for c in choices if isinstance(c, int | float) and not isinstance(c, bool)
            and c > 0 and c >= longest],
        name="prefill-threshold-below-longest-prompt",
        reason="the longest prompt is {bound} tokens; a threshold at or above it never splits "
               "a prefill and runs as 0 (off)")


def _max_model_len_covers_requests(
    context: Mapping[str, Any], specs: Mapping[str, ParamSpec]
) -> Rule | None:
    # vLLM 0.26 answers HTTP 400 to a request whose prompt is over max_model_len less its
    # max_tokens (renderers/params.py:428, `_token_len_check`): every request of such a trial
    # fails. None (no flag: vLLM's own length) is not a number and stays.
    return _remove_choices_by(
        context, specs, "workload.max_request_tokens", "max_model_len",
        lambda choices, longest: [
            c for c in choices if is_number(c) and not isinstance(c, bool) and c < longest],
        name="max-model-len-covers-requests",
        reason="the longest request is {bound} tokens (prompt plus output); vLLM refuses a "
               "request longer than max_model_len")


def known_fact_rules(context: Mapping[str, Any], specs: Mapping[str, ParamSpec]) -> list[Rule]:
    """One `remove` rule per measured fact (search_spaces/known_facts.py) that holds for the
    context's hardware class and vLLM version and names a value of the space. The context's
    `known_facts` (the bundled and the user's, as the runtime loads them) stands in for the
    bundled table; `known_facts_ignore` lists the ids the study file overrides."""
    given = context.get("known_facts")
    facts: tuple[KnownFact, ...] = tuple(given) if given is not None else bundled_facts()
    rules = []
    for fact in applicable(facts, context, tuple(context.get("known_facts_ignore") or ())):
        spec = specs.get(fact.param)
        if fact.effect != "exclude" or spec is None or spec.type != "categorical" or \
                not contains(spec.choices, fact.value):
            continue
        evidence = fact.evidence.get("figures") or fact.evidence.get("study") or "measured"
        rules.append(Rule(
            name=f"known-fact:{fact.id}",
            reason=f"measured pathological on {fact.hardware_class} with vLLM "
                   f"{fact.vllm_version}: {evidence} ({fact.source}; a study file's "
                   f"known_facts.ignore overrides it)",
            when=(), action="remove", targets=((fact.param, (fact.value,)),), is_builtin=True))
    return rules


STATIC_BUILTINS: tuple[StaticBuiltin, ...] = (
    _tp_fits_gpus,
    _tp_divides_heads,
    _quantization_matches_checkpoint,
    _fp8_needs_sm89,
    _max_model_len_within_model,
    _flash_attn_no_e5m2,
    _capture_within_concurrency,
    _threshold_within_prompts,
    _max_model_len_covers_requests,
)

# (reader, target): conditional built-ins fix `target` from `reader`, so it must come first.
BUILTIN_ORDER: tuple[tuple[str, str], ...] = (
    ("tensor_parallel_size", "data_parallel_size"),
    ("attention_backend", "kv_cache_dtype"),
    ("enforce_eager", "cudagraph_mode"),
    ("spec_method", "spec_tokens"),
)


# Built-ins that unset a child param while its parent is off: a config that turns the parent on
# sets the child too, as one change (`PARAM_PARENTS`, which a report's one-knob table reads).
_CHILD_RULES: tuple[Rule, ...] = (
    Rule(
        name="spec-tokens-need-a-method",
        reason="vLLM rejects --spec-tokens without a speculative method "
               "(config/speculative.py:730)",
        when=(Condition("params.spec_method", "eq", "none"),),
        action="fix", targets=(("spec_tokens", None),), is_builtin=True,
    ),
)
# child -> parent: a param that exists only with its parent set.
PARAM_PARENTS: dict[str, str] = {target: rule.when[0].param for rule in _CHILD_RULES
                                 for target, _ in rule.targets}


def conditional_builtins(context: Mapping[str, Any]) -> list[Rule]:
    rules = [
        Rule(
            name="flex-attention-no-fp8-kv",
            reason="FLEX_ATTENTION takes no fp8 KV cache",
            when=(Condition("params.attention_backend", "eq", "FLEX_ATTENTION"),),
            action="fix", targets=(("kv_cache_dtype", "auto"),), is_builtin=True,
        ),
        Rule(
            name="eager-means-no-cudagraphs",
            reason="--enforce-eager turns CUDA graphs off, so cudagraph_mode has no effect",
            when=(Condition("params.enforce_eager", "eq", True),),
            action="fix", targets=(("cudagraph_mode", "NONE"),), is_builtin=True,
        ),
        *_CHILD_RULES,
    ]
    num_gpus = lookup(context, "hardware.num_gpus")
    if is_number(num_gpus) and num_gpus >= 1:
        # A replica is TP GPUs; once TP takes more than half the host, one replica is all that
        # fits. (Smaller TPs with too many replicas are refused before launch, as any config
        # needing more GPUs than the host has.)
        rules.append(Rule(
            name="replicas-fit-gpus",
            reason=f"each data-parallel replica needs tensor_parallel_size GPUs and this host "
                   f"has {int(num_gpus)}",
            when=(Condition("params.tensor_parallel_size", "gt", num_gpus / 2),),
            action="fix", targets=(("data_parallel_size", 1),), is_builtin=True,
        ))
    if _is_sm90(context) is False:
        rules.insert(0, Rule(
            name="flash-attn-fp8-kv-needs-sm90",
            reason="FLASH_ATTN takes an fp8 KV cache only with FA3, which runs on SM90 only",
            when=(Condition("params.attention_backend", "eq", "FLASH_ATTN"),),
            action="fix", targets=(("kv_cache_dtype", "auto"),), is_builtin=True,
        ))
    return rules


def builtin_names() -> set[str]:
    names = {"parallel-sizes-fit-gpus", "tp-divides-attention-heads",
             "quantization-matches-checkpoint", "fp8-needs-sm89", "max-model-len-within-model",
             "flash-attn-no-fp8-e5m2", "default-outside-space", "replicas-fit-gpus",
             "capture-size-within-concurrency", "prefill-threshold-below-longest-prompt",
             "max-model-len-covers-requests"}
    names.update(r.name for r in conditional_builtins({"hardware.compute_capability": 8.0}))
    return names
