"""GPU telemetry over a load: a background thread samples NVML (utilisation, memory, power, SM
clock) for the GPUs a trial uses and summarises them when stopped.

Without NVML or a GPU the sampler does nothing and its summary is empty; it never raises.
"""

from __future__ import annotations

import logging
import os
import statistics
import threading
import time
from collections.abc import Sequence
from typing import Any

from runners.hardware_probe import load_nvml

logger = logging.getLogger(__name__)

QUANTITIES = ("gpu_util_pct", "mem_util_pct", "gpu_mem_used_gib", "power_w", "sm_clock_mhz")


def _resolve_handles(nvml: Any, gpu_indices: Sequence[int | str] | None,
                     visible_devices: str | None) -> list[Any]:
    """NVML handles for CUDA device indices as the engine process sees them.

    NVML counts physical GPUs; CUDA counts those in CUDA_VISIBLE_DEVICES, whose entries are
    physical indices or UUIDs (`GPU-...`, possibly shortened). UUIDs are matched by UUID, the
    one name both APIs share. A `str` in `gpu_indices` is taken as a UUID directly."""
    entries = [e.strip() for e in visible_devices.split(",") if e.strip()] \
        if visible_devices else []
    if gpu_indices is None:
        wanted: list[int | str] = list(range(len(entries))) if entries \
            else list(range(int(nvml.nvmlDeviceGetCount())))
    else:
        wanted = list(gpu_indices)

    handles = []
    for item in wanted:
        entry: str = item if isinstance(item, str) else (
            entries[item] if entries and item < len(entries) else str(item))
        handle = _handle(nvml, entry)
        if handle is None:
            logger.warning("no NVML device for CUDA device %r (CUDA_VISIBLE_DEVICES=%r); not "
                           "sampling it", item, visible_devices)
        else:
            handles.append(handle)
    return handles


def _handle(nvml: Any, entry: str) -> Any | None:
    try:
        if entry.isdigit():
            return nvml.nvmlDeviceGetHandleByIndex(int(entry))
        try:
            return nvml.nvmlDeviceGetHandleByUUID(entry)
        except nvml.NVMLError:
            # A shortened UUID ("GPU-5b1e2f8c") is valid for CUDA but not for NVML: match the
            # prefix among all devices.
            for i in range(int(nvml.nvmlDeviceGetCount())):
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                uuid = nvml.nvmlDeviceGetUUID(handle)
                uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
                if uuid.startswith(entry):
                    return handle
    except nvml.NVMLError as exc:
        logger.debug("NVML lookup of %r failed: %s", entry, exc)
    return None


class TelemetrySampler:
    """Samples the given GPUs every `interval_s` seconds between `start()` and `stop()`.

    `gpu_indices` are CUDA device indices of the engine process (None: all it sees), resolved
    through `visible_devices` (default: this process's CUDA_VISIBLE_DEVICES). `nvml` replaces
    pynvml (tests replay recorded answers). Called by the runner around the load levels; it
    owns one daemon thread and nothing else.
    """

    def __init__(self, gpu_indices: Sequence[int | str] | None = None, interval_s: float = 0.5,
                 *, nvml: Any | None = None, visible_devices: str | None = None) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0 but got {interval_s}.")
        self.gpu_indices = gpu_indices
        self.interval_s = interval_s
        self._nvml = nvml
        self._visible = visible_devices if visible_devices is not None \
            else os.environ.get("CUDA_VISIBLE_DEVICES")
        self._handles: list[Any] = []
        self._samples: dict[str, list[float]] = {q: [] for q in QUANTITIES}
        self._power_totals_w: list[float] = []
        # (monotonic s, mean utilisation over the GPUs) of each sample: a load level's own mean.
        self._util_series: list[tuple[float, float]] = []
        self._num_samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Begin sampling; a no-op (with one DEBUG line) where there is no NVML."""
        if self._thread is not None:
            return
        nvml = self._nvml if self._nvml is not None else load_nvml()
        if nvml is None:
            return
        if self._nvml is not None:
            try:
                nvml.nvmlInit()
            except nvml.NVMLError as exc:
                logger.debug("nvmlInit failed: %s; no telemetry", exc)
                return
        self._nvml = nvml
        try:
            self._handles = _resolve_handles(nvml, self.gpu_indices, self._visible)
        except nvml.NVMLError as exc:
            logger.warning("NVML failed while finding the GPUs (%s); no telemetry", exc)
            self._handles = []
        if not self._handles:
            self._shutdown()
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="nightshift-telemetry",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> dict[str, float]:
        """End sampling and summarise: mean and max per quantity over all samples of all GPUs,
        plus `power_total_mean_w` (all GPUs together) and `num_samples`; {} without data."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=max(5.0, 4 * self.interval_s))
            self._thread = None
            self._shutdown()
        return self.summary()

    def summary(self) -> dict[str, float]:
        with self._lock:
            if self._num_samples == 0:
                return {}
            out: dict[str, float] = {"num_samples": float(self._num_samples),
                                     "num_gpus": float(len(self._handles))}
            for quantity in QUANTITIES:
                values = self._samples[quantity]
                if not values:
                    continue  # not supported on this GPU (e.g. power on some boards)
                stem, _, unit = quantity.rpartition("_")
                out[f"{stem}_mean_{unit}"] = round(statistics.fmean(values), 3)
                out[f"{stem}_max_{unit}"] = round(max(values), 3)
            if self._samples["sm_clock_mhz"]:
                # A falling clock under load is the throttling signal; the mean hides it.
                out["sm_clock_min_mhz"] = round(min(self._samples["sm_clock_mhz"]), 3)
            if self._power_totals_w:
                out["power_total_mean_w"] = round(statistics.fmean(self._power_totals_w), 3)
            return out

    def gpu_util_mean_pct_since(self, start_s: float) -> float | None:
        """Mean NVML utilisation (a kernel running, all GPUs) of the samples taken since
        `start_s` (`time.monotonic()`), e.g. over one load level; None without such samples."""
        with self._lock:
            values = [u for t, u in self._util_series if t >= start_s]
        return round(statistics.fmean(values), 3) if values else None

    def sample_once(self) -> None:
        """Take one sample of every GPU now (the thread calls this; tests may too)."""
        nvml = self._nvml
        if nvml is None:
            return
        values: dict[str, list[float]] = {q: [] for q in QUANTITIES}
        power_total = 0.0
        has_power = False
        for handle in self._handles:
            util = self._read(nvml.nvmlDeviceGetUtilizationRates, handle)
            if util is not None:
                values["gpu_util_pct"].append(float(util.gpu))
                values["mem_util_pct"].append(float(util.memory))
            memory = self._read(nvml.nvmlDeviceGetMemoryInfo, handle)
            if memory is not None:
                values["gpu_mem_used_gib"].append(int(memory.used) / 2**30)
            power_mw = self._read(nvml.nvmlDeviceGetPowerUsage, handle)
            if power_mw is not None:
                values["power_w"].append(float(power_mw) / 1000)
                power_total += float(power_mw) / 1000
                has_power = True
            clock = self._read(nvml.nvmlDeviceGetClockInfo, handle, nvml.NVML_CLOCK_SM)
            if clock is not None:
                values["sm_clock_mhz"].append(float(clock))
        if not any(values.values()):
            return
        with self._lock:
            if values["gpu_util_pct"]:
                self._util_series.append((time.monotonic(),
                                          statistics.fmean(values["gpu_util_pct"])))
            for quantity, got in values.items():
                self._samples[quantity].extend(got)
            if has_power:
                self._power_totals_w.append(power_total)
            self._num_samples += 1

    def _read(self, call: Any, *args: Any) -> Any | None:
        nvml = self._nvml
        try:
            return call(*args)
        except nvml.NVMLError:  # type: ignore[union-attr]
            return None  # not supported on this GPU; the quantity stays out of the summary

    def _run(self) -> None:
        try:
            while True:
                self.sample_once()
                if self._stop.wait(self.interval_s):
                    break
        except Exception:
            # A sampler must never take the trial down with it: log the bug, keep what we have.
            logger.exception("telemetry sampling stopped early")

    def _shutdown(self) -> None:
        nvml = self._nvml
        if nvml is None:
            return
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError as exc:
            logger.debug("nvmlShutdown failed: %s", exc)

    def __enter__(self) -> TelemetrySampler:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
