"""The simulated engine's HTTP server: vLLM's OpenAI-compatible endpoints, /metrics and the
profiler endpoints over a `SimulatedEngine` (`build_app`), served by uvicorn on loopback
(`serve`). Log lines use vLLM's wording so the same log parsers read them.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import socket
import time
import uuid
import zlib
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

import uvicorn
from prometheus_client import disable_created_metrics
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from runners.base import EngineConfig
from runners.loadgen.client import (
    MODELLED_ARRIVAL_FIELD,
    MODELLED_BURST_HEADER,
    MODELLED_CLOCK_HEADER,
    MODELLED_REFILL_HEADER,
    MODELLED_REMAINING_HEADER,
    MODELLED_TIME_FIELD,
    MODELLED_TIME_HEADER,
)
from runners.simulated import logprobs as sim_logprobs
from runners.simulated.engine import SimulatedEngine
from runners.simulated.settings import ServerSettings

if TYPE_CHECKING:
    from runners.tokenizer import PromptTokenizer

logger = logging.getLogger(__name__)

# Every stream says its times are the model's: the load generator then reads TTFT/ITL/latency
# from the chunks' modelled times, which a busy host CPU cannot stretch
# (runners/loadgen/client.py).
MODELLED_CLOCK_HEADERS = {MODELLED_CLOCK_HEADER: "modelled"}
DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default for /v1/completions
FAKE_WORDS = ("the", "model", "serves", "tokens", "quickly", "while", "batching", "requests",
              "under", "load", "and", "memory", "bound", "decode", "steps", "run")


def _tokenize(text: str, vocab_size: int) -> list[int]:
    """A stand-in tokenizer: one token per whitespace-separated word, stable across runs."""
    return [zlib.crc32(word.encode()) % vocab_size for word in text.split()] or [0]


def _stamped(response: JSONResponse, engine: SimulatedEngine) -> JSONResponse:
    """An error answer to a completion, stamped with the modelled time it was given at."""
    response.headers.update({**MODELLED_CLOCK_HEADERS,
                             MODELLED_TIME_HEADER: repr(engine.modelled_time_s())})
    return response


def _error(message: str, status: int, kind: str) -> JSONResponse:
    return JSONResponse({"object": "error", "message": message, "type": kind, "param": None,
                         "code": status}, status_code=status)


def build_app(engine: SimulatedEngine) -> Any:
    """vLLM's OpenAI-compatible routes; profiler routes only with a profile dir, as in vLLM."""
    config = engine.settings.config
    served = config.served_model_name
    created = int(time.time())
    vocab = engine.model.model.vocab_size
    # Text prompts are counted with the model's own tokenizer where its directory has one, as
    # the load generator counts them; else the word stand-in `_tokenize`.
    text_tokenizer = _model_tokenizer(config)
    logits = sim_logprobs.LogitModel(vocab, sim_logprobs.noise_sigma(config.flags),
                                    sim_logprobs.numerics_seed(config.flags))
    in_flight = [0]  # logprob requests being answered

    async def health(_: Request) -> Response:
        if engine.is_hung:
            await asyncio.Event().wait()  # a wedged API server never answers
        return Response(status_code=200 if engine.is_ready else 503)

    async def models(_: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{
            "id": served, "object": "model", "created": created, "owned_by": "vllm",
            "root": config.model, "parent": None, "max_model_len": engine.model.max_model_len,
            "permission": []}]})

    async def metrics(_: Request) -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def completions(request: Request) -> Response:
        if not engine.is_ready:
            return _error("The engine is not ready yet.", 503, "ServiceUnavailableError")
        try:
            body = await request.json()
        except json.JSONDecodeError as exc:
            return _error(f"Request body must be JSON: {exc}.", 400, "BadRequestError")
        if not isinstance(body, dict):
            return _error("Request body must be a JSON object.", 400, "BadRequestError")
        checked = _check_completion(body, served, config.model, vocab,
                                    engine.model.max_model_len, text_tokenizer)
        burst_size = _int_or_zero(request.headers.get(MODELLED_BURST_HEADER))
        is_refilled = request.headers.get(MODELLED_REFILL_HEADER) == "1"
        remaining_text = request.headers.get(MODELLED_REMAINING_HEADER)
        num_remaining = _int_or_zero(remaining_text) if remaining_text is not None else None
        if isinstance(checked, JSONResponse):
            engine.note_arrival(burst_size, num_remaining=num_remaining)
            return _stamped(checked, engine)
        prompt_ids, max_tokens = checked
        engine.request_started()
        await engine.compile_on_first_request()
        if engine.should_fail_request():
            engine.note_arrival(burst_size, num_remaining=num_remaining)
            return _stamped(_error("Simulated internal error (sim_error_rate).", 500,
                                   "InternalServerError"), engine)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        model_name = str(body.get("model") or served)
        if body.get("stream"):
            options = body.get("stream_options") or {}
            include_usage = bool(options.get("include_usage")) if isinstance(
                options, Mapping) else False
            return StreamingResponse(
                _sse(engine, prompt_ids, max_tokens, request_id, model_name, include_usage,
                     is_refilled, burst_size, num_remaining),
                media_type="text/event-stream", headers=MODELLED_CLOCK_HEADERS)
        if sim_logprobs.wants_logprobs(body):  # the quality evaluation's requests
            in_flight[0] += 1
            try:
                batch_key = in_flight[0]  # 1 = alone; batching moves logprobs a little
                async for _event in engine.generate(prompt_ids, max_tokens):
                    pass
                choice = sim_logprobs.completion_choice(logits, prompt_ids, body, max_tokens,
                                                       batch_key)
            finally:
                in_flight[0] -= 1
            return JSONResponse({
                "id": request_id, "object": "text_completion", "created": int(time.time()),
                "model": model_name, "choices": [choice],
                "usage": _usage(len(prompt_ids), max_tokens)})
        words: list[str] = []
        async for event in engine.generate(prompt_ids, max_tokens):
            last = event.request.num_output_tokens
            words.extend(_word(i) for i in range(last - event.num_tokens + 1, last + 1))
        return JSONResponse({
            "id": request_id, "object": "text_completion", "created": int(time.time()),
            "model": model_name,
            "choices": [{"index": 0, "text": "".join(words), "logprobs": None,
                         "finish_reason": "length", "stop_reason": None,
                         "prompt_logprobs": None}],
            "usage": _usage(len(prompt_ids), len(words))})

    async def start_profile(_: Request) -> Response:
        engine.start_profile()
        return Response(status_code=200)

    async def reset_prefix_cache(_: Request) -> Response:
        engine.reset_prefix_cache()
        return Response(status_code=200)

    async def stop_profile(_: Request) -> Response:
        await asyncio.to_thread(engine.stop_profile)
        return Response(status_code=200)

    routes = [Route("/health", health, methods=["GET"]),
              Route("/v1/models", models, methods=["GET"]),
              Route("/metrics", metrics, methods=["GET"]),
              Route("/v1/completions", completions, methods=["POST"]),
              # vLLM serves it under VLLM_SERVER_DEV_MODE=1, which nightshift sets.
              Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"])]
    if engine.settings.profile_dir is not None:
        routes += [Route("/start_profile", start_profile, methods=["POST"]),
                   Route("/stop_profile", stop_profile, methods=["POST"])]
    app = Starlette(routes=routes)
    api_key = engine.settings.api_key
    return _BearerAuth(app, api_key) if api_key else app


class _BearerAuth:
    """ASGI wrapper: every HTTP route but /health answers 401 without the engine's key (a pure
    ASGI layer, so streamed completions pass through untouched)."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                await JSONResponse({"error": "Unauthorized"}, status_code=401)(
                    scope, receive, send)
                return
        await self.app(scope, receive, send)


def _model_tokenizer(config: EngineConfig) -> PromptTokenizer | None:
    from runners.model_info import resolve_model_dir
    from runners.tokenizer import load_tokenizer, tokenizer_dir_for

    return load_tokenizer(tokenizer_dir_for(resolve_model_dir(config.model),
                                            skip_tokenizer_init=config.skip_tokenizer_init))


def _check_completion(body: Mapping[str, Any], served: str, model_path: str, vocab: int,
                      max_model_len: int, tokenizer: PromptTokenizer | None = None,
                      ) -> tuple[list[int], int] | JSONResponse:
    name = body.get("model")
    if name is not None and name not in {served, model_path}:
        return _error(f"The model `{name}` does not exist.", 404, "NotFoundError")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        prompt_ids = tokenizer.tokenizer.encode(prompt).ids if tokenizer is not None \
            else _tokenize(prompt, vocab)
    elif isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompt_ids = [int(t) for t in prompt]
    else:
        return _error("prompt must be a string or a non-empty list of token ids.", 400,
                      "BadRequestError")
    raw_max = body.get("max_tokens")
    if raw_max is None:
        raw_max = DEFAULT_MAX_TOKENS
    if not isinstance(raw_max, int) or isinstance(raw_max, bool) or raw_max < 1:
        return _error(f"max_tokens must be at least 1, got {raw_max}.", 400, "BadRequestError")
    if len(prompt_ids) + raw_max > max_model_len:
        return _error(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {len(prompt_ids) + raw_max} tokens ({len(prompt_ids)} in the messages, "
            f"{raw_max} in the completion). Please reduce the length of the messages or "
            "completion.", 400, "BadRequestError")
    return prompt_ids, raw_max


def _int_or_zero(text: str | None) -> int:
    return int(text) if text is not None and text.isdigit() else 0


def _word(index: int) -> str:
    return " " + FAKE_WORDS[(index * 7 + 3) % len(FAKE_WORDS)]


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens, "prompt_tokens_details": None}


async def _sse(engine: SimulatedEngine, prompt_ids: list[int], max_tokens: int, request_id: str,
               model_name: str, include_usage: bool,
               is_refilled: bool = False, burst_size: int = 0,
               num_remaining: int | None = None) -> AsyncIterator[str]:
    created = int(time.time())
    num_tokens = 0
    async for event in engine.generate(prompt_ids, max_tokens, is_refilled, burst_size,
                                       num_remaining):
        num_tokens += event.num_tokens
        last = event.request.num_output_tokens
        text = "".join(_word(i) for i in range(last - event.num_tokens + 1, last + 1))
        chunk = {"id": request_id, "object": "text_completion", "created": created,
                 "model": model_name,
                 "choices": [{"index": 0, "text": text,
                              "logprobs": None,
                              "finish_reason": "length" if event.is_finished else None,
                              "stop_reason": None}],
                 # Not in vLLM's schema: the modelled clock's times (MODELLED_CLOCK_HEADER).
                 MODELLED_ARRIVAL_FIELD: event.request.arrival_s,
                 MODELLED_TIME_FIELD: event.time_s}
        yield f"data: {json.dumps(chunk)}\n\n"
    if include_usage:
        final = {"id": request_id, "object": "text_completion", "created": created,
                 "model": model_name, "choices": [],
                 "usage": _usage(len(prompt_ids), num_tokens)}
        yield f"data: {json.dumps(final)}\n\n"
    yield "data: [DONE]\n\n"


# --- process -------------------------------------------------------------------------------------
async def serve(settings: ServerSettings) -> int:
    """Run one engine until SIGINT/SIGTERM; the exit code vLLM would give (0 or 1)."""
    try:
        engine = SimulatedEngine(settings)
    except ValueError as exc:
        logger.error("ValueError: %s", exc)
        return 1
    failure = engine.model.check_arguments()
    if failure is not None:
        logger.error("ValueError: %s", failure.message)
        return 1
    # vLLM 0.26 exposes no `*_created` samples; prometheus_client's switch is process-wide,
    # which is right here: this process is one engine.
    disable_created_metrics()  # type: ignore[no-untyped-call]
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((settings.host, settings.port))
    except OSError as exc:
        sock.close()
        logger.error("OSError: [Errno %s] error while attempting to bind on address "
                     "('%s', %d): %s", exc.errno, settings.host, settings.port, exc.strerror)
        return 1
    server = uvicorn.Server(uvicorn.Config(
        build_app(engine), log_level="warning", access_log=False, lifespan="off",
        timeout_graceful_shutdown=1))
    serve_task = asyncio.create_task(server.serve(sockets=[sock]))
    start_task = asyncio.create_task(engine.start())
    await asyncio.wait({serve_task, start_task}, return_when=asyncio.FIRST_COMPLETED)
    if start_task.done() and start_task.result() is not None:
        server.should_exit = True
        await serve_task
        return int(start_task.result() or 1)
    await serve_task
    start_task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await start_task
    return 0
