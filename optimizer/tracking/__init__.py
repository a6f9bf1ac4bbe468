"""MLflow tracking: one parent run per study, one nested child run per trial.

The daemon is the only writer. Optuna's storage is the source of truth; MLflow is brought into
agreement with it on every start (`Tracker.catch_up`), so a crash between the two never leaves a
run RUNNING or a finished trial unlogged, and a replay never logs a value twice.

Modules: `tags` (the tag names and kinds every run carries), `tracker` (`Tracker`: the parent
and child runs, `catch_up`), `payload` (what a trial's run is given, from its record:
`tracking_payload`, its name, `TrialLog`), `store` (opening a store and probing it writable),
`view` (the runs table's saved view, `runs_view`, `runs_page`), `study_summary` (the study
run's closing figures and tags, from the trial records and the report).
"""
