"""Here, after a device run: the per-trial facts the H200 trace tests need, from the study's
Optuna records, as tests/fixtures/traces/h200/trials.json (flags, the measured level's metrics,
telemetry, engine figures and the verdict the device logged).

    python bench/h200/extract_fixtures.py RESULTS_DIR/optuna.db STUDY_NAME OUT_JSON ["WHAT, WHEN"]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import optuna

from optimizer.results.trial_record import record_of

KEEP_SERVER = ("max_num_requests_running", "max_kv_cache_usage_perc", "max_num_requests_waiting",
               "num_preemptions", "is_waiting_rising")


RECORDED = ("nightshift study h200-proof-2 on the lent H200, 2026-12-02 (vLLM 0.26.0, torch "
            "2.11.0+cu130, driver 580.159.04), Qwen2.5-7B shape, dummy weights, 64 concurrent, "
            "512 in / 256 out")


def main(db: str, study_name: str, out: Path, recorded: str = RECORDED) -> int:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name=study_name, storage=f"sqlite:///{db}")
    trials = {}
    for t in study.trials:
        record = record_of(t)
        if record is None or record.state != "complete":
            continue
        step = record.steps[-1]
        metrics = record.metrics
        verdict = record.verdict or {}
        trials[f"trial{t.number}"] = {
            "flags": dict(record.flags),
            "step_metrics": step["metrics"],  # every BenchmarkMetrics field
            "server_metrics": {k: step["server"][k] for k in KEEP_SERVER if k in step["server"]},
            "telemetry": {k.removeprefix("gpu."): v for k, v in metrics.items()
                          if k.startswith("gpu.")},
            "engine": {k: v for k, v in record.engine.items() if v is not None},
            "device_verdict": {k: verdict[k] for k in ("label", "reason", "sources")},
        }
    out.write_text(json.dumps({
        "_recorded": f"{recorded}; extracted by bench/h200/extract_fixtures.py",
        "trials": trials}, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], Path(sys.argv[3]), *sys.argv[4:5]))
