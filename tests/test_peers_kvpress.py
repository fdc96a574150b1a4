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
SETS = ("smollm2_4096", "gemma3_270m_4096")  # raw/<set>/ and samples/<set>.jsonl


@pytest.mark.slow  # lm-eval's import: ~3 s of CPU
@pytest.mark.parametrize("name", SETS)
def test_a_changed_raw_answer_changes_the_table(tmp_path, name):
    """The committed table rendered from a copy of the raw files whose dense answer to one scored
    sample of a set is emptied: the table differs (the score comes from the raw answers, not a cache)."""
    collect = experiment_script("peers_kvpress/collect")
    copy = tmp_path / "peers_kvpress"
    shutil.copytree(HERE, copy)
    assert stale(copy, collect.render(copy)) == []
    raw = copy / "raw" / name / "dense.json"
    data = json.loads(raw.read_text())
    scored = collect.common_samples(collect.load_set(copy / "raw" / name))[0]
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


@pytest.mark.parametrize("name", SETS)
def test_every_committed_sample_splits_before_its_question(name):
    """run_press.split_prompt: the context ends at the input's last newline and the question part is
    the last line plus the answer prefix, for every committed sample; round_robin takes the tasks in
    turn."""
    run_press = experiment_script("peers_kvpress/run_press")
    samples = [json.loads(line) for line in (HERE / "samples" / f"{name}.jsonl").read_text().splitlines()]
    for sample in samples:
        context, question = run_press.split_prompt(sample)
        assert context + question == sample["context"] and context.endswith("\n")
        assert "\n" not in question and question.endswith(sample["gen_prefix"])
    order = [s["task"] for s in run_press.round_robin(samples)]
    tasks = list(dict.fromkeys(s["task"] for s in samples))
    assert order[:len(tasks)] == tasks and order[len(tasks):2 * len(tasks)] == tasks


def _gemma3():
    """A tiny random Gemma 3 (layers 0 and 2 slide over 6 tokens, layer 1 attends to all), 1 KV head."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    config = tf.Gemma3TextConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
                                 num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=16, sliding_window=6,
                                 sliding_window_pattern=2, vocab_size=100, max_position_embeddings=256)
    return tf.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def test_native_price_is_what_the_models_own_cache_holds():
    """run_press.native_tokens (the basis of every Gemma share) equals the tokens transformers'
    DynamicCache(config=...) holds after a prefill (sliding layers window - 1, the global one all);
    native_cache moves a full cache into that cache with the same bytes and the same next logits;
    press_kept asks a press (every layer compressed alike) for the context share that holds `kept`
    of those bytes."""
    import torch
    from transformers import DynamicCache

    run_press = experiment_script("peers_kvpress/run_press")
    model, ids = _gemma3(), torch.arange(3, 23).unsqueeze(0)  # 20 tokens
    own, full = DynamicCache(config=model.config), DynamicCache()
    with torch.no_grad():
        model.model(input_ids=ids, past_key_values=own)
        model.model(input_ids=ids, past_key_values=full)
    assert run_press.cache_bytes(own)[1] == [5, 20, 5] and run_press.native_tokens(model.config, 20) == 30
    assert run_press.cache_bytes(full)[1] == [20, 20, 20]
    moved = run_press.native_cache(model, full)
    assert run_press.cache_bytes(moved) == run_press.cache_bytes(own)
    step = torch.tensor([[7]])
    with torch.no_grad():
        a = model(input_ids=step, past_key_values=own).logits
        b = model(input_ids=step, past_key_values=moved).logits
        c = model(input_ids=step, past_key_values=full).logits
    assert torch.allclose(a, b, atol=1e-6) and torch.allclose(a, c, atol=1e-5)
    assert run_press.press_kept(0.5, "native", model.config, 20) == 0.25  # 0.5 x 30 of 3 x 20
    assert run_press.press_kept(0.5, "context", model.config, 20) == 0.5


def test_each_layer_gets_its_own_rotary_embedding():
    """run_press.layer_rotary: Gemma 3's rotary embedding takes the layer's type (transformers 5.x),
    which kvpress 0.5.5 does not pass; each attention gets it bound to its own layer's type."""
    import torch

    run_press = experiment_script("peers_kvpress/run_press")
    model = _gemma3()
    x, positions = torch.zeros(1, 4, 16), torch.arange(100, 104).unsqueeze(0)
    for layer in model.model.layers:
        kind = layer.self_attn.layer_type
        got = run_press.layer_rotary(model, layer.self_attn)(x, positions)
        want = model.model.rotary_emb(x, positions, layer_type=kind)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    sliding, full = (run_press.layer_rotary(model, model.model.layers[i].self_attn)(x, positions)[0] for i in (0, 1))
    assert not torch.equal(sliding, full)  # the two types' thetas differ: a wrong binding would show


@pytest.mark.slow
def test_gemma_shares_are_of_the_models_own_cache():
    """collect on the Gemma set: dense holds 1.000 of dense's bytes (its own cache, sliding layers at
    their window), kvpress's default cache (dense_full_cache) holds more than 3x that, and a press that
    removes entries holds 1 - its compression_ratio of the context on every layer, to a token."""
    collect = experiment_script("peers_kvpress/collect")
    runs = collect.load_set(HERE / "raw" / "gemma3_270m_4096")
    expected = collect.outputs_of(HERE / "samples" / "gemma3_270m_4096.jsonl")
    table = {row["name"]: row for row in collect.rows(runs, {}, expected)[0]}
    assert abs(table["dense"]["held_share"] - 1) < 1e-9
    assert table["dense_full_cache"]["held_share"] > 3
    presses = [name for name, row in table.items() if not name.startswith(("dense", "ours")) and not row["simulated"]]
    assert presses
    for name in presses:
        per_token = runs[name]["dense_bytes_per_token"]
        for r in runs[name]["results"]:
            kept_tokens = r["held_bytes"] / per_token  # tokens a layer holds (every layer alike)
            assert abs(kept_tokens - r["context_tokens"] * (1 - r["compression_ratio"])) <= 1, name
