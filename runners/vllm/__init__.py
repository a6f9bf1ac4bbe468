"""vLLM as the engine: how `vllm serve` is launched (`launcher`), the one table of its flags and
their rendering (`flags`), what its start-up log says (`logs`), and engine facts (`facts`)."""
