"""What `nightshift start` checks against the file system, the stores and the model before it
writes or starts anything; each problem is one line (`ConfigError`)."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from optimizer.config.fields import MAX_PROMPTS_FILE_BYTES, MAX_SECONDS, MAX_TRACE_FILE_BYTES
from optimizer.config.flag_checks import OWNED_FLAGS
from optimizer.config.loading import engine_env
from optimizer.config.store_checks import (
    server_storage_problem,
    sqlite_file_problem,
    storage_problem,
    tracking_uri_problem,
)
from optimizer.config.workload_spec import LengthSpec, WorkloadSpec
from optimizer.errors import ConfigError, cause_of, one_line, translate

if TYPE_CHECKING:
    from optimizer.config.loading import StudyConfig
    from runners.model_info import ModelInfo
    from runners.tokenizer import PromptTokenizer
    from runners.workload import DatasetSource


def _not_a_file(path: Path) -> str:
    """What a path that must be a regular file is instead."""
    if path.is_dir():
        return "is a directory, not a file"
    if path.exists():  # /dev/zero, a FIFO, a socket: endless or blocking to read
        return "is a device or pipe, not a regular file"
    return "does not exist"


def check_before_start(cfg: StudyConfig) -> None:
    """What `nightshift start` checks before it writes or starts anything: the stores can be
    made where they are named (without making them), the prompts file reads as the load
    generator reads it, and the workload fits the model. Raises ConfigError (one line)."""
    for problem in (storage_problem(cfg.storage_url), tracking_uri_problem(cfg.tracking_uri),
                    sqlite_file_problem("storage", cfg.storage_url),
                    sqlite_file_problem("tracking_uri", cfg.tracking_uri),
                    directory_problem("results_dir", cfg.results_dir),
                    directory_problem("vllm.cache_root", cfg.spec.vllm.cache_root)):
        if problem is not None:
            raise ConfigError(f"{cfg.source_name}: {problem}.") from cause_of(problem)
    problem = server_storage_problem(cfg.storage_url)
    if problem is not None:
        raise ConfigError(f"{cfg.source_name}: {problem}.") from cause_of(problem)
    if _same_sqlite_file(cfg.storage_url, cfg.tracking_uri):
        # Optuna would create its tables there, then MLflow fail on Optuna's schema version:
        # a new file neither can open again.
        raise ConfigError(f"{cfg.source_name}: tracking_uri: {cfg.tracking_uri} is the same "
                          "SQLite file as storage; the Optuna and MLflow stores need a file "
                          "each: use sqlite:///mlruns/mlflow.db (the default) or another file.")
    made_by_us = [cfg.results_dir, Path("mlruns")]
    if cfg.storage_url.startswith("sqlite:///"):
        _check_parent("storage", Path(cfg.storage_url.removeprefix("sqlite:///")), made_by_us,
                      cfg.source_name)
        _check_writable("storage", Path(cfg.storage_url.removeprefix("sqlite:///")),
                        cfg.source_name)
    if cfg.tracking_uri.startswith("sqlite:///"):
        _check_parent("tracking_uri", Path(cfg.tracking_uri.removeprefix("sqlite:///")),
                      made_by_us, cfg.source_name)
    for problem in (ignored_env_problem(cfg.spec.env),
                    unreached_concurrency_problem(cfg.spec.workload)):
        if problem is not None:
            raise ConfigError(f"{cfg.source_name}: {problem}.")
    check_workload(cfg)


def ignored_env_problem(env: Mapping[str, str]) -> str | None:
    """Why a variable of the study's `env` would set nothing, or None: one vLLM removed and now
    ignores (audit's table, `REMOVED_ENV`, whose finding fails the export's audit), with the
    study key that sets what it was meant to."""
    # optimizer.export's package imports optimizer.config: imported once config is whole.
    from optimizer.export.audit import REMOVED_ENV
    from runners.vllm.flags import flag_table

    for name in sorted(env):
        if name not in REMOVED_ENV:
            continue
        found = re.fullmatch(r"(.*?)\s*(?:\(([^()]*)\))?", REMOVED_ENV[name])
        instead, when = (found.group(1), found.group(2)) if found else (REMOVED_ENV[name], None)
        if instead.startswith("--"):
            kebab = instead.split()[0].removeprefix("--")
            fix = f"remove it and {OWNED_FLAGS[kebab]}" if kebab in OWNED_FLAGS else \
                f"remove it and set fixed_flags.{kebab.replace('-', '_')} instead"
        else:
            fix = f"remove it ({instead})"
        return (f"env.{name}: vLLM {flag_table().version} ignores it"
                f"{f' ({when})' if when else ''}, so it would set nothing; {fix}")
    return None


def unreached_concurrency_problem(w: WorkloadSpec) -> str | None:
    """Why a level's concurrency is a load it never applies, or None: without duration_s each
    of num_requests requests is sent once, so fewer requests than the concurrency never put
    that many in flight, yet its figures would be labelled with it. A rate's concurrency is a
    cap (never broken by fewer requests); a trace or a capacity search sets its own load."""
    if w.duration_s is not None or w.trace is not None or w.capacity is not None or \
            w.num_requests is None:
        return None
    for index, level in enumerate(w.levels):
        if level.request_rate is None and level.concurrency is not None and \
                w.num_requests < level.concurrency:
            which = f"levels[{index}]" if "levels" in w.model_fields_set else \
                "the default level"
            return (f"workload.num_requests: {w.num_requests} requests, each sent once, never "
                    f"reach {which}'s concurrency of {level.concurrency}; raise "
                    f"num_requests to at least {level.concurrency} (a p99 wants many more), "
                    "lower that concurrency, or set duration_s")
    return None


def _same_sqlite_file(storage: str, tracking_uri: str) -> bool:
    """Whether both URLs name one SQLite file (after `~` and relative paths are resolved)."""
    if not (storage.startswith("sqlite:///") and tracking_uri.startswith("sqlite:///")):
        return False
    paths = [Path(u.removeprefix("sqlite:///")).expanduser().absolute() for u in
             (storage, tracking_uri)]
    if os.path.normpath(paths[0]) == os.path.normpath(paths[1]):
        return True
    try:  # two names of one existing file (a link)
        return paths[0].exists() and paths[1].exists() and paths[0].samefile(paths[1])
    except OSError:
        return False


def directory_problem(field: str, path: Path | None) -> str | None:
    """Why nightshift could not make or use `path` as a directory, or None: it, or a folder
    above it, is a file."""
    if path is None:
        return None
    path = path.expanduser().absolute()
    for folder in (path, *path.parents):
        if folder.exists():
            if folder.is_dir():
                return None
            what = "is a file" if folder == path else f"lies under the file {str(folder)!r:.120}"
            return f"{field}: {str(path)!r:.120} {what}, not a directory; name a directory"
    return None


def check_workload(cfg: StudyConfig) -> None:
    """The workload's part of `check_before_start` (also each case of `nightshift regress`):
    the tokenizer, the prompts file, trace or dataset read as the runner reads them, and the
    longest request within the model's context. Raises ConfigError (one line)."""
    model = _check_model_config(cfg)
    vocab_size = model.vocab_size if model is not None and model.is_vocab_size_given else None
    tokenizer = _check_tokenizer(cfg)
    w = cfg.spec.workload
    longest_prompt = _longest_drawn(w.input_len)
    longest_output = _longest_drawn(w.output_len)
    if cfg.prompts_file is not None:
        longest_prompt, longest_output = _check_prompts_file(
            cfg.prompts_file, cfg.source_name, tokenizer, longest_output, vocab_size)
    if cfg.trace_file is not None and w.trace is not None:
        longest_prompt, longest_output, arrivals = _check_trace_file(
            cfg.trace_file, w.trace.timestamp_unit_s, cfg.source_name,
            max_gap_s=w.trace.max_gap_s, has_shared_prefix=w.shared_prefix is not None,
            has_tokenizer=tokenizer is not None, vocab_size=vocab_size)
        _check_replay_span(cfg, arrivals)
    if cfg.dataset_file is not None:
        workload = cfg.workload
        assert workload.dataset is not None
        _check_dataset(workload.dataset, cfg.source_name, tokenizer)
        # A request's whole context (a multi-turn conversation's too) stays within the
        # dataset's max_total_len.
        longest_prompt = workload.dataset.max_total_len - w.output_len.longest
    elif w.multi_turn is not None:
        if tokenizer is None:
            raise ConfigError(
                f"{cfg.source_name}: workload.multi_turn: synthesised turns are text of drawn "
                f"token lengths and need the model's tokenizer, but {cfg.spec.model.path!r:.80} "
                "has no tokenizer.json here; use a model directory with one or give "
                "workload.dataset.")
        # The last turn carries every earlier message and reply: the longest sum of n drawn
        # prompts and n - 1 drawn replies (not n times the longest draw of each).
        turns = w.multi_turn.num_turns
        longest_prompt = _longest_sum(w.input_len, turns) + \
            _longest_sum(w.output_len, turns - 1)
    if w.shared_prefix is not None:
        longest_prompt += w.shared_prefix.tokens
    _check_fits_model(cfg, model, longest_prompt, longest_output)


_TAIL_SIGMAS = 4.0  # a draw beyond this many sigmas: about 3 in 100,000


def _is_unbounded(spec: LengthSpec) -> bool:
    """A normal or lognormal length without `high`: its draws have no bound but its tail."""
    return spec.high is None and spec.std > 0 and spec.kind in ("normal", "lognormal")


def _longest_drawn(spec: LengthSpec) -> int:
    """The longest length a workload draws in practice: `high` where set; a normal or
    lognormal without it has no bound, so its 4-sigma tail (the loadgen's clip to `high` is
    the way to bound it); else the mean."""
    if not _is_unbounded(spec):
        return spec.longest
    if spec.kind == "normal":
        return math.ceil(spec.mean + _TAIL_SIGMAS * spec.std)
    # lognormal: the loadgen's sigma of the log, its mu keeping `mean` the mean.
    mu = math.log(spec.mean) - spec.std ** 2 / 2
    return math.ceil(math.exp(min(mu + _TAIL_SIGMAS * spec.std, 700.0)))


def _longest_sum(spec: LengthSpec, count: int) -> int:
    """The longest total of `count` independent draws in practice: `count` x the longest
    draw where the draws are bounded (`high`, fixed); an unbounded normal or lognormal's sum
    to its 4-sigma tail (mean x n + 4 sigma sqrt(n), sigma in tokens), which one draw's
    4-sigma tail n times over would far exceed."""
    if count <= 0:
        return 0
    one = _longest_drawn(spec)
    if not _is_unbounded(spec):
        return count * one
    std = spec.std if spec.kind == "normal" else \
        spec.mean * math.sqrt(math.expm1(min(spec.std ** 2, 700.0)))
    return min(count * one, math.ceil(count * spec.mean + _TAIL_SIGMAS * std * math.sqrt(count)))


def _check_model_config(cfg: StudyConfig) -> ModelInfo | None:
    """The model's shape from its config.json, where there is one here (None for a hub id);
    ConfigError where it does not read as a decoder's."""
    from runners.model_info import load_model_info

    try:
        return load_model_info(cfg.spec.model.path)
    except ValueError as exc:
        raise translate(exc, f"{cfg.source_name}: model.path: {one_line(exc)}.",
                        into=ConfigError) from exc


def _check_tokenizer(cfg: StudyConfig) -> PromptTokenizer | None:
    from runners.tokenizer import load_tokenizer

    try:
        return load_tokenizer(cfg.tokenizer_dir)
    except ValueError as exc:
        raise translate(exc, f"{cfg.source_name}: model.path: {one_line(exc)}.",
                        into=ConfigError) from exc


def _check_dataset(source: DatasetSource, study: str,
                   tokenizer: PromptTokenizer | None) -> None:
    from runners.datasets import check_dataset

    where = f"{study}: workload.dataset.path"
    path = source.path
    if not path.is_file():
        what = _not_a_file(path)
        raise ConfigError(f"{where}: {str(path)!r:.120} {what}; give a ShareGPT-style JSON "
                          "(or JSONL) file of {\"id\", \"conversations\"} objects.")
    if path.stat().st_size > MAX_PROMPTS_FILE_BYTES:
        raise ConfigError(f"{where}: {str(path)!r:.120} is over {MAX_PROMPTS_FILE_BYTES:,} "
                          "bytes; a benchmark needs a sample of conversations, not a corpus.")
    with _read_as_the_runner(where, path, "give a JSON file"):
        check_dataset(source, tokenizer)


@contextmanager
def _read_as_the_runner(where: str, path: Path, fix: str) -> Iterator[None]:
    """A file read as the runner will read it, each way it can fail one ConfigError line:
    unreadable, not UTF-8 (`fix` says what to give), or refused by the reader (its message)."""
    try:
        yield
    except OSError as exc:
        raise translate(exc, f"{where}: cannot read {str(path)!r:.120} "
                        f"({type(exc).__name__}); check its permissions.",
                        into=ConfigError) from exc
    except UnicodeDecodeError as exc:
        raise translate(exc, f"{where}: {str(path)!r:.120} is not UTF-8 text; {fix}.") from exc
    except RecursionError as exc:
        raise translate(exc, f"{where}: {str(path)!r:.120} holds JSON nested too deeply to "
                        f"read; {fix}.", into=ConfigError) from exc
    except (ValueError, TypeError) as exc:
        raise translate(exc, f"{where}: {one_line(exc)}.", into=ConfigError) from exc


def _check_parent(field: str, path: Path, made_by_us: list[Path], source: str) -> None:
    parent = path.expanduser().absolute().parent
    # nightshift makes the store's own directory (`.../mlruns/`), never a missing path above
    # it: a typo there would otherwise become a new directory tree.
    if parent.is_dir() or parent.parent.is_dir():
        return
    for ours in made_by_us:
        ours = ours.expanduser().absolute()
        if parent == ours or ours in parent.parents:
            return  # nightshift makes its own results and mlruns directories
    raise ConfigError(f"{source}: {field}: neither directory {str(parent)!r:.120} nor its "
                      "parent exists; create it or name a file in an existing directory.")


def _check_writable(field: str, path: Path, source: str) -> None:
    """An existing SQLite file the daemon could read but not write would fail its first
    write after Ray and the trials' recovery had started: refuse it now. Opening it for
    writing writes nothing (root is refused too where the file is immutable)."""
    try:
        fd = os.open(path.expanduser(), os.O_RDWR)
    except FileNotFoundError:
        return  # made on the first start
    except OSError as exc:
        raise translate(exc, f"{source}: {field}: {str(path)!r:.120} cannot be written "
                        f"({exc.strerror or type(exc).__name__}); make it writable and start "
                        "again.", into=ConfigError) from exc
    os.close(fd)


def _check_prompts_file(path: Path, source: str, tokenizer: PromptTokenizer | None,
                        default_output_len: int, vocab_size: int | None = None
                        ) -> tuple[int, int]:
    """The longest prompt and the longest output (a line's `output_len`, else the default)."""
    from runners.loadgen.prompts_file import prompts_file_longest

    where = f"{source}: workload.prompts_file"
    if not path.is_file():
        what = _not_a_file(path)
        raise ConfigError(f"{where}: {str(path)!r:.120} {what}; give a JSONL file with one "
                          "{\"prompt\": ...} object a line.")
    if path.stat().st_size > MAX_PROMPTS_FILE_BYTES:
        raise ConfigError(f"{where}: {str(path)!r:.120} is over {MAX_PROMPTS_FILE_BYTES:,} "
                          "bytes; a benchmark needs a sample of prompts, not a corpus.")
    with _read_as_the_runner(where, path, "give a JSONL file"):
        return prompts_file_longest(path, tokenizer, default_output_len, vocab_size)


def _check_replay_span(cfg: StudyConfig, arrivals_s: list[float]) -> None:
    """A trace's replay, as recorded x time_scale or at each level's mean rate, sends its
    requests within the day a level may take (the load generator sleeps between arrivals)."""
    w = cfg.spec.workload
    if w.trace is None:
        return
    replayed = arrivals_s[:w.num_requests] if "num_requests" in w.model_fields_set \
        else arrivals_s
    if len(replayed) < 2:
        return
    if "levels" in w.model_fields_set:
        spans = [(f"levels[{i}].request_rate {lv.request_rate:g}",
                  (len(replayed) - 1) / lv.request_rate)
                 for i, lv in enumerate(w.levels) if lv.request_rate]
    else:
        spans = [(f"trace.time_scale {w.trace.time_scale:g}",
                  (replayed[-1] - replayed[0]) / w.trace.time_scale)]
    for what, span_s in spans:
        if span_s > MAX_SECONDS:
            raise ConfigError(
                f"{cfg.source_name}: workload.trace: replayed at {what}, its {len(replayed)} "
                f"requests take {span_s / 3600:,.0f} h to send, over the {MAX_SECONDS / 3600:g} "
                "h a level may take; check trace.timestamp_unit_s (0.001 for milliseconds), "
                "replay it faster or replay fewer requests (num_requests).")


def _check_trace_file(path: Path, timestamp_unit_s: float, source: str, *,
                      has_shared_prefix: bool, max_gap_s: float | None = None,
                      has_tokenizer: bool = False,
                      vocab_size: int | None = None) -> tuple[int, int, list[float]]:
    """The trace read as the runner reads it: its longest prompt and output, in tokens, and its
    arrival times (s from the first)."""
    from runners.arrivals import read_trace
    from runners.loadgen.prompts_file import vocabulary_problem

    where = f"{source}: workload.trace.path"
    fix = ("give a JSONL file with one {\"timestamp\": s, \"input_length\": n, "
           "\"output_length\": n} object a line")
    if not path.is_file():
        what = _not_a_file(path)
        raise ConfigError(f"{where}: {str(path)!r:.120} {what}; {fix}.")
    if path.stat().st_size > MAX_TRACE_FILE_BYTES:
        raise ConfigError(f"{where}: {str(path)!r:.120} is over {MAX_TRACE_FILE_BYTES:,} "
                          "bytes; replay a slice of the trace.")
    with _read_as_the_runner(where, path, fix):
        entries = read_trace(path, timestamp_unit_s, max_gap_s)
    for number, entry in enumerate(entries, start=1):
        problem = vocabulary_problem(entry.prompt, vocab_size)
        if problem is not None:
            raise ConfigError(f"{where}: request {number}: {problem}.")
    if has_shared_prefix:
        # As runners/loadgen/requests.py `_with_shared_prefix` joins them: every prompt token
        # ids, or every prompt text (an entry without one is synthesised: text where the model
        # has a tokenizer, token ids where not) counted again with the tokenizer.
        kinds = ["text" if isinstance(e.prompt, str) else "ids" if isinstance(e.prompt, list)
                 else "text" if has_tokenizer else "ids" for e in entries]
        if len(set(kinds)) > 1:
            first = kinds.index("text" if kinds[0] == "ids" else "ids")
            raise ConfigError(f"{where}: request {first + 1} gives a {kinds[first]} prompt "
                              f"where request 1 gives {kinds[0]}, but workload.shared_prefix "
                              "needs prompts of one kind; give all token ids or all text, or "
                              "leave shared_prefix out.")
        if kinds and kinds[0] == "text" and not has_tokenizer:
            raise ConfigError(f"{where}: the prompts are text, and workload.shared_prefix joins "
                              "text prompts only through the model's tokenizer, which "
                              "model.path does not have here; give token ids or leave "
                              "shared_prefix out.")
    return (max(e.input_len for e in entries), max(e.output_len for e in entries),
            [e.arrival_s for e in entries])


def _human_int(value: object) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT]?)", value)
        if m:
            scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
                     "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[m.group(2)]
            return int(float(m.group(1)) * scale)
    return None


def _check_fits_model(cfg: StudyConfig, model: ModelInfo | None, longest_prompt: int,
                      longest_output: int) -> None:
    """A request's prompt and output must fit the engine's context (vLLM refuses it otherwise,
    and every request of every trial would fail)."""
    fixed = _human_int(cfg.spec.fixed_flags.get("max_model_len"))
    derived = model.derived_max_model_len if model is not None else None
    if model is not None and derived is not None and fixed is not None and fixed > derived and \
            engine_env(cfg, "VLLM_ALLOW_LONG_MAX_MODEL_LEN", "0").strip().lower() \
            not in ("1", "true"):
        raise ConfigError(
            f"{cfg.source_name}: fixed_flags.max_model_len: {fixed} is over the "
            f"{derived} tokens vLLM derives from {model.name}'s "
            "config.json, and vLLM refuses to start with it; lower it, or set env "
            "VLLM_ALLOW_LONG_MAX_MODEL_LEN: '1' if the model is known to hold longer contexts "
            "(RoPE positions past its own give NaNs).")
    raise_it = "raise fixed_flags.max_model_len"
    if fixed is not None and fixed > 0:
        limit, why = fixed, "fixed_flags.max_model_len"
    elif model is None or derived is None:
        return  # a hub id, or a config.json whose length Transformers fills: not known here
    elif model.longrope_default_len is not None and model.longrope_default_len < derived:
        limit = model.longrope_default_len
        why = (f"vLLM's default for {model.name}, a LongRoPE model: its "
               "original_max_position_embeddings")
        raise_it = f"set fixed_flags.max_model_len (up to {derived}, its long context)"
    else:
        limit, why = derived, f"the context vLLM derives from {model.name}'s config.json"
    longest = longest_prompt + longest_output
    if longest > limit:
        raise ConfigError(
            f"{cfg.source_name}: workload: a prompt of up to {longest_prompt} tokens plus an "
            f"output of up to {longest_output} is {longest} tokens, over "
            f"the max_model_len of {limit} ({why}); shorten input_len/output_len (a normal "
            f"or lognormal length without `high` counts its 4-sigma tail: set `high`) or "
            f"{raise_it}.")
