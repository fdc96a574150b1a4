"""Per-unit KV modes chosen by headprune-train (`kv_modes=measured|attention_mass`,
headprune.selection.kv_modes): the measured values, the attention mass beyond the window, the run
without training that chooses, applies, evaluates and exports the layout (results.json: modes,
cost_share, passkey), the export loaded with load_pruned computing what the layout keeps (plain
forward and generate()), and the refusals before any work. Tiny Llama built from a config."""
import json

import pytest
import torch

from headprune.apps.train import run
from headprune.heads.mask import HeadMask
from headprune.heads.surgery import kv_group_heads
from headprune.heads.windows import KVLayout, KVWindows
from headprune.selection.attention_values import attention_mass
from headprune.selection.kv_modes import KVModes
from headprune.selection.measured_values import measured_rises
from headprune.tasks import CAUSAL_LM
from tests.helpers import compose_train, kv_modes_cli, llama, tiny_llama_folder

SINK, WINDOW = 2, 6


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A config-only tiny Llama (2 layers, 4 query / 2 KV heads) and a byte tokenizer with BOS."""
    return tiny_llama_folder(tmp_path_factory.mktemp("tiny_llama_kv"))


def _cli(llama_dir, *overrides):
    return kv_modes_cli(llama_dir, SINK, WINDOW, *overrides)


def _llama(seed: int = 0):
    """The tiny GQA Llama (2 layers x 4 query / 2 KV heads, hidden 32) over 64 tokens and 256 positions."""
    return llama(seed=seed, attn="sdpa", vocab_size=64, max_position_embeddings=256)


def _batches(n: int = 2, tokens: int = 24):
    return [{"input_ids": torch.randint(0, 64, (1, tokens), generator=torch.Generator().manual_seed(i))}
            for i in range(n)]


def _loss(model, batches) -> float:
    with torch.no_grad():
        return sum(float(model(**b, labels=b["input_ids"]).loss) for b in batches) / len(batches)


def _reference_rises(model, mask, batches, units):
    """The straightforward measurement: for every unit and mode, one whole-model forward per batch
    with that unit alone windowed (KVWindows) or masked, the per-token mean next-token loss
    (labels -100 unscored) minus the plain model's."""
    def loss() -> float:
        total, count = 0.0, 0
        with torch.no_grad():
            for b in batches:
                logits = model(input_ids=b["input_ids"]).logits[:, :-1]
                targets = b.get("labels", b["input_ids"])[:, 1:]
                total += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                                                 ignore_index=-100, reduction="sum"))
                count += int((targets != -100).sum())
        return total / count

    base = loss()
    n_layers = mask.num_layers
    removed = [[0.0] * len(units) for _ in range(n_layers)]
    windowed = [[0.0] * len(units) for _ in range(n_layers)]
    for layer in range(n_layers):
        for unit, heads in enumerate(units):
            modes = [["full"] * len(units) for _ in range(n_layers)]
            modes[layer][unit] = "window"
            windows = KVWindows(KVLayout(tuple(map(tuple, modes)), SINK, WINDOW)).attach(model)
            windowed[layer][unit] = loss() - base
            windows.detach()
            trial = mask.mask.clone()
            trial[layer, heads] = 0.0
            with mask.override(trial):
                removed[layer][unit] = loss() - base
    return removed, windowed, base


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_measured_rises_equal_whole_model_probes_and_choose_the_same_layout(attn, monkeypatch):
    """The fast measurement (blocks before the unit carried, a layer's probes stacked as rows, the
    head in token chunks, chunks without a scored target skipped) gives every unit's removal and
    window rise of the whole-model reference to float rounding, on blocks of two rows and on a
    block whose first tokens are unscored, with probes split over several calls; the knapsack
    then chooses the same layout from both."""
    from headprune.costs.tables import kv_mode_costs
    from headprune.selection import unit_probes
    from headprune.selection.budgets import allocate_modes

    monkeypatch.setattr(unit_probes, "HEAD_TOKENS", 7)  # several head chunks, one of them unscored
    monkeypatch.setattr(unit_probes, "PROBE_TOKENS", 3 * 2 * 24)  # 3 probes of a (2, 24) block per call
    model = llama(seed=0, attn=attn, vocab_size=64, max_position_embeddings=256, num_hidden_layers=3)
    mask = HeadMask.for_model(model)
    units = kv_group_heads(model)
    rows = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(5))
    scored_late = torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(6))
    labels = scored_late.clone()
    labels[:, :9] = -100
    batches = [{"input_ids": rows}, {"input_ids": scored_late, "labels": labels}]
    removed, windowed, base = measured_rises(model, mask, batches, units, SINK, WINDOW)
    ref_removed, ref_windowed, ref_base = _reference_rises(model, mask, batches, units)
    assert base == pytest.approx(ref_base, abs=1e-5)
    for fast, ref in ((removed, ref_removed), (windowed, ref_windowed)):
        assert torch.allclose(torch.tensor(fast), torch.tensor(ref), atol=1e-5, rtol=0), (fast, ref)
    assert all(w != 0.0 for layer in windowed for w in layer)  # 24 tokens > 2 + 6: every window bites
    costs = kv_mode_costs(model, 1, 64, SINK, WINDOW)
    layouts = [allocate_modes(r, [[a - b for a, b in zip(rs, ws)] for rs, ws in zip(r, w)], costs, 0.5, SINK, WINDOW)[0]
               for r, w in ((removed, windowed), (ref_removed, ref_windowed))]
    assert layouts[0] == layouts[1]


def test_attention_mass_is_the_probability_outside_sinks_and_window():
    """The mass equals the eager attention maps' probability on keys j with sink <= j <= i - window,
    averaged over the queries i >= sink + window and the unit's query heads."""
    model = _llama()
    batches = _batches(1)
    mass = attention_mass(model, batches, kv_group_heads(model), SINK, WINDOW)
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        maps = model(**batches[0], output_attentions=True).attentions  # per layer (1, H, T, T)
    model.config._attn_implementation = "sdpa"
    t = batches[0]["input_ids"].shape[1]
    for layer in range(2):
        for unit, heads in enumerate(kv_group_heads(model)):
            share = [float(maps[layer][0, h, i, SINK:i - WINDOW + 1].sum()) for h in heads
                     for i in range(SINK + WINDOW, t)]
            assert mass[layer][unit] == pytest.approx(sum(share) / len(share), rel=1e-5)
    assert 0.0 < min(min(m) for m in mass) and max(max(m) for m in mass) < 1.0


@pytest.mark.parametrize("choice", ["measured", "attention_mass"])
def test_a_run_chooses_applies_and_exports_the_kv_modes(choice, tmp_path, llama_dir, data_dir):
    """Half of the KV bytes at seq 32 (a window: 8 of 32 tokens): results.json's final has the
    layout and its cost share (the mode table's price, within the target), the round records the
    measured values; the export (load_pruned) has the layout, its logits equal the run model's
    forward with the layout applied to the dense model, its generate() equals greedy decoding by
    full forwards, and its cache holds what the layout keeps; the passkey evaluation ran."""
    from headprune.deploy.hf import load_pruned
    from headprune.heads.windows import apply_kv_layout
    from headprune.models.build import build_model
    from tests.test_kv_modes import greedy_by_full_forwards

    res = run(compose_train(tmp_path, data_dir, *_cli(llama_dir, f"kv_modes={choice}", "evaluation.enabled=true",
                                                      "evaluation.perplexity_seqs=[32]", "evaluation.perplexity_tokens=64",
                                                      "evaluation.zero_shot_tasks=[]", "evaluation.generate=false",
                                                      "evaluation.passkey_lengths=[250]",
                                                      "evaluation.passkey_depths=[0.5]", "evaluation.passkey_samples=1")))
    final = res["final"]
    layout = KVLayout.from_json(final["kv_layout"])
    assert (layout.sink, layout.window) == (SINK, WINDOW)
    modes = [m for layer in layout.modes for m in layer]
    assert "window" in modes and final["cost_share"] <= 0.5 + 1e-9
    full, windowed = modes.count("full"), modes.count("window")
    assert final["cost_share"] == pytest.approx((full + windowed * 8 / 32) / 4)
    report = res["rounds"][0]["budget"]
    assert report["modes"] == [list(layer) for layer in layout.modes] and report["kv_modes"]["choice"] == choice
    assert report["kv_modes"]["seq"] == 32
    assert ("window_rise" in report["kv_modes"]) == (choice == "measured")
    assert res["budget"]["kv_modes"]["choice"] == choice
    assert set(res["evaluation"]["pruned"]["passkey"]) >= {"accuracy", "by_depth"}

    loaded = load_pruned(tmp_path / "export").eval()
    assert loaded.headprune_kv_layout == layout
    dense = build_model(str(llama_dir), task="causal_lm", random_init=True, attn_implementation="sdpa", seed=0).eval()
    apply_kv_layout(dense, layout)
    ids = torch.randint(3, 100, (1, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, dense(ids).logits, atol=1e-5)
        out = loaded.generate(ids[:, :12], max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(out, greedy_by_full_forwards(loaded, ids[:, :12], 12))


@pytest.mark.parametrize("override,pattern", [
    (["budget=latency"], r"kv_modes=measured chooses .* budget=latency has not; allowed: budget=kv or flops"),
    (["recovery=refit", "recovery.damps=[0.01]"], r"kv_modes=measured applies no repair .*allowed: recovery=none"),
    (["layer_policy=uniform"], r"layer_policy=UniformPolicy allocates per layer; allowed: layer_policy=global"),
    (["data.block_size=16"], r"data.block_size=16 < budget.seq=32; allowed: data.block_size >= budget.seq"),
    (["kv_modes.window=30"], r"sink \+ kv_modes.window = 32 tokens cover the whole budget.seq=32"),
    (["schedule.epochs_per_round=1", "recovery=finetune"], r"one round without epochs"),
    (["pruning.rearrange=true"], r"allowed: pruning.rearrange=false"),
    (["kv_modes.choice=streaming"], r"kv_modes.choice='streaming' is not allowed; allowed: none, measured"),
    (["model.attn_implementation=flash_attention_2"], r"allowed: eager, sdpa"),
    (["kv_modes.samples=100"], r"kv_modes.samples=100 calibration blocks .* data.score_samples=2 gives only 2"),
    (["kv_modes=attention_mass", "budget.target=0.01"], r"budget.target=0.01: only a layout without any unit fits 0.0100 .*allowed: a larger budget.target"),
    (["kv_modes=measured_retrieval", "budget.target=0.01"], r"budget.target=0.01: only a layout without any unit"),
])
def test_settings_kv_modes_cannot_honour_are_refused_before_any_work(override, pattern, tmp_path, llama_dir, data_dir):
    with pytest.raises(ValueError, match=pattern):
        run(compose_train(tmp_path, data_dir, *_cli(llama_dir, "kv_modes=measured", *override)))
    assert not (tmp_path / "results.json").exists() and not (tmp_path / ".hydra").exists()


def test_the_experiment_preset_composes():
    """experiment=llm_kv_modes: SmolLM2 at 2/3 of the KV bytes at 4096 removed, modes among all
    three, calibration blocks as long as the context, no repair, passkey at 4096."""
    from tests.helpers import compose_train as compose

    cfg = compose("/tmp/unused", "/tmp/unused", "experiment=llm_kv_modes")
    assert cfg.model.pretrained == "smollm2" and cfg.kv_modes.choice == "measured"
    # kv_modes=measured_retrieval: the arm that hit every 2/3 target on SmolLM2 (experiments/llm_kv_modes)
    assert cfg.kv_modes.retrieval_blocks == 1 and cfg.kv_modes.removal == "last"
    assert (cfg.budget.target, cfg.budget.seq, cfg.data.block_size) == (0.34, 4096, 4096)
    assert cfg.recovery._target_.endswith("NoRecovery") and cfg.evaluation.passkey_lengths == [4096]
    KVModes(**{k: v for k, v in cfg.kv_modes.items() if k != "_target_"})


@pytest.mark.parametrize("choice,metric", [("measured", "magnitude"), ("attention_mass", "fisher")])
def test_removal_last_removes_nothing_while_every_unit_windowed_fits(choice, metric, tmp_path, llama_dir, data_dir):
    """kv_modes.removal=last: with every unit windowed within the budget (here 8 / 32 of a full unit's
    bytes, budget 0.26) the layout removes no unit and still fits; removal=any removes some on the
    same values (so the restriction is what keeps them)."""
    removed = {}
    for removal in ("any", "last"):
        out = tmp_path / removal
        run(compose_train(out, data_dir, *_cli(llama_dir, f"kv_modes={choice}", f"kv_modes.removal={removal}",
                                               "budget.target=0.26", f"metric={metric}")))
        final = json.loads((out / "results.json").read_text())["final"]
        removed[removal] = sum(layer.count("removed") for layer in final["kv_layout"]["modes"])
        assert final["cost_share"] <= 0.26 + 1e-9
    assert removed["last"] == 0 and removed["any"] > 0, removed


def test_removal_last_is_refused_without_kv_modes(tmp_path, llama_dir, data_dir):
    with pytest.raises(ValueError, match=r"kv_modes.removal=last .* allowed: kv_modes.removal=any with kv_modes=none"):
        run(compose_train(tmp_path, data_dir, *_cli(llama_dir, "kv_modes=none", "kv_modes.removal=last")))
    assert not (tmp_path / "results.json").exists()


def test_measured_modes_are_measured_on_self_generated_calibration(tmp_path, llama_dir, data_dir):
    """data.calibration=self: the rises kv_modes=measured weighs are measured on the blocks the dense
    model sampled (the run dir's cache), not on the corpus: its base loss is the dense model's loss
    on the first of those cached blocks (kv_modes.samples=1)."""
    from headprune.data.self_calibration import CACHE
    from headprune.models.build import build_model

    res = run(compose_train(tmp_path, data_dir, *_cli(llama_dir, "kv_modes=measured", "data.calibration=self",
                                                      "data.self_calibration.batch_size=2")))
    assert res["calibration"]["source"] == "self"
    blocks = torch.load(tmp_path / CACHE)["score"]  # (2, 32) sampled ids
    assert blocks.shape == (2, 32)
    dense = build_model(str(llama_dir), task="causal_lm", random_init=True, attn_implementation="sdpa", seed=0).eval()
    expected = _loss(dense, [{"input_ids": blocks[:1]}])
    assert res["rounds"][0]["budget"]["kv_modes"]["base_loss"] == pytest.approx(expected, rel=1e-5)


def test_layer_granularity_windows_whole_layers():
    """kv_modes.granularity=layer: each layer's options keep its units all full or all windowed, so
    values that would window one unit of each layer (unit granularity) window whole layers instead,
    within the same share."""
    from headprune.costs.tables import kv_mode_costs
    from headprune.selection.budgets import allocate_modes
    from headprune.selection.kv_modes import mode_choices

    model = _llama()
    units = kv_group_heads(model)
    costs = kv_mode_costs(model, 1, 32, SINK, WINDOW)
    full = [[10.0, 1.0], [10.0, 1.0]]  # unit 1 of each layer cheap to window
    windowed = [[1.0, 0.99], [1.0, 0.99]]
    layouts = {}
    for granularity in ("unit", "layer"):
        choices, _ = mode_choices(costs, units, [4, 4], 0.7, "last", granularity)
        if granularity == "layer":
            assert all(0 in k for ks in choices for k in ks)
        layouts[granularity], report = allocate_modes(full, windowed, costs, 0.7, SINK, WINDOW, choices=choices)
        assert report["predicted_share"] <= 0.7
    assert layouts["unit"].modes == (("full", "window"), ("full", "window"))
    assert all(len(set(layer) - {"removed"}) == 1 for layer in layouts["layer"].modes)
    assert "window" in {m for layer in layouts["layer"].modes for m in layer}


def test_a_layer_granular_run_keeps_each_layer_all_full_or_all_windowed(tmp_path, llama_dir, data_dir):
    res = run(compose_train(tmp_path, data_dir, *_cli(llama_dir, "kv_modes=attention_mass", "kv_modes.granularity=layer",
                                                     "budget.target=0.7")))
    modes = res["final"]["kv_layout"]["modes"]
    assert all(len(set(layer) - {"removed"}) == 1 for layer in modes) and "window" in str(modes)
    assert res["rounds"][0]["budget"]["kv_modes"]["granularity"] == "layer"
    assert res["final"]["cost_share"] <= 0.7


def test_granularity_refused_outside_its_values():
    with pytest.raises(ValueError, match=r"kv_modes.granularity='head' is not allowed; allowed: unit .*, layer"):
        KVModes(choice="measured", granularity="head")
    with pytest.raises(ValueError, match=r"kv_modes=none does not do; allowed: kv_modes.granularity=unit"):
        KVModes(granularity="layer")


def test_a_recovery_declares_whether_it_may_follow_kv_modes():
    """KVModes.check reads the recovery's capability (`Recovery.follows_kv_modes`), not its class: a
    new recovery saying it keeps the windows is accepted, the same recovery saying nothing refused;
    none and distill with steps are accepted, distill without steps refused."""
    from headprune.recovery import Distill, NoRecovery
    from headprune.recovery.base import Recovery
    from headprune.selection.budgets import KVBudget
    from headprune.selection.layer_policies import GlobalPolicy
    from headprune.selection.schedules import OneShot

    class Quiet(Recovery):  # a toy recovery of its own, declaring nothing
        pass

    class WindowAware(Recovery):
        def follows_kv_modes(self) -> bool:
            return True

    kv = KVModes(choice="attention_mass", sink=SINK, window=WINDOW)
    settings = (OneShot(target_sparsity=0.5, baseline_epochs=0, epochs_per_round=0), GlobalPolicy())
    budget = KVBudget(target=0.5, seq=32)
    for recovery in (WindowAware(), NoRecovery(), Distill(steps=4)):
        kv.check(*settings, recovery, budget, block_size=32, rearrange=False)
    for recovery in (Quiet(), Distill(steps=0)):
        with pytest.raises(ValueError, match=r"applies no repair after the modes are chosen"):
            kv.check(*settings, recovery, budget, block_size=32, rearrange=False)


def test_the_attention_pass_computes_no_full_logits():
    """The attention statistics read only the maps: the output head runs on one position (a
    (B, T, vocab) logits tensor is 4.3 GB for Gemma 3 at 4096 tokens), and the mass is unchanged."""
    model = _llama()
    units = kv_group_heads(model)
    batches = _batches()
    shapes = []
    handle = model.lm_head.register_forward_hook(lambda module, args, output: shapes.append(tuple(output.shape)))
    mass = attention_mass(model, batches, units, SINK, WINDOW)
    handle.remove()
    assert shapes == [(1, 1, 64)] * len(batches)
    assert all(0.0 < m < 1.0 for layer in mass for m in layer)


class _NoCaps:
    """A layer policy that lets a layer lose every head (layer_policy=global, min_heads_per_layer 0)."""
    def caps(self, alive):
        return [int(alive.shape[1])] * int(alive.shape[0])


@pytest.mark.parametrize("retrieval_blocks", [0, 1])
def test_removal_last_measures_window_rises_only_and_chooses_todays_layout(retrieval_blocks):
    """kv_modes=measured with removal=last while every unit windowed fits: no option removes a unit,
    so only the window rises are measured (half the probes) and the knapsack, reading full = window
    rise and windowed = 0, chooses the layout the three-way values (full = removal rise, windowed =
    removal - window rise, each mixed with the retrieval block's clamped rises) give; with
    removal=any both rises are measured."""
    from headprune.costs.tables import kv_mode_costs
    from headprune.selection.budgets import allocate_modes
    from headprune.data.retrieval import retrieval_batches
    from headprune.selection.kv_modes import mode_choices
    from headprune.selection.measured_values import scored_targets, with_retrieval

    model = llama(seed=0, attn="sdpa", vocab_size=64, max_position_embeddings=256, num_hidden_layers=3)
    mask = HeadMask.for_model(model)
    units = kv_group_heads(model)
    batches = [{"input_ids": torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(3))}]
    costs = kv_mode_costs(model, 1, 40, SINK, WINDOW)  # a windowed unit: 8 / 40 of a full one
    share = 0.5  # every unit windowed (0.2) fits; about 3 of 6 units full
    kv = KVModes(choice="measured", sink=SINK, window=WINDOW, samples=1, removal="last",
                 retrieval_blocks=retrieval_blocks)
    layout, report = kv.choose(model, mask, torch.zeros(3, 4), batches, costs, share, _NoCaps())
    measured = report["kv_modes"]
    assert measured["measured_modes"] == ["window"] and measured["removed_rise"] is None

    removed, windowed, base = measured_rises(model, mask, batches, units, SINK, WINDOW)  # today's: both modes
    if retrieval_blocks:
        extra = retrieval_batches(model.config, 40, SINK, WINDOW, 1, "cpu")
        r_removed, r_windowed, _ = measured_rises(model, mask, extra, units, SINK, WINDOW)
        scored = scored_targets(batches, CAUSAL_LM), scored_targets(extra, CAUSAL_LM)
        removed, windowed = with_retrieval(removed, r_removed, *scored), with_retrieval(windowed, r_windowed, *scored)
    assert torch.allclose(torch.tensor(measured["window_rise"]), torch.tensor(windowed), atol=1e-9, rtol=0)
    choices, fits = mode_choices(costs, units, _NoCaps().caps(mask.alive()), share, "last")
    assert fits
    today, _ = allocate_modes(removed, [[r - w for r, w in zip(rs, ws)] for rs, ws in zip(removed, windowed)], costs,
                              share, SINK, WINDOW, choices=choices)
    assert layout == today
    flat = [m for layer in layout.modes for m in layer]
    assert "full" in flat and "window" in flat  # a real choice, not every unit alike

    kv_any = KVModes(choice="measured", sink=SINK, window=WINDOW, samples=1, removal="any")
    _, report_any = kv_any.choose(model, mask, torch.zeros(3, 4), batches, costs, share, _NoCaps())
    assert report_any["kv_modes"]["measured_modes"] == ["removed", "window"]
    assert report_any["kv_modes"]["removed_rise"] is not None


@pytest.mark.parametrize("choice,reads", [("retrieval", False), ("measured", False), ("attention_mass", True)])
def test_the_metric_pass_runs_only_when_the_choice_reads_its_scores(choice, reads, tmp_path, llama_dir, data_dir,
                                                                    monkeypatch):
    """A KV-mode choice that reads no head score (kv_modes=measured; retrieval / attention_mass with
    unit_value=uniform) skips the metric's pass (results.json scores null) and chooses the layout it
    chooses after one; with unit_value=metric the scores are read and recorded. Seen failing with the
    skip removed (the spy counted a pass) and with it applied to unit_value=metric (no scores)."""
    from headprune.selection import rounds

    calls, real = [], rounds.score
    monkeypatch.setattr(rounds, "score", lambda metric, *a, **k: calls.append(metric) or real(metric, *a, **k))
    value = [] if choice == "measured" else [f"kv_modes.unit_value={'metric' if reads else 'uniform'}"]
    layouts = {}
    for metric in ("fisher", "magnitude"):
        out = tmp_path / metric
        run(compose_train(out, data_dir, *_cli(llama_dir, f"kv_modes={choice}", *value, f"metric={metric}",
                                               "budget.target=0.4")))
        data = json.loads((out / "results.json").read_text())
        layouts[metric] = data["final"]["kv_layout"]
        assert (data["rounds"][0]["scores"] is not None) == reads
    assert len(calls) == (2 if reads else 0), calls
    if not reads:
        assert layouts["fisher"] == layouts["magnitude"]
