"""models/build.py with the real pretrained MiniLM (loaded offline) on a small slice of SST-2
(../shared/data)."""
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from headprune.apps.config_paths import config_dir
from headprune.heads.mask import HeadMask
from headprune.data.classification import TextClassificationDataModule
from headprune.models import build_model, load_tokenizer
from headprune.scoring.taylor import taylor_importance
from headprune.apps.train import run

pytestmark = pytest.mark.real_model  # real_model tests are slow too (conftest.py)


def test_minilm_loads_offline_and_taylor_ranks_its_heads(data_dir):
    tokenizer = load_tokenizer("minilm")
    model = build_model("minilm", num_labels=2)
    assert (model.config.num_hidden_layers, model.config.num_attention_heads) == (6, 12)
    dm = TextClassificationDataModule(tokenizer, train_file="sst2/train.tsv", validation_file="sst2/validation.tsv",
                                      data_dir=str(data_dir), score_samples=32, max_train_samples=64,
                                      max_validation_samples=32, eval_batch_size=16)
    dm.setup()
    mask = HeadMask.for_model(model)
    scores = taylor_importance(model, mask, dm.score_dataloader(), normalize=True)
    assert scores.shape == (6, 12) and torch.isfinite(scores).all() and (scores > 0).all()
    assert len(set(scores.flatten().tolist())) == 72  # a real ranking, no ties


def test_minilm_prune_and_finetune_round_on_sst2_slice(data_dir, tmp_path):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        cfg = compose("train", overrides=[
            f"paths.output_dir={tmp_path}", f"data.data_dir={data_dir}", "data.max_train_samples=96",
            "data.score_samples=32", "data.max_validation_samples=64", "data.max_length=48",
            "schedule=one_shot", "schedule.target_sparsity=0.25", "schedule.baseline_epochs=1",
            "schedule.epochs_per_round=1", "callbacks=none", "logger=none",
            "trainer.num_sanity_val_steps=0", "diagnostics.enabled=false"])  # diagnostics: test_diagnostics.py
    GlobalHydra.instance().clear()
    res = run(cfg)
    assert res["model"] == {"layers": 6, "heads": 12}
    (round1,) = res["rounds"]
    assert round1["n_pruned"] == 18 and round1["sparsity"] == 0.25
    assert sum(round1["heads_per_layer"]) == 54 and min(round1["heads_per_layer"]) >= 1
    for val in (res["baseline"]["val"], round1["val_before_finetune"], round1["val"]):
        assert 0.0 <= val["acc"] <= 1.0 and val["loss"] > 0
    assert res["final"]["pruned"] == sorted(round1["pruned"])
