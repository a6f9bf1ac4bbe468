"""`nightshift start` refuses a model that no config of the search space can fit on the host's
GPUs (every trial would be "rejected before launch (infeasible)" and the study exit 0), and
starts one that some config can fit, or whose fit is unknown (optimizer/config/space_fit.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from optimizer.cli import main
from optimizer.config import load_study
from optimizer.config.space_fit import space_fit_problem
from optimizer.run.engine_choice import simulated_hardware
from optimizer.run.space_context import space_context
from runners.model_info import load_model_info
from search_spaces import load_space

# Llama-3.1-70B's shape: ~131 GiB of bf16 weights, ~66 GiB in fp8.
_LLAMA_70B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
    "intermediate_size": 28672, "num_attention_heads": 64, "num_key_value_heads": 8,
    "num_hidden_layers": 80, "max_position_embeddings": 131072, "vocab_size": 128256,
    "torch_dtype": "bfloat16", "tie_word_embeddings": False}


def _study(tmp_path: Path, num_gpus: int, hardware: str = "l4", **extra: Any) -> Path:
    model = tmp_path / "llama70b"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(_LLAMA_70B))
    path = tmp_path / "c5.yaml"
    path.write_text(yaml.safe_dump({
        "name": "c5", "engine": "simulated",
        "simulated": {"hardware": hardware, "num_gpus": num_gpus},
        "model": {"path": str(model), "load_format": "dummy", "skip_tokenizer_init": True},
        "budget": {"trials": 2}, "slo": {"tpot_p99_ms": 30},
        "workload": {"input_len": 100, "output_len": 50, "levels": [{"concurrency": 4}],
                     "num_requests": 40}, **extra}))
    return path


def _problem(path: Path) -> str | None:
    cfg = load_study(path)
    hardware = simulated_hardware(cfg.spec.simulated.hardware, cfg.spec.simulated.num_gpus)
    model = load_model_info(cfg.spec.model.path)
    space = load_space("default").resolve(space_context(
        hardware, model, cfg.workload, "dummy"))
    space, _ = space.with_fixed(cfg.spec.fixed_flags)
    return space_fit_problem(cfg, space, hardware, model, engine="simulated")


def test_a_model_no_config_can_fit_is_refused_in_one_line_with_nothing_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A 70B model on one 22 GiB L4: even fp8 weights (~66 GiB) overrun the card, and the space
    holds no TP beyond the one GPU; the study ran, every trial rejected, and exited 0."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    code = main(["start", str(_study(tmp_path, 1)), "--no-progress"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2, lines
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: c5.yaml: model.path: no config of search space")
    assert "quantization fp8, tensor_parallel_size 1" in lines[0]
    assert "1 x 22 GiB" in lines[0] and "simulated.num_gpus" in lines[0]
    assert not (tmp_path / "results").exists() and not (tmp_path / "mlruns").exists()


def test_a_model_some_config_fits_is_not_refused(tmp_path: Path) -> None:
    """One 80 GB H100 holds the fp8 weights (~66 GiB) though not the bf16 ones: the space's
    fp8 fits, so it starts."""
    assert _problem(_study(tmp_path, 1, "h100-8x-nvlink")) is None
    assert _problem(_study(tmp_path, 1)) is not None  # the same model on one L4


def test_a_study_that_fixes_bf16_weights_is_judged_with_them_and_its_tp(tmp_path: Path) -> None:
    """The study's fixed flags are every trial's: bf16 weights (~131 GiB) fit no config on one
    H100, and fit TP 2 on two."""
    fixed = {"fixed_flags": {"quantization": "none"}}
    problem = _problem(_study(tmp_path, 1, "h100-8x-nvlink", **fixed))
    assert problem is not None and "quantization none, tensor_parallel_size 1" in problem
    assert _problem(_study(tmp_path, 2, "h100-8x-nvlink", **fixed)) is None


def test_a_fit_that_cannot_be_judged_is_not_refused(tmp_path: Path) -> None:
    cfg = load_study(_study(tmp_path, 1))
    space = load_space("default").resolve(space_context(simulated_hardware("l4", 1), None))
    assert space_fit_problem(cfg, space, simulated_hardware("l4", 1), None,
                             engine="simulated") is None
    assert space_fit_problem(cfg, space, None, load_model_info(cfg.spec.model.path),
                             engine="vllm") is None
