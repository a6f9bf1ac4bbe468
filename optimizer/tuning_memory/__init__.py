"""The tuning memory: what one study leaves for the next (docs/tuning-memory.md).
`fingerprint` (what a study ran on, what it ran, under which SLO, and the rule that says two
studies are compatible; pure), `fingerprint_of` (a study's fingerprint built from its config,
the hardware, the model and its prompts' file), `earlier_studies` (earlier studies read back
from the MLflow store: the warm start's seeds, `nightshift history`'s rows), `learned_facts`
(the config classes a finished study measured as pathological, appended to the known-facts
file). Named apart from GPU memory (`optimizer.bottleneck.memory_fit`). The modules are
imported by name; this file imports nothing."""
