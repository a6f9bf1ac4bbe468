"""This host's hardware profile, probed: NVML's answers (pynvml, imported lazily) with the
datasheet's ceilings, or, with `measure`, the ceilings measured on GPU 0 (torch, imported
lazily). Without a GPU the profile is empty, never an error. `record_nvml` records NVML's
answers for the replay in tests/fixtures/nvml.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import statistics
from collections.abc import Callable
from typing import Any, TypeVar

from runners.hardware import (
    NVLINK_GBPS_PER_LINK,
    PCIE_GBPS_PER_LANE,
    GpuInfo,
    HardwareProfile,
    Interconnect,
    datasheet_spec,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Every NVML call goes through `nvml`, an object with pynvml's functions and constants: the real
# module by default, a replay of recorded answers in tests.

NVML_P2P_STATUS_OK = 0
NVML_TOPOLOGY_NAMES = {0: "internal", 10: "single", 20: "multiple", 30: "hostbridge",
                       40: "node", 50: "system"}


def load_nvml() -> Any | None:
    """pynvml, initialised; None where there is no NVML (no package, no driver, no GPU)."""
    try:
        import pynvml
    except ImportError:
        logger.debug("pynvml is not installed; no NVML")
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:  # a subclass per cause; any of them means "no NVML"
        logger.debug("nvmlInit failed: %s", exc)
        return None
    return pynvml


def _try(nvml: Any, call: Callable[..., T], *args: Any) -> T | None:
    """One optional NVML answer: None where the call is not supported on this GPU/driver."""
    try:
        return call(*args)
    except nvml.NVMLError as exc:
        logger.debug("NVML %s failed: %s", getattr(call, "__name__", call), exc)
        return None


def _try_int(nvml: Any, call: Callable[..., Any], *args: Any) -> int | None:
    value = _try(nvml, call, *args)
    return int(value) if value is not None else None


def _text(value: object) -> str:
    # pynvml returned bytes before 11.x; the recorded fixtures hold str.
    return value.decode() if isinstance(value, bytes) else str(value)


def _cpu_list(masks: list[int]) -> str:
    """NVML's affinity bitmask words (64 CPUs each) as a list like "0-31,64-95"."""
    cpus = [word_i * 64 + bit for word_i, word in enumerate(masks)
            for bit in range(64) if int(word) >> bit & 1]
    runs: list[list[int]] = []
    for cpu in cpus:
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(f"{a}-{b}" if a != b else f"{a}" for a, b in runs)


def _probe_gpu(nvml: Any, index: int) -> tuple[GpuInfo, Any]:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    cc = _try(nvml, nvml.nvmlDeviceGetCudaComputeCapability, handle)
    memory = _try(nvml, nvml.nvmlDeviceGetMemoryInfo, handle)
    words = math.ceil((os.cpu_count() or 64) / 64)
    affinity = _try(nvml, nvml.nvmlDeviceGetCpuAffinity, handle, words)
    # Older drivers lack nvmlDeviceGetNumaNodeId; -1 means "no NUMA affinity".
    numa = _try_int(nvml, nvml.nvmlDeviceGetNumaNodeId, handle) \
        if hasattr(nvml, "nvmlDeviceGetNumaNodeId") else None
    links = 0
    for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))):
        # Links that do not exist on this GPU answer NVMLError (not supported / invalid).
        links += 1 if _try(nvml, nvml.nvmlDeviceGetNvLinkState, handle, link) else 0
    gpu = GpuInfo(
        index=index,
        name=_text(nvml.nvmlDeviceGetName(handle)),
        uuid=_text(_try(nvml, nvml.nvmlDeviceGetUUID, handle) or ""),
        memory_gib=round(int(memory.total) / 2**30, 2) if memory is not None else 0.0,
        compute_capability=(int(cc[0]), int(cc[1])) if cc is not None else (0, 0),
        pcie_generation=_try_int(nvml, nvml.nvmlDeviceGetCurrPcieLinkGeneration, handle),
        pcie_width=_try_int(nvml, nvml.nvmlDeviceGetCurrPcieLinkWidth, handle),
        numa_node=numa if numa is not None and numa >= 0 else None,
        cpu_affinity=_cpu_list([int(w) for w in affinity]) or None if affinity else None,
        nvlink_active_links=links,
    )
    return gpu, handle


def _pcie_gbps(nvml: Any, handle: Any, gpu: GpuInfo) -> float:
    """Per-direction PCIe bandwidth of one GPU's link. Idle GPUs drop their link to a lower
    generation to save power, so the maximum generation is the better lead when NVML has it."""
    gen = _try_int(nvml, nvml.nvmlDeviceGetMaxPcieLinkGeneration, handle)
    width = _try_int(nvml, nvml.nvmlDeviceGetMaxPcieLinkWidth, handle)
    gen = max(gen or 0, gpu.pcie_generation or 0)
    width = max(width or 0, gpu.pcie_width or 0)
    return round(PCIE_GBPS_PER_LANE.get(gen, 0.0) * width, 1)


def probe(measure: bool = False, nvml: Any | None = None) -> HardwareProfile:
    """This host's GPUs from NVML, with datasheet ceilings (measured ones when `measure` and
    torch with CUDA is importable). `nvml` replaces pynvml (tests replay recorded answers);
    where NVML is missing or fails the profile is empty, never an error."""
    if nvml is None:
        nvml = load_nvml()
        if nvml is None:
            return HardwareProfile()
    else:
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            logger.debug("nvmlInit failed: %s", exc)
            return HardwareProfile()
    try:
        profile = _probe_nvml(nvml)
    except nvml.NVMLError as exc:
        logger.warning("NVML failed while probing the GPUs (%s); using an empty profile", exc)
        return HardwareProfile()
    finally:
        _try(nvml, nvml.nvmlShutdown)  # NVML counts inits: this pairs with ours only
    if measure and profile.has_gpu:
        profile = _with_measurements(profile)
    return profile


def _probe_nvml(nvml: Any) -> HardwareProfile:
    count = int(nvml.nvmlDeviceGetCount())
    probed = [_probe_gpu(nvml, i) for i in range(count)]
    gpus = tuple(g for g, _ in probed)
    handles = [h for _, h in probed]

    driver = _try(nvml, nvml.nvmlSystemGetDriverVersion)
    cuda_int = _try_int(nvml, nvml.nvmlSystemGetCudaDriverVersion_v2)
    # 13000 -> "13.0", 12040 -> "12.4"
    cuda = f"{cuda_int // 1000}.{cuda_int % 1000 // 10}" if cuda_int else None

    nvlink_pairs: dict[str, int] = {}
    ancestors: dict[str, str] = {}
    all_nvlink = count > 1
    p2p_nvlink = int(getattr(nvml, "NVML_P2P_CAPS_INDEX_NVLINK", 2))
    for i in range(count):
        for j in range(i + 1, count):
            status = _try_int(nvml, nvml.nvmlDeviceGetP2PStatus, handles[i], handles[j],
                              p2p_nvlink)
            if status == NVML_P2P_STATUS_OK:
                # Per pair, the links either GPU can drive: on NVSwitch hosts every link of a
                # GPU reaches every peer, and on a two-GPU bridge all links join the pair.
                nvlink_pairs[f"{i}-{j}"] = min(gpus[i].nvlink_active_links,
                                               gpus[j].nvlink_active_links)
            else:
                all_nvlink = False
            level = _try_int(nvml, nvml.nvmlDeviceGetTopologyCommonAncestor, handles[i],
                             handles[j])
            if level is not None:
                ancestors[f"{i}-{j}"] = NVML_TOPOLOGY_NAMES.get(level, str(level))
    if ancestors:
        logger.debug("PCIe common ancestors: %s", ancestors)

    interconnect: Interconnect
    if count <= 1:
        interconnect, link_gbps = "none", 0.0
    elif all_nvlink:
        interconnect = "nvlink"
        link_gbps = min(nvlink_pairs.values()) * NVLINK_GBPS_PER_LINK
    else:
        interconnect = "pcie"
        link_gbps = min(_pcie_gbps(nvml, h, g) for g, h in probed)

    spec = datasheet_spec(gpus[0].name) if gpus else None
    if gpus and spec is None:
        logger.info("no datasheet figures for %s; ceilings stay 0 until measured", gpus[0].name)
    return HardwareProfile(
        gpus=gpus,
        driver_version=_text(driver) if driver is not None else None,
        cuda_version=cuda,
        interconnect=interconnect,
        nvlink_links=nvlink_pairs,
        memory_bandwidth_gbps=spec.memory_bandwidth_gbps if spec else 0.0,
        bf16_tflops=spec.bf16_tflops if spec else 0.0,
        fp8_tflops=spec.fp8_tflops if spec else 0.0,
        interconnect_gbps=link_gbps,
        measured=False,
        source="nvml" if gpus else "empty",
    )


def record_nvml(nvml: Any | None = None, num_samples: int = 4,
                interval_s: float = 0.5) -> dict[str, Any]:
    """This host's NVML answers, per call, in the form the replay in tests/fixtures/nvml reads:
    how those fixtures are recorded on a real machine. An answer NVML refuses is recorded as
    `{"error": "NVML_ERROR_..."}`; `series` holds `num_samples` readings of the sampled calls."""
    import time

    nvml = nvml if nvml is not None else _import_pynvml()
    if nvml is None:
        return {"nvmlInit": {"error": "NVML_ERROR_LIBRARY_NOT_FOUND"}}
    names = {getattr(nvml, n): n for n in dir(nvml) if n.startswith("NVML_ERROR_")}

    def answer(call: Callable[..., Any], *args: Any) -> Any:
        try:
            value = call(*args)
        except nvml.NVMLError as exc:
            return {"error": names.get(getattr(exc, "value", None), str(exc))}
        if isinstance(value, bytes):
            return value.decode()
        if hasattr(value, "_fields_"):  # a ctypes struct: its named fields
            return {f[0]: getattr(value, f[0]) for f in value._fields_
                    if isinstance(getattr(value, f[0]), int | float)}
        if isinstance(value, tuple | list) or hasattr(value, "_length_"):  # ctypes arrays too
            return [int(v) if isinstance(v, int) else v for v in value]
        return value

    constants = {n: getattr(nvml, n) for n in
                 ("NVML_NVLINK_MAX_LINKS", "NVML_P2P_CAPS_INDEX_NVLINK", "NVML_CLOCK_SM")}
    init = answer(nvml.nvmlInit)
    data: dict[str, Any] = {"constants": constants, "nvmlInit": init, "system": {},
                            "devices": [], "pairs": {}}
    if init is not None:
        return data
    try:
        data["system"] = {fn: answer(getattr(nvml, fn)) for fn in
                          ("nvmlSystemGetDriverVersion", "nvmlSystemGetCudaDriverVersion_v2")}
        handles = [nvml.nvmlDeviceGetHandleByIndex(i)
                   for i in range(int(nvml.nvmlDeviceGetCount()))]
        words = math.ceil((os.cpu_count() or 64) / 64)
        for h in handles:
            device = {fn: answer(getattr(nvml, fn), h) for fn in (
                "nvmlDeviceGetName", "nvmlDeviceGetUUID", "nvmlDeviceGetMemoryInfo",
                "nvmlDeviceGetCudaComputeCapability", "nvmlDeviceGetCurrPcieLinkGeneration",
                "nvmlDeviceGetCurrPcieLinkWidth", "nvmlDeviceGetMaxPcieLinkGeneration",
                "nvmlDeviceGetMaxPcieLinkWidth", "nvmlDeviceGetNumaNodeId")}
            device["nvmlDeviceGetCpuAffinity"] = answer(nvml.nvmlDeviceGetCpuAffinity, h, words)
            device["nvmlDeviceGetNvLinkState"] = [
                answer(nvml.nvmlDeviceGetNvLinkState, h, link)
                for link in range(int(constants["NVML_NVLINK_MAX_LINKS"]))]
            device["series"] = {fn: [] for fn in (
                "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetMemoryInfo",
                "nvmlDeviceGetPowerUsage", "nvmlDeviceGetClockInfo")}
            data["devices"].append(device)
        for _ in range(num_samples):
            for h, device in zip(handles, data["devices"], strict=True):
                series = device["series"]
                for fn in ("nvmlDeviceGetUtilizationRates", "nvmlDeviceGetMemoryInfo",
                           "nvmlDeviceGetPowerUsage"):
                    series[fn].append(answer(getattr(nvml, fn), h))
                series["nvmlDeviceGetClockInfo"].append(
                    answer(nvml.nvmlDeviceGetClockInfo, h, constants["NVML_CLOCK_SM"]))
            time.sleep(interval_s)
        for i, j in itertools.combinations(range(len(handles)), 2):
            data["pairs"][f"{i}-{j}"] = {
                "nvmlDeviceGetP2PStatus": answer(nvml.nvmlDeviceGetP2PStatus, handles[i],
                                                 handles[j],
                                                 constants["NVML_P2P_CAPS_INDEX_NVLINK"]),
                "nvmlDeviceGetTopologyCommonAncestor": answer(
                    nvml.nvmlDeviceGetTopologyCommonAncestor, handles[i], handles[j])}
    finally:
        answer(nvml.nvmlShutdown)
    return data


def _import_pynvml() -> Any | None:
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


# ---------------------------------------------------------------------------------------------
# Measured ceilings: what this GPU really sustains, which is what a roofline should use.


def measure_copy_gbps(num_bytes: int = 2 << 30, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth of GPU 0 in GB/s, counting bytes read plus written."""
    import torch

    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: first touch, allocator
    rates = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        rates.append(2 * num_bytes / (start.elapsed_time(end) / 1e3) / 1e9)
    del src, dst
    torch.cuda.empty_cache()
    return float(statistics.median(rates))


def measure_bf16_tflops(n: int = 8192, repeats: int = 20) -> float:
    """Dense bf16 matmul rate of GPU 0 in TFLOP/s on random data (zeros would flatter the
    clock: tensor cores draw less power on them)."""
    import torch

    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        torch.matmul(a, b)
    rates = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.matmul(a, b)
        end.record()
        end.synchronize()
        rates.append(2 * n**3 / (start.elapsed_time(end) / 1e3) / 1e12)
    del a, b
    torch.cuda.empty_cache()
    return float(statistics.median(rates))


def _with_measurements(profile: HardwareProfile) -> HardwareProfile:
    try:
        import torch
    except ImportError:
        logger.info("torch is not importable; keeping datasheet ceilings")
        return profile
    if not torch.cuda.is_available():
        logger.info("torch sees no CUDA device; keeping datasheet ceilings")
        return profile
    bandwidth = measure_copy_gbps()
    tflops = measure_bf16_tflops()
    logger.info("measured on %s: %.0f GB/s copy, %.0f TFLOP/s bf16",
                profile.gpu_name, bandwidth, tflops)
    # fp8 is not measured: it keeps the datasheet's ratio to bf16 (2x on Hopper and Ada), so an
    # fp8 GEMM is judged against the same clock and power the bf16 measurement saw.
    fp8 = profile.fp8_tflops * tflops / profile.bf16_tflops \
        if profile.fp8_tflops > 0 and profile.bf16_tflops > 0 else 0.0
    return HardwareProfile(**{**profile.__dict__, "memory_bandwidth_gbps": round(bandwidth, 1),
                              "bf16_tflops": round(tflops, 1), "fp8_tflops": round(fp8, 1),
                              "measured": True})
