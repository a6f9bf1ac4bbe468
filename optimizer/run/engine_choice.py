"""Which engine a study runs and what is known of it here: vLLM or the simulated engine
(`choose_engine`), the simulated host (`simulated_hardware`), the installed release and its flag
table (`engine_version`, `release_table`), and the compile ledger of the cache root its trials
share (`compile_ledger_of`)."""

from __future__ import annotations

import importlib.util
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

from optimizer.config import StudyConfig
from optimizer.errors import ConfigError, translate
from runners.hardware import GpuInfo, HardwareProfile, load_preset, preset_names
from runners.vllm.compile_ledger import CompileLedger
from runners.vllm.flags import flag_table, installed_version
from search_spaces.engine.tables import UnknownVersionError, VllmFlags, bundled_flags, version_key

logger = logging.getLogger(__name__)

DEFAULT_CACHE_ROOT = Path.home() / ".cache" / "nightshift" / "vllm"


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None and shutil.which("nvidia-smi") is not None


def choose_engine(cfg: StudyConfig, dry_run: bool) -> str:
    if dry_run:
        return "simulated"
    if cfg.spec.engine == "auto":
        return "vllm" if vllm_available() else "simulated"
    return cfg.spec.engine


def simulated_hardware(preset: str, num_gpus: int) -> HardwareProfile:
    """A preset's GPU repeated `num_gpus` times, as the simulated engine's host."""
    try:
        base = load_preset(preset)
    except ValueError as exc:
        raise translate(exc, f"simulated.hardware: unknown preset {preset!r}; valid: "
                        f"{', '.join(preset_names())}.", into=ConfigError) from exc
    if base.num_gpus >= num_gpus:
        gpus = base.gpus[:num_gpus]
        interconnect = base.interconnect if num_gpus > 1 else "none"
    else:
        template = base.gpus[0]
        gpus = tuple(GpuInfo(**{**template.__dict__, "index": i,
                                "uuid": f"{template.uuid or 'GPU-sim'}-{i}"})
                     for i in range(num_gpus))
        # Data-centre parts come in NVLink boxes; consumer cards talk over PCIe.
        interconnect = "none" if num_gpus == 1 else (
            "pcie" if base.hardware_class == "24gb" else "nvlink")
    return HardwareProfile(**{**base.__dict__, "gpus": gpus, "interconnect": interconnect})


def release_table(engine: str, asked: str | None = None) -> tuple[VllmFlags | None, str | None]:
    """The flag table of the vLLM a study runs, and a note where it is not known: the release
    `asked` (the study's `vllm.version`), else the simulated engine's (0.26.0) or the installed
    vLLM's; None where vLLM is not installed here (a Ray cluster's driver) and none was asked
    for, or no table holds for its release."""
    if engine == "simulated":
        return bundled_flags(asked), None
    try:
        return flag_table(engine_version(engine, asked) or ""), None
    except UnknownVersionError as exc:
        return None, (f"engine: {exc}; the space searches every flag it declares, as for "
                      "vLLM 0.26; vllm.version names the release the trials run")


def installed_release_problem(asked: str | None, installed: str | None) -> str | None:
    """Why the study's `vllm.version` cannot stand on this machine, or None: where vLLM is
    installed, the trials run it, so a study naming another release would search and check the
    wrong flags."""
    if asked is None or installed is None or version_key(asked) == version_key(installed):
        return None
    return (f"vllm.version: {asked}, but this machine's vLLM is {installed}; leave vllm.version "
            f"out (the installed release picks the flags) or install vLLM {asked}.")


def compile_ledger_of(cfg: StudyConfig, engine: str) -> CompileLedger | None:
    """The reader of the compile ledger in the cache root this study's trials use: the study's
    `env` VLLM_CACHE_ROOT, else (vLLM) `vllm.cache_root` or the default; the simulated engine
    keeps a cache only where `env` names one. None under `startup.compile_cache: per_trial`
    (no shared cache) or where vLLM's version is unknown here (a key holds under one version)."""
    if cfg.spec.startup.compile_cache != "shared":
        return None
    root = cfg.spec.env.get("VLLM_CACHE_ROOT") or (
        cfg.spec.vllm.cache_root or DEFAULT_CACHE_ROOT if engine == "vllm" else None)
    if not root:
        return None
    if engine == "simulated":
        from runners.simulated.sizing import ENGINE_VERSION

        # what the simulated engine's log prints
        version: str | None = cfg.spec.vllm.version or ENGINE_VERSION
    else:
        version = engine_version(engine, cfg.spec.vllm.version)
    if version is None:
        logger.info("vLLM's version is unknown here: the compile ledger in %s is not read", root)
        return None
    return CompileLedger(root, vllm_version=version, engine=engine)


def compiled_elsewhere(cfg: StudyConfig, engine: str) -> Callable[[], frozenset[str]] | None:
    ledger = compile_ledger_of(cfg, engine)
    return ledger.compiled_keys if ledger is not None else None


def engine_version(engine: str, asked: str | None = None) -> str | None:
    """vLLM's installed version (read from its metadata: vllm is not imported), else `asked`
    (the study's `vllm.version`); or the simulated engine's `simulated <the vLLM version it
    mimics>` (`asked`, else 0.26.0); None where unknown."""
    if engine == "simulated":
        from runners.simulated.sizing import ENGINE_VERSION

        return f"simulated {asked or ENGINE_VERSION}"
    return installed_version() or asked

