"""The tags and kinds every nightshift run carries in MLflow, and the file names of a trial's
artifacts: the names the tracker writes and the tuning memory reads."""

TAG_STUDY = "nightshift.study"
TAG_KIND = "nightshift.kind"  # "study", "trial" or "confirmation"
KIND_TRIAL, KIND_CONFIRMATION = "trial", "confirmation"  # a trial's run: search or re-measure
TAG_CONFIRM = "nightshift.confirm"  # a confirmation run's side: "defaults" or "best"
# On a run of the simulated engine (a trial's, and the study's): its figures are a model's,
# never measurements. A run of vLLM carries no such tag. Its name and description say it too.
TAG_ENGINE = "nightshift.engine"
ENGINE_SIMULATED = "simulated"
SIMULATED_NAME_MARK = " sim"  # after the trial number: `t003 sim fp8+kv-fp8`
SIMULATED_DESCRIPTION = "SIMULATED: "  # the description's start: figures from a model
SIMULATED_VERSION_PREFIX = "simulated "  # engine.engine_version: the vLLM version modelled
# MLflow 3's experiment kind (the UI reads it: mlflow/server/js, 3.17.2): a GenAI experiment
# opens on an Overview of traces, a custom-model one on its runs table, which is what a study is.
# MLflow 3.17's UI reads it only where its GenAI / Model training selector is off, and that
# selector is on by default: the page opens on runs with `?workflowType=machine_learning`, or
# after one click on "Model training" (remembered by the browser); `runs_page` builds that URL.
TAG_EXPERIMENT_KIND = "mlflow.experimentKind"
EXPERIMENT_KIND_RUNS = "custom_model_development"

TAG_TRIAL = "nightshift.trial"
# The recommended trial's run (recommendation.recommended_trial, what `export` writes): this tag,
# "true", and its name starting with RECOMMENDED_MARK.
TAG_RECOMMENDED = "nightshift.recommended"
RECOMMENDED_MARK = "★ recommended: "
TAG_PARENT = "mlflow.parentRunId"
# On a study's parent run: the key of the Optuna study it records (its `mlflow_study_key`
# attribute). A study started anew under the same name (its Optuna storage deleted or moved)
# gets a parent run of its own, so its trials never mix with the earlier ones' numbers.
TAG_STUDY_KEY = "nightshift.study_key"
TAG_STATE = "state"  # complete | pruned | failed | running
TAG_FAILURE = "failure_reason"
TAG_CONCLUSION = "conclusion"
SERVER_LOG = "server.log"  # a trial's engine log, in its workdir and as its run's artifact
TRACE_FILE = "trace.trimmed.pt.trace.json.gz"  # runners.engine writes it beside server.log
# The requests each headline p99 is over, in words (optimizer/results/tail_samples.py), and
# "true" where one of them is thin (under 100 requests: set by its two slowest).
TAG_P99_BASIS = "p99.basis"
TAG_P99_THIN = "p99.thin"
