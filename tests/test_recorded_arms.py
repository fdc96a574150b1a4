"""The arms of experiments/llm_kv_modes, retraining_free and recovery are entries of their arms files
(conf/experiment/<experiment>/arms.yaml, served as experiment=<experiment>/<arm> by apps/arms.py; they
were one yaml file each, and the recorded command `experiment=<experiment>/<arm>` is still the command):
each composes (with what run.sh adds per run) to what the arm's command line composed when it ran (the
experiment's base config plus the overrides its run.sh used to pass, kept here as the record), and every
arm run.sh names is an arm. (llm_uneven, llm_calibration, llm_iterative:
tests/test_experiment_configs.py, against their raw files' config blocks.)"""
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from headprune.apps.arms import arms
from headprune.apps.config_schema import register_schemas

register_schemas()

ROOT = Path(__file__).resolve().parents[1]
# the KL steps of llm_kv_modes' KL arms (retrieval_uniform_kl's, measured_kl's)
KL_STEPS = ["recovery=distill", "recovery.steps=12", "recovery.alpha=1.0", "recovery.temperature=1.0",
            "recovery.checkpoint_every=2", "model.gradient_checkpointing=true", "data.max_train_samples=12",
            "data.batch_size=1"]
# the overrides each arm ran with before it became a config (llm_kv_modes/run.sh's ARM array at 0b03af8)
KV_MODES = {
    "attention_mass": ["kv_modes=attention_mass", "kv_modes.removal=any"],
    "attention_mass_85": ["kv_modes=attention_mass", "kv_modes.removal=any", "budget.target=0.15"],
    "attention_mass_last": ["kv_modes=attention_mass", "kv_modes.removal=last"],
    "attention_mass_85_last": ["kv_modes=attention_mass", "kv_modes.removal=last", "budget.target=0.15"],
    "attention_mass_33_last": ["kv_modes=attention_mass", "kv_modes.removal=last", "budget.target=0.67"],
    "measured": ["kv_modes=measured"],
    "removal": ["kv_modes=none"],
    # new since: four calibration blocks (the refit's holdout needs one to choose its damp on)
    "removal_refit": ["kv_modes=none", "layer_policy=attention_drop", "recovery=refit", "data.score_samples=4"],
    "retrieval": ["kv_modes=retrieval", "kv_modes.unit_value=metric"],
    "retrieval_85": ["kv_modes=retrieval", "budget.target=0.15"],
    "retrieval_85_w192": ["kv_modes=retrieval", "budget.target=0.15", "kv_modes.window=192"],
    "retrieval_uniform": ["kv_modes=retrieval", "kv_modes.unit_value=uniform"],
    "retrieval_33": ["kv_modes=retrieval", "budget.target=0.67"],
    # new since the arms became configs: the command line each config equals
    "measured_retrieval": ["kv_modes=measured", "kv_modes.retrieval_blocks=1"],
    "measured_retrieval_clamped": ["kv_modes=given",
                                   "kv_modes.layout=experiments/llm_kv_modes/results/measured_retrieval_clamped_layout.json"],
    "measured_retrieval_last": ["kv_modes=measured", "kv_modes.retrieval_blocks=1", "kv_modes.removal=last"],
    "measured_retrieval_85_last": ["kv_modes=measured", "kv_modes.retrieval_blocks=1", "kv_modes.removal=last",
                                   "budget.target=0.15"],
    # kv_modes.granularity=layer (issue 54): configs ready, not run yet
    "layer": ["kv_modes.granularity=layer"],
    "layer_85": ["kv_modes.granularity=layer", "budget.target=0.15"],
    "layer_sink0": ["kv_modes.granularity=layer", "kv_modes.sink=0", "kv_modes.window=512"],
    # issue 54 item 3, ran: the default chooser's layer-granular layouts (layer_layout.py) and the training-free one
    "layer_given": ["kv_modes=given", "kv_modes.granularity=layer",
                    "kv_modes.layout=experiments/llm_kv_modes/results/layer_given_layout.json"],
    "layer_given_85": ["kv_modes=given", "kv_modes.granularity=layer", "budget.target=0.15",
                       "kv_modes.layout=experiments/llm_kv_modes/results/layer_given_85_layout.json"],
    "layer_given_sink0": ["kv_modes=given", "kv_modes.granularity=layer", "kv_modes.sink=0", "kv_modes.window=512",
                          "kv_modes.layout=experiments/llm_kv_modes/results/layer_given_sink0_layout.json"],
    "retrieval_layer": ["kv_modes=retrieval", "kv_modes.unit_value=uniform", "kv_modes.granularity=layer"],
    "retrieval_layer_sink0": ["kv_modes=retrieval", "kv_modes.unit_value=uniform", "kv_modes.granularity=layer",
                              "kv_modes.sink=0", "kv_modes.window=512"],
    "measured_retrieval_8192": ["kv_modes=measured", "kv_modes.retrieval_blocks=1", "kv_modes.removal=last",
                                "budget.seq=8192", "data.block_size=8192", "evaluation.perplexity_seqs=[8192]",
                                "evaluation.perplexity_tokens=16384", "evaluation.passkey_lengths=[8192]"],
    "measured_retrieval_clamped_kl": [
        "kv_modes=given", "kv_modes.layout=experiments/llm_kv_modes/results/measured_retrieval_clamped_layout.json",
        *KL_STEPS],
    "measured_retrieval_clamped_85": [
        "kv_modes=given", "kv_modes.layout=experiments/llm_kv_modes/results/measured_retrieval_clamped_85_layout.json",
        "budget.target=0.15"],
    "measured_retrieval_clamped_85_last": [
        "kv_modes=given", "kv_modes.layout=experiments/llm_kv_modes/results/measured_retrieval_clamped_85_last_layout.json",
        "budget.target=0.15"],
    "measured_retrieval_clamped_last": [
        "kv_modes=given", "kv_modes.layout=experiments/llm_kv_modes/results/measured_retrieval_clamped_last_layout.json"],
    "retrieval_uniform_kl": ["kv_modes=retrieval", "kv_modes.unit_value=uniform", "recovery=distill", "recovery.steps=12",
                             "recovery.alpha=1.0", "recovery.temperature=1.0", "recovery.checkpoint_every=2",
                             "model.gradient_checkpointing=true", "data.max_train_samples=12", "data.batch_size=1"],
    "retrieval_2048": ["kv_modes=retrieval", "budget.seq=2048", "data.block_size=2048", "evaluation.perplexity_seqs=[2048]",
                       "evaluation.passkey_lengths=[2048]"],
    "retrieval_uniform_self": ["kv_modes=retrieval", "kv_modes.unit_value=uniform", "data.calibration=self"],
    "measured_self": ["kv_modes=measured", "data.calibration=self"],
    "measured_kl": ["kv_modes=given", "kv_modes.layout=experiments/llm_kv_modes/results/measured.json", *KL_STEPS],
    "retrieval_uniform_kl_self": ["kv_modes=given", "kv_modes.layout=experiments/llm_kv_modes/results/retrieval_uniform.json",
                                  *KL_STEPS, "data.calibration=self", "data.self_calibration.train_samples=12"],
    "retrieval_33_kl": ["kv_modes=given", "kv_modes.layout=experiments/llm_kv_modes/results/retrieval_33.json",
                        *KL_STEPS, "budget.target=0.67"],
    "retrieval_85_kl": ["kv_modes=given", "kv_modes.layout=experiments/llm_kv_modes/results/retrieval_85.json",
                        *KL_STEPS, "budget.target=0.15"],
    "retrieval_2048_kl": ["kv_modes=given", "kv_modes.layout=experiments/llm_kv_modes/results/retrieval_2048.json",
                          *KL_STEPS, "budget.seq=2048", "data.block_size=2048", "data.max_train_samples=24",
                          "recovery.steps=24", "recovery.checkpoint_every=4", "evaluation.perplexity_seqs=[2048]",
                          "evaluation.passkey_lengths=[2048]"],
    "retrieval_33_2048": ["kv_modes=retrieval", "budget.target=0.67", "budget.seq=2048", "data.block_size=2048",
                          "evaluation.perplexity_seqs=[2048]", "evaluation.passkey_lengths=[2048]"],
}
# retraining_free/run.sh's ARM array at 03553f2 (STEPS=100; the KL arm's heads runs added data.max_train_samples=null)
RETRAINING_FREE = {
    "taylor": ["metric=taylor", "pruning.rearrange=false", "recovery=none"],
    "fisher": ["metric=fisher", "pruning.rearrange=true", "recovery=none"],
    "fisher_ls": ["metric=fisher", "pruning.rearrange=true", "recovery=least_squares"],
    "fisher_bc": ["metric=fisher", "pruning.rearrange=true", "recovery=bias_compensation"],
    "fisher_refit": ["metric=fisher", "pruning.rearrange=true", "recovery=refit"],
    "refit_rank_refit": ["metric=refit_error", "metric.unit=head", "pruning.rearrange=false", "recovery=refit"],
    "fisher_refit_kl": ["metric=fisher", "pruning.rearrange=true", "recovery=chain", "recovery.options.distill.steps=100",
                        "recovery.options.distill.alpha=1.0", "recovery.options.distill.temperature=1.0",
                        "data.max_train_samples=null"],
}
# recovery/run.sh's `arm` at 03553f2, for `arm <name> 0.9 0` (9 rounds): (the overrides on
# experiment=iterative_vs_one_shot, what run.sh now adds to experiment=recovery/<arm>)
RUN = ["seed=0", "trainer.enable_progress_bar=false"]
RECOVERY = {
    "one_shot_short": (["schedule=one_shot", "schedule.target_sparsity=0.9", "schedule.epochs_per_round=1"],
                       ["schedule.target_sparsity=0.9"]),
    "one_shot_long": (["schedule=one_shot", "schedule.target_sparsity=0.9", "schedule.epochs_per_round=9"],
                      ["schedule.target_sparsity=0.9", "schedule.epochs_per_round=9"]),
    "iterative": (["schedule.target_sparsity=0.9"], ["schedule.target_sparsity=0.9"]),
    "distill": (["schedule.target_sparsity=0.9", "recovery=distill"], ["schedule.target_sparsity=0.9"]),
    "distill_hidden": (["schedule.target_sparsity=0.9", "recovery=distill", "recovery.hidden_weight=1.0"],
                       ["schedule.target_sparsity=0.9"]),
    "dense": (["schedule=one_shot", "schedule.target_sparsity=0.0", "schedule.baseline_epochs=11",
               "schedule.epochs_per_round=0"], ["schedule.baseline_epochs=11"]),
}
RAN_WITH = {"llm_kv_modes": KV_MODES, "retraining_free": RETRAINING_FREE, "recovery": RECOVERY}
BASE = {"recovery": ["experiment=iterative_vs_one_shot", "pruning.physical=false", *RUN]}
CASES = [(e, a) for e, arms in RAN_WITH.items() for a in sorted(arms)]


def _plain(cfg) -> dict:
    return OmegaConf.to_container(cfg, resolve=False)


@pytest.mark.parametrize("experiment,arm", CASES)
def test_each_arm_config_composes_what_its_command_line_did(experiment, arm, train_config):
    recorded = RAN_WITH[experiment][arm]
    old, per_run = recorded if isinstance(recorded, tuple) else (recorded, [])
    base = BASE.get(experiment, [f"experiment={experiment}"])
    as_config = train_config(f"experiment={experiment}/{arm}", *per_run, *(RUN if experiment in BASE else []))
    as_overrides = train_config(*base, *old)
    assert _plain(as_config) == _plain(as_overrides)


# the arms each run.sh names: llm_kv_modes `one <arm> true|false`, retraining_free `one "<run>" <arm>` and
# the `for arm in ...` lists it loops over
NAMED = {"llm_kv_modes": [r"\bone ([a-z]\w*) (?:true|false)"],
         "retraining_free": [r"for arm in ([a-z_ ]+); do"],
         "recovery": [r"\barm ([a-z]\w*) 0\.\d"]}


@pytest.mark.parametrize("experiment", sorted(RAN_WITH))
def test_every_arm_run_sh_runs_has_a_config(experiment):
    lines = (ROOT / f"experiments/{experiment}/run.sh").read_text().splitlines()
    code = [line for line in lines if not line.lstrip().startswith("#")]
    named = {arm for line in code for pattern in NAMED[experiment] for found in re.findall(pattern, line)
             for arm in found.split()} - {"arm"}
    configs = set(arms(experiment))
    assert named and named <= configs and configs == set(RAN_WITH[experiment]), (named - configs, configs ^ set(RAN_WITH[experiment]))
    assert not any("declare -A" in line for line in code)
