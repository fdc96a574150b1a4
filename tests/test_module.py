"""lightning/module.py: HeadPruneModule's checkpoints rebuild pruned shapes on load."""
import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from headprune import prune_heads
from headprune.lightning.module import HeadPruneModule
from tests.helpers import tiny_batch, tiny_bert


@torch.no_grad()
def logits(model, batch: dict) -> torch.Tensor:
    return model(**{k: v for k, v in batch.items() if k != "labels"}).logits


def test_lightning_checkpoint_after_physical_pruning_reloads(tmp_path, tokenizer):
    batch = tiny_batch(tokenizer)
    examples = [{k: v[i] for k, v in batch.items()} for i in range(len(batch["labels"]))]
    module = HeadPruneModule(tiny_bert(), num_labels=2)
    trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", default_root_dir=tmp_path)
    trainer.fit(module, DataLoader(examples, batch_size=3))

    module.head_mask.prune([(0, 1), (1, 0), (1, 1), (1, 2), (1, 3), (2, 3)])
    prune_heads(module.model, module.head_mask.pruned())
    trainer.save_checkpoint(tmp_path / "pruned.ckpt")

    fresh = HeadPruneModule.load_from_checkpoint(tmp_path / "pruned.ckpt", model=tiny_bert(seed=1), num_labels=2)
    assert fresh.model.headprune_layout == [[0, 2, 3], [], [0, 1, 2]]
    torch.testing.assert_close(logits(fresh.eval().model, batch), logits(module.eval().model, batch), atol=0, rtol=0)


def test_validation_logs_the_task_s_own_evaluation(tmp_path, tokenizer):
    """The module's validation is the Task's: val/* after a validation epoch equal `Task.evaluate`
    on the same batches (classification: acc, loss per example; causal LM with padding: loss per
    token, ppl), not a sum of its own."""
    from headprune.tasks import CAUSAL_LM, CLASSIFICATION
    from tests.helpers import tiny

    lm = tiny("llama").train()
    g = torch.Generator().manual_seed(0)
    lm_batches = [{"input_ids": torch.randint(3, lm.config.vocab_size, (3, 12), generator=g),
                   "attention_mask": torch.tensor([[1] * 12, [1] * 5 + [0] * 7, [1] * 9 + [0] * 3])} for _ in range(2)]
    for model, task, batches in ((tiny_bert(), CLASSIFICATION, [tiny_batch(tokenizer, 5, seed=s) for s in range(3)]),
                                 (lm, CAUSAL_LM, lm_batches)):
        module = HeadPruneModule(model, num_labels=2 if task is CLASSIFICATION else None, task=task)
        trainer = L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, accelerator="cpu", default_root_dir=tmp_path)
        (logged,) = trainer.validate(module, DataLoader(batches, batch_size=None), verbose=False)
        want = task.evaluate(model, batches)
        assert logged == {f"val/{k}": pytest.approx(v, rel=1e-6) for k, v in want.items()}, (logged, want)
