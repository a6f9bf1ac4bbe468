"""vLLM as the engine a runner launches: how `vllm serve` is launched (`launcher`), the table of
the release it runs (`flags`: bundled, else the installed parser), what its start-up log says
(`logs`), and its compile cache (`compile_cache`, `compile_ledger`). The flag tables, the
renderer and the engine facts themselves live in `search_spaces.engine`."""
