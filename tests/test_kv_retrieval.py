"""`kv_modes=retrieval` (headprune.selection.kv_modes): the retrieval score of each KV unit (its
most retrieving query head's echo + induction attention on a repeating random sequence), the
windowed value it gives (the unit score x (1 - max(attention mass, retrieval))), a run that
records it, and the refusal of blocks too short for two copies. Tiny Llama built from a config."""
import json

import pytest
import torch

from headprune.apps.train import run
from headprune.heads.mask import HeadMask
from headprune.heads.surgery import kv_group_heads
from headprune.data.retrieval import repeated_random_tokens, retrieval_batches, retrieval_period
from headprune.selection.attention_values import attention_mass, retrieval_scores
from headprune.selection.kv_modes import KVModes
from headprune.selection.measured_values import with_retrieval
from tests.helpers import compose_train, kv_modes_cli, llama, tiny_llama_folder

SINK, WINDOW = 2, 6


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return tiny_llama_folder(tmp_path_factory.mktemp("tiny_llama_retrieval"))


def _model():
    return llama(attn="sdpa", vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                 num_hidden_layers=2, intermediate_size=64, max_position_embeddings=256, bos_token_id=1,
                 eos_token_id=2, pad_token_id=0)


def test_the_sequence_repeats_its_period_without_special_ids():
    model = _model()
    ids = repeated_random_tokens(model.config, 50, 12, seed=3)
    assert ids.shape == (1, 50)
    assert torch.equal(ids[0, 12:24], ids[0, :12]) and torch.equal(ids[0, 48:], ids[0, :2])
    assert not set(ids[0].tolist()) & {0, 1, 2}
    assert torch.equal(ids, repeated_random_tokens(model.config, 50, 12, seed=3))
    assert retrieval_period(64, SINK, WINDOW) == 16 and retrieval_period(20, SINK, WINDOW) == 10
    with pytest.raises(ValueError, match=r"data.block_size > 2 x \(kv_modes.sink \+ kv_modes.window\)"):
        retrieval_period(16, SINK, WINDOW)


def test_retrieval_scores_are_the_attention_on_the_earlier_copy():
    """Each unit's score equals, from the eager attention maps of the same sequence, the largest
    over its query heads of the mean (over queries i >= period + sink) of the probability on keys
    i - period and i - period + 1."""
    model = _model()
    seq = 64
    scores, period = retrieval_scores(model, kv_group_heads(model), SINK, WINDOW, seq, "cpu")
    assert period == 16
    ids = repeated_random_tokens(model.config, seq, period)
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        maps = model(input_ids=ids, output_attentions=True).attentions  # per layer (1, H, T, T)
    model.config._attn_implementation = "sdpa"
    for layer in range(2):
        for unit, heads in enumerate(kv_group_heads(model)):
            per_head = [sum(float(maps[layer][0, h, i, i - period] + maps[layer][0, h, i, i - period + 1])
                            for i in range(period + SINK, seq)) / (seq - period - SINK) for h in heads]
            assert scores[layer][unit] == pytest.approx(max(per_head), rel=1e-5)
    assert 0.0 < min(min(s) for s in scores) and max(max(s) for s in scores) < 2.0


def test_a_window_loses_the_larger_of_attention_mass_and_retrieval(monkeypatch):
    """choose(): the windowed value of each unit is its full value x (1 - max(mass, retrieval)),
    the report carries both statistics and the period; attention_mass on the same inputs reads
    the mass alone. The retrieval scores are set (a random tiny model has no retrieval head) so
    that they exceed the mass in some units and not in others."""
    from headprune.selection import attention_values
    from headprune.selection.budgets import KVBudget
    from headprune.selection.layer_policies import GlobalPolicy

    model = _model()
    mask = HeadMask.for_model(model)
    loader = [{"input_ids": torch.randint(3, 64, (1, 64), generator=torch.Generator().manual_seed(1))}]
    scores = torch.rand(2, 4, generator=torch.Generator().manual_seed(2))
    costs = KVBudget(target=0.5, batch=1, seq=64).mode_table(model, sink=SINK, window=WINDOW)
    units = kv_group_heads(model)
    policy = GlobalPolicy(min_heads_per_layer=0)
    mass = attention_mass(model, loader, units, SINK, WINDOW)
    retrieval = [[0.95, 0.01], [0.01, 0.9]]
    monkeypatch.setattr(attention_values, "retrieval_scores", lambda *args, **kw: (retrieval, 16))
    _, report = KVModes("retrieval", SINK, WINDOW).choose(model, mask, scores, loader, costs, 0.5, policy)
    values = report["kv_modes"]
    assert _flat(values["mass_beyond_window"]) == pytest.approx(_flat(mass))
    assert values["retrieval"] == retrieval and values["retrieval_period"] == 16
    lost = [max(m, r) for m, r in zip(_flat(mass), _flat(retrieval))]
    assert lost != _flat(mass) and lost != _flat(retrieval)  # each statistic wins somewhere
    assert _flat(values["window_value"]) == pytest.approx([f * (1 - x) for f, x in zip(_flat(values["full_value"]), lost)])
    _, plain = KVModes("attention_mass", SINK, WINDOW).choose(model, mask, scores, loader, costs, 0.5, policy)
    assert "retrieval" not in plain["kv_modes"]
    assert _flat(plain["kv_modes"]["window_value"]) == pytest.approx(
        [f * (1 - m) for f, m in zip(_flat(plain["kv_modes"]["full_value"]), _flat(mass))])


def test_uniform_unit_values_read_only_the_share_a_window_loses(monkeypatch):
    """kv_modes.unit_value=uniform: every unit full is worth 1, windowed 1 - max(mass, retrieval),
    whatever the metric's scores; the knapsack then keeps full the units a window costs most."""
    from headprune.selection import attention_values
    from headprune.selection.budgets import KVBudget
    from headprune.selection.layer_policies import GlobalPolicy

    model = _model()
    mask = HeadMask.for_model(model)
    loader = [{"input_ids": torch.randint(3, 64, (1, 64), generator=torch.Generator().manual_seed(1))}]
    scores = torch.tensor([[5.0, 5.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])  # the metric favours layer 0's unit 0
    costs = KVBudget(target=0.5, batch=1, seq=64).mode_table(model, sink=SINK, window=WINDOW)
    retrieval = [[0.0, 0.0], [0.0, 0.99]]
    monkeypatch.setattr(attention_values, "retrieval_scores", lambda *args, **kw: (retrieval, 16))
    mass = attention_mass(model, loader, kv_group_heads(model), SINK, WINDOW)
    layouts = {}
    for value in ("metric", "uniform"):
        layout, report = KVModes("retrieval", SINK, WINDOW, removal="last", unit_value=value).choose(
            model, mask, scores, loader, costs, 0.5, GlobalPolicy(min_heads_per_layer=0))
        layouts[value] = layout.modes
        if value == "uniform":
            assert report["kv_modes"]["full_value"] == [[1.0, 1.0], [1.0, 1.0]]
            assert _flat(report["kv_modes"]["window_value"]) == pytest.approx(
                [1 - max(m, r) for m, r in zip(_flat(mass), _flat(retrieval))])
            assert report["kv_modes"]["unit_value"] == "uniform"
    assert layouts["uniform"][1][1] == "full" and layouts["metric"][1][1] == "window", layouts


def test_uniform_unit_values_refused_where_nothing_reads_them():
    with pytest.raises(ValueError, match=r"kv_modes=measured does not read it; allowed: kv_modes.unit_value=metric"):
        KVModes("measured", SINK, WINDOW, unit_value="uniform")
    with pytest.raises(ValueError, match=r"kv_modes.unit_value='flat' is not allowed; allowed: metric .*, uniform"):
        KVModes("retrieval", SINK, WINDOW, unit_value="flat")


def _flat(rows):
    return [v for row in rows for v in row]


def _cli(llama_dir, *overrides, seq: int = 64):
    return kv_modes_cli(llama_dir, SINK, WINDOW, "kv_modes=retrieval", *overrides, seq=seq, blocks=1)


def test_a_retrieval_run_records_the_scores_and_keeps_the_budget(tmp_path, llama_dir, data_dir):
    """headprune-train kv_modes=retrieval: one round chooses the layout within the budget, removes
    no unit while windows fit (the preset's removal=last), and records the retrieval scores."""
    res = run(compose_train(tmp_path, data_dir, *_cli(llama_dir)))
    final = res["final"]
    assert final["cost_share"] <= 0.5 + 1e-9
    modes = [m for layer in final["kv_layout"]["modes"] for m in layer]
    assert "removed" not in modes and "full" in modes and "window" in modes
    report = res["rounds"][0]["budget"]["kv_modes"]
    assert report["choice"] == "retrieval" and report["removal"] == "last" and report["retrieval_period"] == 16
    assert len(report["retrieval"]) == 2 and all(len(r) == 2 for r in report["retrieval"])
    assert json.loads((tmp_path / "results.json").read_text())["rounds"][0]["budget"]["kv_modes"]["retrieval"] == \
        report["retrieval"]


def test_blocks_too_short_for_two_copies_are_refused_before_any_work(tmp_path, llama_dir, data_dir):
    with pytest.raises(ValueError, match=r"kv_modes=retrieval: a 16-token block .* allowed: data.block_size > 2 x"):
        run(compose_train(tmp_path, data_dir, *_cli(llama_dir, seq=16)))
    assert not (tmp_path / "results.json").exists()


def test_retrieval_blocks_repeat_beyond_the_window_and_score_only_the_repeat():
    model = _model()
    blocks = retrieval_batches(model.config, 64, SINK, WINDOW, 2, torch.device("cpu"))
    assert len(blocks) == 2 and retrieval_batches(model.config, 64, SINK, WINDOW, 0, "cpu") == []
    for seed, block in enumerate(blocks, start=1):
        ids, labels = block["input_ids"], block["labels"]
        assert torch.equal(ids, repeated_random_tokens(model.config, 64, 16, seed))  # period 16 > sink + window
        assert (labels[0, :16] == -100).all() and torch.equal(labels[0, 16:], ids[0, 16:])
    assert not torch.equal(blocks[0]["input_ids"], blocks[1]["input_ids"])


def test_measured_reads_the_retrieval_blocks_beside_the_calibration(tmp_path, llama_dir, data_dir, monkeypatch):
    """kv_modes=measured kv_modes.retrieval_blocks=1: the rises are measured on the calibration
    blocks, then apart on one retrieval block (labels over its repeat only); the report keeps both
    and the mix the knapsack read, which differs from the calibration's alone."""
    from headprune.selection import measured_values as module

    seen = []
    original = module.measured_rises

    def spy(model, mask, batches, *args, **kwargs):
        seen.append(batches)
        return original(model, mask, batches, *args, **kwargs)

    monkeypatch.setattr(module, "measured_rises", spy)
    plain = run(compose_train(tmp_path / "plain", data_dir, *_cli(llama_dir, "kv_modes=measured", seq=64)))
    both = run(compose_train(tmp_path / "both", data_dir, *_cli(llama_dir, "kv_modes=measured",
                                                                "kv_modes.retrieval_blocks=1", seq=64)))
    assert [len(b) for b in seen] == [1, 1, 1]
    assert torch.equal(seen[1][0]["input_ids"], seen[0][0]["input_ids"]) and "labels" not in seen[1][0]
    extra = seen[2][0]
    assert torch.equal(extra["labels"][0, :16], torch.full((16,), -100)) and extra["input_ids"].shape == (1, 64)
    report = both["rounds"][0]["budget"]["kv_modes"]
    assert report["retrieval_blocks"] == 1 and report["retrieval_period"] == 16
    assert report["calibration"]["targets"] == 63 and report["retrieval"]["targets"] == 48
    assert report["calibration"]["window_rise"] == plain["rounds"][0]["budget"]["kv_modes"]["window_rise"]
    assert report["window_rise"] == with_retrieval(report["calibration"]["window_rise"],
                                                   report["retrieval"]["window_rise"], 63, 48)
    assert report["window_rise"] != plain["rounds"][0]["budget"]["kv_modes"]["window_rise"]


def test_the_measured_retrieval_preset_mixes_one_retrieval_block_and_removes_last(tmp_path, llama_dir, data_dir):
    """kv_modes=measured_retrieval: kv_modes=measured with one retrieval block (both sets of rises in
    the report, the mix clamped) and removal=last: no unit removed while every unit windowed fits, so
    only the window rises are measured (measured_modes)."""
    res = run(compose_train(tmp_path, data_dir, *_cli(llama_dir, "kv_modes=measured_retrieval")))
    report = res["rounds"][0]["budget"]["kv_modes"]
    assert (report["choice"], report["retrieval_blocks"], report["removal"]) == ("measured", 1, "last")
    assert report["measured_modes"] == ["window"] and report["removed_rise"] is None
    assert report["window_rise"] == with_retrieval(report["calibration"]["window_rise"],
                                                   report["retrieval"]["window_rise"], 63, 48)
    modes = [m for layer in res["final"]["kv_layout"]["modes"] for m in layer]
    assert "removed" not in modes and "window" in modes


def test_a_retrieval_rise_below_zero_counts_as_zero():
    """The mix weighs each set by its scored targets; a retrieval block's negative rise (removing
    the unit copies random tokens better) adds nothing, so it cannot make the unit cheaper to lose
    than the calibration text says."""
    calibration, retrieval = [[0.2, 0.1], [0.0, 0.4]], [[-1.0, 0.5], [0.3, -0.2]]
    mixed = with_retrieval(calibration, retrieval, 3.0, 1.0)
    assert [v for layer in mixed for v in layer] == pytest.approx([0.15, 0.2, 0.075, 0.3])


@pytest.mark.parametrize("overrides,pattern", [
    (["kv_modes=attention_mass", "kv_modes.retrieval_blocks=1"],
     r"kv_modes.retrieval_blocks=1 adds .* kv_modes=attention_mass measures no loss; allowed: kv_modes.retrieval_blocks=0"),
    (["kv_modes=measured", "kv_modes.retrieval_blocks=-1"], r"kv_modes.retrieval_blocks=-1 must be an integer >= 0"),
    (["kv_modes=measured", "kv_modes.retrieval_blocks=1", "data.block_size=16", "budget.seq=16"],
     r"a 16-token block cannot hold two copies"),
])
def test_retrieval_blocks_refused_where_they_cannot_be_measured(overrides, pattern, tmp_path, llama_dir, data_dir):
    with pytest.raises(ValueError, match=pattern):
        run(compose_train(tmp_path, data_dir, *_cli(llama_dir, *overrides)))
    assert not (tmp_path / "results.json").exists()
