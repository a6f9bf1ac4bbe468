"""The study file: one YAML naming the model, workload, SLO, objective, space, budget and stores,
parsed once into a typed, frozen `StudyConfig` (every error one line, exit code 2).

`schema` holds the pydantic models and bounds, `loading` reads and validates a file,
`flag_checks` and `store_checks` check single fields, `prestart` checks what `start` needs
before it writes anything.
"""

from optimizer.config.loading import (
    StudyConfig,
    baseline_name,
    load_study,
    parse_study,
    resume_command,
)
from optimizer.config.prestart import check_before_start, check_workload

__all__ = ["StudyConfig", "baseline_name", "check_before_start", "check_workload", "load_study",
           "parse_study", "resume_command"]
