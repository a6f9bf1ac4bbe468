"""One request: `send_request` POSTs a streaming completion and times it as vLLM's
`async_request_openai_completions` does (`RequestOutput`), and the modelled-clock headers a
simulated engine answers with (its times are then read instead of the client's clock)."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Final

import httpx

from runners.loadgen.requests import RequestSpec

_ERROR_EXCERPT_CHARS = 300
# A simulated engine answers with this header set to "modelled" and puts its modelled clock's
# times in every chunk: the request's arrival and the token's time, in seconds. Only then are
# a request's figures read from those times (a real vLLM server never sends the header, so its
# figures are always the client's own clock); the level's result says which it was.
MODELLED_CLOCK_HEADER: Final = "x-simulated-clock"
MODELLED_ARRIVAL_FIELD: Final = "simulated_arrival_s"
MODELLED_TIME_FIELD: Final = "simulated_time_s"
# On an error answer of such a server: the modelled time it refused the request at, seconds.
MODELLED_TIME_HEADER: Final = "x-simulated-time"
# Sent only to a server that declared a modelled clock before: "this request's client sends the
# next one as soon as it ends" (a closed loop with requests left), so the server can stamp that
# next arrival at this one's modelled end instead of after the host's scheduling delay.
MODELLED_REFILL_HEADER: Final = "x-simulated-refill"
# With it, how many requests the level still sends after this one: a refill is awaited only
# while some remain (a failed request frees its slot early, so a promise can outlive its level).
MODELLED_REMAINING_HEADER: Final = "x-simulated-remaining"
# Likewise "this request is one of N the client sends at once" (a closed-loop level's first N).
MODELLED_BURST_HEADER: Final = "x-simulated-burst"
_modelled_servers: set[str] = set()  # base URLs whose last answer declared a modelled clock


@dataclass(frozen=True)
class RequestOutput:
    """What one request measured, as vLLM's `RequestFuncOutput` (times from the client's view)."""

    success: bool
    error: str = ""  # one line on why it failed; empty on success
    ttft_s: float = 0.0  # seconds, send to first chunk carrying choices
    itl_s: tuple[float, ...] = ()  # seconds between consecutive chunks carrying choices
    latency_s: float = 0.0  # seconds, send to the last chunk carrying choices (e2el)
    prompt_len: int = 0  # tokens; the server's usage.prompt_tokens when it sent one
    client_prompt_len: int = 0  # tokens, the load generator's own count (or estimate)
    server_prompt_len: int | None = None  # tokens, usage.prompt_tokens; None: not sent
    generated_text: str = ""  # the reply's text, kept only where asked (multi-turn)
    # tokens; usage.completion_tokens, else max_tokens where the reply ended for its length,
    # else the number of chunks
    output_tokens: int = 0
    start_time: float = 0.0  # time.perf_counter() when the request was sent
    # Set only for a server that declared a modelled clock (MODELLED_CLOCK_HEADER): the
    # request's modelled arrival and last token, and then every time above is modelled too.
    modelled_span_s: tuple[float, float] | None = None


def failed_output(spec: RequestSpec, start: float, error: str) -> RequestOutput:
    return RequestOutput(success=False, error=error, prompt_len=spec.prompt_len,
                         client_prompt_len=spec.prompt_len, start_time=start)


async def send_request(
    client: httpx.AsyncClient,
    base_url: str,
    model: str,
    spec: RequestSpec,
    timeout_s: float,
    *,
    on_chunk: Callable[[], None] | None = None,
    is_refilled: bool = False,
    burst_size: int = 0,
    num_remaining: int | None = None,
    keep_text: bool = False,
    clock: Callable[[], float] = time.perf_counter,
) -> RequestOutput:
    """POST one streaming completion and time it; never raises (failures come back as
    `success=False`, as vLLM's request functions do).

    `on_chunk`, a no-argument callable, is called on every SSE data line: the level's stall
    watchdog uses it as a heartbeat. `keep_text` keeps the reply's text (a conversation's next
    turn carries it). `clock` (seconds) is read once as the request is sent and once as each
    SSE data line arrives; tests pass a scripted one.
    """
    url = base_url.rstrip("/") + "/v1/completions"
    headers: dict[str, str] | None = None
    if base_url in _modelled_servers:  # never sent to a server that did not declare its clock
        headers = {MODELLED_REFILL_HEADER: "1"} if is_refilled else {}
        if num_remaining is not None:
            headers[MODELLED_REMAINING_HEADER] = str(num_remaining)
        if burst_size > 1:
            headers[MODELLED_BURST_HEADER] = str(burst_size)
    payload: dict[str, Any] = {
        "model": model,
        "prompt": spec.prompt,
        "max_tokens": spec.output_len,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
    }
    start = clock()
    ttft: float | None = None
    most_recent = start
    itls: list[float] = []
    num_chunks = 0
    finish_reason: str | None = None  # the last choice's: set on a reply's final chunk
    is_done = False  # the stream's `data: [DONE]`
    usage_output_tokens = 0
    server_prompt_len: int | None = None
    texts: list[str] = []
    modelled: list[float] = []  # arrival, then each token's time, on a modelled clock
    try:
        async with asyncio.timeout(timeout_s), client.stream("POST", url, json=payload,
                                                         headers=headers) as resp:
            if resp.status_code != 200:
                body = await resp.aread()
                excerpt = body[:_ERROR_EXCERPT_CHARS].decode("utf-8", "replace")
                excerpt = " ".join(excerpt.split())
                failed = failed_output(spec, start, f"HTTP {resp.status_code}: {excerpt}")
                stamp = resp.headers.get(MODELLED_TIME_HEADER)
                if resp.headers.get(MODELLED_CLOCK_HEADER) == "modelled" and stamp:
                    failed = replace(failed, modelled_span_s=(float(stamp), float(stamp)))
                return failed
            is_modelled = resp.headers.get(MODELLED_CLOCK_HEADER) == "modelled"
            if is_modelled:
                _modelled_servers.add(base_url)
            else:
                _modelled_servers.discard(base_url)
            async for line in resp.aiter_lines():
                # Comments (":" pings) and event/id fields carry no tokens.
                if not line.startswith("data:"):
                    continue
                data_str = line[len("data:"):].strip()
                if data_str == "[DONE]":
                    is_done = True
                    break
                timestamp = clock()
                if on_chunk is not None:
                    on_chunk()
                data = json.loads(data_str)
                if not isinstance(data, dict):
                    return failed_output(spec, start,
                                         f"SSE data is not a JSON object: {data_str:.80}")
                if "error" in data or data.get("object") == "error":
                    # vLLM reports an engine failure mid-stream as a data line, status 200.
                    detail = data.get("error", data.get("message", data))
                    return failed_output(spec, start, f"error in stream: {detail!s:.200}")
                # Any chunk with choices counts as a token (its text may be empty for special
                # tokens), as in vLLM; the usage chunk at the end has choices [].
                if data.get("choices"):
                    if is_modelled:
                        if not modelled:
                            modelled.append(float(data[MODELLED_ARRIVAL_FIELD]))
                        modelled.append(float(data[MODELLED_TIME_FIELD]))
                    if ttft is None:
                        ttft = timestamp - start
                    else:
                        itls.append(timestamp - most_recent)
                    most_recent = timestamp
                    num_chunks += 1
                    finish_reason = data["choices"][0].get("finish_reason") or finish_reason
                    if keep_text:
                        texts.append(str(data["choices"][0].get("text") or ""))
                usage = data.get("usage")
                if isinstance(usage, dict):
                    usage_output_tokens = int(usage.get("completion_tokens") or 0)
                    if usage.get("prompt_tokens") is not None:
                        server_prompt_len = int(usage["prompt_tokens"])
    except TimeoutError:
        return failed_output(spec, start, f"no complete response within {timeout_s:g} s")
    except Exception as exc:  # the contract is to never raise: any failure is this request's
        return failed_output(spec, start, f"{type(exc).__name__}: {exc}")
    if ttft is None:
        return failed_output(spec, start, "stream ended without a chunk carrying a token")
    if not is_done and finish_reason is None:
        # vLLM counts such a reply a success; it is a reply cut off (a proxy or server that
        # dropped the stream), and its short latency would flatter every figure.
        return failed_output(spec, start, f"stream ended after {num_chunks} chunk(s) without a "
                                          "finish_reason or [DONE]: the reply was cut off")
    # A chunk may carry several tokens: usage.completion_tokens counts them; without it a
    # reply that ended for its length (ignore_eos) has exactly max_tokens; else one a chunk.
    output_tokens = usage_output_tokens or (
        spec.output_len if finish_reason == "length" else num_chunks)
    # The server's count stands in the figures (as in vLLM's); the client's is kept beside it
    # so that the two can be compared (`prompt_len_gap`), neither trusted silently.
    prompt_len = server_prompt_len if server_prompt_len is not None else spec.prompt_len
    text = "".join(texts)
    if modelled:
        # The server's modelled clock: the same definitions, on times a busy host can't stretch.
        arrival, first, last = modelled[0], modelled[1], modelled[-1]
        return RequestOutput(
            success=True, ttft_s=first - arrival,
            itl_s=tuple(b - a for a, b in itertools.pairwise(modelled[1:])),
            latency_s=last - arrival, prompt_len=prompt_len, output_tokens=output_tokens,
            start_time=start, modelled_span_s=(arrival, last),
            client_prompt_len=spec.prompt_len, server_prompt_len=server_prompt_len,
            generated_text=text)
    return RequestOutput(
        success=True,
        ttft_s=ttft,
        itl_s=tuple(itls),
        latency_s=most_recent - start,
        prompt_len=prompt_len,
        output_tokens=output_tokens,
        start_time=start,
        client_prompt_len=spec.prompt_len,
        server_prompt_len=server_prompt_len,
        generated_text=text,
    )
