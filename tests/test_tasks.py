"""tasks.py: one Task object per task, chosen from config by name or from a model by its head,
never from the shape of the logits; its loss, weights, metrics and evaluation agree."""
import math

import pytest
import torch
import torch.nn.functional as F

from headprune.tasks import CAUSAL_LM, CLASSIFICATION, get_task, headline, task_of
from tests.helpers import tiny, tiny_bert


def test_a_model_s_head_decides_its_task():
    assert task_of(tiny("llama")) is CAUSAL_LM and task_of(tiny("gpt2")) is CAUSAL_LM
    assert task_of(tiny_bert()) is CLASSIFICATION
    assert get_task("causal_lm") is CAUSAL_LM and get_task("classification") is CLASSIFICATION
    with pytest.raises(ValueError, match=r"model.task='lm' is not allowed; allowed: classification, causal_lm"):
        get_task("lm")


def test_causal_lm_loss_weights_and_perplexity_agree():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=g)  # (B, T, V)
    batch = {"input_ids": torch.randint(0, 7, (2, 5), generator=g),
             "attention_mask": torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])}
    token = F.cross_entropy(logits[:, :-1].transpose(1, 2), batch["input_ids"][:, 1:], reduction="none")  # (B, T-1)
    want = torch.stack([token[0].mean(), token[1, :2].mean()])
    torch.testing.assert_close(CAUSAL_LM.loss(logits, batch), want)
    torch.testing.assert_close(CAUSAL_LM.weights(batch), torch.tensor([4.0, 2.0]))
    totals = CAUSAL_LM.batch_sums(logits, batch).tolist()
    per_token = float((want * torch.tensor([4.0, 2.0])).sum() / 6)
    assert CAUSAL_LM.metrics(*totals) == pytest.approx({"loss": per_token, "ppl": math.exp(per_token)})


def test_classification_loss_and_accuracy():
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [3.0, 0.0]])  # (B, C)
    batch = {"input_ids": torch.zeros(3, 4, dtype=torch.long), "labels": torch.tensor([0, 1, 1])}
    torch.testing.assert_close(CLASSIFICATION.loss(logits, batch), F.cross_entropy(logits, batch["labels"], reduction="none"))
    totals = CLASSIFICATION.batch_sums(logits, batch).tolist()
    assert CLASSIFICATION.metrics(*totals)["acc"] == pytest.approx(2 / 3)
    assert torch.equal(CLASSIFICATION.weights(batch), torch.ones(3))


def test_headline_is_the_task_s():
    assert headline({"acc": 0.9, "loss": 0.3}) == ("acc", 0.9)
    assert headline({"loss": 2.0, "ppl": 7.4}) == ("ppl", 7.4)
    assert CLASSIFICATION.higher_is_better and not CAUSAL_LM.higher_is_better


def test_a_model_whose_head_is_not_the_task_is_refused_naming_model_task():
    from headprune import Pruner, get_metric
    from headprune.lightning.module import HeadPruneModule
    from headprune.selection.layer_policies import GlobalPolicy
    from headprune.selection.schedules import OneShot
    from headprune.tasks import check_model_task

    allowed = r"model.task=causal_lm for this model \(model.task takes classification, causal_lm\)"
    with pytest.raises(ValueError, match=r"model.task=classification does not fit the model: its head "
                                         r"\(LlamaForCausalLM\) does causal_lm; allowed: " + allowed):
        check_model_task(tiny("llama"), CLASSIFICATION, "model.task")
    with pytest.raises(ValueError, match=r"model.task=causal_lm does not fit the model: its head \(Bert"):
        HeadPruneModule(tiny_bert(), num_labels=2, task="causal_lm")
    with pytest.raises(ValueError, match=r"task=classification does not fit the model"):
        Pruner(tiny("llama"), get_metric("magnitude"), OneShot(target_sparsity=0.5), GlobalPolicy(), task=CLASSIFICATION)
    assert Pruner(tiny_bert(), get_metric("magnitude"), OneShot(target_sparsity=0.5), GlobalPolicy()).task is CLASSIFICATION


@pytest.mark.slow  # ~11 s: SST-2's tokenized splits and a tiny Llama export
def test_a_run_whose_model_head_does_not_match_model_task_is_refused_before_any_work(tmp_path, data_dir, monkeypatch):
    """model.pretrained: a causal LM's export with uneven heads (loaded with its own head whatever
    model.task says) under model.task=classification with SST-2: refused once the model is loaded,
    before the run builds anything on it or writes anything, naming model.task and the allowed values."""
    import headprune.apps.train as train
    import headprune.runs.assembly as assembly
    from headprune import save_pruned
    from tests.helpers import UNEVEN, compose_train, tiny_llama, tiny_tokenizer

    tok = tiny_tokenizer()
    save_pruned(tiny_llama(tok, UNEVEN), tmp_path / "lm", tokenizer=tok)

    def no_work(*args, **kwargs):
        raise AssertionError("the run built its module on a model it had not checked against model.task")

    monkeypatch.setattr(assembly, "HeadPruneModule", no_work)
    cfg = compose_train(tmp_path / "run", data_dir, "model=tiny_bert", f"model.pretrained={tmp_path / 'lm'}",
                        "model.random_init=false", "~model.config_overrides")
    with pytest.raises(ValueError, match=r"model.task=classification does not fit the model: its head \(LlamaForCausalLM"
                                         r"\) does causal_lm; allowed: model.task=causal_lm for this model \(model.task "
                                         r"takes classification, causal_lm\)"):
        train.run(cfg)
    assert not (tmp_path / "run" / "results.json").exists() and not (tmp_path / "run" / ".hydra").exists()


def test_a_pruner_given_a_task_never_reads_it_from_the_model_again(tokenizer, monkeypatch):
    """Once a Pruner (and its LightningModule) holds the run's Task, nothing below reads the model's
    head: the gradient metric, the sensitivity profile, the recovery's context and its training loss,
    every `val` and the module's validation all use the Task given (task_of is made to fail)."""
    import headprune.tasks as tasks
    from headprune import Loaders, Pruner, get_metric
    from headprune.lightning.module import HeadPruneModule
    from headprune.recovery.distill import Distill
    from headprune.selection.layer_policies import SensitivityPolicy
    from headprune.selection.schedules import OneShot
    from tests.helpers import tiny_batch

    model = tiny_bert()
    module = HeadPruneModule(model, num_labels=2, task=CLASSIFICATION)
    pruner = Pruner(model, get_metric("taylor"), OneShot(target_sparsity=0.25, baseline_epochs=0, epochs_per_round=0),
                    SensitivityPolicy(), recovery=Distill(steps=1, alpha=0.5), mask=module.head_mask, task=CLASSIFICATION)

    def read_from_model(model):
        raise AssertionError("the task was read from the model's head after the Task was given")

    monkeypatch.setattr(tasks, "task_of", read_from_model)
    batches = [tiny_batch(tokenizer, 6, seed=s) for s in range(2)]
    report = pruner.run(Loaders(score=batches, val=batches, train=batches))
    assert set(report["final"]["val"]) == {"acc", "loss"} and report["rounds"][0]["distill"]["steps"] == 1
    assert report["final"]["val_source"] == "in_memory_masked"  # results.json: whose number final.val is
    assert pruner.context(Loaders(score=batches)).task is CLASSIFICATION
    assert pruner.loss(batches[0]).ndim == 0
    module.eval()  # as Lightning's validation loop runs it
    module.validation_step(batches[0], 0)
    with torch.no_grad():
        want = float(CLASSIFICATION.loss(module(batches[0]), batches[0]).sum())
    torch.testing.assert_close(module._val_sums[:2], torch.tensor([want, 6.0], dtype=torch.float64))
