"""experiments/llm_kv/collect.py on synthetic runs: heldout.md (the corpus not calibrated on and the
last-word accuracy, per arm) and a chained recovery's row (`recovery=chain`: refit, then the KL);
tests/test_experiment_results.py checks the committed tables against the committed files."""
from __future__ import annotations

import json

import pytest

from headprune.run_record import Evaluation
from tests.helpers import experiment_script


def _collect():
    return experiment_script("llm_kv/collect")


def _run(ppl2048, round_, other=None, word=None, dense=None):
    ev = {"perplexity": {"seq128": {"ppl": 2 * ppl2048}, "seq2048": {"ppl": ppl2048}}, "zero_shot": {}}
    if other is not None:
        ev["perplexity_other"] = {"sst2": {"seq2048": {"ppl": other}}}
    if word is not None:
        ev["zero_shot"]["last_word_local"] = {"acc": word, "acc_stderr": 0.01, "n": 200}
    res = {"config": {"data": {"name": "tinyshakespeare"}}, "model": {"layers": 1, "heads": 3}, "rounds": [round_],
           "final": {"pruned": [[0, 2]], "heads_per_layer": [2]}, "evaluation": {"pruned": ev}}
    if dense is not None:
        res["evaluation"]["dense"] = dense
    return res


CHAIN_ROUND = {"score_seconds": 3.0, "val_before_finetune": {"ppl": 80.0}, "chain": ["refit", "distill"],
               "refit": {"seconds": 4.0, "layers": [], "tokens": {"fit": 6, "heldout": 2}}, "distill": {"seconds": 10.0, "tokens": 512},
               "val_after_refit": {"ppl": 40.0}, "val_after_distill": {"ppl": 33.0}, "val_after_recovery": {"ppl": 33.0}}


def test_a_chain_counts_every_stage_and_shows_the_validation_after_each(tmp_path):
    collect = _collect()
    shape = {"layers": 1, "heads": 3, "kv_heads": 3}
    dense = {"perplexity": {"seq128": {"ppl": 20.0}, "seq2048": {"ppl": 10.0}}}
    row = collect.row("fisher_re_refit_kl_kv67", _run(12.0, CHAIN_ROUND, dense=dense), shape)
    assert (row["tuning_seconds"], row["train_tokens"]) == (14.0, 512)  # refit + distill
    (tmp_path / "fisher_re_refit_kl_kv67.json").write_text(json.dumps(_run(12.0, CHAIN_ROUND, dense=dense)))
    table = collect.recoveries(tmp_path, tmp_path / "none")
    assert "| kv67 | Fisher + rearrangement + refit of O, then KL to dense, every weight | 80.00 " \
           "| 40.00 (refit) -> 33.00 (distill) | 3 | 14 |" in table
    summary = collect.summary(Evaluation.of(dense, "tinyshakespeare"), [row])
    assert "| 2 of 3 KV groups kept | training | Fisher + rearrangement + refit of O, then KL to dense" in summary


def test_heldout_ratios_and_where_each_number_comes_from(tmp_path):
    collect = _collect()
    dense = {"perplexity": {"seq128": {"ppl": 20.0}, "seq2048": {"ppl": 10.0}},
             "perplexity_other": {"sst2": {"seq2048": {"ppl": 50.0}}},
             "zero_shot": {"last_word_local": {"acc": 0.2, "acc_stderr": 0.02, "n": 200}}}
    results = tmp_path / "results"
    results.mkdir()
    (results / "fisher_re_refit_kv67.json").write_text(json.dumps(_run(12.0, CHAIN_ROUND, other=90.0, dense=dense)))
    (results / "fisher_kv67.json").write_text(json.dumps(_run(30.0, CHAIN_ROUND)))  # nothing held out: no row
    (results / "fisher_re_kv34.json").write_text(json.dumps(_run(20.0, CHAIN_ROUND)))
    words = tmp_path / "last_word"
    words.mkdir()  # measure.py's file, on the run's export
    (words / "n200.json").write_text(json.dumps({"models": {"fisher_re_kv34": {"zero_shot": {
        "last_word_local": {"acc": 0.05, "acc_stderr": 0.01, "n": 200}}}}}))
    lines = collect.heldout(results, tmp_path / "no_other.json", words).splitlines()
    assert len(lines) == 5
    assert lines[2].startswith("| – | dense | 10.00 | 1.00 | 50.00 | 1.00 | – | 0.200 ± 0.020 (200) |")
    # x dense 1.2 in-domain, 1.8 on SST-2: their ratio 1.5
    assert lines[3] == ("| kv67 | Fisher + rearrangement + refit of O (residual target) | 12.00 | 1.20 | 90.00 | 1.80 | 1.50 "
                        "| – | fisher_re_refit_kv67.json | – |")
    assert lines[4] == ("| kv34 | Fisher + rearrangement | 20.00 | 2.00 | – | – | – | 0.050 ± 0.010 (200) | – "
                        "| last_word/n200.json |")
    (results / "fisher_re_refit_kv67.json").write_text(json.dumps(_run(12.0, CHAIN_ROUND, other=90.0)))
    with pytest.raises(ValueError, match="evaluated the dense model"):
        collect.heldout(results, tmp_path / "no_other.json", words)
