"""The Optuna storage a study lives in (Optuna's word; MLflow's store is `optimizer.tracking`):
`study` (opening the storage and the study with its sampler and pruner, a runner's result as a
trial state, re-queueing, counting the trials), `sqlite_wait` (a SQLite file's reads and writes
waiting through a lock another process holds), `lock` (one daemon per study: `StudyLock`, and
`StorageLease` for a server RDB). The modules are imported by name; this file imports nothing."""
