"""data/language_model.py: text blocks for causal-LM training (model=tiny_gpt2
data=tinyshakespeare): contiguous, disjoint, seeded splits and the data module. (The app on a
tiny GPT-2: test_train.py; the byte tokenizer: test_byte_tokenizer.py.)"""
import pytest

from headprune.data.language_model import TextLMDataModule, split_blocks
from headprune.models.byte_tokenizer import ByteTokenizer


# -- blocks and splits ---------------------------------------------------------------------------
def test_split_blocks_are_contiguous_disjoint_and_seeded():
    n, size = 10_000, 64
    parts = split_blocks(n, size, validation_share=0.1, score_samples=20, seed=3)
    cut = 9_000
    assert all(s + size <= cut for s in parts["train"] + parts["score"])
    assert all(s >= cut and s + size <= n for s in parts["validation"])
    assert len(parts["validation"]) == 1_000 // size and len(parts["score"]) == 20
    spans = sorted(parts["train"] + parts["score"])
    assert spans == list(range(0, cut - size + 1, size))  # the training part, tiled without overlap
    assert not set(parts["train"]) & set(parts["score"])
    assert parts == split_blocks(n, size, 0.1, 20, seed=3)
    assert parts["score"] != split_blocks(n, size, 0.1, 20, seed=4)["score"]


@pytest.mark.parametrize("kwargs,pattern", [
    (dict(score_samples=500), r"data\.score_samples=500 leaves no training data"),
    (dict(validation_share=0.001), r"data\.validation_share=0\.001"),
])
def test_split_blocks_errors_name_the_field(kwargs, pattern):
    args = dict(n_tokens=10_000, block_size=64, validation_share=0.1, score_samples=8, seed=0) | kwargs
    with pytest.raises(ValueError, match=pattern):
        split_blocks(**args)


def test_lm_data_module_on_tinyshakespeare(data_dir):
    tok = ByteTokenizer()
    dm = TextLMDataModule(tok, file="tinyshakespeare/input.txt", data_dir=str(data_dir), block_size=128,
                          score_samples=64, max_validation_samples=100, seed=0)
    dm.setup()
    data = (data_dir / "tinyshakespeare" / "input.txt").read_bytes()
    cut = round(0.9 * len(data))
    assert len(dm.train_set) + len(dm.score_set) == cut // 128 and len(dm.val_set) == 100
    assert not set(dm.train_set.starts) & set(dm.score_set.starts)
    assert max(dm.train_set.starts + dm.score_set.starts) + 128 <= cut <= min(dm.val_set.starts)
    block = dm.val_set[5]["input_ids"]
    start = dm.val_set.starts[5]
    assert block.shape == (128,) and bytes(block.tolist()) == data[start:start + 128]
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"input_ids"} and batch["input_ids"].shape == (32, 128)
    with pytest.raises(ValueError, match=r"data\.block_size=1 "):
        TextLMDataModule(tok, block_size=1)
