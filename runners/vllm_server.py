"""How `vllm serve` is launched and read: argv and environment for one trial, what its start-up
log says about the engine, and why it died when it did.

Pure functions of their inputs (plus one lazy look-up of the installed vLLM version): the
process life cycle belongs to `EngineRunner`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import signal
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from runners.base import EngineConfig, EngineInfo, Failure, FailureReason, Phase

logger = logging.getLogger(__name__)

# What we assume when vLLM is not importable here (the launcher may run on a CPU-only host that
# only builds commands, e.g. for `nightshift export`): the version REFERENCE.md documents.
DEFAULT_VLLM_VERSION = "0.26.0"

# Versions at which the CLI changed under us.
ATTENTION_BACKEND_FLAG_SINCE = (0, 11, 0)  # before: env VLLM_ATTENTION_BACKEND
PROFILER_CONFIG_FLAG_SINCE = (0, 16, 0)  # before: env VLLM_TORCH_PROFILER_DIR
# What nightshift's trace analysis never reads, and vLLM records by default: Python stacks, the
# CUDA-time table it prints, the front end's CPU trace. On the H200 (vLLM 0.26, study h200-grid)
# /stop_profile took 54 s to export a 3-second window with them, over a third of each trial.
# ProfilerConfig refuses unknown keys: they go only to versions whose config was read (0.26;
# its field names, read from the 0.26.0 wheel, are a test fixture).
PROFILER_LEAN_SINCE = (0, 26, 0)
_PROFILER_LEAN: Final = {"torch_profiler_with_stack": False,
                         "torch_profiler_dump_cuda_time_total": False, "ignore_frontend": True}
ATTENTION_ENV_IGNORED_SINCE = (0, 16, 0)  # VLLM_ATTENTION_BACKEND silently ignored from here
# `--enable-mfu-metrics` fills vllm:estimated_{flops,read_bytes,write_bytes}_per_gpu_total (read
# in the 0.26.0 wheel: vllm/config/observability.py, vllm/v1/metrics/perf.py); older versions
# were not checked, and an unknown flag makes vLLM's parser exit 2, so it goes to >= 0.26 only.
# Its cost is host arithmetic in the scheduler, once per step (one pass over the scheduled
# requests and a few dozen products); the GPU does nothing more.
MFU_METRICS_SINCE = (0, 26, 0)

# Boolean flags whose `False` differs from leaving them out (their default is on or "auto"), so
# `False` must be spelled `--no-...`. Every other boolean `False` is simply omitted: vLLM's
# store_true flags have no `--no-` form and would make argparse exit 2.
NEGATABLE_FLAGS = frozenset({
    "enable_prefix_caching",  # default on
    "enable_chunked_prefill",  # default on
    "async_scheduling",  # default None: on where supported
    "use_tqdm_on_load",  # default on
})

# Set by the launcher itself; a flag of the same name would fight the runner's own port/host.
# NVLink multicast switches: kept off on shared machines (a program using multicast can take
# the host's GPUs out of service); carried into a multi-GPU trial's recorded environment.
_MULTICAST_OFF = frozenset({"TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"})
_RESERVED_FLAGS = frozenset({
    "model", "host", "port", "served_model_name", "load_format", "skip_tokenizer_init",
})


def _version_tuple(version: str) -> tuple[int, int, int]:
    """`"0.18.1rc1.dev10+gc86b17cfe"` -> `(0, 18, 1)`; missing parts are 0."""
    parts: list[int] = []
    for piece in version.split(".")[:3]:
        digits = re.match(r"\d+", piece)
        if digits is None:
            break
        parts.append(int(digits.group()))
    while len(parts) < 3:
        parts.append(0)
    return parts[0], parts[1], parts[2]


def flag_name(key: str) -> str:
    """`max_num_seqs` -> `max-num-seqs`; `compilation_config.cudagraph_mode` keeps the part after
    the dot as vLLM spells it (`--compilation-config.cudagraph_mode`)."""
    head, dot, tail = key.partition(".")
    return head.replace("_", "-") + dot + tail


def _flag_args(key: str, value: object) -> list[str]:
    """One snake_case flag as argv elements; [] when the flag is to be left out."""
    name = flag_name(key)
    if value is None:
        return []
    if isinstance(value, bool):
        if value:
            return [f"--{name}"]
        return [f"--no-{name}"] if key in NEGATABLE_FLAGS else []
    if isinstance(value, Mapping):
        return [f"--{name}", json.dumps(dict(value), separators=(",", ":"))]
    if isinstance(value, list | tuple):
        # vLLM's list flags are nargs="+": `--cudagraph-capture-sizes 1 2 4`.
        return [f"--{name}", *(str(v) for v in value)] if value else []
    return [f"--{name}", str(value)]


def config_to_yaml_dict(config: EngineConfig) -> dict[str, Any]:
    """The config's flags as `vllm serve MODEL --config x.yaml` reads them: kebab-case keys, and
    never a YAML `false` (vLLM drops it silently) but `no-<flag>: true`. The model stays on the
    command line, as does anything the runner owns (host, port)."""
    out: dict[str, Any] = {}
    if config.load_format != "auto":
        out["load-format"] = config.load_format
    out["served-model-name"] = config.served_model_name
    if config.skip_tokenizer_init:
        out["skip-tokenizer-init"] = True
    for key, value in config.flags.items():
        if key in _RESERVED_FLAGS or value is None:
            continue
        name = flag_name(key)
        if isinstance(value, bool):
            if value:
                out[name] = True
            elif key in NEGATABLE_FLAGS:
                out[f"no-{name}"] = True
            continue
        if isinstance(value, Mapping):
            # The config-file loader turns values into argv strings: JSON is what the flag parses.
            out[name] = json.dumps(dict(value), separators=(",", ":"))
            continue
        out[name] = value
    return out


def command_to_shell(argv: Sequence[str]) -> str:
    """A copy-pasteable command line, quoted for POSIX shells."""
    return shlex.join(argv)


class VllmLauncher:
    """`EngineLauncher` for `vllm serve` (OpenAI-compatible API server).

    `vllm_version` overrides the installed version (tests, or building commands for another
    host); `cache_root` is shared by every trial so torch.compile artefacts are reused;
    `python` is the interpreter that has vLLM (default: this one).
    """

    name = "vllm"

    def __init__(self, *, vllm_version: str | None = None, cache_root: Path | None = None,
                 python: str | None = None, dev_mode: bool = False) -> None:
        self._vllm_version = vllm_version
        self.cache_root = cache_root
        self.python = python or sys.executable
        self.dev_mode = dev_mode  # VLLM_SERVER_DEV_MODE=1: /reset_prefix_cache, /sleep endpoints

    @property
    def vllm_version(self) -> str:
        if self._vllm_version is None:
            # Lazily: importing the metadata is cheap, but the launcher may be built where vLLM
            # is absent and only `command_to_shell` is wanted.
            from importlib.metadata import PackageNotFoundError, version

            try:
                self._vllm_version = version("vllm")
            except PackageNotFoundError:
                logger.debug("vllm is not installed here; assuming %s", DEFAULT_VLLM_VERSION)
                self._vllm_version = DEFAULT_VLLM_VERSION
        return self._vllm_version

    def command(self, config: EngineConfig, port: int, workdir: Path,
                profile_dir: Path | None) -> tuple[list[str], dict[str, str]]:
        """argv (no shell) and the environment variables to add for one launch on 127.0.0.1."""
        version = _version_tuple(self.vllm_version)
        argv = [self.python, "-m", "vllm.entrypoints.cli.main", "serve", config.model,
                "--host", "127.0.0.1", "--port", str(port),
                "--served-model-name", config.served_model_name,
                "--load-format", config.load_format]
        if config.skip_tokenizer_init:
            argv.append("--skip-tokenizer-init")

        env: dict[str, str] = {}
        if self.cache_root is not None:
            env["VLLM_CACHE_ROOT"] = str(self.cache_root.absolute())
        if self.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"

        for key, value in config.flags.items():
            if key in _RESERVED_FLAGS:
                logger.warning("flag %s is set by the launcher; ignoring %r from the config",
                               key, value)
                continue
            if key == "profiler_config" and profile_dir is not None:
                logger.warning("profiler_config is set by the runner when profiling; ignoring %r",
                               value)
                continue
            if key == "attention_backend" and version < ATTENTION_BACKEND_FLAG_SINCE:
                if value is not None:
                    env["VLLM_ATTENTION_BACKEND"] = str(value)
                continue
            argv.extend(_flag_args(key, value))

        if version >= MFU_METRICS_SINCE and "enable_mfu_metrics" not in config.flags:
            # vLLM's own FLOP and byte accounting, cross-checked against nightshift's roofline.
            argv.append("--enable-mfu-metrics")

        if config.num_gpus > 1:
            # A multi-GPU engine's collectives follow the NCCL (and multicast) variables it
            # inherits: keep them with the trial, so they are logged and exported with it.
            env.update({k: v for k, v in os.environ.items()
                        if k.startswith("NCCL_") or k in _MULTICAST_OFF})
        env.update(config.env)
        if "VLLM_ATTENTION_BACKEND" in config.env and version >= ATTENTION_ENV_IGNORED_SINCE:
            logger.warning("VLLM_ATTENTION_BACKEND is silently ignored by vLLM %s; set the "
                           "attention_backend flag instead", self.vllm_version)

        if profile_dir is not None:
            trace_dir = str(profile_dir.absolute())
            if version >= PROFILER_CONFIG_FLAG_SINCE:
                argv += ["--profiler-config",
                         json.dumps({"profiler": "torch", "torch_profiler_dir": trace_dir,
                                     **(_PROFILER_LEAN if version >= PROFILER_LEAN_SINCE
                                        else {})})]
            else:
                env["VLLM_TORCH_PROFILER_DIR"] = trace_dir
                env["VLLM_TORCH_PROFILER_WITH_STACK"] = "0"
        argv.extend(config.extra_args)
        return argv, env

    def parse_log(self, log_text: str) -> EngineInfo:
        return parse_log(log_text)

    def classify_failure(self, log_text: str, returncode: int | None, phase: Phase) -> Failure:
        return classify_failure(log_text, returncode, phase)


# ---------------------------------------------------------------------------------------------
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
