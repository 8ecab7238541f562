"""The tag vocabulary this project writes on MLflow runs and model versions: every tag name, once.
The code that sets a tag and the code that reads it name the same constant, so a renamed tag
cannot leave a reader behind. A leaf module: the flows, the stages and the gates all import it."""

# -- pipeline runs --------------------------------------------------------------------------------
PIPELINE_TAG = "rlhf.kind"  # pipeline | stage | study
OUTPUTS_TAG = "rlhf.outputs"
INPUTS_TAG = "rlhf.inputs"  # on a pipeline run: what it started from (from_run's outputs)
# On a pipeline run, which stage run holds each of its stages: rlhf.stage.<name> = <how>:<run id>,
# <how> `ran` (a child run of this pipeline run), `reused` (the run of an earlier pipeline run
# with the same inputs and config: the stage was skipped) or `deployed` (the run made by the
# stage's own deployment, which this pipeline run started).
STAGE_TAG_PREFIX = "rlhf.stage."
FLOW_RUN_TAG = "rlhf.prefect_flow_run"  # on a pipeline run: the Prefect flow run that made it
STUDY_TAG, ARM_TAG = "rlhf.study", "rlhf.arm"  # a study's pipeline runs: the study's run id, the arm's name
CONTRACT_TAG = "rlhf.contract"  # passed | failed, set by the gate after the stage (data_contracts)
DESCRIPTION_TAG = "mlflow.note.content"  # what MLflow's UI shows as a run's description
FAILED_STAGE_TAG = "rlhf.failed_stage"  # on a failed pipeline run: the stage it failed in
STAGE_TAG = "rlhf.stage"  # on a stage run: its stage's name
STAGES_TAG = "rlhf.stages"  # on a pipeline run: the stages it runs, comma-separated
PRESET_TAG = "rlhf.preset"
CONFIG_HASH_TAG = "rlhf.config_hash"
GIT_COMMIT_TAG = "rlhf.git_commit"
FROM_RUN_TAG = "rlhf.from_run"
RESUMED_TAG = "rlhf.resumed"  # on a pipeline run: when it was last resumed
RESUMED_FROM_TAG = "rlhf.resumed_from"  # on a stage run: the checkpoint it resumed from, or none
CHAMPION_TAG = "rlhf.champion"  # on the eval run: whether the policy became @champion, and why
CHAMPION_JUDGE_TAG = "rlhf.champion_judge"  # on the eval run: the judge the verdict rests on

# -- studies --------------------------------------------------------------------------------------
ARMS_TAG = "rlhf.arms"
STUDY_PRESET_TAG = "rlhf.study_preset"
STUDY_OVERRIDES_TAG = "rlhf.study_overrides"
ARM_KIND_TAG = "rlhf.arm_kind"
BEST_OF_N_TAG = "rlhf.best_of_n"
SEED_TAG = "rlhf.seed"

# -- a registered model version's lineage ---------------------------------------------------------
INPUT_TAG_PREFIX = "rlhf.input."  # rlhf.input.<input>: the URI of the input it was made from
DATA_DIGEST_TAG = "rlhf.data_digest"
PIPELINE_RUN_TAG = "rlhf.pipeline_run"
PERPLEXITY_BEFORE_TAG, PERPLEXITY_AFTER_TAG = "rlhf.perplexity_before", "rlhf.perplexity_after"
HELDOUT_ACCURACY_TAG = "rlhf.heldout_accuracy"
# Its Wilson interval and pair count: whether this RM, as a judge, can tell better from worse.
HELDOUT_ACCURACY_CI_LOW_TAG = "rlhf.heldout_accuracy_ci_low"
HELDOUT_ACCURACY_CI_HIGH_TAG = "rlhf.heldout_accuracy_ci_high"
HELDOUT_PAIRS_TAG = "rlhf.heldout_pairs"
SCORE_MEAN_TAG, SCORE_STD_TAG = "rlhf.score_mean", "rlhf.score_std"
VALUE_LOSS_TAG, EXPLAINED_VARIANCE_TAG = "rlhf.value_loss", "rlhf.explained_variance"
PPO_PRESET_TAG, ADVANTAGE_ESTIMATOR_TAG = "rlhf.ppo_preset", "rlhf.advantage_estimator"
COLLAPSE_TAG = "rlhf.collapse"  # the live collapse guard's verdict
POLICY_ITERATION_TAG = "rlhf.policy_iteration"  # the iteration of the policy it passed
FINAL_ITERATION_TAG = "rlhf.final_iteration"  # on the PPO run: the last iteration trained
COLLAPSE_GUARD_TAG = "rlhf.collapse_guard"  # ppo.on_collapse
