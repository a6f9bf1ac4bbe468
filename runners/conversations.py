"""Multi-turn load: conversations whose turn k+1 is sent only once turn k's reply has finished,
its prompt the previous prompt, the server's reply and the next user message.

The shape of vLLM's multi-turn benchmark (benchmarks/multi_turn/benchmark_serving_multi_turn.py
in vLLM's repository): the server's own answer, not the dataset's, becomes the next turn's
context; a turn's output length is the dataset reply's token count; a failed turn ends its
conversation. Unlike it, the prompt is raw text for `/v1/completions` (no chat template), and
each of a level's `max_concurrency` slots runs one conversation at a time (its
`--max-active-conversations` equal to its number of clients). Every turn is one request with
the same figures as any other (`loadgen.metrics.compute_metrics`); later turns repeat the earlier
as their prefix, which is what a prefix cache saves.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from runners import datasets
from runners.datasets import Conversation, Turn
from runners.load_level import LoadLevel
from runners.loadgen.client import RequestOutput, send_request
from runners.loadgen.clients import ClientPool, client_pool
from runners.loadgen.level import LevelResult, blocking
from runners.loadgen.level_driver import STALLED_ERROR, STOPPED_ERROR, StopFlag
from runners.loadgen.metrics import compute_metrics
from runners.loadgen.modelled_clock import modelled_duration_s
from runners.loadgen.requests import RequestSpec, synthesise_request
from runners.loadgen.send_log import SendLog
from runners.tokenizer import PromptTokenizer, load_tokenizer
from runners.workload import SLO, Workload

logger = logging.getLogger(__name__)

TURN_SEPARATOR = "\n\n"  # between a reply and the next user message
_WATCH_INTERVAL_S = 0.05


def build_conversations(workload: Workload, num_requests: int,
                        seed: int) -> list[Conversation]:
    """Whole conversations, in order, until their turns number at least `num_requests`: a
    dataset's (`workload.dataset`, at most `multi_turn.max_turns` turns each) or synthesised
    ones of `multi_turn.num_turns` turns, each user message text of a length drawn from
    `workload.input_len` (needs the model's tokenizer). Conversation j does not depend on
    `num_requests`."""
    spec = workload.multi_turn
    if spec is None:
        raise ValueError("build_conversations needs workload.multi_turn but got none.")
    tokenizer = load_tokenizer(workload.tokenizer_dir)
    source: itertools.count[int] | None = None
    stream = None
    if workload.dataset is not None:
        stream = datasets.iter_conversations(workload.dataset, tokenizer, seed,
                                             max_turns=spec.max_turns or 1_000_000)
    else:
        if tokenizer is None:
            raise ValueError("synthesised multi-turn conversations need the model's "
                             "tokenizer (a tokenizer.json in the model directory) but there "
                             "is none; give workload.dataset or a model with a tokenizer.")
        source = itertools.count()
    rng = np.random.default_rng(seed)
    out: list[Conversation] = []
    num_turns = 0
    while num_turns < num_requests:
        if stream is not None:
            conversation = next(stream)
        else:
            assert source is not None and tokenizer is not None
            conversation = _synthesised(workload, rng, tokenizer, f"synthetic-{next(source)}",
                                        spec.num_turns)
        out.append(conversation)
        num_turns += len(conversation.turns)
    return out


def _synthesised(workload: Workload, rng: np.random.Generator, tokenizer: PromptTokenizer,
                 ident: str, num_turns: int) -> Conversation:
    turns = []
    for _ in range(num_turns):
        request = synthesise_request(workload, rng, tokenizer)
        assert isinstance(request.prompt, str)
        turns.append(Turn(request.prompt, request.prompt_len, request.output_len))
    return Conversation(ident, tuple(turns), is_estimated=False)


def next_prompt(previous_prompt: str, reply: str, user: str) -> str:
    """Turn k+1's prompt: turn k's prompt, the server's reply to it, then the next message."""
    return previous_prompt + reply + TURN_SEPARATOR + user


@dataclass(frozen=True)
class TurnOutput:
    """One turn's request as measured, with where it sits."""

    conversation: int  # index in the level's list; -1 for a turn cancelled in flight
    turn: int  # 0 = the first user message; -1 for a turn cancelled in flight
    output: RequestOutput
    sent_s: float = 0.0  # time.perf_counter() when the turn was sent
    ended_s: float = 0.0  # time.perf_counter() when its reply (or failure) had ended


class _ConversationDriver:
    def __init__(self, base_url: str, model: str, conversations: Sequence[Conversation],
                 tokenizer: PromptTokenizer | None, *, timeout_s: float,
                 stop_event: StopFlag | None, stall_timeout_s: float | None,
                 time_limit_s: float | None, max_context_len: int | None = None) -> None:
        self.base_url = base_url
        self.model = model
        self.conversations = conversations
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s
        self.stop_event = stop_event
        self.stall_timeout_s = stall_timeout_s
        self.time_limit_s = time_limit_s
        self.max_context_len = max_context_len  # tokens, a turn's prompt + output
        self.num_cut_at_context = 0  # conversations ended before a turn that would not fit
        self.next_index = itertools.count()
        self.outputs: list[TurnOutput] = []
        self.num_in_flight = 0
        self.max_in_flight = 0
        self.last_progress = time.perf_counter()
        self.abort_reason: str | None = None
        self.start = time.perf_counter()
        # on time.monotonic(), as the server's /metrics samples: every turn's send, the
        # in-flight count, and when each slot stopped (runners/applied_load.py reads them)
        self.sends = SendLog()

    def _heartbeat(self) -> None:
        self.last_progress = time.perf_counter()

    def _count(self, prompt: str) -> int:
        return self.tokenizer.count(prompt) if self.tokenizer is not None else \
            datasets.estimate_tokens(prompt)

    def _is_over(self) -> bool:
        if self.stop_event is not None and self.stop_event.is_set():
            return True
        return self.time_limit_s is not None and \
            time.perf_counter() - self.start >= self.time_limit_s

    async def slot(self, clients: ClientPool) -> None:
        """One slot: conversations one after another, each turn after the last reply; when it
        stops sending (out of conversations, past the time bound), the send log says so."""
        last_modelled_s: list[float] = []  # the end of its last request, on a modelled clock
        try:
            await self._run_slot(clients, last_modelled_s)
        finally:
            self.sends.record_slot_end(time.monotonic(),
                                       last_modelled_s[-1] if last_modelled_s else None)

    async def _run_slot(self, clients: ClientPool, last_modelled_s: list[float]) -> None:
        while not self._is_over():
            index = next(self.next_index)
            if index >= len(self.conversations):
                return
            conversation = self.conversations[index]
            prompt = ""
            reply = ""
            for k, turn in enumerate(conversation.turns):
                if self._is_over():
                    return
                prompt = turn.user if k == 0 else next_prompt(prompt, reply, turn.user)
                # The first turn's count is the dataset's (or synthesis') own.
                prompt_len = turn.user_len if k == 0 else self._count(prompt)
                if k > 0 and self.max_context_len is not None and \
                        prompt_len + turn.reply_len > self.max_context_len:
                    # The server's replies made the context longer than the dataset's did:
                    # end the conversation where `datasets` ends one, rather than send a turn
                    # the server must refuse (a failure of the workload, not the engine).
                    self.num_cut_at_context += 1
                    break
                spec = RequestSpec(prompt, prompt_len, turn.reply_len,
                                   is_prompt_len_estimated=conversation.is_estimated)
                sent = time.perf_counter()
                out = await self._send(clients, spec)
                reply = out.generated_text
                if out.modelled_span_s is not None:
                    last_modelled_s.append(out.modelled_span_s[1])
                self.outputs.append(TurnOutput(index, k, replace(out, generated_text=""),
                                               sent, time.perf_counter()))
                if not out.success:
                    break  # as vLLM's client: a failed turn ends its conversation

    async def _send(self, clients: ClientPool, spec: RequestSpec) -> RequestOutput:
        if self.num_in_flight == 0:
            self._heartbeat()
        self.num_in_flight += 1
        self.sends.record_send(time.monotonic(), None)
        self.sends.record_in_flight(time.monotonic(), self.num_in_flight)
        self.max_in_flight = max(self.max_in_flight, self.num_in_flight)
        sent = time.perf_counter()
        index, client = clients.acquire()
        try:
            return await send_request(client, self.base_url, self.model, spec,
                                      self.timeout_s, on_chunk=self._heartbeat,
                                      keep_text=True)
        except asyncio.CancelledError:
            self.outputs.append(TurnOutput(-1, -1, RequestOutput(
                success=False, error=self.abort_reason or STOPPED_ERROR,
                prompt_len=spec.prompt_len, client_prompt_len=spec.prompt_len,
                start_time=sent)))
            raise
        finally:
            clients.release(index)
            self.num_in_flight -= 1
            self.sends.record_in_flight(time.monotonic(), self.num_in_flight)
            self._heartbeat()

    async def watch(self, slots: list[asyncio.Task[None]]) -> None:
        while True:
            await asyncio.sleep(_WATCH_INTERVAL_S)
            if self.stop_event is not None and self.stop_event.is_set():
                self.abort_reason = STOPPED_ERROR
            elif (self.stall_timeout_s is not None and self.num_in_flight > 0
                  and time.perf_counter() - self.last_progress > self.stall_timeout_s):
                logger.warning("no chunk from any of %d in-flight turns for %.1f s: cancelling "
                               "them as stalled", self.num_in_flight, self.stall_timeout_s)
                self.abort_reason = STALLED_ERROR
            if self.abort_reason is not None:
                for task in slots:
                    task.cancel()
                return


async def run_conversations(
    base_url: str,
    model: str,
    conversations: Sequence[Conversation],
    level: LoadLevel,
    slo: SLO,
    *,
    timeout_s: float,
    tokenizer_dir: Path | None = None,
    stop_event: StopFlag | None = None,
    stall_timeout_s: float | None = None,
    duration_s: float | None = None,
    max_context_len: int | None = None,
    api_key: str | None = None,
) -> tuple[LevelResult, list[TurnOutput], int]:
    """Drive one level of conversations, `level.max_concurrency` of them in flight, each turn
    sent once the previous reply has ended; no turn is sent after `duration_s` (those in
    flight finish). A conversation ends before a turn whose counted prompt plus output would
    pass `max_context_len` (the workload's bound, never the server's: a config's shorter
    max_model_len must fail the turns it cannot serve, not send a lighter load): the server's
    replies, not the dataset's, are the context. The figures are the level's, every turn one
    request; the turn outputs say which turn each request was; the last element is how many
    conversations were ended so. Raises ValueError for bad arguments only."""
    if not conversations:
        raise ValueError("run_conversations needs at least one conversation but got none.")
    if level.request_rate_rps is not None or level.max_concurrency is None:
        raise ValueError(f"a multi-turn level is bounded by conversations in flight: it needs "
                         f"max_concurrency and no request rate, but got {level.label}.")
    tokenizer = load_tokenizer(tokenizer_dir)
    cap = level.max_concurrency
    driver = _ConversationDriver(base_url, model, conversations, tokenizer,
                                 timeout_s=timeout_s, stop_event=stop_event,
                                 stall_timeout_s=stall_timeout_s, time_limit_s=duration_s,
                                 max_context_len=max_context_len)
    # Spread over clients of a few dozen turns each, as a level's (runners/loadgen/clients.py).
    async with client_pool(api_key) as clients:
        slots = [asyncio.create_task(driver.slot(clients)) for _ in range(cap)]
        watchdog = asyncio.create_task(driver.watch(slots))
        try:
            await asyncio.gather(*slots, return_exceptions=True)
        finally:
            watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watchdog
        driver.sends.num_clients = clients.num_clients
    duration = time.perf_counter() - driver.start
    outputs = [t.output for t in driver.outputs]
    modelled_s = modelled_duration_s(outputs)
    is_modelled = modelled_s is not None
    if modelled_s is not None:
        duration = modelled_s
    metrics = compute_metrics(outputs, duration, slo,
                              max_concurrency_seen=driver.max_in_flight)
    logger.info("level %s: %d conversations, %d turns completed, %d failed in %.1f s%s%s",
                level.label, len({t.conversation for t in driver.outputs if t.turn >= 0}),
                metrics.completed, metrics.failed, duration,
                f"; {driver.num_cut_at_context} ended before a turn over "
                f"{driver.max_context_len} tokens" if driver.num_cut_at_context else "",
                f" ({driver.abort_reason})" if driver.abort_reason else "")
    result = LevelResult(metrics=metrics, outputs=outputs,
                         stalled=driver.abort_reason == STALLED_ERROR,
                         stopped=driver.abort_reason == STOPPED_ERROR,
                         is_modelled_clock=is_modelled, sends=driver.sends)
    return result, list(driver.outputs), driver.num_cut_at_context


run_conversations_sync = blocking(run_conversations)


def turn_metrics(turns: Sequence[TurnOutput], num_cut_at_context: int = 0) -> dict[str, float]:
    """Mean TTFT of first turns and of later turns (ms, successful ones), the number of
    turns, and of conversations ended before a turn that would not fit the context: later
    turns carry the earlier ones as a prefix, so the gap is the prefix cache's saving (or its
    absence)."""
    first = [t.output.ttft_s for t in turns if t.turn == 0 and t.output.success]
    later = [t.output.ttft_s for t in turns if t.turn > 0 and t.output.success]
    out = {"multi_turn.num_turns": float(sum(1 for t in turns if t.turn >= 0)),
           "multi_turn.num_cut_at_context": float(num_cut_at_context)}
    if first:
        out["multi_turn.first_turn_mean_ttft_ms"] = float(np.mean(first)) * 1000.0
    if later:
        out["multi_turn.later_turns_mean_ttft_ms"] = float(np.mean(later)) * 1000.0
    return out
