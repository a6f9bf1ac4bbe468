"""The load generator, as `vllm bench serve` measures: `requests` builds a workload's requests
(`prompts_file` reads a prompts file line by line), `client` sends one streaming completion and
times it, `clients` spreads a load's requests over httpx clients, `level` runs one load level
(`level_driver` sends and watches its requests, `send_log` keeps what its client did;
`modelled_clock`: its duration where a simulated engine's replies are on a modelled clock),
`metrics` computes vLLM's figures of a level.

Definitions follow vLLM's `vllm/benchmarks/serve.py` (`get_request`, `calculate_metrics`) and
`vllm/benchmarks/lib/endpoint_request_func.py` (`async_request_openai_completions`), so a number
measured here means what the same number means in a `vllm bench serve` result file.
"""
