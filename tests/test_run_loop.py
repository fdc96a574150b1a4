"""One loop for every run: the Pruner's `advance` is what both a Trainer-free run and the Lightning
callback call; "a round waits for its fine-tuning" is explicit state that survives a resume; a run
that trains nothing builds no Trainer, yet logs to wandb what a trained run logs (rounds, the LLM
evaluations, stages); the `evaluation` of the export reads the saved folder."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from headprune import Loaders, Pruner, get_metric
from headprune.apps.train import run
from headprune.runs import export as run_export
from headprune.selection.layer_policies import GlobalPolicy
from headprune.selection.pruner import RunObserver
from headprune.selection.schedules import Iterative
from tests.helpers import TINY_LM_MODEL, compose_train, tiny_batch, tiny_bert

TINY_LM = [*TINY_LM_MODEL, "data.max_train_samples=0",
           "data.score_samples=8", "data.max_validation_samples=4", "schedule=one_shot", "schedule.target_sparsity=0.5",
           "schedule.baseline_epochs=0", "schedule.epochs_per_round=0", "recovery=none", "callbacks=none",
           "diagnostics.enabled=false", "evaluation.enabled=true", "evaluation.perplexity_seqs=[64]",
           "evaluation.perplexity_tokens=512", "evaluation.zero_shot_tasks=[]", "evaluation.generate=false"]


class Seen(RunObserver):
    def __init__(self):
        self.events = []

    def baseline(self, baseline):
        self.events.append("baseline")

    def before_round(self, k):
        self.events.append(f"before{k}")

    def pruned(self, result):
        self.events.append(f"pruned{result.round}")

    def recorded(self, record):
        self.events.append(f"recorded{record['round']}")

    def finished(self, data):
        self.events.append("finished")


def test_advance_does_what_is_due_at_each_epoch_and_waiting_is_state(tokenizer):
    schedule = Iterative(target_sparsity=0.5, step=0.25, baseline_epochs=1, epochs_per_round=2)
    seen = Seen()
    pruner = Pruner(tiny_bert(), get_metric("magnitude"), schedule, GlobalPolicy(), observer=seen)
    loaders = Loaders(score=[tiny_batch(tokenizer, 8, seed=0)], val=[tiny_batch(tokenizer, 8, seed=9)])
    assert not pruner.advance(0, loaders) and seen.events == []  # baseline epochs still to train
    pruner.advance(1, loaders)  # baseline recorded, round 1 prunes, its result waits for 2 epochs
    assert seen.events == ["baseline", "before0", "pruned1"] and pruner.awaiting_finetune
    assert "val" not in pruner.rounds[-1] and pruner.state_dict()["awaiting_finetune"] is True
    pruner.advance(2, lambda: pytest.fail("nothing is due after epoch 2: no loaders are built"))
    resumed = Pruner(tiny_bert(), get_metric("magnitude"), schedule, GlobalPolicy(), observer=seen)
    resumed.load_state_dict(pruner.state_dict())
    assert resumed.awaiting_finetune
    resumed.advance(3, loaders, train_seconds=1.5)  # round 1's result, then round 2
    assert seen.events[3:] == ["recorded1", "before1", "pruned2"] and resumed.rounds[0]["train_seconds"] == 1.5
    resumed.advance(5, loaders)
    assert not resumed.awaiting_finetune and seen.events[-1] == "recorded2"
    resumed.finish(loaders)
    assert seen.events[-1] == "finished" and resumed.results.data["final"]["sparsity"] == 0.5


def test_stop_ends_the_run_after_the_current_round(tokenizer):
    schedule = Iterative(target_sparsity=0.5, step=0.25, baseline_epochs=0, epochs_per_round=0)
    pruner = Pruner(tiny_bert(), get_metric("magnitude"), schedule, GlobalPolicy())
    loaders = Loaders(score=[tiny_batch(tokenizer, 8, seed=0)], val=[tiny_batch(tokenizer, 8, seed=9)])
    pruner.stop("asked to")
    assert pruner.advance(0, loaders) and not pruner.rounds
    assert pruner.finish(loaders)["final"]["stop_reason"] == "asked to"


@pytest.mark.slow
def test_a_run_that_trains_nothing_builds_no_trainer_and_logs_everything_to_wandb(tmp_path, data_dir,
                                                                                   monkeypatch):
    from lightning.pytorch import Trainer
    from wandb.sdk.wandb_run import Run
    from wandb.sdk.wandb_summary import Summary

    logged, summarised = [], {}
    run_log, summary_update = Run.log, Summary.update

    def spy_log(self, data, *args, **kwargs):
        logged.append(dict(data))
        return run_log(self, data, *args, **kwargs)

    def spy_update(self, d=None, **kwargs):
        summarised.update(d or {})
        return summary_update(self, d, **kwargs)

    def no_trainer(*args, **kwargs):
        raise AssertionError("a run that trains nothing built a Trainer")

    monkeypatch.setattr(Run, "log", spy_log)
    monkeypatch.setattr(Summary, "update", spy_update)
    monkeypatch.setattr(Trainer, "__init__", no_trainer)
    monkeypatch.setenv("WANDB_MODE", "offline")
    res = run(compose_train(tmp_path, data_dir, *TINY_LM, "logger=wandb"))
    assert list((tmp_path / "wandb").glob("offline-run-*")), "no wandb run"
    (round1,) = [d for d in logged if d.get("prune/round") == 1]
    assert round1["prune/val_ppl"] == res["rounds"][0]["val"]["ppl"] and round1["prune/sparsity"] == 0.5
    for which in ("dense", "pruned"):
        ppl = res["evaluation"][which]["perplexity"]["seq64"]["ppl"]
        assert summarised[f"eval/{which}/perplexity/seq64/ppl"] == ppl
    assert summarised["final/sparsity"] == 0.5 and summarised["stages/evaluate_pruned"] > 0
    assert res["pruning"] == {"physical": True, "physical_effective": True}


@pytest.mark.slow
def test_the_export_is_evaluated_from_its_saved_folder(tmp_path, data_dir, monkeypatch):
    """A save that writes wrong weights changes the export's evaluation, not the run's own numbers:
    the evaluation reads the folder as a user loads it."""
    good = run(compose_train(tmp_path / "good", data_dir, *TINY_LM, "logger=none"))
    save = run_export.save_pruned

    def broken_save(model, directory, **kwargs):
        save(model, directory, **kwargs)
        weights = load_file(directory / "model.safetensors")
        name = next(k for k in weights if k.endswith("attn.c_proj.weight"))
        weights[name] = torch.zeros_like(weights[name])
        save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})

    monkeypatch.setattr(run_export, "save_pruned", broken_save)
    bad = run(compose_train(tmp_path / "bad", data_dir, *TINY_LM, "logger=none"))
    assert bad["final"]["val"] == good["final"]["val"]  # the in-memory model is the same
    # results.json says which number is which: final.val of the masked model in memory, the
    # evaluation blocks of the dense model in memory and of the saved export
    assert good["final"]["val_source"] == "in_memory_masked"
    assert {w: good["evaluation"][w]["source"] for w in ("dense", "pruned")} == {"dense": "in_memory_dense",
                                                                                 "pruned": "export"}
    ppl = {name: r["evaluation"]["pruned"]["perplexity"]["seq64"]["ppl"] for name, r in (("good", good), ("bad", bad))}
    assert ppl["good"] != pytest.approx(ppl["bad"], rel=1e-4)
    assert good["evaluation"]["pruned"]["model"] == str(tmp_path / "good" / "export")
    assert json.loads((tmp_path / "good" / "results.json").read_text())["evaluation"]["pruned"]["model"]
