"""A test-only OpenAI-compatible server with known latencies, run as a real subprocess:
`python -m tests.runners.echo_engine --port P --ttft-ms 20 --tpot-ms 5`.

Streams `max_tokens` fake tokens over SSE as vLLM 0.26 does (text chunks, then a usage chunk
with `choices: []`, then `[DONE]`): the first after `ttft_ms`, the rest every `tpot_ms` on an
absolute schedule so sleep overheads do not accumulate. The model name picks a behaviour:
"echo" (normal), "chunked" (3 tokens a chunk), "chunked-nousage" (the same without the
usage chunk), "cut" (half the tokens, then the stream ends without finish_reason, usage or
[DONE]), "error" (HTTP 500), "hang" (one token, then silence), "modelled-lagging" (declares a
modelled clock, as the simulated engine does, that runs at half the wall's pace from the first
such request: the arrivals of a host whose lag grows, closer together than they were sent).
GET /stats reports the most requests it had in flight at once; DELETE /stats resets it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from runners.loadgen.client import (
    MODELLED_ARRIVAL_FIELD,
    MODELLED_CLOCK_HEADER,
    MODELLED_TIME_FIELD,
)

_TOKENS_PER_CHUNK = {"chunked": 3, "chunked-nousage": 3}
_LAGGING = "modelled-lagging"
_LAGGING_PACE = 0.5  # modelled seconds per wall second between its arrivals


def _chunk(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def build_app(ttft_ms: float, tpot_ms: float) -> Starlette:
    state = {"in_flight": 0, "max_in_flight": 0, "num_requests": 0}
    lagging_origin_s: list[float] = []  # the wall time of the first "modelled-lagging" request

    async def health(request: Request) -> Response:
        return PlainTextResponse("")

    async def stats(request: Request) -> Response:
        if request.method == "DELETE":
            state["max_in_flight"] = state["in_flight"]
            state["num_requests"] = 0
        return JSONResponse(state)

    async def completions(request: Request) -> Response:
        body = await request.json()
        model = body.get("model", "echo")
        state["num_requests"] += 1
        if model == "error":
            return JSONResponse({"object": "error", "message": "injected failure"},
                                status_code=500)
        num_tokens = int(body["max_tokens"])
        prompt = body["prompt"]
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        per_chunk = _TOKENS_PER_CHUNK.get(model, 1)
        modelled_arrival_s: float | None = None
        if model == _LAGGING:
            if not lagging_origin_s:
                lagging_origin_s.append(time.perf_counter())
            origin = lagging_origin_s[0]
            modelled_arrival_s = origin + (time.perf_counter() - origin) * _LAGGING_PACE

        async def stream() -> AsyncIterator[str]:
            start = time.perf_counter()
            state["in_flight"] += 1
            state["max_in_flight"] = max(state["max_in_flight"], state["in_flight"])
            try:
                sent = 0
                index = 0
                stop_at = num_tokens // 2 if model == "cut" else num_tokens
                while sent < stop_at:
                    due = start + (ttft_ms + index * tpot_ms * per_chunk) / 1000
                    await asyncio.sleep(max(0.0, due - time.perf_counter()))
                    n = min(per_chunk, num_tokens - sent)
                    sent += n
                    index += 1
                    finish = "length" if sent == num_tokens else None
                    chunk: dict[str, Any] = {
                        "id": "cmpl-echo", "object": "text_completion", "model": model,
                        "choices": [{"index": 0, "text": " tok" * n, "logprobs": None,
                                     "finish_reason": finish}]}
                    if modelled_arrival_s is not None:  # the token's time on that clock
                        chunk[MODELLED_ARRIVAL_FIELD] = modelled_arrival_s
                        chunk[MODELLED_TIME_FIELD] = modelled_arrival_s + due - start
                    yield _chunk(chunk)
                    if model == "hang":
                        await asyncio.sleep(3600)
                if model == "cut":
                    return
                if model.endswith("-nousage"):
                    yield "data: [DONE]\n\n"
                    return
                yield _chunk({"id": "cmpl-echo", "object": "text_completion", "model": model,
                              "choices": [], "usage": {
                                  "prompt_tokens": prompt_tokens,
                                  "completion_tokens": num_tokens,
                                  "total_tokens": prompt_tokens + num_tokens}})
                yield "data: [DONE]\n\n"
            finally:
                state["in_flight"] -= 1

        return StreamingResponse(
            stream(), media_type="text/event-stream",
            headers={MODELLED_CLOCK_HEADER: "modelled"} if model == _LAGGING else None)

    return Starlette(routes=[
        Route("/health", health),
        Route("/stats", stats, methods=["GET", "DELETE"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ttft-ms", type=float, default=20.0)
    parser.add_argument("--tpot-ms", type=float, default=5.0)
    args = parser.parse_args()
    uvicorn.run(build_app(args.ttft_ms, args.tpot_ms), host="127.0.0.1", port=args.port,
                log_level="warning", timeout_graceful_shutdown=1)


if __name__ == "__main__":
    main()
