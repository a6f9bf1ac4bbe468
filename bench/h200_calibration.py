"""Builds the simulated engine's calibration set: every H200 measurement the project holds, one
record per measured load level (config, workload, figures), in
tests/fixtures/h200_calibration.json.

Sources: the H200 studies' Optuna storages (REPO_STUDIES; each complete trial's recorded
steps), study 2's extracted records (tests/fixtures/traces/h200/trials.json), and the figures
that exist only as tables (the first probe, study 1, study 3's log, the fp8_per_block start-up
note), typed in below with where they come from. A new H200 study appends its records with

    python bench/h200_calibration.py --optuna sqlite:///PATH/optuna.db --study NAME \
        --study-file bench/h200/X.yaml --date YYYY-MM-DD

(records already in the set, by id, are replaced, so re-running is safe).
tests/runners/test_simulated_calibration.py replays every record through the model.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "tests" / "fixtures" / "h200_calibration.json"
FIGURES = ("output_throughput", "request_throughput", "request_goodput", "median_tpot_ms",
           "p99_tpot_ms", "median_ttft_ms", "p99_ttft_ms", "duration_s", "mean_e2el_ms")
CARD = "NVIDIA H200 (143771 MiB), vLLM 0.26.0, dummy weights"
QWEN_SLO = {"ttft_p99_ms": 1500.0, "tpot_p99_ms": 10.0}
DECODE_64 = {"input_len": 512, "output_len": 256, "max_concurrency": 64}


def _flags_of(params: Mapping[str, Any], flags: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM flags beyond the defaults: a search-space value of auto/none/false sets nothing.

    Pass a trial's `flags` (what it handed vLLM, in vLLM's names: `no_enable_prefix_caching`,
    `compilation_config.cudagraph_mode`) with no `params`: the widened spaces' params also list
    the knobs left at vLLM's defaults (`cudagraph_mode: FULL_AND_PIECEWISE`, `stream_interval:
    1`), which are no change."""
    out: dict[str, Any] = {}
    for name, value in {**params, **flags}.items():
        if value in ("auto", "none", None, False):
            continue
        if name == "max_num_batched_tokens" and value == 8192:
            continue  # the H200 default
        if name == "gpu_memory_utilization" and value == 0.92:
            continue
        out[name] = value
    return dict(sorted(out.items()))


def _measured(metrics: Mapping[str, Any]) -> dict[str, float]:
    return {k: float(metrics[k]) for k in FIGURES if metrics.get(k) is not None}


def _spread(metrics: Mapping[str, Any]) -> dict[str, float]:
    """(max - min) / max of a level's repeats on one server, per figure (repeats > 1 only)."""
    return {k.removeprefix("spread."): float(v) for k, v in metrics.items()
            if k.startswith("spread.") and v is not None}


# --- records typed in from tables (no machine-readable copy survives) --------------------------
def _documented() -> Iterator[dict[str, Any]]:
    probe = [  # /work/shared/gpu/README.md "Measured (probe.py ...)", 2026-12-02
        ("defaults", {}, 7382, 7.06, 317, 199, 1932336),
        ("eager", {"enforce_eager": True}, 3073, 18.84, 421, 59, 1932336),
        ("flashinfer", {"attention_backend": "FLASHINFER"}, 6831, 7.84, 312, 189, 1932208),
        ("kv-fp8", {"kv_cache_dtype": "fp8"}, 6808, 6.78, 626, 89, 3863248),
        ("fp8", {"quantization": "fp8"}, 8619, 5.37, 504, 114, 2045664),
    ]
    for name, flags, tok_s, tpot, ttft, startup, kv in probe:
        yield {"id": f"probe/{name}/c64", "study": "probe", "date": "2026-12-02",
               "source": "shared/gpu/README.md, probe.py table (256 requests)",
               "model": "qwen2.5-7b", "flags": flags,
               "workload": {**DECODE_64, "num_requests": 256}, "slo": None,
               "measured": {"output_throughput": tok_s, "median_tpot_ms": tpot,
                            "median_ttft_ms": ttft},
               "startup_s": startup, "kv_cache_tokens": kv}
    study1 = [  # docs/h200-study.md, study 1 table (192 requests, max_model_len 4096)
        (0, {}, 7355, 6.5, 8.0, 467, 808, 28.7, 28.7, 197, 2115440),
        (1, {"attention_backend": "FLASHINFER", "quantization": "fp8", "enforce_eager": True,
             "max_num_batched_tokens": 2048}, 2606, 23.3, 24.0, 111, 759, 10.2, 0, 194, 2244032),
        (2, {"kv_cache_dtype": "fp8", "quantization": "fp8", "enforce_eager": True},
         2602, 21.5, 28.0, 317, 573, 10.2, 0, 63, 4454896),
        (3, {"kv_cache_dtype": "fp8", "quantization": "fp8", "enforce_eager": True,
             "max_num_batched_tokens": 2048}, 2965, 19.6, 23.4, 114, 651, 11.6, 0, 56, 4488064),
        (4, {"attention_backend": "FLASHINFER", "kv_cache_dtype": "fp8", "quantization": "fp8",
             "enforce_eager": True, "max_num_batched_tokens": 2048},
         2166, 27.0, 31.6, 142, 755, 8.5, 0, 168, 4488064),
    ]
    for trial, flags, tok_s, tp50, tp99, tt50, tt99, rps, good, startup, kv in study1:
        yield {"id": f"study1/t{trial}/c64", "study": "study1", "date": "2026-12-02",
               "source": "docs/h200-study.md, study 1 table",
               "model": "qwen2.5-7b", "flags": {**flags, "max_model_len": 4096},
               "workload": {**DECODE_64, "num_requests": 192}, "slo": QWEN_SLO,
               "measured": {"output_throughput": tok_s, "median_tpot_ms": tp50,
                            "p99_tpot_ms": tp99, "median_ttft_ms": tt50, "p99_ttft_ms": tt99,
                            "request_throughput": rps, "request_goodput": good},
               "startup_s": startup, "kv_cache_tokens": kv}
    yield {"id": "study2/t3", "study": "study2", "date": "2026-12-02",
           "source": "docs/h200-study.md, study 2 table (trial 3)", "model": "qwen2.5-7b",
           "flags": {"enforce_eager": True, "gpu_memory_utilization": 0.06,
                     "max_model_len": 4096},
           "workload": {**DECODE_64, "num_requests": 192}, "slo": QWEN_SLO, "measured": {},
           "failure": "oom_at_start"}
    study3: list[tuple[int, dict[str, Any], float]] = [  # docs/h200-study.md, study 3 (log)
        (0, {}, 29.4), (1, {"kv_cache_dtype": "fp8", "quantization": "fp8"}, 39.2),
        (2, {"quantization": "fp8", "max_num_batched_tokens": 2048}, 37.2),
        (3, {"kv_cache_dtype": "fp8", "quantization": "fp8", "max_num_batched_tokens": 2048},
         37.6),
    ]
    for trial, flags, good in study3:
        yield {"id": f"study3/t{trial}/best-of-c64-c256", "study": "study3", "date": "2026-12-03",
               "source": "docs/h200-study.md, study 3 table (goodput at the better of two levels)",
               "model": "qwen2.5-7b", "flags": {**flags, "max_model_len": 4096},
               "workload": {"input_len": 512, "output_len": 256, "max_concurrency": [64, 256],
                            "num_requests": 384},
               "slo": QWEN_SLO, "measured": {"request_goodput": good}}
    yield {"id": "startup/fp8_per_block/r2", "study": "llama-startup", "date": "2026-12-04",
           "source": "shared/gpu/README.md, 'Start-up on the H200' (the rate's workload is "
                     "not named there; the prefill study's, whose lowest probe is 2 req/s, is "
                     "assumed)",
           "model": "llama-3.1-8b",
           "flags": {"quantization": "fp8_per_block", "max_model_len": 4096},
           "workload": {"input_len": {"kind": "uniform", "low": 1000, "high": 3000},
                        "output_len": 128, "request_rate_rps": 2.0, "num_requests": 40},
           "slo": {"ttft_p99_ms": 3000.0, "tpot_p99_ms": 150.0},
           "measured": {"p99_tpot_ms": 475.0}, "startup_s": 306.0,
           "note": "kernels JIT-compiled while serving; GPU 14% busy"}


def _study2() -> Iterator[dict[str, Any]]:
    path = ROOT / "tests" / "fixtures" / "traces" / "h200" / "trials.json"
    data = json.loads(path.read_text())
    for name, trial in data["trials"].items():
        yield {"id": f"study2/{name.replace('trial', 't')}/c64", "study": "study2",
               "date": "2026-12-02", "source": str(path.relative_to(ROOT)),
               "model": "qwen2.5-7b", "flags": _flags_of({}, trial["flags"]),
               "workload": {**DECODE_64, "num_requests": 192}, "slo": QWEN_SLO,
               "measured": _measured(trial["step_metrics"]),
               "startup_s": trial["engine"].get("startup_s"),
               "kv_cache_tokens": trial["engine"].get("kv_cache_tokens")}


# --- records read from an Optuna storage --------------------------------------------------------
def _workload_of(study_file: Path) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """Model, workload and SLO of a study file. A shared-prefix load keeps its prefix spec and
    seed (the test rebuilds its prompts as the load generator did); `input_len` is then the
    part after the prefix, as in the study file."""
    spec = yaml.safe_load(study_file.read_text())
    model = spec["model"]["path"] if isinstance(spec["model"], dict) else spec["model"]
    work = spec["workload"]
    slo = {k: float(v) for k, v in (spec.get("slo") or {}).items() if v is not None}
    workload = {"input_len": work["input_len"], "output_len": work["output_len"]}
    if work.get("shared_prefix"):
        workload["shared_prefix"] = dict(work["shared_prefix"])
        workload["seed"] = int(work.get("seed", 0))
    if int(work.get("repeats", 1)) > 1:
        workload["repeats"] = int(work["repeats"])
    return str(model), workload, slo


def from_optuna(storage: str, study_name: str, study_file: Path,
                date: str) -> list[dict[str, Any]]:
    """One record per recorded step of each complete trial of an Optuna study."""
    import optuna

    from optimizer.results.trial_record import record_of

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name=study_name, storage=storage)
    model, workload, slo = _workload_of(study_file)
    records: list[dict[str, Any]] = []
    for trial in study.trials:
        record = record_of(trial)
        if record is None or record.state != "complete":
            continue
        flags = _flags_of({}, record.flags)
        startup = record.engine.get("startup_s")
        kv_tokens = record.engine.get("kv_cache_tokens")
        for step in record.steps:
            level, metrics = step["level"], step["metrics"]
            if not metrics.get("completed"):
                continue  # a level stopped as saturated: no figures to compare
            rate, conc = level.get("request_rate_rps"), level.get("max_concurrency")
            load = f"r{rate:g}" if rate is not None else f"c{conc}"
            records.append({
                "id": f"{study_name}/t{trial.number}/s{step['step']}-{load}",
                "study": study_name, "date": date,
                "source": f"{storage.removeprefix('sqlite:///')} trial {trial.number} "
                          f"step {step['step']}",
                "model": model, "flags": flags,
                "workload": {**workload, "max_concurrency": conc, "request_rate_rps": rate,
                             "num_requests": int(metrics["completed"])},
                "slo": slo or None, "measured": _measured(metrics),
                "startup_s": startup, "kv_cache_tokens": kv_tokens,
                **({"spread": _spread(metrics)} if _spread(metrics) else {})})
    return records


REPO_STUDIES = (  # (storage, study, study file, date): the grid's under docs/h200/, the rest
    # under tests/fixtures/h200/ (tests read them too)
    ("docs/h200/grid/optuna.db", "h200-grid", "bench/h200/grid.yaml", "2026-12-03"),
    ("tests/fixtures/h200/labels/decode/optuna.db", "h200-decode", "bench/h200/decode.yaml",
     "2026-12-04"),
    ("tests/fixtures/h200/labels/prefill/optuna.db", "h200-prefill", "bench/h200/prefill.yaml",
     "2026-12-04"),
    # Session 7 (docs/h200-widened.md) and session 8 (docs/h200-knobs.md): the shared-prefix
    # chat load, one level of 64 concurrent, each measured twice on its server.
    ("tests/fixtures/h200/widened/optuna.db", "h200-widened", "bench/h200/widened.yaml",
     "2026-12-04"),
    ("tests/fixtures/h200/knobs/knobs/optuna.db", "h200-knobs", "bench/h200/knobs.yaml",
     "2026-12-04"),
)


def build_all() -> list[dict[str, Any]]:
    records = [*_documented(), *_study2()]
    for db, name, study_file, date in REPO_STUDIES:
        records += from_optuna(f"sqlite:///{ROOT / db}", name, ROOT / study_file, date)
    for record in records:
        record["source"] = record["source"].replace(str(ROOT) + "/", "")
    return records


def write(records: list[dict[str, Any]], out: Path) -> None:
    out.write_text(json.dumps({"card": CARD, "records": records}, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--optuna", help="storage URL of a new H200 study to append")
    parser.add_argument("--study", help="its study name")
    parser.add_argument("--study-file", type=Path, help="its study YAML (model and workload)")
    parser.add_argument("--date", default="", help="when it was measured, YYYY-MM-DD")
    args = parser.parse_args(argv)
    if args.optuna is None:
        records = build_all()
    else:
        if not (args.study and args.study_file and args.study_file.is_file()):
            print("--optuna needs --study NAME and --study-file PATH (an existing YAML); "
                  "pass both.", file=sys.stderr)
            return 2
        new = from_optuna(args.optuna, args.study, args.study_file, args.date)
        old = json.loads(args.out.read_text())["records"] if args.out.is_file() else []
        ids = {r["id"] for r in new}
        records = [r for r in old if r["id"] not in ids] + new
    write(records, args.out)
    print(f"{len(records)} records in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
