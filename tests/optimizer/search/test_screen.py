"""The informed start (`sampler: screen`): after the queued defaults, the search policy launches
the configs the analytic model ranks first, refits the ranking to each measurement, and hands
over to TPE after SCREEN_TRIALS; a real Optuna study, the real analytic model, no engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
from optuna.trial import BaseTrial

from bench.screen_candidates import asked as _asked
from optimizer.config import load_study
from optimizer.search.controller import SearchController
from optimizer.search.samplers import SCREEN_ATTR, ScreenSampler, _tpe
from optimizer.search.screen import load_of, predicted_goodput, sample_candidates
from optimizer.search.searcher import SCREEN_TRIALS
from optimizer.storage.study import make_sampler
from runners.base import EngineConfig, RunResult, StepMetrics
from runners.hardware import load_preset
from runners.model_info import load_model_info
from runners.simulated.performance import PerformanceModel
from search_spaces import load_space
from tests.builders import categorical_space, search_setup, write_study
from tests.optimizer.test_search_policy import _metrics


def _study(candidates: list[dict[str, object]], predicted: list[float]) -> optuna.Study:
    study = optuna.create_study(direction="maximize", sampler=ScreenSampler(
        candidates, predicted, fallback=_tpe(0, 6), n_screen=2, explore_every=10))
    return study


def _ask(study: optuna.Study) -> dict[str, object]:
    trial = study.ask()
    return {"x": trial.suggest_categorical("x", ["a", "b", "c"]),
            "y": trial.suggest_categorical("y", [1, 2])}


CANDIDATES: list[dict[str, object]] = [{"x": x, "y": y} for x in "abc" for y in (1, 2)]


def test_the_screen_picks_the_best_predicted_config_after_the_queued_ones() -> None:
    study = _study(CANDIDATES, [1.0, 2.0, 3.0, 4.0, 9.0, 5.0])
    study.enqueue_trial({"x": "a", "y": 1})
    assert _ask(study) == {"x": "a", "y": 1}, "the queued defaults go first, untouched"
    assert _ask(study) == {"x": "c", "y": 1}, "then the top of the prediction"
    assert study.trials[1].system_attrs[SCREEN_ATTR] == 4


def test_a_measurement_below_its_prediction_reorders_the_rest() -> None:
    # Predicted: (c,1) best, (c,2) next, (b,2) third. Measured: c is poor, b is good.
    study = _study(CANDIDATES, [1.0, 1.0, 1.0, 6.0, 9.0, 8.0])
    for params, value in (({"x": "c", "y": 1}, 1.0), ({"x": "b", "y": 1}, 8.0)):
        study.enqueue_trial(params)
        trial = study.ask()
        trial.suggest_categorical("x", ["a", "b", "c"])
        trial.suggest_categorical("y", [1, 2])
        study.tell(trial, value)
    assert _ask(study) == {"x": "b", "y": 2}, "refitted: b's measured edge outranks c's guess"


def test_after_its_trials_the_screen_hands_over_to_tpe() -> None:
    study = _study(CANDIDATES, [1.0, 2.0, 3.0, 4.0, 9.0, 5.0])
    for _ in range(4):
        params = _ask(study)
        study.tell(study.trials[-1].number, 1.0 if params["x"] != "c" else 2.0)
    screened = [t for t in study.trials if SCREEN_ATTR in t.system_attrs]
    assert len(screened) == 2, "n_screen trials, no more"


def test_the_policy_screens_the_space_with_the_analytic_model_after_the_defaults(
        tmp_path: Path) -> None:
    cfg, space, study = search_setup(
        tmp_path, {"quantization": ["none", "fp8"], "max_num_seqs": [16, 256],
                   "kv_cache_dtype": ["auto", "fp8"]},
        trials=12, sampler={"name": "screen", "seed": 0})
    policy = SearchController(cfg, space, study, workload=cfg.workload, total_gpus=1,
                              hardware=load_preset("h200"), model=load_model_info("qwen2.5-7b"))
    policy.prepare()
    assert isinstance(study.sampler, ScreenSampler)
    launched = []
    for _ in range(1 + SCREEN_TRIALS):
        running = policy.next_launch(lambda num_gpus: not policy.running)
        assert running is not None
        launched.append(running)
        steps = tuple(StepMetrics(step=i, level=level, metrics=_metrics(5.0, 5.0))
                      for i, level in enumerate(policy.workload.levels))
        policy.on_result(running, RunResult(status="complete", steps=steps))
    assert launched[0].is_baseline, "the defaults first"
    first = launched[1].params
    assert first["quantization"] == "fp8", \
        f"fp8 weights halve a decode step's weight reads: the model ranks them first ({first})"
    attrs = {t.number: t.system_attrs for t in study.get_trials(deepcopy=False)}
    assert all(SCREEN_ATTR in attrs[r.trial.number] for r in launched[1:]), \
        "every screened config (the 8-config space holds 7 besides the defaults)"


def test_a_card_without_bandwidth_figures_or_another_objective_searches_with_tpe_alone(
        tmp_path: Path) -> None:
    from dataclasses import replace

    space_path = categorical_space(tmp_path, quantization=["none", "fp8"])
    for hardware, objective in ((replace(load_preset("h200"), memory_bandwidth_gbps=0.0),
                                 "goodput"), (load_preset("h200"), "tpot")):
        cfg = load_study(write_study(tmp_path, trials=4, search_space=str(space_path),
                                     objective=objective, sampler={"name": "screen"}))
        study = optuna.create_study(directions=cfg.directions, sampler=make_sampler(cfg))
        SearchController(cfg, load_space(space_path).resolve({}), study,
                         workload=cfg.workload, total_gpus=1, hardware=hardware,
                         model=load_model_info("qwen2.5-7b")).prepare()
        assert isinstance(study.sampler, optuna.samplers.TPESampler), objective


# -- the candidates: drawn from the distributions, as a RandomSampler study would draw them ------
# The reference the direct draw must equal is the draw it replaced, as bench/screen_candidates.py
# times it: Optuna's RandomSampler in a scratch study, asked up to 3 * count times (`_asked`).

def _every_kind(trial: BaseTrial) -> dict[str, Any]:
    """Every distribution a space can give, a param suggested only for some configs, and a
    single-valued one (Optuna takes no draw for it)."""
    params: dict[str, Any] = {
        "mixed": trial.suggest_categorical("mixed", [None, True, 2, 0.5, "x"]),
        "seqs": trial.suggest_int("seqs", 8, 512, log=True),
        "blocks": trial.suggest_int("blocks", 16, 128, step=16),
        "util": trial.suggest_float("util", 0.8, 0.95, step=0.01),
        "scale": trial.suggest_float("scale", 1e-3, 1.0, log=True),
        "ratio": trial.suggest_float("ratio", 0.0, 1.0),
        "one": trial.suggest_int("one", 4, 4),
    }
    if params["mixed"] == "x":
        params["only_x"] = trial.suggest_categorical("only_x", ["a", "b"])
    return params


def _typed(configs: list[dict[str, Any]]) -> list[list[tuple[str, Any, type]]]:
    return [[(k, v, type(v)) for k, v in c.items()] for c in configs]


def test_the_candidates_are_the_configs_a_random_sampler_study_would_give_for_the_seed() -> None:
    for seed in (0, 7):
        assert _typed(sample_candidates(_every_kind, 300, seed=seed)) == \
            _typed(_asked(_every_kind, 300, seed)), \
            f"seed {seed}: the same configs, values, types and order as RandomSampler's"


def test_the_candidates_of_a_bundled_space_are_those_the_study_would_give() -> None:
    space = load_space("hopper").resolve({})
    drawn = sample_candidates(space.sample, 400, seed=3)
    assert len(drawn) == 400
    assert _typed(drawn) == _typed(_asked(space.sample, 400, 3)), \
        "the same configs screened, in the same order, for the same seed"
    assert drawn != sample_candidates(space.sample, 400, seed=4), "another seed, other configs"


def test_a_space_smaller_than_the_count_gives_all_its_configs(tmp_path: Path) -> None:
    space = load_space(categorical_space(tmp_path, max_num_seqs=[256, 64, 16],
                                         kv_cache_dtype=["auto", "fp8"])).resolve({})
    drawn = sample_candidates(space.sample, 50, seed=0)
    assert len(drawn) == space.size() == 6, "every config of a space smaller than the count"
    assert drawn == _asked(space.sample, 50, 0)


def test_the_candidates_are_drawn_without_asking_an_optuna_study() -> None:
    asked: list[BaseTrial] = []

    def sample(trial: BaseTrial) -> dict[str, Any]:
        asked.append(trial)
        return {"x": trial.suggest_int("x", 0, 1000)}

    sample_candidates(sample, 200, seed=0)
    assert not any(isinstance(t, optuna.trial.Trial) for t in asked), \
        "no trial of a study per candidate: a study start asked one 1,500 to 4,500 times"


# -- the SLO: every bound the study sets counts, e2el's alone included ---------------------------

def test_an_e2el_only_slo_scales_the_screens_prediction_past_its_bound(tmp_path: Path) -> None:
    space_path = categorical_space(tmp_path, max_num_seqs=[16, 256])
    perf = PerformanceModel.from_config(EngineConfig("Qwen/Qwen2.5-7B-Instruct", {}),
                                        load_preset("h200"), load_model_info("qwen2.5-7b"),
                                        is_compile_cache_warm=True)
    predicted = {}
    for bound in (None, 60_000.0, 5.0):
        cfg = load_study(write_study(tmp_path, trials=4, search_space=str(space_path),
                                     slo={} if bound is None else {"e2el_ms": bound},
                                     objective="goodput" if bound else "throughput"))
        load = load_of(cfg.workload)
        assert load is not None
        assert load.slo_e2el_ms == bound
        predicted[bound] = predicted_goodput(perf, load)
    assert predicted[60_000.0] == predicted[None] > 0, "a bound every request meets: no change"
    assert predicted[5.0] < predicted[None] / 100, \
        f"no request ends in 5 ms: the prediction falls steeply past the bound ({predicted})"
