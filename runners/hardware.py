"""The hardware profile: what GPUs a machine has, how they are linked, and their ceilings.

`probe()` reads NVML (pynvml, imported lazily); `load_preset()` gives recorded profiles used by
the simulated engine and tests. Without a GPU the profile is empty, never an error.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

PRESETS_DIR = Path(__file__).parent / "hardware_profiles"

Interconnect = Literal["nvlink", "pcie", "none"]
HardwareClass = Literal["hopper", "ampere", "24gb", "other", "none"]


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
        if self.compute_capability >= 9.0:
            return "hopper"
        if self.gpu_memory_gib <= 26:
            return "24gb"
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
