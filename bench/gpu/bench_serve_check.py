"""Checks a claimed capacity with vLLM's own client (issue 32): `vllm serve` on 127.0.0.1, then
`vllm bench serve` at a constant Poisson rate for >= 180 s of arrivals at each rate asked (the
claim C, then 1.15 x C), `/metrics` polled every second, and one verdict row per rate.

Runs ON the device (vLLM 0.26.0 importable: PYTHONPATH=/tmp/site:$PWD), one device call per
(config, rate) pair (a start plus one rate takes ~5 min warm, 7-8 min cold, of the
10-minute call; docs/vllm-bench-serve.md):

    python3 bench/gpu/bench_serve_check.py run --model qwen3-8b --rates 7.5 --out $OUT/defaults \
        --env VLLM_CACHE_ROOT=/root/vllm-cache -- --max-model-len 4096
    python3 bench/gpu/bench_serve_check.py run --model qwen3-8b --rates 8.625 --out $OUT/best \
        -- --config best.yaml

Everything after `--` goes to `vllm serve` as is (a nightshift export: `-- --config best.yaml`).
vLLM 0.26's client sends text prompts only and asserts it has a tokenizer (docs/vllm-bench-
serve.md), so the server cannot run with `--skip-tokenizer-init`: both get a word-level tokenizer
written here with exactly the model's vocabulary (`t0`..`tN` split on spaces: every id decodes,
and a decoded prompt re-encodes to the same ids, so prompt lengths are exact). The server
therefore detokenizes its output, as a deployed server does and a nightshift trial (token ids,
no tokenizer) does not.

`judge OUT_DIR [--max-failed-fraction F] [--write]` re-judges what a run wrote (no GPU): the
rules are in `judge_rate`; failed requests are judged once, by nightshift's own rule
(`failures_miss`), and count as ended in the rule on completions (`RequestTiming.end_s`).
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, Final

import yaml

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from the repo root or elsewhere
    sys.path.insert(0, str(ROOT))

from bench.gpu.serve_check_verdict import (  # noqa: E402
    MAX_FAILED_FRACTION,
    QUEUE_CSV,
    REQUESTS_CSV,
    RESULTS_JSON,
    TABLE_HEADER,
    TPOT_SLO_MS,
    Verdict,
    error_kinds_from_detailed,
    error_kinds_from_log,
    judge_rate,
    read_queue,
    read_requests,
    slim_result,
    table_row,
    timings_from_detailed,
    write_requests,
)
from runners.model_info import read_config, resolve_model_dir  # noqa: E402
from runners.process import EngineProcess, free_port, tail, wait_healthy  # noqa: E402
from runners.prometheus import NUM_REQUESTS_RUNNING, NUM_REQUESTS_WAITING, scrape  # noqa: E402

logger = logging.getLogger("bench_serve_check")

# The load of issue 32: prompts uniform 100-400 tokens, answers uniform 600-1400 (ignore_eos).
# vLLM's random dataset draws integers in [floor(L * (1 - r)), ceil(L * (1 + r))], r per side
# (vllm/benchmarks/datasets/utils.py:70-81): 250 +- 60% and 1000 +- 40% give exactly these.
INPUT_LEN: Final = 250
OUTPUT_LEN: Final = 1000
RANGE_RATIO: Final = {"input": 0.6, "output": 0.4}
ARRIVAL_S: Final = 180.0  # seconds of arrivals at a constant rate, at least (issue 32)
OVER_RATIO: Final = 1.15
SERVED_NAME: Final = "model"
# The bench's own budget beyond its arrivals: loading the tokenizer and drawing ~2000 prompts
# (seconds), then the drain of what is in flight (a request lives ~15 s at the claim; an
# overloaded server also drains its backlog).
BENCH_PREP_S: Final = 60.0
DEFAULT_DRAIN_S: Final = 150.0
POLL_S: Final = 1.0
# Flags this script sets itself (or, for --skip-tokenizer-init, cannot allow: the client's text
# prompts need the server's tokenizer).
_OWN_FLAGS: Final = ("--host", "--port", "--tokenizer", "--served-model-name", "--load-format",
                     "--skip-tokenizer-init")


class BadInput(Exception):
    """One line naming the field and the fix; exit 2 before anything starts."""


# --- argv, as data ---------------------------------------------------------------------------

def num_prompts_for(rate_rps: float, arrival_s: float = ARRIVAL_S) -> int:
    """Requests for at least `arrival_s` of arrivals: vLLM spaces N arrivals over exactly N / rate
    seconds (its Poisson delays are rescaled to that total: vllm/benchmarks/serve.py:476-485)."""
    return math.ceil(rate_rps * arrival_s - 1e-9)


def serve_argv(python: str, model_dir: Path, port: int, tokenizer_dir: Path,
               extra_args: Sequence[str]) -> list[str]:
    """`vllm serve` with dummy weights of `model_dir`'s shape and the word-level tokenizer."""
    return [python, "-m", "vllm.entrypoints.cli.main", "serve", str(model_dir),
            "--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_NAME,
            "--load-format", "dummy", "--tokenizer", str(tokenizer_dir), *extra_args]


def bench_argv(python: str, port: int, tokenizer_dir: Path, rate_rps: float, num_prompts: int,
               result_dir: Path, result_filename: str, *, seed: int = 0,
               tpot_slo_ms: float = TPOT_SLO_MS, ttft_slo_ms: float | None = None,
               label: str = "check") -> list[str]:
    """`vllm bench serve` (0.26.0) at a constant Poisson rate with issue 32's load.

    `--temperature 0` as nightshift's load generator sends (0.26's client leaves it to the
    server otherwise); `--save-detailed` keeps per-request start times, TTFTs and ITLs, from
    which the steady window is judged; `--ignore-eos` is forced for the random dataset anyway
    (serve.py:2012-2018) and given for the reader."""
    goodput = [f"tpot:{tpot_slo_ms:g}"] + ([f"ttft:{ttft_slo_ms:g}"] if ttft_slo_ms else [])
    return [python, "-m", "vllm.entrypoints.cli.main", "bench", "serve",
            "--backend", "openai", "--host", "127.0.0.1", "--port", str(port),
            "--endpoint", "/v1/completions", "--model", SERVED_NAME,
            "--tokenizer", str(tokenizer_dir),
            "--dataset-name", "random", "--random-input-len", str(INPUT_LEN),
            "--random-output-len", str(OUTPUT_LEN),
            "--random-range-ratio", json.dumps(RANGE_RATIO), "--ignore-eos", "--temperature", "0",
            "--request-rate", repr(float(rate_rps)), "--burstiness", "1.0",
            "--num-prompts", str(num_prompts), "--seed", str(seed),
            "--goodput", *goodput,
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--save-result", "--save-detailed", "--result-dir", str(result_dir),
            "--result-filename", result_filename, "--label", label, "--disable-tqdm"]


def serve_args_problem(extra_args: Sequence[str]) -> str | None:
    """One line if the `vllm serve` arguments set what this script owns, else None. A
    `--config FILE` is read for the same keys (vLLM's config file takes the long names without
    dashes, with - or _)."""
    for arg in extra_args:
        name = arg.split("=", 1)[0]
        if name in _OWN_FLAGS:
            return (f"vllm serve argument {name}: this script sets --host/--port/--tokenizer/"
                    "--served-model-name/--load-format itself and cannot serve with "
                    "--skip-tokenizer-init (vLLM 0.26's client sends text); drop it.")
    configs = [extra_args[i + 1] for i, a in enumerate(extra_args[:-1]) if a == "--config"]
    configs += [a.split("=", 1)[1] for a in extra_args if a.startswith("--config=")]
    for path in configs:
        try:
            data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError) as exc:
            return f"--config {path}: cannot read it as YAML ({type(exc).__name__}); fix the path."
        if not isinstance(data, dict):
            return f"--config {path}: expected a mapping of vllm serve flags; give an export."
        for key in data:
            flag = "--" + str(key).replace("_", "-")
            if flag in _OWN_FLAGS and not (flag == "--skip-tokenizer-init" and not data[key]):
                return (f"--config {path}: key {key!r} is set by this script (or impossible "
                        "with vLLM 0.26's text-only client); remove it from a copy.")
    return None


# --- the tokenizer ---------------------------------------------------------------------------

def write_tokenizer(directory: Path, vocab_size: int, eos_token_id: int | None,
                    max_model_len: int) -> Path:
    """A word-level tokenizer over exactly `vocab_size` ids (`t<id>`, split on whitespace), the
    eos id (if any, inside the vocabulary) as its one special token. Every id the dummy model
    can sample decodes; decode -> encode is the identity, so vLLM's random prompts keep their
    drawn lengths and `num_special_tokens_to_add()` is 0."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    eos = eos_token_id if eos_token_id is not None and 0 <= eos_token_id < vocab_size else 0
    eos_text = "<|endoftext|>"
    vocab = {f"t{i}": i for i in range(vocab_size) if i != eos}
    vocab[eos_text] = eos
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=eos_text))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([AddedToken(eos_text, special=True, normalized=False)])
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos_text,
        "pad_token": eos_text, "model_max_length": max_model_len,
        "clean_up_tokenization_spaces": False}), encoding="utf-8")
    return directory



class QueuePoller:
    """Scrapes `/metrics` every `poll_s` on a thread, appending rows to the queue CSV."""

    def __init__(self, base_url: str, path: Path, rate_rps: float,
                 poll_s: float = POLL_S) -> None:
        self._base_url, self._path, self._rate, self._poll_s = base_url, path, rate_rps, poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="queue-poller", daemon=True)

    def __enter__(self) -> QueuePoller:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        is_new = not self._path.exists()
        with self._path.open("a", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            if is_new:
                writer.writerow(["rate_rps", "t_s", "unix_s", "waiting", "running"])
            while not self._stop.is_set():
                t, unix = time.perf_counter(), time.time()
                values = scrape(self._base_url, timeout_s=2.0)
                writer.writerow([self._rate, f"{t:.3f}", f"{unix:.3f}",
                                 values.get(NUM_REQUESTS_WAITING, ""),
                                 values.get(NUM_REQUESTS_RUNNING, "")])
                f.flush()
                self._stop.wait(max(0.0, self._poll_s - (time.perf_counter() - t)))


# --- the run ---------------------------------------------------------------------------------

def _parse_env(pairs: Sequence[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise BadInput(f"--env {pair!r}: expected KEY=VALUE, e.g. "
                           "--env VLLM_CACHE_ROOT=/root/vllm-cache.")
        env[key] = value
    return env


def _rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BadInput(f"--rates {text!r}: expected comma-separated req/s, e.g. "
                       "7.5,8.625.") from None
    if not rates or not all(math.isfinite(r) and r > 0 for r in rates):
        raise BadInput(f"--rates {text!r}: every rate must be a finite number > 0 req/s.")
    return rates


def plan(args: argparse.Namespace) -> dict[str, Any]:
    """Everything checked before anything starts (BadInput on the first problem)."""
    if args.claim is not None:
        if not (math.isfinite(args.claim) and args.claim > 0):
            raise BadInput(f"--claim {args.claim}: must be a finite number > 0 req/s.")
        rates = [args.claim, round(args.claim * OVER_RATIO, 6)]
    else:
        rates = _rates(args.rates)
    model_dir = resolve_model_dir(args.model)
    if model_dir is None:
        raise BadInput(f"--model {args.model}: no config.json there and no bundled shape of that "
                       "name; give a directory holding config.json or e.g. qwen3-8b.")
    try:
        config = read_config(model_dir)
    except ValueError as exc:
        raise BadInput(f"--model: {exc}") from None
    text = config.get("text_config", config) if isinstance(config, dict) else None
    if not isinstance(text, dict):
        text = {}
    vocab = text.get("vocab_size")
    if not isinstance(vocab, int) or vocab <= 0:
        raise BadInput(f"--model: {model_dir / 'config.json'} names no vocab_size; the "
                       "tokenizer needs it: give the model's config.json as published.")
    eos = text.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    problem = serve_args_problem(args.serve_args)
    if problem:
        raise BadInput(problem)
    env = _parse_env(args.env)
    if args.arrival_s < ARRIVAL_S:
        raise BadInput(f"--arrival-s {args.arrival_s}: issue 32 asks for >= {ARRIVAL_S:g} s.")
    if args.tpot_slo_ms <= 0 or (args.ttft_slo_ms is not None and args.ttft_slo_ms <= 0):
        raise BadInput("--tpot-slo-ms/--ttft-slo-ms: must be > 0 ms.")
    if not 0 <= args.max_failed_fraction <= 1:
        raise BadInput(f"--max-failed-fraction {args.max_failed_fraction}: must be in [0, 1] "
                       f"(nightshift's default {MAX_FAILED_FRACTION:g}).")
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        probe = args.out / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise BadInput(f"--out {args.out}: cannot write there ({exc.strerror}); give a "
                       "writable directory (on the device: $OUT/NAME).") from None
    return {"rates": rates, "model_dir": model_dir.resolve(), "vocab_size": vocab,
            "eos_token_id": eos if isinstance(eos, int) else None,
            "max_model_len": int(text.get("max_position_embeddings") or 32768),
            "env": env}


def run(args: argparse.Namespace) -> int:
    deadline = time.monotonic() + args.deadline_s
    p = plan(args)
    work = args.workdir / f"{int(time.time())}-{os.getpid()}"
    tokenizer_dir = write_tokenizer(work / "tokenizer", p["vocab_size"], p["eos_token_id"],
                                    p["max_model_len"])
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    python = sys.executable
    argv = serve_argv(python, p["model_dir"], port, tokenizer_dir, args.serve_args)
    print("vllm serve:", shlex.join(argv), flush=True)
    records: list[dict[str, Any]] = []
    rows: list[str] = []
    server = EngineProcess.start(argv, p["env"], args.out / "server.log", work / "registry")
    try:
        started = time.monotonic()
        state = wait_healthy(base_url, server,
                             timeout_s=max(1.0, min(args.startup_timeout_s,
                                                    deadline - time.monotonic())))
        if state != "ready":
            print(f"vllm serve {state} after {time.monotonic() - started:.0f} s; see "
                  f"{args.out / 'server.log'}:\n{tail(args.out / 'server.log', 4000)}",
                  flush=True)
            return 1
        print(f"server ready in {time.monotonic() - started:.0f} s", flush=True)
        for rate in p["rates"]:
            record, verdict = _run_rate(args, rate, port, base_url, tokenizer_dir, work,
                                        python, deadline)
            records.append(record)
            if verdict is not None:
                rows.append(table_row(args.label, verdict))
            (args.out / RESULTS_JSON).write_text(json.dumps(records, indent=1),
                                                  encoding="utf-8")
    finally:
        server.terminate(grace_s=20)
    summary = "\n".join([TABLE_HEADER, *rows])
    (args.out / "summary.md").write_text(summary + "\n", encoding="utf-8")
    print(summary, flush=True)
    for record in records:
        if "verdict" not in record:
            print(f"rate {record['rate_rps']:g}: {record['status']}", flush=True)
    return 0 if records and all("verdict" in r for r in records) else 1


def _run_rate(args: argparse.Namespace, rate: float, port: int, base_url: str,
              tokenizer_dir: Path, work: Path, python: str,
              deadline: float) -> tuple[dict[str, Any], Verdict | None]:
    """One rate: the bench under its time bound, the queue polled meanwhile, the verdict."""
    n = num_prompts_for(rate, args.arrival_s)
    arrival_s = n / rate
    name = f"vllm-{rate:g}rps.json"
    argv = bench_argv(python, port, tokenizer_dir, rate, n, work, name, seed=args.seed,
                      tpot_slo_ms=args.tpot_slo_ms, ttft_slo_ms=args.ttft_slo_ms,
                      label=args.label)
    record: dict[str, Any] = {"rate_rps": rate, "num_prompts": n, "bench_argv": argv,
                              "bench_command": shlex.join(argv)}
    left = deadline - time.monotonic() - 40  # 40 s: kill the bench, parse, stop the server
    needed = BENCH_PREP_S / 2 + arrival_s + 20
    if left < needed:
        record["status"] = (f"skipped: {left:.0f} s left before --deadline-s, {needed:.0f} s "
                            "needed at least; run this rate in its own call")
        return record, None
    bound = min(BENCH_PREP_S + arrival_s + args.drain_s, left)
    print(f"vllm bench serve ({n} requests, {arrival_s:.0f} s of arrivals, bound {bound:.0f} "
          f"s):\n{record['bench_command']}", flush=True)
    started = time.monotonic()
    with QueuePoller(base_url, args.out / QUEUE_CSV, rate), \
            EngineProcess.start(argv, {}, args.out / "bench.log", work / "registry") as bench:
        code = bench.wait(timeout_s=bound)
        record["bench_s"] = round(time.monotonic() - started, 1)
        if code is None:
            bench.terminate(grace_s=5)
            record["status"] = (f"killed: vllm bench serve ran past its bound of {bound:.0f} s "
                                f"(arrivals {arrival_s:.0f} s + drain {args.drain_s:g} s); "
                                "judge the queue in queue.csv")
            return record, None
    if code != 0:
        record["status"] = (f"failed: vllm bench serve exited {code}; see bench.log:\n"
                            + tail(args.out / "bench.log", 3000))
        return record, None
    detailed = json.loads((work / name).read_text(encoding="utf-8"))
    requests = timings_from_detailed(detailed)
    write_requests(args.out / REQUESTS_CSV, rate, requests)
    queue = read_queue(args.out / QUEUE_CSV).get(rate, [])
    kinds = error_kinds_from_detailed(detailed)
    verdict = judge_rate(detailed, requests, queue, rate, tpot_slo_ms=args.tpot_slo_ms,
                         ttft_slo_ms=args.ttft_slo_ms,
                         max_failed_fraction=args.max_failed_fraction, error_kinds=kinds)
    record.update(status="done", vllm_result=slim_result(detailed), error_kinds=kinds,
                  verdict=asdict(verdict))
    return record, verdict


def judge_dir(args: argparse.Namespace) -> int:
    """Re-judge a run's directory (results.json, requests.csv, queue.csv; the error kinds
    from results.json, or from bench.log for a run written before it kept them): no GPU. The
    table goes to stdout and, with --write, to summary.md, its verdicts to results.json."""
    if not 0 <= args.max_failed_fraction <= 1:
        print(f"--max-failed-fraction {args.max_failed_fraction}: must be in [0, 1] "
              f"(nightshift's default {MAX_FAILED_FRACTION:g}).", file=sys.stderr)
        return 2
    try:
        records = json.loads((args.dir / RESULTS_JSON).read_text(encoding="utf-8"))
        requests = read_requests(args.dir / REQUESTS_CSV)
        queue = read_queue(args.dir / QUEUE_CSV)
        log = args.dir / "bench.log"
        logged = error_kinds_from_log(log.read_text(encoding="utf-8")) if log.exists() else {}
    except (OSError, ValueError, KeyError) as exc:
        print(f"{args.dir}: expected results.json, requests.csv and queue.csv from a run but "
              f"got {type(exc).__name__}: {exc}; give a `run --out` directory.", file=sys.stderr)
        return 2
    rows = []
    for record in records:
        rate = float(record["rate_rps"])
        label = args.label or str(record.get("vllm_result", {}).get("label") or "config")
        if "vllm_result" not in record or rate not in requests:
            rows.append(f"| {label} | {rate:g} | {record.get('status', '?')} |")
            continue
        verdict = judge_rate(record["vllm_result"], requests[rate], queue.get(rate, []), rate,
                             tpot_slo_ms=args.tpot_slo_ms, ttft_slo_ms=args.ttft_slo_ms,
                             max_failed_fraction=args.max_failed_fraction,
                             error_kinds=record.get("error_kinds", logged.get(rate)))
        rows.append(table_row(label, verdict))
        record["verdict"] = asdict(verdict)
    summary = "\n".join([TABLE_HEADER, *rows])
    if args.write:
        (args.dir / "summary.md").write_text(summary + "\n", encoding="utf-8")
        (args.dir / RESULTS_JSON).write_text(json.dumps(records, indent=1), encoding="utf-8")
    print(summary)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bench_serve_check.py", description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="serve, load with vllm bench serve, judge (on the device)")
    r.add_argument("--model", required=True,
                   help="a directory holding config.json (dummy weights of its shape) or a "
                        "bundled shape (qwen3-8b)")
    rates = r.add_mutually_exclusive_group(required=True)
    rates.add_argument("--rates", help="comma-separated req/s, one call each is safest: 7.5")
    rates.add_argument("--claim", type=float,
                       help=f"the claimed capacity C: runs C then {OVER_RATIO} x C")
    r.add_argument("--out", type=Path, required=True, help="where everything goes ($OUT/NAME)")
    r.add_argument("--label", default="config", help="the config's name in the table")
    r.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment for vllm serve (repeat)")
    r.add_argument("--arrival-s", type=float, default=ARRIVAL_S,
                   help="seconds of arrivals per rate (>= 180)")
    r.add_argument("--drain-s", type=float, default=DEFAULT_DRAIN_S,
                   help="seconds the bench may run past its arrivals before it is killed")
    r.add_argument("--deadline-s", type=float, default=570.0,
                   help="wall seconds for the whole invocation (the device call's limit is 600)")
    r.add_argument("--startup-timeout-s", type=float, default=420.0)
    r.add_argument("--tpot-slo-ms", type=float, default=TPOT_SLO_MS)
    r.add_argument("--ttft-slo-ms", type=float, default=None)
    r.add_argument("--max-failed-fraction", type=float, default=MAX_FAILED_FRACTION,
                   help="failed requests miss a rate only above this fraction of them (the "
                        "study's workload.max_failed_fraction; nightshift's default "
                        f"{MAX_FAILED_FRACTION:g})")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--workdir", type=Path, default=Path("/tmp/bench_serve_check"),
                   help="the tokenizer and vLLM's detailed results (large; not returned)")
    r.add_argument("serve_args", nargs=argparse.REMAINDER,
                   help="after --: arguments for vllm serve (e.g. --config best.yaml)")
    j = sub.add_parser("judge", help="re-judge a run's --out directory (no GPU)",
                       description="Re-judge a run's --out directory on the CPU: "
                                   "bench_serve_check.py judge docs/h100/session15/"
                                   "claims-hold-fp8/fp8 --max-failed-fraction 0.05 --write")
    j.add_argument("dir", type=Path)
    j.add_argument("--label", default=None, help="the config's name (default: the run's)")
    j.add_argument("--tpot-slo-ms", type=float, default=TPOT_SLO_MS)
    j.add_argument("--ttft-slo-ms", type=float, default=None)
    j.add_argument("--max-failed-fraction", type=float, default=MAX_FAILED_FRACTION,
                   help=f"as run's (default {MAX_FAILED_FRACTION:g})")
    j.add_argument("--write", action="store_true",
                   help="also rewrite DIR/summary.md and the verdicts in DIR/results.json")
    return parser


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "judge":
        return judge_dir(args)
    if args.serve_args and args.serve_args[0] == "--":
        args.serve_args = args.serve_args[1:]
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # The server and the bench run in sessions of their own (a SIGKILL of this process would
    # leave them behind): a SIGTERM unwinds through the `finally` that ends them.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        return run(args)
    except BadInput as exc:
        print(exc, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
