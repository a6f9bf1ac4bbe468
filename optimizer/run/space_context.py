"""What a search space's rules read (`space_context`): the host, the model, the vLLM release,
whether the weights are real, the workload's shape (`workload_facts`) and the measured facts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from runners.hardware import HardwareProfile
from runners.model_info import ModelInfo
from runners.workload import LengthDistribution, Workload
from search_spaces.engine.facts import vllm_scheduler_defaults
from search_spaces.engine.tables import VllmFlags
from search_spaces.known_facts import KnownFact


def space_context(hardware: HardwareProfile, model: ModelInfo | None,
                  workload: Workload | None = None,
                  load_format: str | None = None,
                  table: VllmFlags | None = None, *, vllm_version: str | None = None,
                  known_facts: Sequence[KnownFact] | None = None,
                  ignore_facts: Sequence[str] = ()) -> dict[str, Any]:
    """What the space's rules read: the host, the model, the vLLM release (`table`: its flags,
    defaults and value sets; `vllm_version`: the engine's version string), (from the study
    file) whether the weights are real and the workload's shape, and the measured facts
    (search_spaces/known_facts.py; the bundled ones where `known_facts` is None) less the ids
    the study file ignores; a fact left out makes a rule on it not apply."""
    hw = {"num_gpus": hardware.num_gpus, "compute_capability": hardware.compute_capability,
          "gpu_memory_gib": hardware.gpu_memory_gib, "interconnect": hardware.interconnect,
          "hardware_class": hardware.hardware_class, "gpu_name": hardware.gpu_name}
    mdl: dict[str, Any] = {}
    if model is not None:
        mdl = {"num_attention_heads": model.num_attention_heads,
               "num_key_value_heads": model.num_key_value_heads,
               "quant_method": model.quant_method,
               "max_position_embeddings": model.max_position_embeddings,
               "max_model_len": model.derived_max_model_len,
               "default_max_model_len": model.longrope_default_len or
               model.derived_max_model_len,
               "num_params": model.num_params}
    if load_format is not None:
        mdl["real_weights"] = load_format != "dummy"
    context: dict[str, Any] = {"hardware": hw, "model": mdl}
    if table is not None:
        context["engine"] = {**table.engine_facts(), "host_defaults": vllm_scheduler_defaults(
            hardware.gpu_memory_gib, hardware.gpu_name, table.version,
            hardware.compute_capability)}
    if workload is not None:
        context["workload"] = workload_facts(workload)
    if vllm_version is not None:
        context["engine"] = {**context.get("engine", {}), "vllm_version": vllm_version}
    if known_facts is not None:
        context["known_facts"] = tuple(known_facts)
    if ignore_facts:
        context["known_facts_ignore"] = tuple(ignore_facts)
    return context


def workload_facts(workload: Workload) -> dict[str, Any]:
    """The workload's shape as the rules read it; a fact the study file does not settle is left
    out (a prompts file may share a system prompt; a rate without a cap has no concurrency)."""
    facts: dict[str, Any] = {}
    if workload.capacity is not None:
        concurrency = workload.capacity.high if workload.capacity.axis == "concurrency" else None
    else:
        caps = [lv.max_concurrency for lv in workload.levels]
        concurrency = None if any(c is None for c in caps) else max(
            (c for c in caps if c), default=None)
    if concurrency is not None:
        facts["max_concurrency"] = concurrency
    shared = workload.shared_prefix
    if shared is not None and shared.fraction > 0 and shared.num_tokens >= 16:
        facts["shares_prefix"] = True  # a system prompt of at least one KV block
    elif workload.multi_turn is not None:
        facts["shares_prefix"] = True  # each turn carries the conversation so far
    elif workload.prompts_file is None and workload.trace is None and workload.dataset is None:
        # Synthesised prompts are random: no two share a prefix the cache could reuse. A file,
        # a trace or a dataset may (a shared system prompt): left unknown.
        facts["shares_prefix"] = False
    if workload.prompts_file is None and workload.trace is None and workload.dataset is None \
            and workload.multi_turn is None:
        longest = _longest(workload.input_len)
        if longest is not None:
            facts["max_prompt_tokens"] = longest + (shared.num_tokens if shared else 0)
            output = _longest(workload.output_len)
            if output is not None:
                # vLLM refuses a request whose prompt plus max_tokens exceeds max_model_len.
                facts["max_request_tokens"] = facts["max_prompt_tokens"] + output
    return facts


def _longest(dist: LengthDistribution) -> int | None:
    """The longest length `dist` draws: a fixed length, else its `high` (the load generator
    clips to it); None for a normal or lognormal without `high` (its tail has no bound)."""
    return dist.mean if dist.kind == "fixed" else dist.high
