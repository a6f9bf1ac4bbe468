"""The study file: one YAML naming the model, workload, SLO, objective, space, budget and stores,
parsed once into a typed, frozen `StudyConfig` (every error one line, exit code 2).

`schema` holds `StudySpec` and the checks between its sections, `sections` and
`workload_spec` the sections (each workload spec builds the runner value it stands for),
`fields` the base model, path field and bounds; `loading` reads a file into a `StudyConfig`
(its workload built once), `validation_errors` turns pydantic's errors into one line,
`flag_checks` and `store_checks` check single fields, `prestart` checks what `start` needs
before it writes anything (the stores, directories and env), `workload_checks` the workload
(load, tokenizer, model fit) and `workload_file_checks` its prompts, trace or dataset file.
"""

from optimizer.config.loading import (
    StudyConfig,
    load_study,
    parse_study,
    resume_command,
)
from optimizer.config.prestart import check_before_start
from optimizer.config.workload_checks import check_workload
from optimizer.results.baseline_words import baseline_name

__all__ = ["StudyConfig", "baseline_name", "check_before_start", "check_workload", "load_study",
           "parse_study", "resume_command"]
