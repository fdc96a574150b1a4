import json

import pytest

from headprune.data.classification import TextClassificationDataModule
from headprune.data.textdata import encode_labels, label_vocabulary, read_table


def _write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


def test_tsv_csv_jsonl_and_index_columns(tmp_path):
    tsv = _write(tmp_path / "a.tsv", "sentence\tlabel\ngood film\t1\nbad \"quoted\" film\t0\n")
    t = read_table(tsv, "sentence", "label")
    assert t.texts == ["good film", 'bad "quoted" film'] and t.labels == ["1", "0"]
    csv_ = _write(tmp_path / "a.csv", "premise,hypothesis,gold\n\"a, b\",c,entail\nd,e,contra\n")
    t = read_table(csv_, "premise", "gold", text_pair_column="hypothesis")
    assert t.texts == ["a, b", "d"] and t.pairs == ["c", "e"] and t.labels == ["entail", "contra"]
    t = read_table(csv_, 0, 2)
    assert t.texts == ["a, b", "d"]
    nohead = _write(tmp_path / "b.tsv", "x\tpos\ny\tneg\n")
    t = read_table(nohead, "0", 1, header=False)
    assert t.texts == ["x", "y"] and t.labels == ["pos", "neg"]
    jl = _write(tmp_path / "c.jsonl", "\n".join(json.dumps({"text": s, "y": y}) for s, y in [("hi", 1), ("yo", 0)]))
    assert read_table(jl, "text", "y").labels == [1, 0]


def test_label_vocabulary():
    assert label_vocabulary(["pos", "neg", "pos"]) == {"neg": 0, "pos": 1}
    assert label_vocabulary([0, 1, 1]) == {"0": 0, "1": 1}
    mixed = [True, 1, 1.0, "01", 1]  # equal as dict keys, not as labels: True is its own class
    vocab = label_vocabulary(mixed)
    assert vocab == {"1": 0, "True": 1} and encode_labels(mixed, vocab, "x") == [1, 0, 0, 0, 0]


def test_missing_label_column_names_field(tmp_path):
    tsv = _write(tmp_path / "a.tsv", "sentence\tlabel\nx\t1\n")
    with pytest.raises(ValueError, match=r"data\.label_column='gold'.*columns"):
        read_table(tsv, "sentence", "gold")
    with pytest.raises(ValueError, match=r"data\.text_column=5 is out of range"):
        read_table(tsv, 5, "label")


def test_datamodule_string_labels_score_split_and_missing_files(tmp_path, tokenizer):
    rows = "\n".join(f"text {i}\t{'pos' if i % 3 else 'neg'}" for i in range(40))
    _write(tmp_path / "train.tsv", "text\tlabel\n" + rows + "\n")
    _write(tmp_path / "dev.tsv", "text\tlabel\nfine\tpos\nawful\tneg\n")
    dm = TextClassificationDataModule(tokenizer, train_file="train.tsv", validation_file="dev.tsv",
                                      data_dir=str(tmp_path), text_column="text", score_samples=8,
                                      max_train_samples=20, batch_size=4)
    dm.setup()
    assert dm.num_labels == 2 and dm.label_ids == {"neg": 0, "pos": 1}
    assert len(dm.score_set) == 8 and len(dm.train_set) == 20 and len(dm.val_set) == 2
    score_ids = {tuple(x["input_ids"]) for x in dm.score_set}
    assert not score_ids & {tuple(x["input_ids"]) for x in dm.train_set}
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape[0] == 4 and batch["labels"].dtype.is_floating_point is False
    missing = TextClassificationDataModule(tokenizer, train_file="nope.tsv", validation_file="dev.tsv",
                                           data_dir=str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"data\.train_file.*nope\.tsv"):
        missing.setup()


def test_unknown_validation_label_and_single_class(tmp_path, tokenizer):
    _write(tmp_path / "train.tsv", "text\tlabel\na\tx\nb\ty\nc\tx\n")
    _write(tmp_path / "dev.tsv", "text\tlabel\na\tz\n")
    dm = TextClassificationDataModule(tokenizer, train_file=str(tmp_path / "train.tsv"),
                                      validation_file=str(tmp_path / "dev.tsv"), text_column="text",
                                      score_samples=1)
    with pytest.raises(ValueError, match="label 'z'"):
        dm.setup()
    _write(tmp_path / "one.tsv", "text\tlabel\na\tx\nb\tx\n")
    dm = TextClassificationDataModule(tokenizer, train_file=str(tmp_path / "one.tsv"),
                                      validation_file=str(tmp_path / "one.tsv"), text_column="text",
                                      score_samples=1)
    with pytest.raises(ValueError, match="single class"):
        dm.setup()


def test_empty_file_negative_labels_and_truncation_notice(tmp_path, tokenizer, caplog):
    _write(tmp_path / "empty.tsv", "text\tlabel\n")
    _write(tmp_path / "dev.tsv", "text\tlabel\na\t0\n")
    dm = TextClassificationDataModule(tokenizer, train_file=str(tmp_path / "empty.tsv"),
                                      validation_file=str(tmp_path / "dev.tsv"), text_column="text")
    with pytest.raises(ValueError, match="training data is empty"):
        dm.setup()
    _write(tmp_path / "neg.tsv", "text\tlabel\na\t-1\nb\t0\n")
    with pytest.raises(ValueError, match="labels must be >= 0"):
        TextClassificationDataModule(tokenizer, train_file=str(tmp_path / "neg.tsv"),
                                     validation_file=str(tmp_path / "dev.tsv"), text_column="text",
                                     score_samples=1).setup()
    long = " ".join(["word"] * 50)
    _write(tmp_path / "long.tsv", "text\tlabel\n" + "".join(f"{long}\t{i % 2}\n" for i in range(6)))
    dm = TextClassificationDataModule(tokenizer, train_file=str(tmp_path / "long.tsv"),
                                      validation_file=str(tmp_path / "dev.tsv"), text_column="text",
                                      score_samples=2, max_length=16)
    with caplog.at_level("WARNING"):
        dm.setup()
    assert all(len(x["input_ids"]) == 16 for x in dm.train_set)
    notices = [r.getMessage() for r in caplog.records if "truncated" in r.getMessage()]
    assert len(notices) == 1 and "6 examples" in notices[0]
    big = TextClassificationDataModule(tokenizer, train_file=str(tmp_path / "long.tsv"),
                                       validation_file=str(tmp_path / "dev.tsv"), text_column="text",
                                       score_samples=2, max_length=100_000)
    with caplog.at_level("WARNING"):
        big.setup()
    assert big.max_length == tokenizer.model_max_length


# -- defects that would change the task without a word: named with file and line -------------------
def test_an_empty_label_is_an_error_naming_file_and_line(tmp_path):
    tsv = _write(tmp_path / "a.tsv", "sentence\tlabel\ngood\t1\nbad\t\nok\t0\n")
    with pytest.raises(ValueError, match=r"a\.tsv:3: the label is empty"):
        read_table(tsv, "sentence", "label")
    jl = _write(tmp_path / "a.jsonl", '{"text": "a", "y": 1}\n{"text": "b", "y": null}\n')
    with pytest.raises(ValueError, match=r"a\.jsonl:2: the label is empty"):
        read_table(jl, "text", "y")


def test_padded_labels_are_stripped_and_said(tmp_path, caplog):
    tsv = _write(tmp_path / "a.tsv", "sentence\tlabel\ngood\t 1\nbad\t0\nfine\t1 \n")
    table = read_table(tsv, "sentence", "label")
    assert table.labels == ["1", "0", "1"] and label_vocabulary(table.labels) == {"0": 0, "1": 1}
    assert any("2 label(s) had spaces" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("row", ['{"text": "", "y": 1}', '{"text": null, "y": 1}', '{"text": NaN, "y": 1}',
                                 '{"text": "   ", "y": 1}'])
def test_empty_or_null_texts_are_errors_naming_the_row(row, tmp_path):
    jl = _write(tmp_path / "a.jsonl", '{"text": "fine", "y": 0}\n' + row + "\n")
    with pytest.raises(ValueError, match=r"a\.jsonl:2: the text is empty"):
        read_table(jl, "text", "y")


def test_file_defects_name_file_and_line(tmp_path):
    bad = tmp_path / "latin1.tsv"
    bad.write_bytes("sentence\tlabel\ngood\t1\ncaf\u00e9\t0\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1\.tsv:3: byte 0xe9 at column 4 is not valid UTF-8"):
        read_table(bad, "sentence", "label")
    jl = _write(tmp_path / "broken.jsonl", '{"text": "a", "y": 1}\n{"text": "b", "y": 0\n')
    with pytest.raises(ValueError, match=r"broken\.jsonl:2: not valid JSON"):
        read_table(jl, "text", "y")
    (tmp_path / "folder.tsv").mkdir()
    with pytest.raises(IsADirectoryError, match=r"folder\.tsv' is a folder"):
        read_table(tmp_path / "folder.tsv", "sentence", "label")
    short = _write(tmp_path / "short.tsv", "sentence\tlabel\ngood\t1\nbad\n")
    with pytest.raises(ValueError, match=r"short\.tsv:3: the row lacks column 'label'"):
        read_table(short, "sentence", "label")


def test_selection_slice_is_held_out_of_training_and_scoring(tmp_path, tokenizer):
    rows = "\n".join(f"text {i}\t{i % 2}" for i in range(40))
    _write(tmp_path / "train.tsv", "text\tlabel\n" + rows + "\n")
    _write(tmp_path / "dev.tsv", "text\tlabel\nfine\t1\nawful\t0\n")
    dm = TextClassificationDataModule(tokenizer, train_file="train.tsv", validation_file="dev.tsv",
                                      data_dir=str(tmp_path), text_column="text", score_samples=8, select_samples=6)
    dm.setup()
    parts = [{tuple(x["input_ids"]) for x in part} for part in (dm.score_set, dm.select_set, dm.train_set)]
    assert [len(p) for p in parts] == [8, 6, 26] and not (parts[0] & parts[1] or parts[1] & parts[2])
    assert len(next(iter(dm.select_dataloader()))["input_ids"]) == 6
    (tmp_path / "dir.tsv").mkdir()
    folder = TextClassificationDataModule(tokenizer, train_file="dir.tsv", validation_file="dev.tsv",
                                          data_dir=str(tmp_path))
    with pytest.raises(IsADirectoryError, match=r"data\.train_file: .*dir\.tsv' is a folder"):
        folder.setup()


# -- labels that do not start at 0, numerically equal labels, long lines, a BOM ---------------------
def test_integer_labels_are_mapped_to_0_to_k_minus_1(tmp_path, tokenizer, caplog):
    """Yelp-style labels 1/2 make a 2-way classifier (no phantom class 0), and the mapping is logged."""
    _write(tmp_path / "train.tsv", "text\tlabel\n" + "".join(f"t {i}\t{1 + i % 2}\n" for i in range(8)))
    _write(tmp_path / "dev.tsv", "text\tlabel\na\t2\nb\t1\n")
    dm = TextClassificationDataModule(tokenizer, train_file=str(tmp_path / "train.tsv"),
                                      validation_file=str(tmp_path / "dev.tsv"), text_column="text", score_samples=2)
    with caplog.at_level("INFO"):
        dm.setup()
    assert dm.num_labels == 2 and dm.label_ids == {"1": 0, "2": 1}
    assert [x["labels"] for x in dm.val_set] == [1, 0]
    assert any("'1' -> 0" in r.getMessage() and "'2' -> 1" in r.getMessage() for r in caplog.records)
    assert label_vocabulary([3, 7, 3]) == {"3": 0, "7": 1}
    assert label_vocabulary(["10", "9", "2"]) == {"2": 0, "9": 1, "10": 2}  # numeric order, not string order


def test_a_training_file_with_only_label_1_is_a_single_class(tmp_path, tokenizer):
    _write(tmp_path / "one.tsv", "text\tlabel\na\t1\nb\t1\nc\t1\n")
    dm = TextClassificationDataModule(tokenizer, train_file=str(tmp_path / "one.tsv"),
                                      validation_file=str(tmp_path / "one.tsv"), text_column="text", score_samples=1)
    with pytest.raises(ValueError, match="single class"):
        dm.setup()


def test_numerically_equal_labels_are_one_class(tmp_path, tokenizer):
    """1, "1", 1.0 and "1.0" are the same class (JSON lines and TSV)."""
    rows = [("a", 1), ("b", 1.0), ("c", "1.0"), ("d", 0), ("e", "0"), ("f", 0.0)]
    _write(tmp_path / "train.jsonl", "\n".join(json.dumps({"text": t, "label": y}) for t, y in rows))
    _write(tmp_path / "dev.tsv", "text\tlabel\na\t1.0\nb\t0\n")
    dm = TextClassificationDataModule(tokenizer, train_file=str(tmp_path / "train.jsonl"),
                                      validation_file=str(tmp_path / "dev.tsv"), text_column="text", score_samples=1)
    dm.setup()
    assert dm.num_labels == 2 and dm.label_ids == {"0": 0, "1": 1}
    assert [x["labels"] for x in dm.val_set] == [1, 0]


def test_a_megabyte_line_reads(tmp_path):
    huge = "word " * 200_000
    for name, sep in (("big.tsv", "\t"), ("big.csv", ",")):
        t = read_table(_write(tmp_path / name, f"text{sep}label\n{huge}{sep}1\nsmall{sep}0\n"), "text", "label")
        assert t.texts == [huge, "small"] and t.labels == ["1", "0"]


def test_a_utf8_bom_is_stripped(tmp_path):
    tsv = tmp_path / "bom.tsv"
    tsv.write_bytes("\ufeffsentence\tlabel\ngood\t1\n".encode("utf-8"))
    assert read_table(tsv, "sentence", "label").texts == ["good"]
    jl = tmp_path / "bom.jsonl"
    jl.write_bytes("\ufeff{\"text\": \"hi\", \"y\": 0}\n".encode("utf-8"))
    assert read_table(jl, "text", "y").labels == [0]


def test_a_file_read_again_is_not_parsed_again_until_it_changes(tmp_path, monkeypatch, caplog):
    """read_table keeps the tables it read in this process: an unchanged file with the same settings
    is not parsed again (SST-2's train file: ~1 s per data setup), each caller gets lists of its
    own, the padded-label warning is repeated, and a rewritten file or other settings are read anew."""
    from headprune.data import textdata

    parsed = []
    parse = textdata._parse_table
    monkeypatch.setattr(textdata, "_parse_table", lambda path, *a: parsed.append(path) or parse(path, *a))
    tsv = _write(tmp_path / "a.tsv", "sentence\tlabel\ngood film\t 1\nbad film\t0\n")
    with caplog.at_level("WARNING"):
        first = read_table(tsv, "sentence", "label")
        first.texts.append("changed by the caller")
        second = read_table(tsv, "sentence", "label")
    assert len(parsed) == 1
    assert second.texts == ["good film", "bad film"] and second.labels == ["1", "0"]
    assert sum("1 label(s) had spaces" in r.getMessage() for r in caplog.records) == 2
    read_table(tsv, 0, "label")  # other settings
    assert len(parsed) == 2
    _write(tsv, "sentence\tlabel\nanother film\t1\n")  # a new size (and mtime)
    assert read_table(tsv, "sentence", "label").texts == ["another film"] and len(parsed) == 3
