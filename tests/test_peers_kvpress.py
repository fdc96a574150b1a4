"""experiments/peers_kvpress: the committed table is what collect.py renders of the committed raw
files (tests/test_experiment_results.py holds that check with every experiment's), and this file
checks what that table rests on: a raw file changed changes the table, the score is lm-eval's RULER
metric, and the runners split every committed sample where kvpress's protocol does."""
import json
import shutil

import pytest

from headprune.report import stale
from tests.helpers import EXPERIMENTS, experiment_script

HERE = EXPERIMENTS / "peers_kvpress"
SAMPLES = HERE / "samples" / "smollm2_4096.jsonl"


@pytest.mark.slow  # lm-eval's import: ~3 s of CPU
def test_a_changed_raw_answer_changes_the_table(tmp_path):
    """The committed table rendered from a copy of the raw files whose dense answer to one scored
    sample is emptied: the table differs (the score comes from the raw answers, not a cache)."""
    collect = experiment_script("peers_kvpress/collect")
    copy = tmp_path / "peers_kvpress"
    shutil.copytree(HERE, copy)
    assert stale(copy, collect.render(copy)) == []
    raw = copy / "raw" / "smollm2_4096" / "dense.json"
    data = json.loads(raw.read_text())
    scored = collect.common_samples(collect.load_set(copy / "raw" / "smollm2_4096"))[0]
    for result in data["results"]:
        if (result["task"], result["index"]) == scored:
            result["prediction"] = ""
    raw.write_text(json.dumps(data))
    assert stale(copy, collect.render(copy)) == ["results.md"]


@pytest.mark.slow
def test_score_is_lm_evals_ruler_metric():
    """collect.score equals lm-eval's own process_results for the task's doc (string_match_all)."""
    from lm_eval.tasks.ruler.common_utils import process_results

    collect = experiment_script("peers_kvpress/collect")
    doc = {"outputs": ["4430567", "x1"], "max_length": 4096}
    for prediction in (" 4430567.", " 4430567 and X1", "nothing", "\x01 4430567"):
        assert collect.score("niah_single_1", prediction, doc["outputs"]) == process_results(doc, [prediction])["4096"]


def test_every_committed_sample_splits_before_its_question():
    """run_press.split_prompt: the context ends at the input's last newline and the question part is
    the last line plus the answer prefix, for every committed sample; round_robin takes the tasks in
    turn."""
    run_press = experiment_script("peers_kvpress/run_press")
    samples = [json.loads(line) for line in SAMPLES.read_text().splitlines()]
    for sample in samples:
        context, question = run_press.split_prompt(sample)
        assert context + question == sample["context"] and context.endswith("\n")
        assert "\n" not in question and question.endswith(sample["gen_prefix"])
    order = [s["task"] for s in run_press.round_robin(samples)]
    tasks = list(dict.fromkeys(s["task"] for s in samples))
    assert order[:len(tasks)] == tasks and order[len(tasks):2 * len(tasks)] == tasks
