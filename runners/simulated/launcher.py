"""`SimulatedLauncher`: how `EngineRunner` launches and reads the simulated engine.

Builds the `python -m runners.simulated` command line and reads back the vLLM-style lines the
simulated engine prints; the parser is deliberately small (the full vLLM one lives in
runners/vllm/logs.py).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from runners.base import EngineConfig, EngineInfo, Failure, FailureReason, Phase
from runners.hardware import HardwareProfile, load_preset
from runners.vllm import logs as vllm_logs
from search_spaces.engine.tables import VllmFlags, bundled_flags, flag_name, has_table

SERVER_MODULE = "runners.simulated"  # what the launch command runs: `python -m runners.simulated`


def is_simulated_argv(argv: Sequence[str]) -> bool:
    """Whether a recorded launch command ran the simulated engine: its figures are a model's,
    never measurements, and it models no speculative draft acceptance."""
    return any(SERVER_MODULE in a for a in argv)

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


@dataclass(frozen=True)
class VllmVariant:
    """The vLLM release the simulated engine pretends to be: 0.26.0 (what the model is
    calibrated against) unless a variant names another release, whose bundled flag table its
    parser then takes (0.27.0 refuses --max-num-partial-prefills, as 0.27 does), and/or renames
    or drops flags on top of it. The figures stay the 0.26-calibrated model's: a release's
    performance changes are not modelled. Lets the upgrade path (`nightshift regress` on a flag
    the new version no longer takes) run on CPU. Names are kebab-case flags, as `vllm serve`
    spells them."""

    version: str = "0.26.0"
    renamed: Mapping[str, str] = field(default_factory=dict)  # old -> new
    dropped: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> VllmVariant:
        unknown = set(data) - {"version", "renamed", "dropped"}
        if unknown:
            raise ValueError(f"a vLLM variant takes version, renamed and dropped but got "
                             f"{sorted(unknown)}.")
        renamed = {flag_name(str(k)): flag_name(str(v))
                   for k, v in dict(data.get("renamed") or {}).items()}
        return cls(version=str(data.get("version") or "0.26.0"), renamed=renamed,
                   dropped=tuple(flag_name(str(d)) for d in data.get("dropped") or ()))

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "renamed": dict(self.renamed),
                "dropped": list(self.dropped)}

    @property
    def is_default(self) -> bool:
        return self == VllmVariant()

    def flag_table(self) -> VllmFlags:
        """The bundled table of this variant's release (0.26's where none is bundled for it)
        with its renames and drops applied: what its parser accepts."""
        base = bundled_flags(self.version) if has_table(self.version) else bundled_flags()
        types = {k: v for k, v in base.types.items()
                 if k not in self.dropped and k not in self.renamed}
        types.update({new: base.types[old] for old, new in self.renamed.items()
                      if old in base.types})
        return replace(base, version=self.version, types=types,
                       source=f"simulated vLLM {self.version}'s flags ({base.version} table"
                              f"{', variant' if self.renamed or self.dropped else ''})",
                       defaults={k: v for k, v in base.defaults.items()
                                 if k.partition(".")[0] in types},
                       renamed={**base.renamed, **self.renamed})

    def refused(self, flags: Mapping[str, Any]) -> list[str]:
        """The `--flags` among snake_case `flags` this variant's parser does not know (the
        simulator's own `sim_` faults aside)."""
        known = self.flag_table().names
        return [f"--{flag_name(k).partition('.')[0]}" for k in flags
                if not k.startswith("sim_") and flag_name(k).partition(".")[0] not in known]

    def as_baseline_flags(self, flags: Mapping[str, Any]) -> dict[str, Any]:
        """`flags` with renamed ones spelled as 0.26 spells them (what the model reads)."""
        back = {new.replace("-", "_"): old.replace("-", "_")
                for old, new in self.renamed.items()}
        return {back.get(k, k): v for k, v in flags.items()}


class SimulatedLauncher:
    """An `EngineLauncher` for `python -m runners.simulated`. Pure: builds argv, reads logs."""

    name = "simulated"

    def __init__(self, hardware: str | HardwareProfile = "h200", *,
                 startup_time_scale: float = 0.01, seed: int = 0,
                 variant: VllmVariant | None = None) -> None:
        self.hardware = load_preset(hardware) if isinstance(hardware, str) else hardware
        self.startup_time_scale = startup_time_scale
        self.seed = seed
        self.variant = variant or VllmVariant()

    def command(self, config: EngineConfig, port: int, workdir: Path,
                profile_dir: Path | None) -> tuple[list[str], dict[str, str]]:
        # As `VllmLauncher` does for vLLM >= 0.26: the engine's own FLOP and byte counters on.
        flags = {"enable_mfu_metrics": True, **config.flags}
        # The variables travel in the environment, by name in argv: a token in them must not
        # be readable by another user (`ps -eww`).
        payload = {"model": config.model, "flags": flags, "env_names": sorted(config.env),
                   "load_format": config.load_format,
                   "served_model_name": config.served_model_name}
        argv = [sys.executable, "-m", SERVER_MODULE, "--host", "127.0.0.1",
                "--port", str(port),
                "--config-json", json.dumps(payload, sort_keys=True),
                "--hardware-json", json.dumps(self.hardware.to_dict(), sort_keys=True),
                "--startup-time-scale", repr(self.startup_time_scale),
                "--seed", str(self.seed)]
        if profile_dir is not None:
            argv += ["--profile-dir", str(profile_dir)]
        if not self.variant.is_default:
            argv += ["--vllm-variant-json", json.dumps(self.variant.to_dict(), sort_keys=True)]
        return argv, dict(config.env)

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
