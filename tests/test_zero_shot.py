"""Zero-shot through lm-eval: the shipped SST-2 task prepared from the shared data, offline,
accuracy equal to a direct log-likelihood comparison on a tiny model, chance level, errors
naming the task, and the real SmolLM2 on 64 sentences; the last-word task's passages (held out,
both corpora, interleaved) and its accuracy as greedy prediction of the whole last word."""
import json
import random

import pytest
import torch

from headprune.evaluation import LOCAL_TASKS, chance_level, prepare_local_tasks, zero_shot
from headprune.evaluation.zero_shot import task_dir
from tests.helpers import smollm2, tiny_chat_lm, tiny_tokenizer

PROMPT = "{}\nQuestion: Is this sentence positive or negative?\nAnswer:"  # as in sst2_local.yaml


def sst2_rows(data_dir, n):
    lines = (data_dir / "sst2" / "validation.tsv").read_text(encoding="utf-8").splitlines()[1:n + 1]
    return [(s, int(label)) for s, label in (line.split("\t") for line in lines)]


def direct_acc(model, tok, rows) -> float:
    """Share of sentences whose label's choice (" negative" / " positive") has the higher summed
    log-likelihood after the prompt."""
    right = 0
    for sentence, label in rows:
        context = tok.encode(PROMPT.format(sentence), add_special_tokens=False)
        scores = []
        for choice in (" negative", " positive"):
            ids = torch.tensor([context + tok.encode(choice, add_special_tokens=False)])  # (1, T)
            with torch.no_grad():
                logp = model(input_ids=ids).logits[0, :-1].log_softmax(-1)  # (T-1, V)
            scores.append(logp[len(context) - 1:].gather(1, ids[0, len(context):, None]).sum().item())
        right += int(scores.index(max(scores)) == label)
    return right / len(rows)


def test_the_shipped_tasks_are_found_beside_the_module():
    assert set(LOCAL_TASKS) == {"sst2_local", "last_word_local"}
    for task in LOCAL_TASKS.values():
        assert task.placeholder in (task_dir() / task.yaml).read_text()


def test_prepare_writes_the_data_and_a_task_pointing_at_it(data_dir, tmp_path):
    folder = prepare_local_tasks(["sst2_local"], data_dir, tmp_path)
    rows = [json.loads(line) for line in (folder / "sst2_local.jsonl").read_text().splitlines()]
    assert len(rows) == 872 and {r["label"] for r in rows} == {0, 1}
    assert [(r["sentence"], r["label"]) for r in rows[:5]] == sst2_rows(data_dir, 5)
    task_yaml = (folder / "sst2_local.yaml").read_text()
    assert json.dumps(str(folder / "sst2_local.jsonl")) in task_yaml and "SST2_LOCAL_JSONL" not in task_yaml
    stamp = (folder / "sst2_local.jsonl").stat().st_mtime_ns
    prepare_local_tasks(["sst2_local"], data_dir, tmp_path)
    assert (folder / "sst2_local.jsonl").stat().st_mtime_ns == stamp  # unchanged data is not rewritten


def test_prepare_errors_name_what_is_missing(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="sst2/validation.tsv"):
        prepare_local_tasks(["sst2_local"], tmp_path, tmp_path / "cache")
    monkeypatch.delenv("HEADPRUNE_DATA_DIR", raising=False)
    with pytest.raises(ValueError, match="HEADPRUNE_DATA_DIR"):
        prepare_local_tasks(["sst2_local"], None, tmp_path / "cache")
    with pytest.raises(ValueError, match="allowed: sst2_local"):
        prepare_local_tasks(["sst2"], tmp_path, tmp_path / "cache")


@pytest.mark.slow  # an lm-eval run: over ~2 s
def test_tiny_model_zero_shot_offline_equals_direct_log_likelihoods(data_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    tok = tiny_tokenizer()
    model = tiny_chat_lm(tok).train()
    random.seed(7)
    torch.manual_seed(7)
    want_next = (random.random(), torch.rand(1))
    random.seed(7)
    torch.manual_seed(7)
    result = zero_shot(model, tok, tasks=["sst2_local"], data_dir=data_dir, limit=24, batch_size=5,
                       cache_dir=tmp_path)
    assert (random.random(), torch.rand(1)) == want_next  # lm-eval's reseeding is undone
    assert model.training
    row = result["sst2_local"]
    assert set(row) == {"acc", "acc_stderr", "chance", "n"}
    assert (row["n"], row["chance"]) == (24, 0.5)
    assert row["acc"] == pytest.approx(direct_acc(model.eval(), tok, sst2_rows(data_dir, 24)))
    assert row["acc_stderr"] == pytest.approx((row["acc"] * (1 - row["acc"]) / 23) ** 0.5)


def test_chance_level_is_the_mean_of_one_over_the_choices():
    class Task:
        OUTPUT_TYPE = "multiple_choice"
        eval_docs = [{"k": 2}, {"k": 4}, {"k": 5}]

        def doc_to_choice(self, doc):
            return ["x"] * doc["k"]

    assert chance_level(Task()) == pytest.approx((1 / 2 + 1 / 4 + 1 / 5) / 3)
    assert chance_level(Task(), limit=2) == pytest.approx((1 / 2 + 1 / 4) / 2)
    Task.OUTPUT_TYPE = "generate_until"
    assert chance_level(Task()) is None


@pytest.mark.slow
def test_hub_tasks_offline_and_unknown_tasks_fail_naming_the_task(monkeypatch):
    import datasets
    import huggingface_hub

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # offline even where a network exists
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    tok = tiny_tokenizer()
    with pytest.raises(RuntimeError, match=r"zero_shot task 'hellaswag': lm-eval could not load its data"):
        zero_shot(tiny_chat_lm(tok), tok, tasks=["hellaswag"], limit=2)
    with pytest.raises(ValueError, match=r"zero_shot task 'no_such_task' is neither a local task"):
        zero_shot(tiny_chat_lm(tok), tok, tasks=["no_such_task"], limit=2)


@pytest.mark.slow
def test_a_hub_task_offline_fails_at_the_check(monkeypatch):
    """With the hub offline, an lm-eval task whose data is not cached fails in check_tasks (before
    the model loads), naming the task; an unknown name fails without building lm-eval's index.
    (Beside the test above: both read lm-eval's task index, built once per process.)"""
    import datasets
    import huggingface_hub

    from headprune.evaluation.zero_shot import check_tasks

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(RuntimeError, match=r"zero_shot task 'piqa': lm-eval could not load its data"):
        check_tasks(["sst2_local", "piqa"], "evaluation.zero_shot_tasks")


def test_the_task_index_is_built_once_per_folder_and_files(data_dir, tmp_path, monkeypatch):
    """task_manager builds lm-eval's TaskManager once for the same folders and files (a start-time
    check and each model's evaluation share it); a file added to the local folder makes a new one."""
    import importlib

    import lm_eval.tasks

    zs = importlib.import_module("headprune.evaluation.zero_shot")  # the module; the package exports the function

    built = []

    class Counting(lm_eval.tasks.TaskManager):
        def __init__(self, *args, **kwargs):
            built.append(kwargs)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", Counting)
    monkeypatch.setattr(zs, "_MANAGERS", {})
    folder = prepare_local_tasks(["sst2_local"], data_dir, tmp_path)
    first = zs.task_manager(folder, include_defaults=False)
    assert zs.task_manager(folder, include_defaults=False) is first and len(built) == 1
    (folder / "other.yaml").write_text("task: other_local\n")
    assert zs.task_manager(folder, include_defaults=False) is not first and len(built) == 2


@pytest.mark.real_model
def test_smollm2_sst2_local_on_64_sentences(data_dir, tmp_path):
    model, tokenizer = smollm2()
    row = zero_shot(model, tokenizer, tasks=["sst2_local"], data_dir=data_dir, limit=64, batch_size=16,
                    cache_dir=tmp_path)["sst2_local"]
    assert (row["n"], row["chance"]) == (64, 0.5)
    assert 0.5 < row["acc"] <= 1.0 and 0 < row["acc_stderr"] < 0.1


def test_last_word_passages_are_held_out_text_of_both_corpora_interleaved(data_dir):
    from headprune.evaluation.last_word import passages

    items = passages(data_dir)
    assert len(items) == 1264 + 745 and [p["corpus"] for p in items[:4]] == ["tinyshakespeare", "sst2"] * 2
    text = (data_dir / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")
    second_half = text[round(0.95 * len(text)):]  # the held-out part (last 10%) from its middle
    sentences = [s for s, _ in sst2_rows(data_dir, 872)]
    for p in items:
        assert p["target"][0] == " " and p["target"][1:].isalpha() and p["context"] and not p["context"].endswith(" ")
        if p["corpus"] == "tinyshakespeare":
            assert p["context"] + p["target"] in second_half and len(p["context"].split()) >= 30
        else:
            assert any(s.startswith(p["context"] + p["target"]) for s in sentences)
    assert sum(p["corpus"] == "sst2" for p in items[:200]) == 100


@pytest.mark.slow
def test_last_word_accuracy_is_greedy_prediction_of_the_whole_target(data_dir, tmp_path, monkeypatch):
    """On passages whose target is what a tiny model predicts greedily (odd items: the wrong
    word), lm-eval's `acc` through the shipped YAML is exactly the share of right items: no
    delimiter is put between context and target, and every target token must be the argmax."""
    import importlib

    from headprune.evaluation.last_word import passages

    zs = importlib.import_module("headprune.evaluation.zero_shot")  # the module (the package exports the function)

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    tok = tiny_tokenizer()
    model = tiny_chat_lm(tok)
    items = []
    for p in passages(data_dir)[:80]:
        ids = torch.tensor([tok.encode(p["context"], add_special_tokens=False)])  # (1, T)
        for _ in range(2):  # two greedy tokens (bytes)
            with torch.no_grad():
                ids = torch.cat([ids, model(input_ids=ids).logits[:, -1:].argmax(-1)], dim=1)
        greedy = tok.decode(ids[0, -2:])
        if tok.encode(greedy, add_special_tokens=False) == ids[0, -2:].tolist():  # text that encodes back
            items.append({**p, "target": greedy if len(items) % 2 == 0 else greedy + "q"})
        if len(items) == 8:
            break
    task = zs.LOCAL_TASKS["last_word_local"]
    monkeypatch.setitem(zs.LOCAL_TASKS, "last_word_local",
                        zs.LocalTask(task.yaml, task.placeholder, lambda _: "".join(json.dumps(p) + "\n" for p in items)))
    row = zero_shot(model, tok, tasks=["last_word_local"], data_dir=data_dir, batch_size=4,
                    cache_dir=tmp_path)["last_word_local"]
    assert (row["acc"], row["n"], row["chance"]) == (0.5, 8, None)
