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


# -- calibration from several corpora ------------------------------------------------------------
@pytest.fixture
def small_data(data_dir, tmp_path):
    """The shared Tiny Shakespeare and the first 2,000 rows of SST-2's train file (a fast test)."""
    (tmp_path / "tinyshakespeare").mkdir()
    (tmp_path / "tinyshakespeare" / "input.txt").symlink_to(data_dir / "tinyshakespeare" / "input.txt")
    (tmp_path / "sst2").mkdir()
    lines = (data_dir / "sst2" / "train.tsv").read_text(encoding="utf-8").splitlines(keepends=True)
    (tmp_path / "sst2" / "train.tsv").write_text("".join(lines[:2001]), encoding="utf-8")
    (tmp_path / "sst2" / "validation.tsv").symlink_to(data_dir / "sst2" / "validation.tsv")
    return tmp_path


def shakespeare(data_dir, **kwargs):
    return TextLMDataModule(ByteTokenizer(), file="tinyshakespeare/input.txt", data_dir=str(data_dir), block_size=64,
                            score_samples=5, name="tinyshakespeare", **kwargs)


def test_calibration_mixes_corpora_from_their_training_parts(small_data):
    """data.calibration_corpora=[tinyshakespeare, sst2]: 3 + 2 score blocks, the first from the
    data's own training part (held out of training as before), the others from SST-2's train file
    (never its validation sentences); seeded; the same own blocks as a one-corpus run of 3."""
    dm = shakespeare(small_data, calibration_corpora=["tinyshakespeare", "sst2"])
    dm.setup()
    assert dm.calibration_counts() == {"tinyshakespeare": 3, "sst2": 2} and len(dm.score_set) == 5
    text = (small_data / "tinyshakespeare" / "input.txt").read_bytes()
    blocks = [bytes(dm.score_set[i]["input_ids"].tolist()) for i in range(5)]
    one = TextLMDataModule(ByteTokenizer(), file="tinyshakespeare/input.txt", data_dir=str(small_data), block_size=64,
                           score_samples=3)
    one.setup()
    assert blocks[:3] == [text[s:s + 64] for s in one.score_set.starts]
    assert dm.train_set.starts == one.train_set.starts  # the own score blocks stay out of training
    train = "\n".join(line.split("\t")[0].strip() for line in
                      (small_data / "sst2" / "train.tsv").read_text(encoding="utf-8").splitlines()[1:]).encode()
    validation = (small_data / "sst2" / "validation.tsv").read_bytes()
    assert all(b in train and b not in validation for b in blocks[3:])
    again = shakespeare(small_data, calibration_corpora=["tinyshakespeare", "sst2"])
    again.setup()
    assert [again.score_set[i]["input_ids"].tolist() for i in range(5)] == [list(b) for b in blocks]
    only = shakespeare(small_data, calibration_corpora=["sst2"])
    only.setup()
    assert all(bytes(only.score_set[i]["input_ids"].tolist()) in train for i in range(5))
    assert len(only.train_set) == len(one.train_set) + 3  # nothing of the own corpus held out for scoring


@pytest.mark.parametrize("kwargs,pattern", [
    (dict(calibration_corpora=["wikipedia"]),
     r"data.calibration_corpora=\['wikipedia'\]: unknown \['wikipedia'\]; allowed: .*tinyshakespeare, sst2"),
    (dict(calibration_corpora=["sst2", "sst2"]), r"data.calibration_corpora=\['sst2', 'sst2'\]: a corpus named twice"),
    (dict(calibration_corpora=["tinyshakespeare", "sst2"], score_samples=1),
     r"data.score_samples=1 cannot be split over the 2 data.calibration_corpora"),
])
def test_bad_calibration_corpora_are_refused_before_reading(kwargs, pattern, tmp_path):
    with pytest.raises(ValueError, match=pattern):
        TextLMDataModule(ByteTokenizer(), file="missing.txt", data_dir=str(tmp_path), name="tinyshakespeare", **kwargs)


def test_the_cli_setting_is_refused_before_anything_is_written(tmp_path, data_dir):
    from headprune.apps.train import run
    from tests.helpers import compose_train
    from tests.test_llm_pipeline import TINY_LM

    cfg = compose_train(tmp_path, data_dir, *TINY_LM, "data.calibration_corpora=[tinyshakespeare,c4]")
    with pytest.raises(ValueError, match=r"data.calibration_corpora=\['tinyshakespeare', 'c4'\]: unknown \['c4'\]"):
        run(cfg)
    assert not (tmp_path / "results.json").exists() and not (tmp_path / ".hydra").exists()


# -- token ids once per process ----------------------------------------------------------------------
def test_a_corpus_is_tokenized_once_per_process_for_each_text_and_tokenizer(monkeypatch):
    """tokenize_corpus: the ids a fresh encode gives; the same text with a tokenizer of the same JSON
    (another instance too: tests build theirs in temporary folders) is not encoded again, and each
    caller gets its own copy; another text, or a tokenizer with other merges, is encoded anew; a
    tokenizer without a Rust backend (ByteTokenizer) is never reused; four are kept, oldest out."""
    from collections import OrderedDict

    import torch

    import headprune.data.language_model as lm
    from tests.helpers import bpe_tokenizer, byte_tokenizer

    monkeypatch.setattr(lm, "_TOKENIZED", OrderedDict())
    encoded = []

    def counting(tok):
        encode = tok.encode
        monkeypatch.setattr(tok, "encode", lambda *a, **k: encoded.append(a[0]) or encode(*a, **k))
        return tok

    text = "First Citizen:\nBefore we proceed any further, hear me speak.\n"
    tok = counting(byte_tokenizer())
    first = lm.tokenize_corpus(tok, text)
    assert torch.equal(first, torch.tensor(byte_tokenizer().encode(text, add_special_tokens=False)))
    first[0] = -1  # the caller's own copy
    again = lm.tokenize_corpus(counting(byte_tokenizer()), text)
    assert torch.equal(again, torch.tensor(byte_tokenizer().encode(text, add_special_tokens=False)))
    assert encoded == [text]
    merged = lm.tokenize_corpus(counting(bpe_tokenizer()), text)  # "h e" and "Ġ t" merged: fewer ids
    assert len(merged) < len(again) and encoded == [text, text]
    byte = ByteTokenizer()
    assert torch.equal(lm.tokenize_corpus(byte, text), lm.tokenize_corpus(byte, text)) and len(lm._TOKENIZED) == 2
    for i in range(3):
        lm.tokenize_corpus(tok, f"{text}{i}")
    assert len(lm._TOKENIZED) == 4 and len(encoded) == 5
    lm.tokenize_corpus(tok, text)  # the oldest (text, byte tokenizer) went out: encoded again
    assert encoded[-1] == text and len(encoded) == 6
