"""TelemetrySampler on recorded NVML answers (tests/fixtures/nvml) replayed by ReplayNvml."""

from __future__ import annotations

import shutil
import time

import pytest

from runners.telemetry import TelemetrySampler
from tests.runners.test_hardware import ReplayNvml

H200_UUID = "GPU-b31e1465-1cf8-90ac-8df9-d86d075754f8"


def sample(sampler: TelemetrySampler, times: int) -> dict[str, float]:
    """Start, take `times` samples deterministically, stop. The thread's own samples are kept
    out by a long interval: its first sample happens at start, before ours."""
    sampler.start()
    for _ in range(times):
        sampler.sample_once()
    return sampler.stop()


def test_summary_of_the_recorded_idle_h200() -> None:
    nvml = ReplayNvml("h200")
    sampler = TelemetrySampler([0], interval_s=60, nvml=nvml, visible_devices="0")
    summary = sample(sampler, 3)
    # Four recorded samples: the thread's first one at start, then our three.
    assert summary["num_samples"] == 4 and summary["num_gpus"] == 1
    assert summary["gpu_util_mean_pct"] == 0 and summary["mem_util_max_pct"] == 0
    assert summary["gpu_mem_used_max_gib"] == pytest.approx(644939776 / 2**30, abs=1e-3)
    assert summary["power_mean_w"] == pytest.approx((78.718 + 78.721 + 78.693 + 78.699) / 4,
                                                    abs=1e-3), "NVML reports milliwatts"
    assert summary["power_total_mean_w"] == summary["power_mean_w"], "one GPU: total = per GPU"
    assert summary["sm_clock_min_mhz"] == 345 == summary["sm_clock_max_mhz"]
    assert nvml.num_inits == 0, "every nvmlInit is paired with a shutdown"


def test_uuid_in_cuda_visible_devices_is_resolved_by_uuid() -> None:
    nvml = ReplayNvml("8xh100_nvlink")
    uuids = [d["nvmlDeviceGetUUID"] for d in nvml.data["devices"]]
    sampler = TelemetrySampler([0, 1], interval_s=60, nvml=nvml,
                               visible_devices=f"{uuids[6]},{uuids[3]}")
    summary = sample(sampler, 1)
    assert summary["num_gpus"] == 2
    # Device 6 starts at 77 % and device 3 at 74 % in the recording; both then read 90 %.
    assert summary["gpu_util_mean_pct"] == pytest.approx((77 + 74 + 90 + 90) / 4)
    assert summary["power_total_mean_w"] == pytest.approx(((486 + 483) + (520 + 520)) / 2)


def test_physical_indices_in_cuda_visible_devices_map_logical_devices() -> None:
    nvml = ReplayNvml("8xh100_nvlink")
    summary = sample(TelemetrySampler([0], interval_s=60, nvml=nvml, visible_devices="5,2"), 0)
    assert summary["gpu_util_max_pct"] == 76, "logical device 0 is physical GPU 5"


def test_shortened_uuid_matches_by_prefix() -> None:
    nvml = ReplayNvml("h200")
    summary = sample(TelemetrySampler(None, interval_s=60, nvml=nvml,
                                      visible_devices=H200_UUID[:12]), 0)
    assert summary["num_gpus"] == 1


def test_all_visible_gpus_when_no_indices_are_given() -> None:
    nvml = ReplayNvml("2x4090_pcie")
    summary = sample(TelemetrySampler(None, interval_s=60, nvml=nvml, visible_devices=""), 0)
    assert summary["num_gpus"] == 2


def test_unsupported_power_is_left_out_not_zero() -> None:
    summary = sample(TelemetrySampler(None, interval_s=60, nvml=ReplayNvml("2x4090_pcie"),
                                      visible_devices="0,1"), 2)
    assert "power_mean_w" not in summary and "power_total_mean_w" not in summary
    assert summary["gpu_util_mean_pct"] == 98


def test_no_driver_gives_an_empty_summary_and_never_raises() -> None:
    sampler = TelemetrySampler([0], nvml=ReplayNvml("no_gpu"))
    sampler.start()
    sampler.sample_once()
    assert sampler.stop() == {}


def test_unknown_device_is_skipped_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    nvml = ReplayNvml("h200")
    summary = sample(TelemetrySampler(["GPU-does-not-exist"], interval_s=60, nvml=nvml), 0)
    assert summary == {}
    assert "no NVML device" in caplog.text
    assert nvml.num_inits == 0


def test_thread_samples_on_its_own_until_stopped() -> None:
    nvml = ReplayNvml("h200")
    with TelemetrySampler([0], interval_s=0.01, nvml=nvml, visible_devices="0") as sampler:
        deadline = time.monotonic() + 5
        while sampler.summary().get("num_samples", 0) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    summary = sampler.stop()
    assert summary["num_samples"] >= 3
    assert sampler.stop() == summary, "stop is idempotent"


def test_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="interval_s must be > 0"):
        TelemetrySampler([0], interval_s=0)


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a real GPU is present")
def test_real_pynvml_without_gpu_gives_empty_summary() -> None:
    sampler = TelemetrySampler([0], interval_s=0.01)
    sampler.start()
    assert sampler.stop() == {}
