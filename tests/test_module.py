"""lightning/module.py: HeadPruneModule's checkpoints rebuild pruned shapes on load."""
import lightning as L
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
