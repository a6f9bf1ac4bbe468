"""Hardware probe on recorded NVML answers (tests/fixtures/nvml), datasheet ceilings, presets.

`ReplayNvml` is a module-like double of pynvml that answers from a fixture file; the telemetry
tests use it too.
"""

from __future__ import annotations

import json
import shutil
from itertools import count
from pathlib import Path
from typing import Any

import pytest

from runners.hardware import (
    GpuInfo,
    HardwareProfile,
    datasheet_spec,
    load_preset,
    preset_names,
    save_profile,
)
from runners.hardware_probe import probe, record_nvml

NVML_FIXTURES = Path(__file__).parents[1] / "fixtures" / "nvml"
ERROR_CODES = {"NVML_ERROR_NOT_SUPPORTED": 3, "NVML_ERROR_DRIVER_NOT_LOADED": 9,
               "NVML_ERROR_LIBRARY_NOT_FOUND": 12, "NVML_ERROR_INVALID_ARGUMENT": 2,
               "NVML_ERROR_NOT_FOUND": 6}


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


class _Record:
    """Attribute access over a recorded struct (`.total`, `.gpu`), with `_fields_` as pynvml's
    ctypes structs have."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.__dict__.update(data)
        self._fields_ = [(key, None) for key in data]


class ReplayNvml:
    """pynvml's functions used by runners/, answering from one recorded fixture.

    A recorded `{"error": NAME}` raises NVMLError; a device's `series` lists successive answers
    of a sampled call (the last one repeats); handles are the device indices."""

    NVMLError = NVMLError

    def __init__(self, name: str | dict[str, Any]) -> None:
        self.data = name if isinstance(name, dict) else \
            json.loads((NVML_FIXTURES / f"{name}.json").read_text())
        for key, value in {**self.data["constants"], **ERROR_CODES}.items():
            setattr(self, key, value)
        self.calls: list[str] = []
        self.num_inits = 0
        self._series_pos: dict[tuple[int, str], count[int]] = {}

    def _answer(self, value: Any) -> Any:
        if isinstance(value, dict) and set(value) == {"error"}:
            raise NVMLError(ERROR_CODES[value["error"]])
        return _Record(value) if isinstance(value, dict) else value

    def _device(self, handle: int, fn: str) -> Any:
        self.calls.append(fn)
        device = self.data["devices"][handle]
        series = device.get("series", {}).get(fn)
        if series is not None:
            i = next(self._series_pos.setdefault((handle, fn), count()))
            return self._answer(series[min(i, len(series) - 1)])
        return self._answer(device[fn])

    def nvmlInit(self) -> None:
        self.calls.append("nvmlInit")
        self._answer(self.data["nvmlInit"] or {})
        self.num_inits += 1

    def nvmlShutdown(self) -> None:
        self.num_inits -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        return str(self._answer(self.data["system"]["nvmlSystemGetDriverVersion"]))

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        return int(self._answer(self.data["system"]["nvmlSystemGetCudaDriverVersion_v2"]))

    def nvmlDeviceGetCount(self) -> int:
        return len(self.data["devices"])

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        if not 0 <= index < len(self.data["devices"]):
            raise NVMLError(ERROR_CODES["NVML_ERROR_INVALID_ARGUMENT"])
        return index

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> int:
        uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
        for i, device in enumerate(self.data["devices"]):
            if device["nvmlDeviceGetUUID"] == uuid:
                return i
        raise NVMLError(ERROR_CODES["NVML_ERROR_NOT_FOUND"])

    def __getattr__(self, fn: str) -> Any:
        # Every per-device call: (handle, *args) -> recorded answer.
        if not fn.startswith("nvmlDevice"):
            raise AttributeError(fn)

        def call(handle: int, *args: Any) -> Any:
            if fn == "nvmlDeviceGetNvLinkState":
                self.calls.append(fn)
                links = self.data["devices"][handle][fn]
                if args[0] >= len(links):
                    raise NVMLError(ERROR_CODES["NVML_ERROR_INVALID_ARGUMENT"])
                return self._answer(links[args[0]])
            if fn in ("nvmlDeviceGetP2PStatus", "nvmlDeviceGetTopologyCommonAncestor"):
                self.calls.append(fn)
                if fn == "nvmlDeviceGetP2PStatus":
                    assert args[1] == self.NVML_P2P_CAPS_INDEX_NVLINK, "only NVLink is recorded"
                pair = self.data["pairs"][f"{min(handle, args[0])}-{max(handle, args[0])}"]
                return self._answer(pair[fn])
            if fn == "nvmlDeviceGetClockInfo":
                assert args[0] == self.NVML_CLOCK_SM, "only the SM clock is recorded"
            return self._device(handle, fn)

        return call


@pytest.fixture(params=["h200", "8xh100_nvlink", "2x4090_pcie", "no_gpu"])
def any_nvml(request: pytest.FixtureRequest) -> ReplayNvml:
    nvml = ReplayNvml(request.param)
    nvml.data["_name"] = request.param
    return nvml


# ---------------------------------------------------------------------------------- probe


def test_probe_h200_reads_one_gpu_driver_and_cuda() -> None:
    profile = probe(nvml=ReplayNvml("h200"))
    assert profile.source == "nvml" and profile.num_gpus == 1
    gpu = profile.gpus[0]
    assert gpu.name == "NVIDIA H200"
    assert gpu.uuid.startswith("GPU-")
    assert gpu.memory_gib == pytest.approx(140.4, abs=0.1)
    assert gpu.compute_capability == (9, 0)
    assert (gpu.pcie_generation, gpu.pcie_width) == (5, 16)
    assert gpu.numa_node is None, "NOT_SUPPORTED on the lent H200"
    assert gpu.cpu_affinity == "0-15"
    assert gpu.nvlink_active_links == 0, "all 36 link queries answer NOT_SUPPORTED there"
    assert profile.driver_version == "580.159.04"
    assert profile.cuda_version == "13.0", "13000 from NVML reads as 13.0"
    assert profile.interconnect == "none" and profile.interconnect_gbps == 0
    assert profile.hardware_class == "hopper"
    assert (profile.memory_bandwidth_gbps, profile.bf16_tflops, profile.fp8_tflops) == \
        (4800, 989, 1979)
    assert not profile.measured


def test_probe_8xh100_sees_an_all_to_all_nvlink_host() -> None:
    profile = probe(nvml=ReplayNvml("8xh100_nvlink"))
    assert profile.num_gpus == 8
    assert profile.interconnect == "nvlink"
    assert len(profile.nvlink_links) == 28 and set(profile.nvlink_links.values()) == {18}
    assert profile.interconnect_gbps == 450, "18 NVLink 4 links x 25 GB/s per direction"
    assert all(g.nvlink_active_links == 18 for g in profile.gpus)
    assert profile.gpus[5].numa_node == 1
    assert profile.gpus[0].cpu_affinity == "0-55,112-167"
    assert profile.memory_bandwidth_gbps == 3350, "H100 SXM, not the PCIe figure"


def test_probe_2x4090_is_pcie_rated_at_the_maximum_link_generation() -> None:
    profile = probe(nvml=ReplayNvml("2x4090_pcie"))
    assert profile.interconnect == "pcie"
    assert profile.nvlink_links == {}
    assert profile.gpus[0].pcie_generation == 1, "the current (idle) generation is recorded"
    assert profile.interconnect_gbps == pytest.approx(31.5), "gen 4 x16, not the idle gen 1"
    assert profile.gpus[0].numa_node is None, "NOT_SUPPORTED answers leave the field empty"
    assert profile.hardware_class == "24gb"
    assert profile.compute_capability == pytest.approx(8.9)


def test_probe_without_driver_is_empty_and_does_not_raise() -> None:
    profile = probe(nvml=ReplayNvml("no_gpu"))
    assert profile == HardwareProfile()
    assert profile.source == "empty" and not profile.has_gpu


def test_probe_pairs_every_init_with_a_shutdown(any_nvml: ReplayNvml) -> None:
    probe(nvml=any_nvml)
    assert any_nvml.num_inits == 0


def test_probe_with_measure_on_a_cpu_box_keeps_datasheet_figures() -> None:
    try:
        import torch

        if torch.cuda.is_available():
            pytest.skip("a CUDA device is present: measurement would run")
    except ImportError:
        pass
    profile = probe(measure=True, nvml=ReplayNvml("h200"))
    assert not profile.measured and profile.memory_bandwidth_gbps == 4800


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a real GPU is present")
def test_probe_with_real_pynvml_on_a_host_without_gpu_is_empty() -> None:
    assert probe().source == "empty"


@pytest.mark.gpu
def test_probe_real_gpu_with_measurement() -> None:
    profile = probe(measure=True)
    assert profile.has_gpu and profile.measured
    assert profile.memory_bandwidth_gbps > 100 and profile.bf16_tflops > 10


def test_record_nvml_captures_what_probe_reads(any_nvml: ReplayNvml) -> None:
    recorded = record_nvml(any_nvml, num_samples=2, interval_s=0)
    json.dumps(recorded)  # a fixture must be plain JSON
    assert probe(nvml=ReplayNvml(recorded)) == probe(nvml=ReplayNvml(any_nvml.data["_name"]))


# ---------------------------------------------------------------------------------- ceilings


@pytest.mark.parametrize(("name", "bandwidth_gbps"), [
    ("NVIDIA H200", 4800),
    ("NVIDIA H100 80GB HBM3", 3350),
    ("NVIDIA H100 PCIe", 2000),
    ("NVIDIA A100-SXM4-80GB", 2039),
    ("NVIDIA A100 80GB PCIe", 2039),
    ("NVIDIA A100-SXM4-40GB", 1555),
    ("NVIDIA L40S", 864),
    ("NVIDIA GeForce RTX 4090", 1008),
    ("NVIDIA A10", 600),
    ("NVIDIA L4", 300),
])
def test_datasheet_matches_the_most_specific_name(name: str, bandwidth_gbps: float) -> None:
    spec = datasheet_spec(name)
    assert spec is not None and spec.memory_bandwidth_gbps == bandwidth_gbps


def test_unknown_gpu_has_no_datasheet_entry() -> None:
    assert datasheet_spec("Tesla T4") is None
    assert datasheet_spec("NVIDIA GH200 480GB") is None, "not an H200: its HBM differs"


# ---------------------------------------------------------------------------------- presets


def test_every_preset_loads_and_says_where_it_came_from() -> None:
    names = preset_names()
    assert {"h200", "h100-8x-nvlink", "a100-80gb", "rtx4090-2x-pcie", "l4"} <= set(names)
    for name in names:
        raw = json.loads((Path(__file__).parents[2] / "runners" / "hardware_profiles"
                          / f"{name}.json").read_text())
        assert raw.get("_recorded"), f"{name}.json must say where its figures come from"
        profile = load_preset(name)
        assert profile.source == f"preset:{name}" and profile.has_gpu


@pytest.mark.parametrize(("name", "hardware_class", "interconnect"), [
    ("h100-8x-nvlink", "hopper", "nvlink"),
    ("a100-80gb", "ampere", "none"),
    ("rtx4090-2x-pcie", "24gb", "pcie"),
    ("l4", "24gb", "none"),
])
def test_presets_classify_as_expected(name: str, hardware_class: str, interconnect: str) -> None:
    profile = load_preset(name)
    assert profile.hardware_class == hardware_class
    assert profile.interconnect == interconnect


def test_save_profile_round_trips_through_load_preset(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # Patched by string path because load_preset reads only its own directory; pointing it at
    # tmp_path is the one way to read back what save_profile wrote without touching the repo.
    monkeypatch.setattr("runners.hardware.PRESETS_DIR", tmp_path)
    profile = probe(nvml=ReplayNvml("8xh100_nvlink"))
    save_profile(profile, tmp_path / "probed.json", note="probed in a test")
    loaded = load_preset("probed")
    assert loaded.gpus == profile.gpus
    assert loaded.nvlink_links == profile.nvlink_links
    assert json.loads((tmp_path / "probed.json").read_text())["_recorded"] == "probed in a test"


@pytest.mark.parametrize(("name", "memory_gib", "capability", "expected"), [
    ("NVIDIA H100 80GB HBM3", 79.6, (9, 0), "hopper"),
    ("NVIDIA H20", 95.6, (9, 0), "hopper"),
    ("NVIDIA B200", 178.4, (10, 0), "blackwell"),
    ("NVIDIA GeForce RTX 5090", 31.4, (12, 0), "blackwell"),
    ("NVIDIA GeForce RTX 5080", 15.5, (12, 0), "24gb"),
    ("NVIDIA L40S", 44.4, (8, 9), "other"),
])
def test_the_hardware_class_is_hopper_only_for_hopper(
        name: str, memory_gib: float, capability: tuple[int, int], expected: str) -> None:
    # A Blackwell card read as "hopper" took Hopper's space, template and every fact measured
    # on Hopper (bundled or learned by earlier studies: both keyed by class).
    profile = HardwareProfile(gpus=(GpuInfo(0, name, memory_gib=memory_gib,
                                            compute_capability=capability),))
    assert profile.hardware_class == expected
