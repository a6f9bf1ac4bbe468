"""The hardware profile: what GPUs a machine has, how they are linked, and their ceilings
(datasheet figures by GPU name); recorded profiles by name (`load_preset`) for the simulated
engine and tests. `runners/hardware_probe.py` reads this host's profile from NVML.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from runners.atomic import write_atomic

logger = logging.getLogger(__name__)

PRESETS_DIR = Path(__file__).parent / "hardware_profiles"

Interconnect = Literal["nvlink", "pcie", "none"]
HardwareClass = Literal["hopper", "blackwell", "ampere", "24gb", "other", "none"]


@dataclass(frozen=True)
class GpuInfo:
    index: int  # NVML (physical) index
    name: str
    uuid: str = ""
    memory_gib: float = 0.0
    compute_capability: tuple[int, int] = (0, 0)
    pcie_generation: int | None = None
    pcie_width: int | None = None
    numa_node: int | None = None
    cpu_affinity: str | None = None  # e.g. "0-31"
    nvlink_active_links: int = 0  # NVLink links up on this GPU


@dataclass(frozen=True)
class HardwareProfile:
    """One host's GPUs. Ceilings are measured where `measured` is True, else datasheet leads."""

    gpus: tuple[GpuInfo, ...] = ()
    driver_version: str | None = None
    cuda_version: str | None = None
    interconnect: Interconnect = "none"  # worst link between any two GPUs of the host
    nvlink_links: dict[str, int] = field(default_factory=dict)  # "i-j" -> active links
    memory_bandwidth_gbps: float = 0.0  # GB/s, one GPU
    bf16_tflops: float = 0.0  # dense, one GPU
    fp8_tflops: float = 0.0  # dense, one GPU; 0 where the chip has none
    interconnect_gbps: float = 0.0  # GB/s per direction between two GPUs
    measured: bool = False
    source: str = "empty"  # "nvml", "preset:<name>" or "empty"

    @property
    def num_gpus(self) -> int:
        return len(self.gpus)

    @property
    def has_gpu(self) -> bool:
        return bool(self.gpus)

    @property
    def gpu_name(self) -> str:
        return self.gpus[0].name if self.gpus else "none"

    @property
    def compute_capability(self) -> float:
        """The smallest compute capability on the host, as a number (9.0, 8.9, 8.0)."""
        if not self.gpus:
            return 0.0
        major, minor = min(g.compute_capability for g in self.gpus)
        return major + minor / 10

    @property
    def gpu_memory_gib(self) -> float:
        return min((g.memory_gib for g in self.gpus), default=0.0)

    @property
    def hardware_class(self) -> HardwareClass:
        if not self.gpus:
            return "none"
        if 9.0 <= self.compute_capability < 10.0:
            return "hopper"
        if self.gpu_memory_gib <= 26:
            return "24gb"
        if self.compute_capability >= 10.0:
            # Blackwell (B200 10.0, RTX 50xx 12.0) is not Hopper: neither Hopper's template,
            # space nor the facts measured there (known or learned, keyed by class) carry over.
            return "blackwell"
        if self.compute_capability >= 8.0 and "A100" in self.gpu_name:
            return "ampere"
        return "other"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["hardware_class"] = self.hardware_class
        d["compute_capability"] = self.compute_capability
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HardwareProfile:
        data = dict(data)
        data.pop("hardware_class", None)
        data.pop("compute_capability", None)
        data.pop("_recorded", None)
        gpus = tuple(
            GpuInfo(**{**g, "compute_capability": tuple(g.get("compute_capability", (0, 0)))})
            for g in data.pop("gpus", ())
        )
        return cls(gpus=gpus, **data)


def load_preset(name: str) -> HardwareProfile:
    """A recorded profile by name (file stem under `hardware_profiles/`)."""
    path = PRESETS_DIR / f"{name}.json"
    if not path.is_file():
        valid = ", ".join(sorted(p.stem for p in PRESETS_DIR.glob("*.json")))
        raise ValueError(f"unknown hardware preset {name!r}; valid: {valid}")
    profile = HardwareProfile.from_dict(json.loads(path.read_text()))
    return HardwareProfile(**{**profile.__dict__, "source": f"preset:{name}"})


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.json"))


def save_profile(profile: HardwareProfile, path: Path, note: str | None = None) -> None:
    """Write a profile as `load_preset` reads it; `note` becomes its `_recorded` line."""
    data: dict[str, Any] = {"_recorded": note} if note else {}
    data.update(profile.to_dict())
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(data, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------
# Datasheet ceilings. Dense figures per GPU, first matching name wins (so "H100 PCIe" is tried
# before the SXM "H100", "A100 80GB" before "A100", and "A10"/"L4" do not catch A100/L40S).


@dataclass(frozen=True)
class GpuSpec:
    memory_bandwidth_gbps: float  # GB/s
    bf16_tflops: float  # dense
    fp8_tflops: float  # dense; 0 where the chip has no FP8 tensor cores


DATASHEET: tuple[tuple[re.Pattern[str], GpuSpec], ...] = (
    # not GH200: its HBM (96 GB HBM3 at 4.0 TB/s, 144 GB HBM3e at 4.9) is not H200's
    (re.compile(r"(?<!G)H200"), GpuSpec(4800, 989, 1979)),
    (re.compile(r"H100.*PCIe", re.IGNORECASE), GpuSpec(2000, 756, 1513)),
    (re.compile(r"H100"), GpuSpec(3350, 989, 1979)),
    (re.compile(r"A100.*80\s*GB", re.IGNORECASE), GpuSpec(2039, 312, 0)),
    (re.compile(r"A100"), GpuSpec(1555, 312, 0)),
    (re.compile(r"L40S"), GpuSpec(864, 362, 733)),
    (re.compile(r"RTX 4090"), GpuSpec(1008, 165, 330)),
    (re.compile(r"\bA10(?!\d)"), GpuSpec(600, 125, 0)),
    (re.compile(r"\bL4(?!\d)"), GpuSpec(300, 121, 242)),
)

NVLINK_GBPS_PER_LINK = 25.0  # GB/s per direction per link, NVLink 3 (A100) and 4 (H100/H200)
PCIE_GBPS_PER_LANE = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}  # per direction


def datasheet_spec(gpu_name: str) -> GpuSpec | None:
    """The datasheet ceilings for an NVML device name, or None for a GPU we have no figures for."""
    for pattern, spec in DATASHEET:
        if pattern.search(gpu_name):
            return spec
    return None
