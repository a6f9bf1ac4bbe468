"""What `vllm serve`'s start-up log says about the engine (`parse_log`), and why it died when it
did (`classify_failure`): pure functions of the log text, tested on real logs.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from runners.base import EngineInfo, Failure, FailureReason, Phase

# Start-up log. Every pattern is searched anywhere in a line, so the process prefixes vLLM adds
# (`(EngineCore_DP0 pid=123) INFO 12-02 13:20:01 [gpu_worker.py:123] `) do not matter. The first
# occurrence wins: with tensor parallelism every rank prints the same figures.

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_NUM = r"(-?[\d,]*\.?\d+)"

_BACKEND_PATTERNS = (
    re.compile(r"Using (\w+) attention backend out of potential backends"),
    re.compile(r"Using AttentionBackendEnum\.(\w+) backend"),  # ~0.11-0.12
    re.compile(r"Using (Flash Attention|FlashInfer|Triton) backend on V1 engine"),  # ~0.8-0.10
)
_OLD_BACKEND_NAMES = {"Flash Attention": "FLASH_ATTN", "FlashInfer": "FLASHINFER",
                      "Triton": "TRITON_ATTN"}
_MODEL_LOADING = re.compile(
    rf"Model loading took {_NUM} GiB(?: memory)? and {_NUM} seconds")
_KV_MEMORY = re.compile(rf"Available KV cache memory: {_NUM} GiB")
_KV_TOKENS = re.compile(r"GPU KV cache size: ([\d,]+) tokens")
_CONCURRENCY = re.compile(rf"Maximum concurrency for ([\d,]+) tokens per request: {_NUM}x")
_GRAPHS = re.compile(rf"Graph capturing finished in {_NUM} secs?(?:, took {_NUM} GiB)?")
_INIT_ENGINE = re.compile(
    rf"init engine \(.*?\) took {_NUM} s(?:econds)?(?: \(compilation: {_NUM} s)?")
_TORCH_COMPILE = re.compile(rf"torch\.compile (?:takes|took) {_NUM} s in total")
_MAX_MODEL_LEN = re.compile(r"Using max model len ([\d,]+)")
# vLLM 0.26's JIT monitor (vllm/utils/jit_monitor.py), active after warm-up: one warning per
# kernel compiled during inference ("Triton kernel JIT compilation during inference: NAME."),
# and Triton's own line for each autotuning it then runs.
_RUNTIME_JIT = re.compile(r"JIT compilation during inference: (\S+?)\.?(?: |$)", re.MULTILINE)
_RUNTIME_AUTOTUNE = re.compile(r"Triton autotuning for function (\w+)")
_JIT_MONITOR_ON = "Kernel JIT monitor activated"
# The compile cache (vLLM 0.26, docs/startup-cost.md): a warm start loads the AOT artefact
# (compilation/decorators.py:312) or, without AOT, each range's graph (backends.py:293);
# a cold one compiles a range (backends.py:394), saves a new AOT artefact (decorators.py:708) or
# recompiles after a failed load (decorators.py:322). Eager mode says so (config/vllm.py:1163).
_CACHE_WARM = re.compile(r"Directly load AOT compilation from path|"
                         r"Directly load the compiled graph")
_CACHE_COLD = re.compile(r"Compiling a graph for (?:compile range|dynamic shape)|"
                         r"saved AOT compiled function to|Compiling model again due to a load "
                         r"failure")
_NO_COMPILE = re.compile(r"disabling torch\.compile")  # config/vllm.py:1164 and :1172
# vLLM's own key, the directory it used: the AOT one where AOT compile is on (decorators.py:541,
# the default with torch >= 2.10), else the backbone's (backends.py:1064).
_AOT_DIR = re.compile(r"torch_compile_cache/torch_aot_compile/([0-9a-f]{64})")
_CACHE_DIR = re.compile(r"torch_compile_cache/([0-9a-f]{10})/")
_ASYNC_SCHEDULING = re.compile(r"Asynchronous scheduling is (enabled|disabled)")
_RUNNER_V2 = "Using V2 Model Runner"
_RUNNER_V1_FALLBACK = "using the V1 model runner instead"
_VERSION_PATTERNS = (
    re.compile(r"vLLM API server version (\S+)"),
    re.compile(r"Initializing a V1 LLM engine \(v([^)\s]+)\)"),
    re.compile(r"█\s+version\s+(\d+\.\d+\S*)"),  # the start-up banner since ~0.11
)


def _num(text: str) -> float:
    return float(text.replace(",", ""))


def parse_log(log_text: str) -> EngineInfo:
    """What vLLM told about itself at start; fields it did not print stay None."""
    text = _ANSI.sub("", log_text)
    fields: dict[str, Any] = {}

    for pattern in _BACKEND_PATTERNS:
        if m := pattern.search(text):
            fields["attention_backend"] = _OLD_BACKEND_NAMES.get(m.group(1), m.group(1))
            break
    for pattern in _VERSION_PATTERNS:
        if m := pattern.search(text):
            fields["engine_version"] = m.group(1).lstrip("v")
            break
    if m := _MODEL_LOADING.search(text):
        fields["model_memory_gib"] = _num(m.group(1))
        fields["model_load_s"] = _num(m.group(2))
    if m := _KV_MEMORY.search(text):
        fields["kv_cache_gib"] = _num(m.group(1))
    if m := _KV_TOKENS.search(text):
        fields["kv_cache_tokens"] = int(_num(m.group(1)))
    if m := _CONCURRENCY.search(text):
        fields["max_model_len"] = int(_num(m.group(1)))
        fields["max_concurrency_at_max_len"] = _num(m.group(2))
    elif m := _MAX_MODEL_LEN.search(text):
        fields["max_model_len"] = int(_num(m.group(1)))
    if m := _GRAPHS.search(text):
        fields["graph_capture_s"] = _num(m.group(1))
        if m.group(2) is not None:
            fields["graph_memory_gib"] = _num(m.group(2))
    if m := _INIT_ENGINE.search(text):
        fields["init_engine_s"] = _num(m.group(1))
        if m.group(2) is not None:
            fields["compile_s"] = _num(m.group(2))
    if "compile_s" not in fields and (m := _TORCH_COMPILE.search(text)):
        fields["compile_s"] = _num(m.group(1))
    if _CACHE_COLD.search(text):
        fields["compile_cache"] = "cold"
    elif _CACHE_WARM.search(text):
        fields["compile_cache"] = "warm"
    elif _NO_COMPILE.search(text):
        fields["compile_cache"] = "none"
    if m := _AOT_DIR.search(text) or _CACHE_DIR.search(text):
        fields["compile_cache_dir"] = m.group(1)[:16]
    if m := _ASYNC_SCHEDULING.search(text):
        fields["async_scheduling"] = m.group(1) == "enabled"
    if _RUNNER_V1_FALLBACK in text:
        fields["model_runner"] = "V1"
    elif _RUNNER_V2 in text:
        fields["model_runner"] = "V2"
    if _JIT_MONITOR_ON in text:
        serving = text[text.index(_JIT_MONITOR_ON):]
        # Distinct kernels: every tensor-parallel rank logs its own compiles of the same ones.
        fields["num_runtime_jit_compiles"] = len(set(_RUNTIME_JIT.findall(serving))) + \
            len(set(_RUNTIME_AUTOTUNE.findall(serving)))
    return EngineInfo(**fields)


# ---------------------------------------------------------------------------------------------
# Failures. Rules are tried in order; the first that matches a line decides. Argument and port
# errors come first because they end the process before anything else can be logged; the
# memory messages vLLM raises itself come before the generic CUDA OOM they can be wrapped in;
# the broad "not supported" family comes last and only looks at exception lines, since vLLM
# logs benign ERROR lines such as "Cannot use FA version 2 is not supported ..." on healthy
# starts.

_EXCEPTION_LINE = re.compile(r"\b(?:[A-Za-z_][\w.]*)?(?:Error|Exception)\b:\s")
_GRAPH_START = re.compile(r"Capturing CUDA graphs|Profiling CUDA graph memory")
_GRAPH_END = re.compile(r"Graph capturing finished|Estimated CUDA graph memory")
_CUDA_TROUBLE = re.compile(
    r"OutOfMemoryError|CUDA out of memory|CUDA error|cudaError\w+|out of memory")
_CUDA_OOM = re.compile(r"OutOfMemoryError|CUDA out of memory|CUDA error: out of memory")
_GENERIC_WRAPPERS = re.compile(
    r"Engine core initialization failed|EngineCore failed to start|"
    r"Engine process failed to start|See root cause above")
# A traceback vLLM logs as a warning and goes on from (the H200 logs print one for "Tokenizer not
# available" under --skip-tokenizer-init on every healthy start) is no cause of death.
_HANDLED_RECORD = re.compile(r"\b(?:DEBUG|INFO|WARNING) \d\d-\d\d \d\d:\d\d:\d\d ")


@dataclass(frozen=True)
class _Rule:
    reason: FailureReason
    pattern: re.Pattern[str]
    message: Callable[[re.Match[str]], str]
    exception_lines_only: bool = False


def _gib(m: re.Match[str], group: str) -> str:
    value = m.group(group)
    return f"{_num(value):.2f}" if value is not None else "?"


def _kv_too_small_message(m: re.Match[str]) -> str:
    groups = m.groupdict()
    fit = groups.get("fit")
    if groups.get("needed") is not None:
        what = (f"max_model_len {m.group('max_len')} needs {_gib(m, 'needed')} GiB of KV cache "
                f"but only {_gib(m, 'avail')} GiB is available")
    else:
        what = (f"max_model_len {m.group('max_len')} is more than the "
                f"{int(_num(m.group('tokens'))):,} tokens the KV cache holds")
    to = f" to at most {fit}" if fit else ""
    return f"{what}; lower max_model_len{to} or raise gpu_memory_utilization."


_ARG_RULES = (
    _Rule(FailureReason.INVALID_ARGUMENT,
          re.compile(r"error: unrecognized arguments: (?P<args>.+)"),
          lambda m: f"vLLM does not know the argument(s) {m.group('args').strip()}; remove them "
                    "or check the flag names against `vllm serve --help` for this version."),
    _Rule(FailureReason.INVALID_ARGUMENT,
          re.compile(r"error: argument (?P<flag>\S+?): (?P<why>invalid .+)"),
          lambda m: f"vLLM refused the value of {m.group('flag')} ({m.group('why').strip()}); "
                    "fix the value in the search space."),
    _Rule(FailureReason.INVALID_ARGUMENT,
          re.compile(r"^\s*(?:vllm serve: )?error: (?P<why>.+)|usage: vllm serve"),
          lambda m: "vLLM's argument parser refused the command"
                    + (f" ({m.group('why').strip()})" if m.group("why") else "")
                    + "; check the flags against `vllm serve --help` for this version."),
)
# VLLM_FORCE_AOT_LOAD=1 re-raises a failed AOT load (compilation/decorators.py:326): an absent
# artefact is a FileNotFoundError naming its path under torch_aot_compile/ (decorators.py:543-560),
# one that fails to load logs "Compiling model again due to a load failure" first (:322).
_AOT_RULES = (
    _Rule(FailureReason.COMPILE_CACHE_MISS,
          re.compile(r"torch_aot_compile/\S*rank_\d+_\d+/model"),
          lambda m: "the compile cache predicted warm had no loadable artefact "
                    "(VLLM_FORCE_AOT_LOAD=1 refused to compile); relaunch without the check.",
          exception_lines_only=True),
    _Rule(FailureReason.COMPILE_CACHE_MISS,
          re.compile(r"Compiling model again due to a load failure"),
          lambda m: "the compiled artefact predicted warm failed to load "
                    "(VLLM_FORCE_AOT_LOAD=1 refused to compile); relaunch without the check."),
)
_PORT_RULES = (
    _Rule(FailureReason.PORT_IN_USE,
          re.compile(r"\[Errno 98\]|Address already in use"),
          lambda m: "the server port was already in use; retry on another port or stop the "
                    "process holding it."),
)
_MEMORY_RULES = (
    _Rule(FailureReason.OOM_AT_START,
          re.compile(r"Free memory on device (?:\S+ )?\((?P<free>[\d.]+)/(?P<total>[\d.]+) GiB\)"
                     r" on startup is less than desired GPU memory utilization"
                     r" \((?P<util>[\d.]+), (?P<want>[\d.]+) GiB\)"),
          lambda m: f"only {m.group('free')} of {m.group('total')} GiB was free at start but "
                    f"gpu_memory_utilization {m.group('util')} asks for {m.group('want')} GiB; "
                    "free the GPU from other processes or lower gpu_memory_utilization."),
    _Rule(FailureReason.OOM_AT_START,
          re.compile(r"less than desired GPU memory utilization"),
          lambda m: "less GPU memory was free at start than gpu_memory_utilization asks for; "
                    "free the GPU from other processes or lower gpu_memory_utilization."),
    _Rule(FailureReason.OOM_AT_START,
          re.compile(r"No available memory for the cache blocks"),
          lambda m: "weights and activations left no memory for the KV cache; raise "
                    "gpu_memory_utilization, lower max_num_batched_tokens, or quantize."),
    _Rule(FailureReason.OOM_AT_START,
          re.compile(r"Failed to load model - not enough GPU memory"),
          lambda m: "the model weights did not fit in GPU memory; raise tensor_parallel_size, "
                    "quantize, or choose a smaller model."),
    _Rule(FailureReason.KV_CACHE_TOO_SMALL,
          re.compile(r"max seq len \((?P<max_len>\d+)\), \((?P<needed>[\d.]+) Gi?B KV cache "
                     r"is\s*needed, which is larger than the available KV cache memory "
                     r"\((?P<avail>-?[\d.]+) Gi?B\)\.?(?: Based on the available memory, the "
                     r"estimated maximum model length is (?P<fit>\d+))?", re.IGNORECASE),
          _kv_too_small_message),
    _Rule(FailureReason.KV_CACHE_TOO_SMALL,
          re.compile(r"max seq len \((?P<max_len>\d+)\) is larger than the maximum number of "
                     r"tokens that can be stored in KV cache \((?P<tokens>[\d,]+)\)"),
          _kv_too_small_message),
)
_CUDA_OOM_RULE = _Rule(
    FailureReason.OOM_AT_START, _CUDA_OOM,
    lambda m: "CUDA ran out of memory during start-up; lower gpu_memory_utilization, "
              "max_num_batched_tokens or max_num_seqs.")
_UNSUPPORTED_RULES = (
    _Rule(FailureReason.UNSUPPORTED_CONFIG,
          re.compile(r"Selected backend (?:AttentionBackendEnum\.)?(?P<backend>\w+) is not valid "
                     r"for this configuration\. Reason: (?P<why>.+)"),
          lambda m: f"attention backend {m.group('backend')} cannot run this configuration "
                    f"({m.group('why').strip()}); pick another attention_backend or "
                    "kv_cache_dtype.", exception_lines_only=True),
    _Rule(FailureReason.UNSUPPORTED_CONFIG,
          re.compile(r"No valid attention backend found"),
          lambda m: "no attention backend supports this combination of dtype, kv_cache_dtype "
                    "and GPU; change kv_cache_dtype or the model dtype.",
          exception_lines_only=True),
    _Rule(FailureReason.UNSUPPORTED_CONFIG,
          re.compile(r"(?i)\bfp8\b.*(?:not supported|unsupported|requires|compute capability)|"
                     r"(?:not supported|unsupported).*\bfp8\b"),
          lambda m: "FP8 is not supported on this GPU for this setting; drop the fp8 "
                    "quantization/kv_cache_dtype on this hardware.", exception_lines_only=True),
    _Rule(FailureReason.UNSUPPORTED_CONFIG,
          re.compile(r"compute capability|not supported|is not supported for|"
                     r"Cannot use .* backend|does not support"),
          lambda m: "vLLM rejected the configuration as unsupported on this hardware or model; "
                    "mark the combination infeasible in the search space.",
          exception_lines_only=True),
)


def _split_lines(text: str) -> list[str]:
    # tqdm bars redraw with \r; each redraw is a line of its own for matching purposes.
    return re.split(r"\r\n|\n|\r", _ANSI.sub("", text))


def _excerpt(lines: Sequence[str], index: int, before: int = 2, after: int = 2) -> str:
    chunk = [line for line in lines[max(0, index - before):index + after + 1] if line.strip()]
    return "\n".join(chunk)


def _search(rules: Iterable[_Rule],
            lines: Sequence[str]) -> tuple[_Rule, re.Match[str], int] | None:
    for rule in rules:
        for i, line in enumerate(lines):
            if rule.exception_lines_only and not _EXCEPTION_LINE.search(line):
                continue
            if m := rule.pattern.search(line):
                return rule, m, i
    return None


def _graph_capture_trouble(lines: Sequence[str]) -> int | None:
    """Index of the first CUDA error/OOM line logged after a graph capture started and before
    it finished, or None."""
    capturing = False
    for i, line in enumerate(lines):
        if _GRAPH_START.search(line):
            capturing = True
        elif _GRAPH_END.search(line):
            capturing = False
        elif capturing and _CUDA_TROUBLE.search(line):
            return i
    return None


def _error_text(line: str, limit: int = 160) -> str:
    """The exception part of a log line (prefix dropped), cut after its first sentence."""
    m = _EXCEPTION_LINE.search(line)
    text = line[m.start():].strip() if m else line.strip()
    end = text.find(". ")
    if 0 < end < limit:
        return text[:end + 1]
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _exit_words(returncode: int | None) -> str:
    if returncode is None:
        return "without an exit code"
    if returncode < 0:
        try:
            return f"on signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"on signal {-returncode}"
    return f"with code {returncode}"


def _root_error(lines: Sequence[str]) -> tuple[str, int] | None:
    """The last exception line that is not a wrapper pointing "above", nor part of a traceback
    vLLM logged as a warning and survived."""
    found: tuple[str, int] | None = None
    wrapper: tuple[str, int] | None = None
    for i, line in enumerate(lines):
        m = _EXCEPTION_LINE.search(line)
        if m is None:
            continue
        text = _error_text(line, limit=200)
        if _HANDLED_RECORD.search(line[:m.start()]):
            continue
        if _GENERIC_WRAPPERS.search(line):
            wrapper = (text, i)
        else:
            found = (text, i)
    return found or wrapper


def classify_failure(log_text: str, returncode: int | None, phase: Phase) -> Failure:
    """Why vLLM died (or never became ready), from its log and exit code."""
    lines = _split_lines(log_text)

    hit = _search((*_ARG_RULES, *_PORT_RULES, *_MEMORY_RULES), lines)
    if hit is None:
        i = _graph_capture_trouble(lines)
        if i is not None:
            return Failure(
                FailureReason.CUDA_GRAPH_CAPTURE,
                f"vLLM failed while capturing CUDA graphs ({_error_text(lines[i])}); lower "
                "max_cudagraph_capture_size, use cudagraph_mode PIECEWISE, or enforce_eager.",
                _excerpt(lines, i))
        hit = _search((_CUDA_OOM_RULE,), lines)
        if hit is not None and phase == "run":
            _, _, i = hit
            return Failure(FailureReason.CRASH_MID_RUN,
                           "vLLM ran out of GPU memory while serving; lower "
                           "gpu_memory_utilization, max_num_seqs or max_num_batched_tokens.",
                           _excerpt(lines, i))
    if hit is None and phase == "startup":
        hit = _search(_AOT_RULES, lines)
    if hit is None:
        hit = _search(_UNSUPPORTED_RULES, lines)
    if hit is not None:
        rule, m, i = hit
        return Failure(rule.reason, rule.message(m), _excerpt(lines, i))

    root = _root_error(lines)
    detail = f" ({root[0]})" if root else ""
    excerpt = _excerpt(lines, root[1]) if root else "\n".join(
        line for line in lines[-5:] if line.strip())
    if phase == "run":
        return Failure(FailureReason.CRASH_MID_RUN,
                       f"vLLM exited {_exit_words(returncode)} while serving{detail}; see the "
                       "server log for the traceback.", excerpt)
    return Failure(FailureReason.STARTUP_CRASH,
                   f"vLLM exited {_exit_words(returncode)} during start-up{detail}; see the "
                   "server log for the traceback.", excerpt)
