"""After bench/h100/steady.yaml ran ON the device: check each measured trial's claimed capacity
with vLLM's own client (bench/gpu/bench_serve_check.py) at C and 1.15 x C, the best trial first,
then the defaults. Runs as one `sh:` entry of bench/h200/run_study.sh's sequence.

    python3 bench/h100/check_claims.py bench/h100/steady.yaml /root/h200-results/claims [LABEL]

LABEL names the baseline trial's check (default "defaults"; a study whose fixed flags make its
baseline another config names that config). CHECK_UPPER=1 adds a third rate, the claim's upper
end (the lightest load the trial missed, where it lies between C and 1.15 x C), after the two,
on the same server: whether vLLM's client misses where nightshift's hold did. CHECK_EXTRA=R1,R2
adds further rates after those (e.g. a rate an earlier session's client ran, to see how far a
3-minute p99 moves between runs). Both apply to every trial checked, the baseline's included.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import optuna  # noqa: E402

from optimizer.config import load_study  # noqa: E402
from optimizer.results.trial_record import record_of  # noqa: E402

# Flags bench_serve_check sets itself (or cannot allow), each followed by a value unless boolean.
_OWN_WITH_VALUE = {"--host", "--port", "--served-model-name", "--load-format", "--tokenizer",
                   "--api-key"}
_OWN_BOOLEAN = {"--skip-tokenizer-init"}


def serve_args(argv: list[str]) -> list[str]:
    """The trial's `vllm serve` flags after the model, less what the check sets itself."""
    start = argv.index("serve") + 2  # python -m vllm.entrypoints.cli.main serve MODEL ...
    out: list[str] = []
    rest = argv[start:]
    i = 0
    while i < len(rest):
        arg = rest[i]
        name = arg.split("=", 1)[0]
        if name in _OWN_BOOLEAN:
            i += 1
        elif name in _OWN_WITH_VALUE:
            i += 1 if "=" in arg else 2
        else:
            out.append(arg)
            i += 1
    return out


def main() -> int:
    study_file, out_root = Path(sys.argv[1]), Path(sys.argv[2])
    baseline_label = sys.argv[3] if len(sys.argv) > 3 else "defaults"
    cfg = load_study(study_file)
    study = optuna.load_study(study_name=cfg.name, storage=cfg.storage_url)
    claims = []
    for trial in study.trials:
        record = record_of(trial)
        if record is None or record.state != "complete" or not record.capacity:
            continue
        met = record.capacity.get("met_load")
        if not met:
            continue
        label = baseline_label if record.is_baseline else f"trial{trial.number}"
        print(f"claim of {label}: {record.capacity}", flush=True)  # held or not, with the bracket
        claims.append((float(met), label, record))
    best = max((c for c in claims if c[1] != baseline_label), default=None, key=lambda c: c[0])
    order = [c for c in (best, next((c for c in claims if c[1] == baseline_label), None)) if c]
    for met, label, record in order:
        env = [f"--env={k}={v}" for k, v in record.env.items()
               if k in ("VLLM_CACHE_ROOT", "VLLM_USE_FLASHINFER_SAMPLER")]
        # bench_serve_check's --claim rates (C, then 1.15 C, rounded alike), then any others
        more = [r for r in os.environ.get("CHECK_EXTRA", "").split(",") if r.strip()]
        upper = record.capacity.get("missed_load")
        if os.environ.get("CHECK_UPPER") == "1" and upper and met < upper < met * 1.15:
            more.insert(0, repr(float(upper)))
        rates = (["--rates", ",".join([repr(met), repr(round(met * 1.15, 6)), *more])] if more
                 else ["--claim", repr(met)])
        argv = [sys.executable, str(ROOT / "bench/gpu/bench_serve_check.py"), "run",
                "--model", "qwen3-8b", *rates, "--label", label,
                "--out", str(out_root / label), "--deadline-s", "1500",
                # the study's own failure rule: a rate misses on failures only above it
                "--max-failed-fraction", repr(cfg.spec.workload.max_failed_fraction), *env, "--",
                *serve_args(list(record.argv))]
        print("check:", " ".join(argv), flush=True)
        subprocess.run(argv, check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
