"""The study files that spend device time (bench/h200/) and the quickstart load, resolve their
search space on the hardware they were written for, and seed configs of that space: a typo
found here costs a second, found on the lent GPU it costs a session."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import yaml

from optimizer.config import StudyConfig, load_study
from optimizer.run.seeds import seed_trial_params
from optimizer.run.space_context import space_context
from runners.hardware import load_preset
from runners.model_info import load_model_info
from search_spaces import ResolvedSpace, load_space

ROOT = Path(__file__).resolve().parents[1]
STUDIES = sorted(p for p in [*ROOT.glob("bench/h200/*.yaml"), *ROOT.glob("examples/*.yaml")]
                 if "model" in (yaml.safe_load(p.read_text()) or {}))


def _resolved(path: Path) -> tuple[StudyConfig, ResolvedSpace]:
    cfg = load_study(path)
    name = cfg.spec.search_space
    local = path.parent / name
    space = load_space(local if local.is_file() else ("hopper" if name == "auto" else name))
    model = load_model_info(cfg.spec.model.path)
    return cfg, space.resolve(space_context(load_preset("h200"), model))


@pytest.mark.parametrize("path", STUDIES, ids=[p.name for p in STUDIES])
def test_study_file_loads_and_its_seeds_are_configs_of_its_space(path: Path) -> None:
    cfg, resolved = _resolved(path)
    seeds = seed_trial_params(cfg, resolved)
    keys = [json.dumps(s, sort_keys=True) for s in seeds]
    assert len(set(keys)) == len(keys), "no seed repeats another"
    assert json.dumps(resolved.defaults(), sort_keys=True) not in keys, \
        "the defaults run first anyway"


def test_the_h200_grid_seeds_every_config_of_its_grid_once() -> None:
    cfg, resolved = _resolved(ROOT / "bench/h200/grid.yaml")
    configs = [resolved.defaults(), *seed_trial_params(cfg, resolved)]
    axes = {"attention_backend": ["auto", "FLASHINFER", "TRITON_ATTN"],
            "kv_cache_dtype": ["auto", "fp8"], "quantization": ["none", "fp8"],
            "enforce_eager": [False, True], "max_num_batched_tokens": [8192, 2048]}
    grid = {json.dumps(dict(zip(axes, values, strict=True)), sort_keys=True)
            for values in itertools.product(*axes.values())}
    seen = [json.dumps({k: c[k] for k in axes}, sort_keys=True) for c in configs]
    assert len(seen) == len(set(seen)) == len(grid) == 48
    assert set(seen) == grid
    assert all(c["gpu_memory_utilization"] == 0.92 for c in configs), "no OOM probe in a grid"
