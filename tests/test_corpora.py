"""Named corpora (data/corpora.py): the training and held-out parts of each, the same split as
the data module's, and names and files refused clearly."""
import pytest

from headprune.data.corpora import check_corpora, corpus_ids, corpus_text
from headprune.data.language_model import TextLMDataModule
from headprune.models.byte_tokenizer import ByteTokenizer


def test_tinyshakespeare_parts_are_the_data_modules_split(data_dir):
    tok = ByteTokenizer()
    dm = TextLMDataModule(tok, file="tinyshakespeare/input.txt", data_dir=str(data_dir), block_size=128)
    dm.setup("fit")
    train, held = corpus_ids("tinyshakespeare", "train", tok, data_dir), corpus_ids("tinyshakespeare", "held_out", tok, data_dir)
    assert held.tolist() == dm.held_out_ids.tolist()
    assert train.tolist() + held.tolist() == list((data_dir / "tinyshakespeare" / "input.txt").read_bytes())


def test_sst2_parts_are_the_train_and_validation_sentences(data_dir):
    held = corpus_text("sst2", "held_out", data_dir).split("\n")
    train = corpus_text("sst2", "train", data_dir).split("\n")
    assert (len(held), len(train)) == (872, 67349)
    first = (data_dir / "sst2" / "validation.tsv").read_text(encoding="utf-8").splitlines()[1].split("\t")[0]
    assert held[0] == first.strip() and not set(held) & set(train[:1000]) - {""}


def test_bad_names_and_missing_files_name_the_setting(tmp_path):
    with pytest.raises(ValueError, match=r"data.calibration_corpora=\['c4'\]: unknown \['c4'\]; allowed: .*tinyshakespeare, sst2"):
        check_corpora(["c4"], "data.calibration_corpora")
    with pytest.raises(ValueError, match="a corpus named twice"):
        check_corpora(["sst2", "sst2"], "x")
    with pytest.raises(FileNotFoundError, match=r"evaluation.other_corpora: corpus 'sst2' needs .*sst2/validation.tsv"):
        corpus_text("sst2", "held_out", tmp_path, "evaluation.other_corpora")
    with pytest.raises(ValueError, match="no data_dir is set"):
        corpus_text("sst2", "held_out", None, "evaluation.other_corpora")
