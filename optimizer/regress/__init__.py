"""`nightshift regress`: a library of "hardware x model x workload" cases, each holding configs
with their reference measurements, re-measured on the installed vLLM and judged held, improved,
regressed or failed to start (docs/regress.md).

`library` holds the YAML schema, loading and `append_case`; `measure` runs a case's configs
interleaved; `compare` the interval and verdicts and the flag check; `report` the first line,
MLflow runs and the report files; `export` turns a study's trials into a case; `run` is the
whole command without a terminal.
"""
