"""`SimulatedLauncher`: how `EngineRunner` launches and reads the simulated engine.

Builds the `python -m runners.simulated` command line and reads back the vLLM-style lines the
simulated engine prints; the parser is deliberately small (the full vLLM one lives in
runners/vllm/logs.py).
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import replace
from pathlib import Path

from runners.base import EngineConfig, EngineInfo, Failure, FailureReason, Phase
from runners.hardware import HardwareProfile, load_preset
from runners.vllm import logs as vllm_logs

# The engine prints vLLM's own start-up lines, read by vLLM's parser; this line is its own.
_MODELLED_STARTUP = re.compile(r"modelled start-up ([0-9][0-9,]*(?:\.[0-9]+)?) s")

# First match wins: graph capture before the generic OOM (its error is a CUDA OOM too).
_FAILURE_PATTERNS: tuple[tuple[FailureReason, re.Pattern[str]], ...] = (
    (FailureReason.PORT_IN_USE, re.compile(r"Address already in use|\[Errno 98\]")),
    (FailureReason.COMPILE_CACHE_MISS,
     re.compile(r"FileNotFoundError: .*torch_aot_compile/\S*rank_\d+_\d+/model")),
    (FailureReason.KV_CACHE_TOO_SMALL,
     re.compile(r"To serve at least one request with the models?'s? max seq len")),
    (FailureReason.CUDA_GRAPH_CAPTURE,
     re.compile(r"Capturing CUDA graphs[^\n]*\n(?:[^\n]*\n)*?[^\n]*(out of memory|CUDA error)",
                re.IGNORECASE)),
    (FailureReason.OOM_AT_START,
     re.compile(r"No available memory for the cache blocks|Failed to load model - not enough "
                r"GPU memory|CUDA out of memory|less than desired GPU memory utilization")),
    (FailureReason.UNSUPPORTED_CONFIG,
     re.compile(r"is not supported for the current GPU|not valid for this configuration|"
                r"No valid attention backend|max local gpu count")),
    (FailureReason.INVALID_ARGUMENT,
     re.compile(r"must be divisible by tensor parallel size|Invalid attention backend|"
                r"error: (argument|unrecognized arguments)|^error: ", re.MULTILINE)),
)
_ERROR_LINE = re.compile(r"^.*\b(ERROR|Error:|Exception:|error:).*$", re.MULTILINE)


class SimulatedLauncher:
    """An `EngineLauncher` for `python -m runners.simulated`. Pure: builds argv, reads logs."""

    name = "simulated"

    def __init__(self, hardware: str | HardwareProfile = "h200", *,
                 startup_time_scale: float = 0.01, seed: int = 0) -> None:
        self.hardware = load_preset(hardware) if isinstance(hardware, str) else hardware
        self.startup_time_scale = startup_time_scale
        self.seed = seed

    def command(self, config: EngineConfig, port: int, workdir: Path,
                profile_dir: Path | None) -> tuple[list[str], dict[str, str]]:
        # As `VllmLauncher` does for vLLM >= 0.26: the engine's own FLOP and byte counters on.
        flags = {"enable_mfu_metrics": True, **config.flags}
        payload = {"model": config.model, "flags": flags, "env": dict(config.env),
                   "load_format": config.load_format,
                   "served_model_name": config.served_model_name}
        argv = [sys.executable, "-m", "runners.simulated", "--host", "127.0.0.1",
                "--port", str(port),
                "--config-json", json.dumps(payload, sort_keys=True),
                "--hardware-json", json.dumps(self.hardware.to_dict(), sort_keys=True),
                "--startup-time-scale", repr(self.startup_time_scale),
                "--seed", str(self.seed)]
        if profile_dir is not None:
            argv += ["--profile-dir", str(profile_dir)]
        return argv, {}

    def parse_log(self, log_text: str) -> EngineInfo:
        info = vllm_logs.parse_log(log_text)
        modelled = _MODELLED_STARTUP.findall(log_text)
        if not modelled:
            return info
        # The modelled start-up, not the time-scaled sleep: the last start counts.
        return replace(info, startup_s=float(modelled[-1].replace(",", "")))

    def classify_failure(self, log_text: str, returncode: int | None, phase: Phase) -> Failure:
        for reason, pattern in _FAILURE_PATTERNS:
            match = pattern.search(log_text)
            if match is not None:
                line = _line_at(log_text, match.start(), match.end())
                return Failure(reason, _message(reason, line, returncode), log_excerpt=line)
        excerpt = "\n".join(_ERROR_LINE.findall(log_text)[-5:]) or log_text[-2000:]
        if returncode is None:
            reason = FailureReason.HANG if phase == "run" else FailureReason.STARTUP_TIMEOUT
            what = ("stopped answering during the load" if phase == "run"
                    else "never became healthy")
            return Failure(reason, f"the simulated engine is alive but {what}.", excerpt)
        if phase == "run":
            return Failure(FailureReason.CRASH_MID_RUN,
                           f"the simulated engine exited with code {returncode} during the "
                           "load.", excerpt)
        return Failure(FailureReason.STARTUP_CRASH,
                       f"the simulated engine exited with code {returncode} during start-up "
                       "for no reason its log names.", excerpt)


def _line_at(text: str, start: int, end: int) -> str:
    """The whole log line(s) holding a match."""
    line_start = text.rfind("\n", 0, start) + 1
    line_end = text.find("\n", end)
    return text[line_start:line_end if line_end >= 0 else len(text)].strip()


def _message(reason: FailureReason, line: str, returncode: int | None) -> str:
    code = "still running" if returncode is None else f"exit code {returncode}"
    last = line.splitlines()[-1] if line else ""
    # Drop vLLM's "LEVEL date [file:line]" prefix so the message reads as one sentence.
    last = re.sub(r"^(\(\w+ pid=\d+\) )?[A-Z]+ \d\d-\d\d [\d:]+ \[[^\]]+\] ", "", last)
    return f"simulated engine failed ({reason.value}, {code}): {last}"
