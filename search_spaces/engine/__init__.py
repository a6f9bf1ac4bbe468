"""vLLM as an engine, one fact in one place: the flag table of each release (`tables`: types,
choices, bounds, defaults, `--no-` forms; bundled `flags_<minor>.json`), what changed between
releases (`releases`), the one renderer of flags onto a command line (`render`), and the facts
derived from a config's flags (`facts`: fp8 KV cache, weight quantization, `EngineFlags`).
Pure data and its readers: standard library only, so the search spaces, the runners and the
optimizer all import it."""
