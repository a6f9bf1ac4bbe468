"""The nightshift core, in the order a trial's data passes through it: `config` (the study
file), `search` (what to try next, when to stop, where it runs), `run` (the daemon and its
executors), `storage` (the Optuna study), `results` (what a finished trial means),
`bottleneck` (what limits it), `tracking` (MLflow), `report` and `export`; beside them
`tuning_memory`, `regress` and `cli`; `errors` the exception tree they share.
docs/architecture.md draws it."""
