"""The `evaluation:` block of a causal-LM run (evaluation/llm_suite.py): perplexity on another corpus
beside the calibration corpus's (same windows, seqs, token count, BOS rule), its schema in
results.json, and settings refused before any work."""
import json
from types import SimpleNamespace

import pytest
import torch

from headprune.evaluation.llm_suite import EvaluationSettings, evaluate_llm, header
from headprune.apps.train import run
from headprune.evaluation import Windows, perplexity
from headprune.models.byte_tokenizer import ByteTokenizer
from headprune.tasks import CAUSAL_LM
from tests.helpers import compose_train
from tests.test_llm_pipeline import TINY_LM
from tests.helpers import tiny_byte_llama


def sst2_validation_bytes(data_dir) -> list[int]:
    """SST-2's validation sentences, stripped and newline-joined, as bytes (the byte tokenizer's ids)."""
    lines = (data_dir / "sst2" / "validation.tsv").read_text(encoding="utf-8").splitlines()[1:]
    return list("\n".join(line.split("\t")[0].strip() for line in lines).encode())


def datamodule(data_dir, held_out: torch.Tensor):
    return SimpleNamespace(held_out_ids=held_out, tokenizer=ByteTokenizer(), data_dir=str(data_dir), name="text",
                           val_windows=lambda: {"seq": 32, "windows": 2, "tokens": 64, "targets": 62, "bos": False})


def test_other_corpus_gets_the_same_windows_as_the_main_corpus(data_dir):
    tok, model = ByteTokenizer(), tiny_byte_llama()
    main = torch.arange(300) % 200  # (300,) a stand-in held-out part
    options = EvaluationSettings(enabled=True, perplexity_seqs=[16, 32], perplexity_tokens=128, other_corpora=["sst2"],
                                 zero_shot_tasks=[], generate=False)
    out = evaluate_llm(model, tok, datamodule(data_dir, main), options, str(data_dir))
    other = torch.tensor(sst2_validation_bytes(data_dir))
    for seq in (16, 32):
        want_main = perplexity(model, Windows.cut(main, seq, tok.bos_token_id, 128), options.batch_size)
        want_other = perplexity(model, Windows.cut(other, seq, tok.bos_token_id, 128), options.batch_size)
        assert out["perplexity"][f"seq{seq}"] == want_main
        assert out["perplexity_other"]["sst2"][f"seq{seq}"] == want_other
        assert want_other["tokens"] == want_main["tokens"] == 128 and want_other["bos"] is True
    assert want_other["ppl"] != want_main["ppl"]
    assert set(out["seconds"]) == {"perplexity", "perplexity_other"}
    head = header(options, datamodule(data_dir, main))
    assert head["other_corpora"] == {"sst2": str(data_dir / "sst2" / "validation.tsv")}


def test_a_run_reports_the_other_corpus_for_dense_and_pruned(tmp_path, data_dir):
    run(compose_train(tmp_path, data_dir, *TINY_LM, "evaluation.other_corpora=[sst2]"))
    ev = json.loads((tmp_path / "results.json").read_text())["evaluation"]
    assert ev["settings"]["other_corpora"] == ["sst2"] and set(ev["other_corpora"]) == {"sst2"}
    for which in ("dense", "pruned"):
        other, main = ev[which]["perplexity_other"]["sst2"], ev[which]["perplexity"]
        assert set(other) == set(main) == {"seq64", "seq128"}
        for seq in ("seq64", "seq128"):
            assert {k: other[seq][k] for k in ("seq", "windows", "tokens", "targets", "bos")} == \
                   {k: main[seq][k] for k in ("seq", "windows", "tokens", "targets", "bos")}
    dense, pruned = ev["dense"], ev["pruned"]
    assert dense["perplexity_other"]["sst2"]["seq128"]["ppl"] != pruned["perplexity_other"]["sst2"]["seq128"]["ppl"]
    assert dense["perplexity_other"]["sst2"]["seq128"]["ppl"] != dense["perplexity"]["seq128"]["ppl"]


def test_llm_kv_measures_the_other_corpus_by_default(tmp_path, data_dir):
    cfg = compose_train(tmp_path, data_dir, "experiment=llm_kv")
    assert list(cfg.evaluation.other_corpora) == ["sst2"]


@pytest.mark.parametrize("override,error,pattern", [
    ("evaluation.other_corpora=[wikipedia]", ValueError,
     r"evaluation.other_corpora=\['wikipedia'\]: unknown \['wikipedia'\]; allowed: .*tinyshakespeare, sst2"),
    ("evaluation.perplexity_tokens=99968", ValueError,  # Tiny Shakespeare holds 111,539 bytes out, SST-2 92,293
     r"evaluation.perplexity_tokens=99968 exceeds the \d+ held-out tokens of evaluation.other_corpora 'sst2'"),
])
def test_other_corpus_settings_are_refused_before_anything_is_written(override, error, pattern, tmp_path, data_dir):
    overrides = [*TINY_LM, "evaluation.other_corpora=[sst2]", override]
    with pytest.raises(error, match=pattern):
        run(compose_train(tmp_path, data_dir, *overrides))
    assert not (tmp_path / "results.json").exists() and not (tmp_path / ".hydra").exists()


def test_a_missing_corpus_file_names_the_setting_and_the_file(tmp_path, data_dir):
    empty = tmp_path / "data"
    (empty / "tinyshakespeare").mkdir(parents=True)
    (empty / "tinyshakespeare" / "input.txt").write_bytes((data_dir / "tinyshakespeare" / "input.txt").read_bytes())
    with pytest.raises(FileNotFoundError, match=r"evaluation.other_corpora: corpus 'sst2' needs .*sst2/validation.tsv"):
        run(compose_train(tmp_path / "run", empty, *TINY_LM, "evaluation.other_corpora=[sst2]"))
    assert not (tmp_path / "run" / "results.json").exists()


def test_llm_kv_runs_the_last_word_task(tmp_path, data_dir):
    cfg = compose_train(tmp_path, data_dir, "experiment=llm_kv")
    assert list(cfg.evaluation.zero_shot_tasks) == ["sst2_local", "last_word_local"]


# -- defects from the probe (issue 31): each failed before its fix --------------------------------
def test_window_lengths_that_do_not_divide_the_token_count_cover_the_same_tokens(data_dir):
    """perplexity_tokens=1100 with seqs [64, 96] used 1,088 tokens at 64 and 1,056 at 96; now both
    cover the first 960 (the largest multiple of 192, their least common multiple), stated in each
    record's `tokens` and in the header."""
    tok, model = ByteTokenizer(), tiny_byte_llama()
    options = EvaluationSettings(enabled=True, perplexity_seqs=[64, 96], perplexity_tokens=1100, zero_shot_tasks=[],
                                 generate=False)
    options.check(CAUSAL_LM)
    out = evaluate_llm(model, tok, datamodule(data_dir, torch.arange(2000) % 200), options, str(data_dir))
    assert [out["perplexity"][k]["tokens"] for k in ("seq64", "seq96")] == [960, 960]
    assert (out["perplexity"]["seq64"]["windows"], out["perplexity"]["seq96"]["windows"]) == (15, 10)
    assert header(options, datamodule(data_dir, torch.arange(10)))["perplexity_tokens_used"] == 960


def test_window_lengths_with_no_common_token_count_are_refused():
    options = EvaluationSettings(enabled=True, perplexity_seqs=[100, 127], perplexity_tokens=150)
    with pytest.raises(ValueError, match=r"evaluation.perplexity_tokens=150 holds no whole number of windows of every "
                                         r"length in evaluation.perplexity_seqs \[100, 127\].*allowed: .*12700"):
        options.check(CAUSAL_LM)


@pytest.mark.parametrize("override,pattern", [
    ("evaluation.perplexity_seqs=[]", r"evaluation.perplexity_seqs=\[\] names no window length; allowed: a non-empty"),
    pytest.param("evaluation.zero_shot_tasks=[no_such_task]",
                 r"evaluation.zero_shot_tasks: 'no_such_task' is neither a local task", marks=pytest.mark.slow),
])
def test_settings_that_failed_late_fail_before_any_work(override, pattern, tmp_path, data_dir, monkeypatch):
    """[] was `max() arg is an empty sequence`; an unknown zero-shot task failed only after the model
    load, the dense perplexity pass and .hydra/ were written. Both now fail before the model loads."""
    import headprune.runs.execute as execute

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the settings were checked")

    monkeypatch.setattr(execute, "assemble", no_load)
    with pytest.raises(ValueError, match=pattern):
        run(compose_train(tmp_path, data_dir, *TINY_LM, override))
    assert not (tmp_path / "results.json").exists() and not (tmp_path / ".hydra").exists()


def test_local_task_data_is_checked_before_anything_is_written(tmp_path, data_dir, monkeypatch):
    import headprune.evaluation.llm_suite as evaluations

    def no_evaluation(*args, **kwargs):
        raise AssertionError("the evaluation started before its data was checked")

    monkeypatch.setattr(evaluations, "evaluate_llm", no_evaluation)
    empty = tmp_path / "data"
    (empty / "tinyshakespeare").mkdir(parents=True)
    (empty / "tinyshakespeare" / "input.txt").write_bytes((data_dir / "tinyshakespeare" / "input.txt").read_bytes())
    with pytest.raises(FileNotFoundError, match=r"zero_shot task 'sst2_local' needs .*sst2/validation.tsv"):
        run(compose_train(tmp_path / "run", empty, *TINY_LM, "evaluation.zero_shot_tasks=[sst2_local]"))
    assert not (tmp_path / "run" / "results.json").exists() and not (tmp_path / "run" / ".hydra").exists()
