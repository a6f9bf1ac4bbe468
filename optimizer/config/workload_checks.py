"""What `nightshift start` (and each case of `nightshift regress`) checks of the workload before
it writes or starts anything: its levels reach the load they are labelled with, the tokenizer and
the model read, and the longest request fits the model's context (each problem one
`ConfigError` line)."""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

from optimizer.config.fields import MAX_SECONDS
from optimizer.config.loading import engine_env
from optimizer.config.workload_file_checks import (
    check_dataset_file,
    check_prompts_file,
    check_trace_file,
)
from optimizer.config.workload_spec import LengthSpec, WorkloadSpec
from optimizer.errors import ConfigError, one_line, translate

if TYPE_CHECKING:
    from optimizer.config.loading import StudyConfig
    from runners.model_info import ModelInfo
    from runners.tokenizer import PromptTokenizer


def unreached_concurrency_problem(w: WorkloadSpec) -> str | None:
    """Why a level's concurrency is a load it never applies, or None: without duration_s each
    of num_requests requests is sent once, so fewer requests than the concurrency never put
    that many in flight, yet its figures would be labelled with it. A rate's concurrency is a
    cap (never broken by fewer requests); a trace or a capacity search sets its own load."""
    if w.duration_s is not None or w.trace is not None or w.capacity is not None or \
            w.num_requests is None:
        return None
    for index, level in enumerate(w.levels):
        if level.request_rate is None and level.concurrency is not None and \
                w.num_requests < level.concurrency:
            which = f"levels[{index}]" if "levels" in w.model_fields_set else \
                "the default level"
            return (f"workload.num_requests: {w.num_requests} requests, each sent once, never "
                    f"reach {which}'s concurrency of {level.concurrency}; raise "
                    f"num_requests to at least {level.concurrency} (a p99 wants many more), "
                    "lower that concurrency, or set duration_s")
    return None


def check_workload(cfg: StudyConfig) -> None:
    """The workload's part of `check_before_start` (also each case of `nightshift regress`):
    the tokenizer, the prompts file, trace or dataset read as the runner reads them, and the
    longest request within the model's context. Raises ConfigError (one line)."""
    model = _check_model_config(cfg)
    vocab_size = model.vocab_size if model is not None and model.is_vocab_size_given else None
    tokenizer = _check_tokenizer(cfg)
    w = cfg.spec.workload
    longest_prompt = _longest_drawn(w.input_len)
    longest_output = _longest_drawn(w.output_len)
    if cfg.prompts_file is not None:
        longest_prompt, longest_output = check_prompts_file(
            cfg.prompts_file, cfg.source_name, tokenizer, longest_output, vocab_size)
    if cfg.trace_file is not None and w.trace is not None:
        longest_prompt, longest_output, arrivals = check_trace_file(
            cfg.trace_file, w.trace.timestamp_unit_s, cfg.source_name,
            max_gap_s=w.trace.max_gap_s, has_shared_prefix=w.shared_prefix is not None,
            has_tokenizer=tokenizer is not None, vocab_size=vocab_size)
        _check_replay_span(cfg, arrivals)
    if cfg.dataset_file is not None:
        workload = cfg.workload
        assert workload.dataset is not None
        check_dataset_file(workload.dataset, cfg.source_name, tokenizer)
        # A request's whole context (a multi-turn conversation's too) stays within the
        # dataset's max_total_len.
        longest_prompt = workload.dataset.max_total_len - w.output_len.longest
    elif w.multi_turn is not None:
        if tokenizer is None:
            raise ConfigError(
                f"{cfg.source_name}: workload.multi_turn: synthesised turns are text of drawn "
                f"token lengths and need the model's tokenizer, but {cfg.spec.model.path!r:.80} "
                "has no tokenizer.json here; use a model directory with one or give "
                "workload.dataset.")
        # The last turn carries every earlier message and reply: the longest sum of n drawn
        # prompts and n - 1 drawn replies (not n times the longest draw of each).
        turns = w.multi_turn.num_turns
        longest_prompt = _longest_sum(w.input_len, turns) + \
            _longest_sum(w.output_len, turns - 1)
    if w.shared_prefix is not None:
        longest_prompt += w.shared_prefix.tokens
    _check_fits_model(cfg, model, longest_prompt, longest_output)


_TAIL_SIGMAS = 4.0  # a draw beyond this many sigmas: about 3 in 100,000


def _is_unbounded(spec: LengthSpec) -> bool:
    """A normal or lognormal length without `high`: its draws have no bound but its tail."""
    return spec.high is None and spec.std > 0 and spec.kind in ("normal", "lognormal")


def _longest_drawn(spec: LengthSpec) -> int:
    """The longest length a workload draws in practice: `high` where set; a normal or
    lognormal without it has no bound, so its 4-sigma tail (the loadgen's clip to `high` is
    the way to bound it); else the mean."""
    if not _is_unbounded(spec):
        return spec.longest
    if spec.kind == "normal":
        return math.ceil(spec.mean + _TAIL_SIGMAS * spec.std)
    # lognormal: the loadgen's sigma of the log, its mu keeping `mean` the mean.
    mu = math.log(spec.mean) - spec.std ** 2 / 2
    return math.ceil(math.exp(min(mu + _TAIL_SIGMAS * spec.std, 700.0)))


def _longest_sum(spec: LengthSpec, count: int) -> int:
    """The longest total of `count` independent draws in practice: `count` x the longest
    draw where the draws are bounded (`high`, fixed); an unbounded normal or lognormal's sum
    to its 4-sigma tail (mean x n + 4 sigma sqrt(n), sigma in tokens), which one draw's
    4-sigma tail n times over would far exceed."""
    if count <= 0:
        return 0
    one = _longest_drawn(spec)
    if not _is_unbounded(spec):
        return count * one
    std = spec.std if spec.kind == "normal" else \
        spec.mean * math.sqrt(math.expm1(min(spec.std ** 2, 700.0)))
    return min(count * one, math.ceil(count * spec.mean + _TAIL_SIGMAS * std * math.sqrt(count)))


def _check_model_config(cfg: StudyConfig) -> ModelInfo | None:
    """The model's shape from its config.json, where there is one here (None for a hub id);
    ConfigError where it does not read as a decoder's."""
    from runners.model_info import load_model_info

    try:
        return load_model_info(cfg.spec.model.path)
    except ValueError as exc:
        raise translate(exc, f"{cfg.source_name}: model.path: {one_line(exc)}.",
                        into=ConfigError) from exc


def _check_tokenizer(cfg: StudyConfig) -> PromptTokenizer | None:
    from runners.tokenizer import load_tokenizer

    try:
        return load_tokenizer(cfg.tokenizer_dir)
    except ValueError as exc:
        raise translate(exc, f"{cfg.source_name}: model.path: {one_line(exc)}.",
                        into=ConfigError) from exc


def _check_replay_span(cfg: StudyConfig, arrivals_s: list[float]) -> None:
    """A trace's replay, as recorded x time_scale or at each level's mean rate, sends its
    requests within the day a level may take (the load generator sleeps between arrivals)."""
    w = cfg.spec.workload
    if w.trace is None:
        return
    replayed = arrivals_s[:w.num_requests] if "num_requests" in w.model_fields_set \
        else arrivals_s
    if len(replayed) < 2:
        return
    if "levels" in w.model_fields_set:
        spans = [(f"levels[{i}].request_rate {lv.request_rate:g}",
                  (len(replayed) - 1) / lv.request_rate)
                 for i, lv in enumerate(w.levels) if lv.request_rate]
    else:
        spans = [(f"trace.time_scale {w.trace.time_scale:g}",
                  (replayed[-1] - replayed[0]) / w.trace.time_scale)]
    for what, span_s in spans:
        if span_s > MAX_SECONDS:
            raise ConfigError(
                f"{cfg.source_name}: workload.trace: replayed at {what}, its {len(replayed)} "
                f"requests take {span_s / 3600:,.0f} h to send, over the {MAX_SECONDS / 3600:g} "
                "h a level may take; check trace.timestamp_unit_s (0.001 for milliseconds), "
                "replay it faster or replay fewer requests (num_requests).")


def _human_int(value: object) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT]?)", value)
        if m:
            scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
                     "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[m.group(2)]
            return int(float(m.group(1)) * scale)
    return None


def _check_fits_model(cfg: StudyConfig, model: ModelInfo | None, longest_prompt: int,
                      longest_output: int) -> None:
    """A request's prompt and output must fit the engine's context (vLLM refuses it otherwise,
    and every request of every trial would fail)."""
    fixed = _human_int(cfg.spec.fixed_flags.get("max_model_len"))
    derived = model.derived_max_model_len if model is not None else None
    if model is not None and derived is not None and fixed is not None and fixed > derived and \
            engine_env(cfg, "VLLM_ALLOW_LONG_MAX_MODEL_LEN", "0").strip().lower() \
            not in ("1", "true"):
        raise ConfigError(
            f"{cfg.source_name}: fixed_flags.max_model_len: {fixed} is over the "
            f"{derived} tokens vLLM derives from {model.name}'s "
            "config.json, and vLLM refuses to start with it; lower it, or set env "
            "VLLM_ALLOW_LONG_MAX_MODEL_LEN: '1' if the model is known to hold longer contexts "
            "(RoPE positions past its own give NaNs).")
    raise_it = "raise fixed_flags.max_model_len"
    if fixed is not None and fixed > 0:
        limit, why = fixed, "fixed_flags.max_model_len"
    elif model is None or derived is None:
        return  # a hub id, or a config.json whose length Transformers fills: not known here
    elif model.longrope_default_len is not None and model.longrope_default_len < derived:
        limit = model.longrope_default_len
        why = (f"vLLM's default for {model.name}, a LongRoPE model: its "
               "original_max_position_embeddings")
        raise_it = f"set fixed_flags.max_model_len (up to {derived}, its long context)"
    else:
        limit, why = derived, f"the context vLLM derives from {model.name}'s config.json"
    longest = longest_prompt + longest_output
    if longest > limit:
        raise ConfigError(
            f"{cfg.source_name}: workload: a prompt of up to {longest_prompt} tokens plus an "
            f"output of up to {longest_output} is {longest} tokens, over "
            f"the max_model_len of {limit} ({why}); shorten input_len/output_len (a normal "
            f"or lognormal length without `high` counts its 4-sigma tail: set `high`) or "
            f"{raise_it}.")
