"""RULER offline through lm-eval's task code (evaluation/ruler.py) and in the `evaluation:` block:
settings refused before any work, samples fixed by the seed, the essay variants on the local
haystack, the metric lm-eval's, the samples file's keys, and a run scoring the dense model and the
export on the same samples."""
import json

import pytest

from headprune.apps.train import run
from headprune.evaluation import ruler
from headprune.evaluation.llm_suite import EvaluationSettings
from headprune.tasks import CAUSAL_LM
from tests.helpers import compose_train, tiny_tokenizer
from tests.test_llm_pipeline import TINY_LM

# fwe: lm-eval's smallest RULER generator, no 6-million-word import; 512 bytes hold its prompt + 50 answer tokens
RULER_RUN = [*TINY_LM, "+model.config_overrides.n_positions=640", "evaluation.ruler_tasks=[fwe]",
             "evaluation.ruler_contexts=[512]", "evaluation.ruler_samples=2", "evaluation.ruler_prompt=plain"]


@pytest.mark.parametrize("fields,pattern", [
    (dict(ruler_tasks=["qa_1"]), r"evaluation.ruler_tasks=\['qa_1'\]: unknown \['qa_1'\]; allowed: .*niah_single_1"),
    (dict(ruler_tasks=["vt", "vt"]), r"evaluation.ruler_tasks=\['vt', 'vt'\]: a task named twice"),
    (dict(ruler_tasks=["vt"], ruler_contexts=[]), r"evaluation.ruler_contexts=\[\]: allowed: a non-empty list"),
    (dict(ruler_tasks=["vt"], ruler_contexts=[0]), r"evaluation.ruler_contexts=\[0\]: allowed"),
    (dict(ruler_tasks=["vt"], ruler_samples=0), r"evaluation.ruler_samples=0: allowed: an integer >= 1"),
    (dict(ruler_tasks=["vt"], ruler_seed="a"), r"evaluation.ruler_seed='a': allowed: an integer"),
])
def test_bad_ruler_settings_are_refused(fields, pattern):
    options = EvaluationSettings(enabled=True, zero_shot_tasks=[], **fields)
    with pytest.raises(ValueError, match=pattern):
        options.check(CAUSAL_LM)


@pytest.mark.parametrize("override,pattern", [
    ("evaluation.ruler_tasks=[nope]", r"evaluation.ruler_tasks=\['nope'\]: unknown"),
    ("evaluation.ruler_contexts=[128]", r"evaluation.ruler_contexts: 128 tokens are too few for RULER's fwe"),
    ("evaluation.ruler_contexts=[1024]", r"evaluation.ruler_contexts: 1024 exceeds the model's 640 positions"),
    ("evaluation.ruler_prompt=chat", r"evaluation.ruler_prompt=chat, but the tokenizer \(ByteTokenizer\)"),
    ("evaluation.ruler_prompt=template", r"evaluation.ruler_prompt='template' is not allowed; allowed: auto, chat, plain"),
])
def test_a_run_refuses_ruler_settings_before_any_work(override, pattern, tmp_path, data_dir, monkeypatch):
    import headprune.evaluation.llm_suite as suite

    def no_evaluation(*args, **kwargs):
        raise AssertionError("the evaluation started before the RULER settings were checked")

    monkeypatch.setattr(suite, "evaluate_llm", no_evaluation)
    with pytest.raises(ValueError, match=pattern):
        run(compose_train(tmp_path, data_dir, *RULER_RUN, override))
    assert not (tmp_path / "results.json").exists()


def test_the_seed_fixes_the_samples(data_dir):
    tok = tiny_tokenizer()
    first = ruler.ruler_samples(tok, ["fwe"], [512], 2, 7, str(data_dir), True)
    again = ruler.ruler_samples(tok, ["fwe"], [512], 3, 7, str(data_dir), True)
    other = ruler.ruler_samples(tok, ["fwe"], [512], 2, 8, str(data_dir), True)
    assert again[:2] == first  # the same seed: the same prompts (the first n of more samples too)
    assert [s["outputs"] for s in other] != [s["outputs"] for s in first]
    assert [set(s) for s in first] == [set(ruler.SAMPLE_KEYS)] * 2
    for s in first:  # lm-eval's prompt: the input as a user turn, its answer prefix opening the assistant's turn
        assert s["input"].endswith("</s><s>assistant: " + s["gen_prefix"]) and s["max_gen_toks"] == 50
        assert all(word in s["input"] for word in s["outputs"])


def test_the_score_is_lm_evals_ruler_metric():
    from lm_eval.tasks.ruler.common_utils import process_results

    for prediction, outputs in [(" 1234567.\n", ["1234567"]), ("ABC and x", ["abc", "def"]), ("none", ["1", "2"])]:
        want = process_results({"max_length": 4096, "outputs": outputs}, [prediction])["4096"]
        assert ruler.score("niah_multivalue", prediction, outputs) == want
    assert ruler.score("cwe", "Alpha, beta", ["alpha", "beta", "gamma", "delta"]) == 0.5


def test_a_run_scores_dense_and_export_on_the_same_samples(tmp_path, data_dir):
    run(compose_train(tmp_path, data_dir, *RULER_RUN))
    ev = json.loads((tmp_path / "results.json").read_text())["evaluation"]
    assert ev["ruler"]["tasks"]["fwe"] == {"lm_eval_task": "ruler_fwe", "max_gen_toks": 50, "metric": "string_match_all",
                                          "haystack": "synthetic"}
    dense, pruned = ev["dense"]["ruler"], ev["pruned"]["ruler"]
    assert dense["tasks"]["fwe"]["512"]["sha256"] == pruned["tasks"]["fwe"]["512"]["sha256"]
    for block in (dense, pruned):
        cell = block["tasks"]["fwe"]["512"]
        assert cell["samples"] == 2 and [c["index"] for c in cell["cases"]] == [0, 1]
        assert cell["score"] == sum(c["score"] for c in cell["cases"]) / 2
        assert block["mean_all_tasks"] == {"512": cell["score"]}
        assert block["floor"] == 0.2 and set(block["below_floor"]["512"]) <= {"fwe"}
    # the RULER mean leaves out the tasks where dense scores below 20% (a random model: all of them, or none)
    kept = dense["tasks"]["fwe"]["512"]["score"] >= 0.2
    assert pruned["below_floor"]["512"] == ([] if kept else ["fwe"])
    assert pruned["mean_dense_at_least_20"]["512"] == (pruned["tasks"]["fwe"]["512"]["score"] if kept else None)
    assert ev["dense"]["seconds"]["ruler"] > 0


@pytest.mark.slow  # lm-eval's prepare_niah builds 6 million word pairs at import (~10 s)
def test_essay_variants_use_tiny_shakespeare_offline(data_dir, monkeypatch):
    import datasets

    def no_hub(*args, **kwargs):
        raise AssertionError("the essay haystack was read from the hub")

    monkeypatch.setattr(datasets, "load_dataset", no_hub)
    tok = tiny_tokenizer()
    samples = ruler.ruler_samples(tok, ["niah_single_2", "niah_single_1"], [4096], 1, 0, str(data_dir), False)
    essay, repeat = samples
    assert "First Citizen: Before we proceed any further, hear me speak." in essay["input"]
    assert "The grass is green." in repeat["input"] and "Citizen" not in repeat["input"]
    assert essay["outputs"][0] in essay["input"] and essay["input"].endswith(" " + essay["gen_prefix"])
    head = ruler.header(["niah_single_2", "niah_single_1"], False)
    assert head["tasks"]["niah_single_2"]["haystack"] == "tinyshakespeare_train"
    assert head["tasks"]["niah_single_1"]["haystack"] == "repeat"


def test_the_samples_file_holds_the_seeded_prompts(tmp_path, data_dir):
    from headprune.models.byte_tokenizer import ByteTokenizer

    out = tmp_path / "samples.jsonl"
    ruler.main(["write-samples", "--model", "byte-gpt2", "--tasks", "fwe", "--contexts", "512", "--samples", "2",
                "--seed", "3", "--no-chat-template", "--data-dir", str(data_dir), "--out", str(out)])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [list(line) for line in lines] == [list(ruler.SAMPLE_KEYS)] * 2
    assert lines == ruler.ruler_samples(ByteTokenizer(), ["fwe"], [512], 2, 3, str(data_dir), False)
    assert [(s["task"], s["context"], s["index"]) for s in lines] == [("fwe", 512, 0), ("fwe", 512, 1)]


def _ruler_block(scores: dict[str, float], context: str = "4096") -> dict:
    tasks = {t: {context: {"score": s, "samples": 2, "sha256": "x", "cases": []}} for t, s in scores.items()}
    return {"tasks": tasks, "mean_all_tasks": {context: sum(scores.values()) / len(scores)}}


def test_the_ruler_mean_leaves_out_tasks_where_dense_is_below_20_percent():
    dense = _ruler_block({"niah_single_1": 1.0, "vt": 0.5, "cwe": 0.1})
    export = _ruler_block({"niah_single_1": 0.9, "vt": 0.3, "cwe": 0.0})
    means = ruler.floor_means(export, dense)
    assert means["below_floor"] == {"4096": ["cwe"]} and means["mean_dense_at_least_20"]["4096"] == pytest.approx(0.6)
    lines = ruler.table({"dense": dense, "export": export}, dense)
    assert lines[0] == ("| model | context | niah_single_1 | vt | cwe | mean, all tasks | RULER mean (dense >= 20%) "
                        "| / dense |")
    assert lines[3] == "| export | 4096 | 0.90 | 0.30 | 0.00 | 0.400 | 0.600 | 0.800 |"
    assert lines[-1] == "Left out of the RULER mean (dense below 20%): 4096 tokens: cwe"


def test_headprune_collect_shows_ruler_for_dense_and_export(tmp_path):
    from headprune.apps.collect import main

    run_dir = tmp_path / "sweep" / "0"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "overrides.yaml").write_text("- kv_modes=retrieval\n")
    (run_dir / "results.json").write_text(json.dumps({
        "baseline": {"val": {"ppl": 10.0}}, "rounds": [], "model": {},
        "final": {"sparsity": 0.5, "val": {"ppl": 11.0}, "stop_reason": "target"},
        "evaluation": {"dense": {"ruler": _ruler_block({"vt": 0.5, "fwe": 0.1})},
                       "pruned": {"ruler": _ruler_block({"vt": 0.25, "fwe": 0.0})}}}))
    main([str(tmp_path / "sweep"), "--out", str(tmp_path / "out")])
    text = (tmp_path / "out" / "ruler.md").read_text()
    assert "## kv_modes=retrieval" in text
    assert "| export | 4096 | 0.25 | 0.00 | 0.125 | 0.250 | 0.500 |" in text and "4096 tokens: fwe" in text


def test_llm_kv_modes_collect_shows_ruler_and_its_targets(tmp_path):
    from tests.helpers import experiment_script

    collect = experiment_script("llm_kv_modes/collect")
    dense = {"ruler": _ruler_block({"vt": 0.5, "fwe": 0.8})}
    runs = {"retrieval": {"budget": {"target": 0.34}, "evaluation": {"pruned": {"ruler": _ruler_block(
                {"vt": 0.5, "fwe": 0.7})}}},
            "retrieval_85": {"budget": {"target": 0.15}, "evaluation": {"pruned": {"ruler": _ruler_block(
                {"vt": 0.45, "fwe": 0.7})}}},
            "removal": {"budget": {"target": 0.34}, "evaluation": {"pruned": {}}}}
    lines = collect.ruler_section(runs, dense)
    assert "| retrieval | 4096 | 0.50 | 0.70 | 0.600 | 0.600 | 0.923 |" in lines
    assert "- retrieval: miss (0.600 vs 0.95 x 0.650)" in lines
    assert "- retrieval_85: hit (0.575 vs 0.85 x 0.650)" in lines
    assert not any(line.startswith("| removal") for line in lines)
    assert collect.ruler_section({"removal": runs["removal"]}, dense) == []


def test_an_export_with_windows_generates_through_its_windowed_cache(tmp_path, monkeypatch):
    import headprune.heads.windows as windows
    from headprune.deploy.hf import load_pruned, save_pruned
    from headprune.heads.windows import KVLayout, KVWindows
    from tests.helpers import llama

    tok = tiny_tokenizer()
    model = llama(tok, attn="sdpa", max_position_embeddings=256)
    KVWindows(KVLayout.uniform(model, "window", sink=2, window=8)).attach(model)
    save_pruned(model, tmp_path / "export", tokenizer=tok)
    export = load_pruned(tmp_path / "export")
    installed = []
    install = windows.install_cache_layer
    monkeypatch.setattr(windows, "install_cache_layer", lambda *a, **k: installed.append(a[1]) or install(*a, **k))
    sample = {"task": "fwe", "input": "a b c d e f g h i j k l m n o p Answer:", "max_gen_toks": 3}
    prediction, tokens = ruler.generate(export, tok, sample)
    assert tokens == len(sample["input"]) and isinstance(prediction, str)
    assert installed and set(installed) == set(range(model.config.num_hidden_layers))  # every windowed layer


@pytest.mark.parametrize("prompt,template,chat", [("auto", "{{ x }}", True), ("auto", None, False),
                                                  ("plain", "{{ x }}", False), ("chat", "{{ x }}", True)])
def test_ruler_prompt_auto_follows_the_tokenizers_chat_template(prompt, template, chat):
    """auto: an instruct tokenizer's prompts go through its chat template, a base model's (no
    template, e.g. Gemma-3-270M's) are lm-eval's plain prompt; what was used is recorded."""
    from types import SimpleNamespace

    options = EvaluationSettings(enabled=True, zero_shot_tasks=[], ruler_tasks=["fwe"], ruler_prompt=prompt)
    options.check(CAUSAL_LM)
    assert options.ruler_chat(SimpleNamespace(chat_template=template)) is chat
