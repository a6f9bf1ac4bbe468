"""The simulated engine: a real HTTP server whose latencies follow a roofline-style model."""
