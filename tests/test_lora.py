"""Recovery with a step budget after each round, the LLM way: recovery=lora (peft adapters, merged)
and recovery=distill with steps > 0 (every weight, KL to the unpruned model); training_steps.py."""
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from headprune import prune_heads, save_pruned
from headprune.apps.train import run
from headprune.deploy.fold import fold
from headprune.heads.mask import HeadMask
from headprune.recovery import Distill, Lora
from headprune.recovery.base import RecoveryContext
from headprune.recovery.lora import lora_adapters, lora_targets
from headprune.lr_schedules import warmup_cosine
from headprune.results import RunResults
from headprune.scoring import get_metric
from headprune.selection.layer_policies import UniformPolicy
from headprune.selection.pruner import Loaders, Pruner
from headprune.selection.schedules import OneShot
from tests.helpers import PRUNE, TINY_LM_MODEL, V, Crash, compose_train, inputs, tiny

TINY_LM = [*TINY_LM_MODEL, "data.max_train_samples=8",
           "data.score_samples=8", "data.max_validation_samples=4", "data.batch_size=2", "schedule=iterative",
           "schedule.target_sparsity=0.5", "schedule.step=0.25", "schedule.baseline_epochs=0",
           "schedule.epochs_per_round=0", "logger=none", "diagnostics.enabled=false", "callbacks=none"]


class Blocks(list):
    """A list of batches that also has a `dataset` (what a recovery checks for training data)."""

    @property
    def dataset(self):
        return self


def blocks(n: int, tokens: int = 12, seed: int = 0) -> Blocks:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (n, tokens), generator=g)  # (n, T)
    return Blocks({"input_ids": ids[i:i + 2], "attention_mask": torch.ones_like(ids[i:i + 2])} for i in range(0, n, 2))


def _masked(family: str):
    model = tiny(family)
    mask = HeadMask.for_model(model)
    for layer, heads in PRUNE.items():
        mask.prune([(layer, h) for h in heads])
    return model, mask


def _logits(model):
    with torch.no_grad():
        return model(**inputs()).logits


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_adapters_see_only_the_kept_heads_and_merge_exactly(family):
    """While the adapters are in, a pruned head cannot reach the output, not even through the
    output projection's adapter; on exit the adapters are folded into the weights: the plain
    model computes what the adapted one did, with its gates and requires_grad flags back."""
    model, mask = _masked(family)
    model.lm_head.requires_grad_(False)
    flags = [p.requires_grad for p in model.parameters()]
    targets = len(lora_targets(model))
    with lora_adapters(model, Lora()) as modules:
        assert modules == targets == {"llama": 21, "gpt2": 12}[family]  # 3 layers x (7 | 4) projections
        assert all(p.requires_grad == ("lora_" in n) for n, p in model.named_parameters())
        g = torch.Generator().manual_seed(1)
        for name, p in model.named_parameters():
            if "lora_B" in name:  # peft starts B at zero: make every adapter change its output
                p.data = torch.randn(p.shape, generator=g) * 0.5
        adapted = _logits(model)
        _blow_up_pruned_values(model, family)
        torch.testing.assert_close(_logits(model), adapted)
    assert "lora" not in " ".join(n for n, _ in model.named_modules())
    assert len(mask._handles) == 3 and not model.lm_head.weight.requires_grad
    assert [p.requires_grad for p in model.parameters()] == flags and any(flags)  # peft froze them: unfrozen
    torch.testing.assert_close(_logits(model), adapted, atol=1e-5, rtol=1e-5)


def _blow_up_pruned_values(model, family):
    """Huge values for every pruned head of layer 2 (heads 2 and 3), in its value projection."""
    with torch.no_grad():
        if family == "gpt2":  # c_attn: Conv1D, weight (in, 3 * hidden), value block last
            attn = model.transformer.h[2].attn.c_attn.get_base_layer()
            attn.weight[:, 2 * 32 + 16:] += 100.0
        else:  # llama GQA: 4 heads over 2 KV groups of head_dim 8; heads 2, 3 = KV group 1
            v = model.model.layers[2].self_attn.v_proj.get_base_layer()
            v.weight[8:] += 100.0


def test_adapters_on_physically_pruned_uneven_kv_groups():
    """After physical removal, a layer whose KV group lost one of its two query heads pads its
    queries and gathers its contexts by hooks on the projections; with the adapters in, those
    hooks wrap the adapter's path too (the model runs), and the merge keeps what it computed."""
    model = tiny("llama")
    prune_heads(model, {layer: heads for layer, heads in PRUNE.items() if layer})  # [4, 3, 2] heads
    mask = HeadMask.for_model(model)
    with lora_adapters(model, Lora()):
        g = torch.Generator().manual_seed(1)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.data = torch.randn(p.shape, generator=g) * 0.5
        adapted = _logits(model)
    assert len(mask._handles) == 3 and len(model.model.layers[1].self_attn._headprune_hooks) == 2
    torch.testing.assert_close(_logits(model), adapted, atol=1e-5, rtol=1e-5)


def test_a_lora_round_trains_merges_and_exports_what_it_trained(tmp_path):
    """No Trainer: one round masks, LoRA trains its steps (on one repeated block, so its loss must
    fall), merges, records the report and the validation after it; the export is a plain
    checkpoint that computes the tuned model's logits."""
    model = tiny("llama")
    mask = HeadMask.for_model(model)
    lora = Lora(steps=30, lr=3e-2, dropout=0.0)
    pruner = Pruner(model, get_metric("magnitude"), OneShot(target_sparsity=0.5, baseline_epochs=0, epochs_per_round=0),
                    UniformPolicy(), None, lora, mask=mask, results=RunResults(tmp_path))
    train = Blocks(blocks(2, seed=3)[:1])
    record = pruner.step(0, Loaders(blocks(4), blocks(2, seed=1), train=train))
    report = record["lora"]
    assert report["steps"] == 30 and report["rank"] == 8 and report["tokens"] == 30 * 24
    assert report["loss_last"] < report["loss_first"] - 0.1
    assert record["val"] == record["val_after_recovery"] != record["val_before_finetune"]
    assert not (tmp_path / "teacher").exists() and pruner.dense is None  # alpha=0: no teacher kept
    tuned = _logits(model)
    fold(model, mask)
    save_pruned(model, tmp_path / "export")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    torch.testing.assert_close(_logits(plain), tuned, atol=1e-5, rtol=1e-5)


def test_distillation_steps_train_every_weight_against_the_unpruned_model(tmp_path):
    model = tiny("llama")
    distill = Distill(steps=4, lr=1e-3, alpha=1.0, temperature=1.0)
    pruner = Pruner(model, get_metric("magnitude"), OneShot(target_sparsity=0.5, baseline_epochs=0, epochs_per_round=0),
                    UniformPolicy(), None, distill, results=RunResults(tmp_path))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    record = pruner.step(0, Loaders(blocks(4), blocks(2, seed=1), train=blocks(4, seed=2)))
    assert record["distill"]["teacher_seconds"] > 0 and pruner.dense is distill.state.model
    assert record["distill"]["trainable_params"] == sum(p.numel() for p in model.parameters())
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert "model.layers.0.mlp.up_proj.weight" in changed and (tmp_path / "teacher" / "config.json").is_file()


def test_lr_warms_up_then_decays_to_zero():
    factors = [warmup_cosine(s, 20) for s in range(20)]
    assert factors[0] == 0.5 and factors[1] == 1.0 and factors[-1] < 0.01
    assert all(a >= b for a, b in zip(factors[1:], factors[2:]))


@pytest.mark.parametrize("kwargs,pattern", [
    ({"steps": 0}, r"recovery\.steps=0 must be >= 1"), ({"rank": 0}, r"recovery\.rank=0"),
    ({"dropout": 1.0}, r"recovery\.dropout=1\.0"), ({"lr": 0.0}, r"recovery\.lr=0\.0"),
])
def test_bad_lora_settings_name_the_field(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        Lora(**kwargs)


def test_unknown_target_modules_are_named_with_the_allowed_ones():
    with pytest.raises(ValueError, match=r"\['qproj'\] is not a projection of this model; allowed: .*'q_proj'"):
        Lora(target_modules=["qproj"]).check_model(tiny("llama"))
    assert all(n.endswith(("q_proj", "v_proj")) for n in lora_targets(tiny("llama"), ["q_proj", "v_proj"]))


def test_no_training_data_is_refused():
    with pytest.raises(ValueError, match="recovery=lora with recovery.steps > 0 trains on the training blocks"):
        Lora(steps=1).train_and_record(RecoveryContext(None, None, Loaders(blocks(2), train=Blocks())), {"round": 1}, {})


# -- runs --------------------------------------------------------------------------------------------
def test_lora_with_distillation_between_iterative_rounds(tmp_path, data_dir):
    """headprune-train with no epochs at all: LoRA + distillation after each of two rounds, the
    teacher saved once; the export is plain."""
    res = run(compose_train(tmp_path, data_dir, *TINY_LM, "recovery=lora", "recovery.steps=2", "recovery.alpha=0.5"))
    assert len(res["rounds"]) == 2 and all(r["lora"]["steps"] == 2 and r["lora"]["teacher_seconds"] > 0
                                           for r in res["rounds"])
    assert all(r["val"] == r["val_after_recovery"] for r in res["rounds"])
    assert (tmp_path / "teacher" / "config.json").is_file()
    assert json.loads((tmp_path / "export" / "config.json").read_text())["model_type"] == "gpt2"


@pytest.mark.parametrize("recovery", [["recovery=lora"], ["recovery=distill", "recovery.steps=2"]])
def test_no_training_blocks_fail_before_anything_runs(recovery, tmp_path, data_dir):
    with pytest.raises(ValueError, match=r"trains recovery.steps=\d+ steps on the training blocks, but "
                                         r"data.max_train_samples=0 leaves none"):
        run(compose_train(tmp_path, data_dir, *TINY_LM, *recovery, "data.max_train_samples=0"))
    assert not (tmp_path / "results.json").exists()


@pytest.mark.slow
def test_lora_with_a_teacher_between_fine_tuned_rounds_resumes_exactly(tmp_path, data_dir):
    """LoRA + distillation after each round, then the schedule's epochs: a crash after round 2
    prunes resumes from the checkpoint (merged adapters are in its weights; the teacher saved when
    round 1 pruned is reloaded) and ends where the uninterrupted run ends."""
    settings = ["model=tiny_bert", "logger=none", "data.max_train_samples=64", "data.score_samples=32",
                "data.max_validation_samples=32", "trainer.num_sanity_val_steps=0", "diagnostics.enabled=false",
                "schedule=iterative", "schedule.target_sparsity=0.5", "schedule.step=0.25", "schedule.baseline_epochs=1",
                "schedule.epochs_per_round=1", "callbacks=default", "recovery=lora", "recovery.steps=2",
                "recovery.alpha=0.9"]
    whole = run(compose_train(tmp_path / "whole", data_dir, *settings))
    crash = ["+callbacks.crash._target_=tests.helpers.CrashAfterEpoch", "+callbacks.crash.epoch=2"]
    with pytest.raises(Crash):
        run(compose_train(tmp_path / "broken", data_dir, *settings, *crash))
    ckpt = torch.load(tmp_path / "broken" / "checkpoints" / "last.ckpt", weights_only=False)
    assert not any("lora_" in k for k in ckpt["state_dict"])  # merged: the checkpoint is a plain model
    resumed = run(compose_train(tmp_path / "broken", data_dir, *settings,
                                f"ckpt_path={tmp_path / 'broken' / 'checkpoints' / 'last.ckpt'}"))
    assert all(r["lora"]["teacher_seconds"] > 0 for r in whole["rounds"])
    assert [r["val"] for r in resumed["rounds"]] == [r["val"] for r in whole["rounds"]]
    assert resumed["final"]["pruned"] == whole["final"]["pruned"] and resumed["final"]["val"] == whole["final"]["val"]


def test_prune_to_budget_takes_lora_with_its_training_text():
    from headprune.selection.retraining_free import prune_to_budget

    report = prune_to_budget(tiny("llama"), blocks(4), {"kind": "kv", "target": 0.5, "seq": 12}, metric="magnitude",
                             recovery=Lora(steps=2), layer_policy=UniformPolicy(), rearrange=False,
                             eval_loader=blocks(2, seed=1), train_loader=blocks(4, seed=2))
    assert report["round"]["lora"]["steps"] == 2 and report["round"]["val"] == report["round"]["val_after_recovery"]
