"""The launch a user deploys. `nightshift export`: a trial as a `vllm serve --config` YAML
(data only), a shell launcher, or env vars, each built from what the trial ran: its recorded
flags, environment and command line, never today's study file where the record says.
`nightshift audit`: any `vllm serve` launch read against its flag table (a config whose flags
the audit refuses is never recommended).

Modules: `choice` (which trial: `select_trial`, the recommendation's note, the flags a
deployment leaves out), `launch` (what ran: `launched`, the flags, extra args, model and
environment a deployment passes), `render` (the header and the three formats), `audit` (a
launch's findings: `parse_launch`, `audit`). This package's public face for the export:
callers import from here; the audit is imported by name (`optimizer.export.audit`).
"""

from optimizer.export.choice import choice_note, select_trial
from optimizer.export.launch import trial_env
from optimizer.export.render import FORMATS, render

__all__ = ["FORMATS", "choice_note", "render", "select_trial", "trial_env"]
