"""runs/preflight.py: settings that could only fail later (after training, at the last round,
in a sweep's objective) fail at start, naming the field, before anything is written."""
import pytest

from headprune.apps.train import run
from tests.helpers import compose_iterative


@pytest.mark.parametrize("override,pattern", [
    ("data.score_samples=0", r"data\.score_samples=0 leaves no held-out examples"),
    ("layer_policy.min_heads_per_layer=5", r"layer_policy\.min_heads_per_layer=5 exceeds the model's 4 heads"),
    ("+trainer.max_epochs=3", r"trainer\.max_epochs=3 is not allowed: the schedule sets the number of epochs"),
    ("schedule.target_sparsity=0.99", r"schedule\.target_sparsity=0\.99 removes all 12 heads.*at most 0\.9167"),
])
def test_settings_that_could_only_fail_later_fail_at_start(override, pattern, tmp_path, data_dir):
    extra = ["layer_policy.min_heads_per_layer=0"] if "target_sparsity" in override else []
    with pytest.raises(ValueError, match=pattern):
        run(compose_iterative(tmp_path, data_dir, override, *extra))
    assert not (tmp_path / "results.json").exists() and not (tmp_path / "checkpoints").exists()


def test_objectives_are_checked_at_start(cfg_factory):
    with pytest.raises(ValueError, match=r"objectives: 'speed' is not allowed; allowed: headline"):
        run(cfg_factory("model=tiny_bert", "debug=fast", "objectives=[speed]"))
    with pytest.raises(ValueError, match=r"latency_share is measured under budget=latency only"):
        run(cfg_factory("model=tiny_bert", "debug=fast", "objectives=[val_acc,latency_share]"))


def test_a_chain_without_training_text_names_the_stage_steps_it_would_train(tmp_path, data_dir):
    """recovery=chain trains its distill stage for recovery.options.distill.steps; the refusal said
    `recovery.steps=None`, a setting the chain does not have."""
    from tests.helpers import TINY_LM_MODEL, compose_train

    overrides = [*TINY_LM_MODEL, "data.max_train_samples=0", "data.score_samples=8", "data.max_validation_samples=4",
                 "schedule=one_shot", "schedule.target_sparsity=0.5", "schedule.baseline_epochs=0",
                 "schedule.epochs_per_round=0", "recovery=chain", "recovery.options.distill.steps=7",
                 "logger=none", "callbacks=none", "diagnostics.enabled=false"]
    with pytest.raises(ValueError, match=r"recovery=chain trains recovery\.options\.distill\.steps=7 steps on the "
                                         r"training blocks, but data\.max_train_samples=0 leaves none") as err:
        run(compose_train(tmp_path, data_dir, *overrides))
    assert "None" not in str(err.value)
    assert not (tmp_path / "results.json").exists()
