"""How `vllm serve` is launched: argv and environment for one trial (flags rendered by
`search_spaces.engine.render` with the launched release's table, `runners.vllm.flags`; the
start-up log read by `runners.vllm.logs`).

Pure functions of their inputs (plus one lazy look-up of the installed vLLM version): the
process life cycle belongs to `EngineRunner`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from runners.base import EngineConfig, EngineInfo, Failure, Phase
from runners.vllm.flags import flag_table, table_for
from runners.vllm.logs import classify_failure, parse_log
from search_spaces.engine.render import flag_args, to_config_dict
from search_spaces.engine.tables import bundled_flags

logger = logging.getLogger(__name__)

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


def config_flags(config: EngineConfig) -> dict[str, Any]:
    """Everything a deployment passes besides the model, as snake_case flags: the load format
    (when not auto), the served name, tokenizer-less start, then the config's flags less those
    the runner owns (host, port)."""
    out: dict[str, Any] = {}
    if config.load_format != "auto":
        out["load_format"] = config.load_format
    out["served_model_name"] = config.served_model_name
    if config.skip_tokenizer_init:
        out["skip_tokenizer_init"] = True
    out.update((k, v) for k, v in config.flags.items() if k not in _RESERVED_FLAGS)
    return out


def config_to_yaml_dict(config: EngineConfig) -> dict[str, Any]:
    """The config as `vllm serve MODEL --config x.yaml` reads it (`render.to_config_dict`:
    kebab-case keys, `no-<flag>: true` rather than a YAML `false`, which vLLM drops). The
    model stays on the command line, as does anything the runner owns (host, port)."""
    return to_config_dict(config_flags(config), flag_table())


def command_to_shell(argv: Sequence[str]) -> str:
    """A copy-pasteable command line, quoted for POSIX shells."""
    return shlex.join(argv)


class VllmLauncher:
    """`EngineLauncher` for `vllm serve` (OpenAI-compatible API server).

    `vllm_version` overrides the installed version (tests, or building commands for another
    host); `cache_root` is shared by every trial so torch.compile artefacts are reused (vLLM
    keys its cache under it: docs/startup-cost.md), unless `is_cache_per_trial` gives each
    launch its own under its work directory; `python` is the interpreter that has vLLM
    (default: this one).
    """

    name = "vllm"

    def __init__(self, *, vllm_version: str | None = None, cache_root: Path | None = None,
                 python: str | None = None, dev_mode: bool = False,
                 is_cache_per_trial: bool = False) -> None:
        self._vllm_version = vllm_version
        self.cache_root = cache_root
        self.is_cache_per_trial = is_cache_per_trial
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
                # A CPU-only host that only builds commands (`nightshift export`): assume the
                # version of the bundled flag table, the one REFERENCE.md documents.
                self._vllm_version = bundled_flags().version
                logger.debug("vllm is not installed here; assuming %s", self._vllm_version)
        return self._vllm_version

    def command(self, config: EngineConfig, port: int, workdir: Path,
                profile_dir: Path | None) -> tuple[list[str], dict[str, str]]:
        """argv (no shell) and the environment variables to add for one launch on 127.0.0.1."""
        version = _version_tuple(self.vllm_version)
        table = table_for(self.vllm_version)
        argv = [self.python, "-m", "vllm.entrypoints.cli.main", "serve", config.model,
                "--host", "127.0.0.1", "--port", str(port),
                "--served-model-name", config.served_model_name,
                "--load-format", config.load_format]
        if config.skip_tokenizer_init:
            argv.append("--skip-tokenizer-init")

        env: dict[str, str] = {}
        if self.is_cache_per_trial:
            env["VLLM_CACHE_ROOT"] = str((workdir / "vllm_cache").absolute())
        elif self.cache_root is not None:
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
            argv.extend(flag_args(key, value, table))

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
