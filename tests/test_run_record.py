"""headprune.run_record: a results.json read back with its main corpus named from the run's own
settings (config.data.name), not assumed to be Tiny Shakespeare."""
import json

import pytest

from headprune.run_record import dense_of, read_record, record, records
from tests.helpers import EXPERIMENTS


def _doc(main="wikitext", other=None, dense=True):
    def block(x):
        return {"perplexity": {"seq128": {"ppl": x}, "seq2048": {"ppl": x + 1}},
                "perplexity_other": other if other is not None else {"tinyshakespeare": {"seq2048": {"ppl": 10 * x}}},
                "generation": [{"prompt": "p", "answer": str(x)}]}
    evaluation = {"pruned": block(3.0)} | ({"dense": block(2.0)} if dense else {})
    return {"config": {"data": {"name": main}}, "evaluation": evaluation}


def test_the_main_corpus_is_the_runs_own_and_every_other_is_named():
    run = record(_doc(), "arm")
    assert run.main_corpus == "wikitext"
    assert run.ppl("pruned", 2048) == 4.0 == run.ppl("pruned", "seq2048", "wikitext")  # perplexity: the run's corpus
    assert run.ppl("pruned", 2048, "tinyshakespeare") == 30.0  # perplexity_other: any other
    assert run.evaluation["dense"].corpora == ["wikitext", "tinyshakespeare"]
    assert run.ppl("pruned", 128, "tinyshakespeare") is None and run.ppl("pruned", 4096) is None  # not measured
    assert record(_doc(dense=False), "arm").ppl("dense", 2048) is None
    assert run.evaluation["pruned"].get("generation")[0]["answer"] == "3.0"
    with pytest.raises(ValueError, match="allowed: dense, pruned"):
        run.ppl("export", 2048)


def test_a_record_without_its_corpus_or_with_it_twice_is_refused_by_name(tmp_path):
    doc = _doc()
    del doc["config"]["data"]["name"]
    (tmp_path / "r.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"r\.json: config\.data\.name is missing"):
        read_record(tmp_path / "r.json")
    with pytest.raises(ValueError, match=r"arm: evaluation\.pruned\.perplexity_other holds 'wikitext'"):
        record(_doc(other={"wikitext": {}}, dense=False), "arm")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match=r"bad\.json: cannot be read"):
        read_record(tmp_path / "bad.json")


def test_dense_comes_from_the_first_run_that_evaluated_it():
    runs = records({"a": _doc(dense=False), "b": _doc(main="c4"), "c": _doc()})
    assert dense_of(runs).main_corpus == "c4" and dense_of(runs).ppl(128) == 2.0
    with pytest.raises(ValueError, match="evaluation.dense"):
        dense_of(records({"a": _doc(dense=False)}))


def test_a_committed_record_reads_as_its_raw_file_says():
    path = EXPERIMENTS / "llm_uneven" / "results" / "attention_drop_refit_kv67.json"
    raw = json.loads(path.read_text())
    run = read_record(path)
    assert run.name == path.stem and run.main_corpus == "tinyshakespeare"
    pruned = raw["evaluation"]["pruned"]
    assert run.ppl("pruned", 2048) == pruned["perplexity"]["seq2048"]["ppl"]
    assert run.ppl("pruned", 128, "sst2") == pruned["perplexity_other"]["sst2"]["seq128"]["ppl"]
