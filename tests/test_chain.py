"""recovery=chain: a retraining-free repair, then training on top of it, in one run; each stage's
record and the metrics after it; the settings refused when the chain is built."""
import pytest
import torch

from headprune import Loaders, Pruner, get_metric
from headprune.apps.train import run
from headprune.recovery import Chain, Distill, Refit
from headprune.recovery.base import AFTER_RECOVERY
from headprune.selection.layer_policies import GlobalPolicy
from headprune.selection.schedules import OneShot
from tests.helpers import compose_train, tiny

V = 64  # tiny("llama")'s vocabulary is larger; ids below it are valid


class Blocks(list):
    @property
    def dataset(self):
        return self


def _blocks(n: int, seed: int) -> Blocks:
    ids = torch.randint(3, V, (n, 16), generator=torch.Generator().manual_seed(seed))  # (n, T)
    return Blocks({"input_ids": ids[i:i + 2], "attention_mask": torch.ones_like(ids[i:i + 2])} for i in range(0, n, 2))


def _prune(recovery):
    torch.manual_seed(0)
    model = tiny("llama").eval()
    schedule = OneShot(target_sparsity=0.5, baseline_epochs=0, epochs_per_round=0)
    pruner = Pruner(model, get_metric("magnitude"), schedule, GlobalPolicy(), recovery=recovery)
    loaders = Loaders(score=_blocks(8, 0), val=_blocks(4, 1), train=_blocks(8, 2))
    return pruner.run(loaders)["rounds"][0]


def test_the_training_starts_from_the_repaired_model():
    alone = _prune(Refit())
    chained = _prune(Chain(stages=["refit", "distill"], options={"distill": {"steps": 3, "alpha": 1.0, "lr": 1e-3}}))
    assert chained["chain"] == ["refit", "distill"] and {"refit", "distill"} <= set(chained)
    assert chained["val_after_refit"] == alone[AFTER_RECOVERY]  # the refit saw the pruned model, as alone
    assert chained["val_after_distill"] == chained[AFTER_RECOVERY] == chained["val"]
    assert chained["val_after_distill"] != chained["val_after_refit"]  # the steps trained the refit model
    assert chained["distill"]["steps"] == 3


def test_a_chain_needs_what_its_stages_need():
    chain = Chain(stages=["refit", "lora"], options={"lora": {"steps": 2}})
    assert chain.needs_dense and chain.needs_train_data and not chain.trains
    assert not Chain(stages=["refit"]).needs_train_data
    assert Chain(stages=["finetune", "refit"]).trains


@pytest.mark.parametrize("kwargs,pattern", [
    ({"stages": []}, r"names no recovery; allowed: a list of"),
    ({"stages": ["refit", "nope"]}, r"'nope' is not allowed; allowed: .*refit"),
    ({"stages": ["chain"]}, r"'chain' is not allowed"),
    ({"stages": ["refit", "refit"]}, r"names a recovery twice"),
    ({"stages": ["refit"], "options": {"lora": {"steps": 2}}}, r"settings for \['lora'\], which .* does not run"),
    ({"stages": ["finetune", "distill"]}, r"all train in the schedule's epochs; at most one"),
    ({"stages": ["refit"], "options": {"refit": {"dampp": 1}}}, r"recovery.options.refit: .*dampp"),
])
def test_bad_chains_are_refused_when_built(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        Chain(**kwargs)


@pytest.mark.slow
def test_the_cli_runs_a_chain(tmp_path, data_dir):
    res = run(compose_train(tmp_path, data_dir, "model=tiny_gpt2", "data=tinyshakespeare",
                            "+model.config_overrides.n_layer=2", "+model.config_overrides.n_head=4",
                            "+model.config_overrides.n_embd=32", "data.max_train_samples=8", "data.score_samples=8",
                            "data.max_validation_samples=4", "schedule=one_shot", "schedule.target_sparsity=0.5",
                            "schedule.baseline_epochs=0", "schedule.epochs_per_round=0", "recovery=chain",
                            "recovery.options.distill.steps=2", "callbacks=none", "logger=none",
                            "diagnostics.enabled=false"))
    (round1,) = res["rounds"]
    assert round1["chain"] == ["refit", "distill"] and round1["distill"]["steps"] == 2
    assert round1["val"] == round1["val_after_distill"] and "val_after_refit" in round1
