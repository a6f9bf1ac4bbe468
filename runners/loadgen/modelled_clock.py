"""A level's duration on a server's modelled clock (the simulated engine's, declared in its
replies' headers: runners/loadgen/client.py): `modelled_duration_s`, the requests' own span, and
`modelled_level_duration_s`, the level's as `vllm bench serve` counts it. A model's times, never
a measurement."""

from __future__ import annotations

from collections.abc import Sequence

from runners.loadgen.client import RequestOutput


def modelled_duration_s(outputs: Sequence[RequestOutput]) -> float | None:
    """A level's duration on a server's modelled clock: its first request's arrival to its last
    token or refusal, over every request stamped on that clock (an error answer is, so a level
    whose first or last requests failed is not shorter than the load it offered); None unless
    every success came with the modelled times."""
    successes = [o.modelled_span_s for o in outputs if o.success]
    if not successes or any(span is None for span in successes):
        return None
    spans = [o.modelled_span_s for o in outputs if o.modelled_span_s is not None]
    first = min(start for start, _ in spans)
    last = max(end for _, end in spans)
    return max(last - first, 1e-9)


def modelled_level_duration_s(outputs: Sequence[RequestOutput],
                              sent_offsets_s: Sequence[float]) -> float | None:
    """A level's duration where its figures are on a server's modelled clock, as `vllm bench
    serve` defines its benchmark duration (vLLM 0.26, vllm/benchmarks/serve.py:974 and :1048:
    from the start of the sending loop, before the first arrival's gap, to the end of the last
    request, on one clock; the wall clock's duration here is that one): the later of two ends,
    each counted from the level's start.

    - The engine's: the first request's scheduled send, then the requests' modelled span
      (`modelled_duration_s`). The engine takes a busy host's late wake-ups off its clock, so on
      that clock arrivals can be closer together than the client sent them: alone, this end
      made a 10 req/s level of 80 requests last 7.33 s (goodput 10.9 req/s) and a trace
      replayed at 4.65 req/s over 12.67 s last 11.34 s (goodput 5.29).
    - The schedule's: each request's scheduled send (`sent_offsets_s`, one per output, in issue
      order) plus its modelled life (arrival to last token; 0 for a refusal or a request the
      server never stamped). A level lasts at least the arrivals it offered: a rate level of n
      requests at least n / rate (vLLM's schedule puts the last send there) plus its last
      request's life, a trace replay its replayed span plus its last request's life.

    None unless every success came with the modelled times (then the wall clock's stands)."""
    engine_s = modelled_duration_s(outputs)
    if engine_s is None:
        return None
    if len(sent_offsets_s) != len(outputs):
        raise ValueError(f"sent_offsets_s must hold one send time per output ({len(outputs)}) "
                         f"but holds {len(sent_offsets_s)}.")
    lives = [o.modelled_span_s[1] - o.modelled_span_s[0] if o.modelled_span_s is not None
             else 0.0 for o in outputs]
    schedule_s = max(offset + life for offset, life in zip(sent_offsets_s, lives, strict=True))
    return max(sent_offsets_s[0] + engine_s, schedule_s)

