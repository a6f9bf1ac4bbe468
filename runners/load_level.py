"""One step of offered load (`LoadLevel`): what a load level sends and what a capacity search
probes, below both the workload and the search."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoadLevel:
    """One step of offered load: a request rate, a fixed concurrency, or both (a rate capped by
    a concurrency, as `vllm bench serve --max-concurrency` does). A rate's arrivals are Poisson,
    or gamma with `burstiness` (runners/arrivals.py); with a trace (`Workload.trace`) a rate is
    the replay's mean rate."""

    request_rate_rps: float | None = None  # None = send all at once (infinite rate)
    max_concurrency: int | None = None
    # Gamma shape of the gaps between arrivals, as `vllm bench serve --burstiness`: 1 = Poisson,
    # lower = burstier; None = the workload's `burstiness`.
    burstiness: float | None = None

    @property
    def label(self) -> str:
        parts = []
        if self.request_rate_rps is not None:
            parts.append(f"rate={self.request_rate_rps:g}")
        if self.max_concurrency is not None:
            parts.append(f"concurrency={self.max_concurrency}")
        if self.burstiness is not None and self.burstiness != 1.0:
            parts.append(f"burstiness={self.burstiness:g}")
        return ",".join(parts) or "rate=inf"
