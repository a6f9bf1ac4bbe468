"""End to end on the simulated engine: a study whose prompts are text from a ShareGPT-style file,
sent as multi-turn conversations and counted with the model's own tokenizer (a tiny real BPE
built at test time), logs what the figures rest on."""

from __future__ import annotations

import shutil
from pathlib import Path

import optuna
import pytest
from mlflow import MlflowClient

from optimizer.cli import main
from tests.builders import load, trial_runs, write_study
from tests.runners.tiny_model import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # ~30 s of study after ~25 s of Ray start-up here


def test_a_dataset_multi_turn_study_counts_prompts_with_the_tokenizer(
        tmp_path: Path, ray_cluster: None) -> None:
    model = make_tiny_model(tmp_path / "model")
    shutil.copy(ROOT / "examples" / "conversations.json", tmp_path / "conversations.json")
    path = write_study(tmp_path, trials=1, max_parallel_trials=1,
                       model={"path": str(model), "load_format": "dummy"},
                       workload={"dataset": {"path": "conversations.json"},
                                 "multi_turn": {"max_turns": 3},
                                 "levels": [{"concurrency": 2}], "num_requests": 12,
                                 "warmup_requests": 2})
    assert main(["start", str(path), "--no-progress"]) == 0
    trial = load(tmp_path).trials[0]
    assert trial.state == optuna.trial.TrialState.COMPLETE
    run = trial_runs(tmp_path)[0]
    metrics = run.data.metrics
    assert metrics["server.prompt_tokens_server_minus_client_max_abs"] == 0.0, \
        "client and server count with the same tokenizer"
    assert metrics["server.prompt_len_is_estimated"] == 0.0
    assert metrics["server.multi_turn.num_turns"] >= 12
    assert "server.multi_turn.later_turns_mean_ttft_ms" in metrics
    client = MlflowClient(f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    parent = client.search_runs([client.get_experiment_by_name("e2e").experiment_id],
                                filter_string="tags.`nightshift.kind` = 'study'")[0]
    assert parent.data.params["workload.prompt_lengths"] == "counted"
