"""A study names the vLLM release its trials run (`vllm.version`) where this machine cannot say:
that release's flag table picks the space's flags and checks the study's fixed flags, and the
simulated engine takes that release's parser and version (issue 37)."""

from __future__ import annotations

from pathlib import Path

import pytest

from optimizer.config import load_study
from optimizer.errors import ConfigError
from optimizer.run.engine_choice import engine_version, installed_release_problem, release_table
from runners.base import EngineConfig
from runners.engine import EngineRunner
from runners.load_level import LoadLevel
from runners.simulated.launcher import SimulatedLauncher, VllmVariant
from runners.workload import LengthDistribution, Workload
from tests.builders import categorical_space, write_study


def _study(tmp_path: Path, **vllm: object) -> Path:
    tmp_path.mkdir(exist_ok=True)
    space = categorical_space(tmp_path, max_num_seqs=[256, 64], max_num_partial_prefills=[1, 2])
    return write_study(tmp_path, trials=2, search_space=str(space), engine="simulated",
                       **({"vllm": vllm} if vllm else {}))


def test_a_study_on_0_27_does_not_search_a_flag_0_27_removed_and_its_engine_takes_0_27s_parser(
        tmp_path: Path) -> None:
    from optimizer.run.runtime import build_daemon, study_fingerprint

    cfg = load_study(_study(tmp_path, version="0.27.0"))
    daemon, notes = build_daemon(cfg, dry_run=True)
    searched = {p.name for p in daemon.space.params if not p.is_fixed}
    assert "max_num_partial_prefills" not in searched and "max_num_seqs" in searched
    assert any(r.name == "not-a-flag-of-release" and "0.27.0" in r.reason
               for r in daemon.space.applied_rules)
    assert any(n.startswith("engine: SIMULATED as vLLM 0.27.0 (vllm.version)") for n in notes)
    assert daemon.executor.spec.options == {"vllm_variant": {"version": "0.27.0"}}, \
        "every trial's simulated engine is 0.27.0's parser"
    assert study_fingerprint(cfg, dry_run=True).engine_version == "simulated 0.27.0"

    plain = load_study(_study(tmp_path / "plain"))
    daemon, _ = build_daemon(plain, dry_run=True)
    assert "max_num_partial_prefills" in {p.name for p in daemon.space.params}, \
        "no release named: the simulated engine's own, 0.26.0, which has the flag"
    assert daemon.executor.spec.options == {}


def test_a_release_without_a_table_or_a_fixed_flag_it_removed_is_one_line_naming_the_field(
        tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"vllm\.version: no flag table is bundled for vLLM "
                                          r"'0\.35\.0'; give one of 0\.26\.0, "):
        load_study(_study(tmp_path, version="0.35.0"))
    study = write_study(tmp_path, trials=2, vllm={"version": "0.27.0"},
                        fixed_flags={"max_num_partial_prefills": 2})
    with pytest.raises(ConfigError, match=r"fixed_flags\.max_num_partial_prefills: "
                                          r"--max-num-partial-prefills was removed in vLLM "
                                          r"0\.27\.0 .*; remove it for vLLM 0\.27\.0"):
        load_study(study)
    # A flag first of 0.29 is a flag there, and not one of 0.26 (the default).
    load_study(write_study(tmp_path, trials=2, vllm={"version": "0.29.0"},
                           fixed_flags={"prefix_cache_retention_interval": 10}))
    with pytest.raises(ConfigError, match=r"not a vLLM 0\.26 engine flag"):
        load_study(write_study(tmp_path, trials=2,
                               fixed_flags={"prefix_cache_retention_interval": 10}))


def test_the_release_named_must_be_the_installed_one_where_vllm_is_installed() -> None:
    assert installed_release_problem("0.30.0", None) is None, "a driver without vLLM: as named"
    assert installed_release_problem(None, "0.26.0") is None
    assert installed_release_problem("0.26.0", "0.26.0+cu130") is None
    assert installed_release_problem("0.30.0", "0.26.0") == (
        "vllm.version: 0.30.0, but this machine's vLLM is 0.26.0; leave vllm.version out (the "
        "installed release picks the flags) or install vLLM 0.30.0.")
    table, note = release_table("simulated", "0.28.0")
    assert table is not None and "0.28.0" in table.releases and note is None
    assert engine_version("simulated", "0.28.0") == "simulated 0.28.0"
    assert engine_version("simulated") == "simulated 0.26.0"


def test_the_simulated_engine_as_another_release_says_that_release_at_start(
        tmp_path: Path) -> None:
    runner = EngineRunner(SimulatedLauncher("h200", startup_time_scale=0.001,
                                            variant=VllmVariant(version="0.29.0")),
                          tmp_path / "engines", stall_timeout_s=30.0)
    workload = Workload(input_len=LengthDistribution(mean=32),
                        output_len=LengthDistribution(mean=4), num_requests=2,
                        num_warmup_requests=0, levels=(LoadLevel(max_concurrency=1),))
    config = EngineConfig("qwen2.5-7b", {}, load_format="dummy", skip_tokenizer_init=True)
    try:
        result = runner.run(config, workload, tmp_path / "run")
    finally:
        runner.close()
    assert result.status == "complete", result.failure
    assert result.engine.engine_version == "0.29.0"
