"""selection/measured.py and selection/attention_drop.py (layer_policy=measured, attention_drop): the
partial forwards equal the whole model's, the measured allocation meets a cost budget exactly and
empties a provably useless layer first, respects min_heads_per_layer and protected layers, records
its passes / tokens / seconds, its greedy correction never raises the measured loss (and fixes a
misleading curve), attention drop ranks a zeroed-O layer first; both run from the CLI with every
recovery and export an attention-free layer that reloads."""
import pytest
import torch

from headprune.apps.train import run
from headprune.costs.tables import flops_costs, kv_costs
from headprune.deploy.hf import load_pruned
from headprune.heads.mask import HeadMask
from headprune.heads.surgery import kv_group_heads
from headprune.recovery import RECOVERIES
from headprune.selection.attention_drop import attention_change, drop_layers
from headprune.selection.budgets import unit_plan
from headprune.selection.layer_policies import AttentionDropPolicy, MeasuredPolicy
from headprune.selection.measured import Probe, correct, trial_mask
from headprune.selection.rounds import prune_round
from tests.helpers import SIX_HEADS, TINY_LM_MODEL, V, results
from tests.helpers import llama as tiny_llama_lm

USELESS = 2  # the layer whose attention output projection is zeroed


def llama(layers: int = 4, zero: int | None = USELESS, seed: int = 0):
    """A tiny random Llama (4 query heads, 2 KV groups of 2 per layer) whose layer `zero` has its
    output projection zeroed: masking any of its heads changes nothing. The head is sharpened so
    that the model is confident, and `batches` label with its own predictions: then removing any
    head that matters raises the loss."""
    model = tiny_llama_lm(seed=seed, attn="sdpa", vocab_size=V, num_hidden_layers=layers)
    with torch.no_grad():
        if zero is not None:
            model.model.layers[zero].self_attn.o_proj.weight.zero_()
        model.lm_head.weight.mul_(8.0)
    return model


def batches(model, n: int = 8, tokens: int = 16, batch: int = 4, seed: int = 0) -> list[dict]:
    ids = torch.randint(0, V, (n, tokens), generator=torch.Generator().manual_seed(seed))  # (N, T)
    with torch.no_grad():
        predicted = model(input_ids=ids).logits.argmax(-1)  # (N, T)
    labels = torch.cat([ids[:, :1], predicted[:, :-1]], dim=1)  # labels[t + 1] = the model's guess at t
    return [{"input_ids": ids[i:i + batch], "attention_mask": torch.ones_like(ids[i:i + batch]),
             "labels": labels[i:i + batch]} for i in range(0, n, batch)]


def allocate(policy, model, share: float, costs=None):
    mask = HeadMask.for_model(model)
    scores = torch.rand(mask.num_layers, mask.num_heads, generator=torch.Generator().manual_seed(1))
    costs = costs or kv_costs(model, 1, 16)
    heads, report, shortfall = policy.measure_allocation(model, mask, batches(model), scores, costs, share,
                                                         kv_group_heads(model))
    return heads, report, shortfall, costs


def test_a_run_from_layer_l_on_carried_states_equals_the_whole_forward():
    model = llama()
    mask = HeadMask.for_model(model)
    probe = Probe.of(model, mask, batches(model))
    trial = mask.mask.clone()
    trial[1, :2] = 0.0  # layer 1 loses a KV group: the carried states must see it
    trial[3, 3] = 0.0
    whole = probe.loss(trial)
    assert whole != pytest.approx(probe.loss(mask.mask), abs=1e-4)
    for layer, hidden in probe.carried(trial):
        assert probe.loss(trial, layer, hidden) == pytest.approx(whole, abs=1e-5), layer
    assert torch.equal(mask.mask, torch.ones_like(mask.mask))  # the trials left the mask as it was


def test_probe_takes_the_first_samples_sequences():
    model = llama()
    probe = Probe.of(model, HeadMask.for_model(model), batches(model), samples=6)
    assert [b["input_ids"].shape[0] for b in probe.batches] == [4, 2]
    assert probe.tokens() == 6 * 15  # next-token targets


@pytest.mark.parametrize("share,removed", [(0.75, 2), (0.5, 4), (0.4, 5)])
def test_measured_meets_the_kv_budget_exactly_and_empties_the_useless_layer_first(share, removed):
    model = llama()
    heads, report, shortfall, costs = allocate(MeasuredPolicy(profile_samples=None), model, share)
    kept = report["kept_units_per_layer"]
    assert shortfall is None
    assert sum(kept) == 8 - removed  # the most units that fit: 8 x share, rounded down
    assert report["predicted_share"] <= share and report["predicted_cost"] == costs.total(kept)
    assert kept[USELESS] == 0  # its two groups cost nothing: they go first
    assert {(l, h) for l, h in heads} >= {(USELESS, h) for h in range(4)}
    assert len(heads) == 2 * removed


def test_the_useless_layer_goes_under_a_flops_budget_too():
    model = llama()
    _, report, shortfall, _ = allocate(MeasuredPolicy(profile_samples=None), model, 0.75, flops_costs(model, 1, 16))
    assert shortfall is None and report["kept_units_per_layer"][USELESS] == 0
    assert report["predicted_share"] <= 0.75


def test_min_heads_per_layer_and_protected_layers_are_respected():
    model = llama()
    _, report, _, _ = allocate(MeasuredPolicy(profile_samples=None, min_heads_per_layer=2), model, 0.5)
    assert report["kept_units_per_layer"] == [1, 1, 1, 1]  # one group (2 heads) per layer at least
    _, report, _, _ = allocate(MeasuredPolicy(profile_samples=None, protect_first=1, protect_last=1), model, 0.5)
    kept = report["kept_units_per_layer"]
    assert kept[0] == 2 and kept[3] == 2 and sum(kept) == 4


def test_a_budget_the_constraints_cannot_meet_is_a_shortfall_with_the_cheapest_layout():
    model = llama()
    _, report, shortfall, _ = allocate(MeasuredPolicy(profile_samples=None, min_heads_per_layer=2), model, 0.25)
    assert report["kept_units_per_layer"] == [1, 1, 1, 1]
    assert "cannot be met" in shortfall


def test_the_report_records_passes_tokens_and_seconds_and_the_correction_never_raises_the_loss():
    model = llama(layers=4, zero=None, seed=3)
    _, report, _, _ = allocate(MeasuredPolicy(profile_samples=6, passes=3, candidates=2), model, 0.5)
    m = report["measured"]
    assert m["samples"] == 6 and m["tokens"] == 6 * 15
    assert 1 <= m["passes_run"] == len(m["passes"]) <= m["passes_max"] == 3
    assert m["seconds"] >= m["profile_seconds"] > 0 and m["correction_seconds"] > 0 and m["forwards"] > 0
    assert [len(c) for c in m["curves"]] == [3, 3, 3, 3]  # 0, 1 or 2 groups kept
    assert m["loss"] <= m["knapsack_loss"]
    losses = [p["loss_before"] for p in m["passes"]] + [m["loss"]]
    assert losses == sorted(losses, reverse=True)
    for p in m["passes"]:
        assert all(t["measured"] >= p["loss_before"] for t in p["tried"][:-1])  # only an improvement is kept
        if p["accepted"] is not None:
            assert p["accepted"]["loss"] < p["loss_before"]


def test_the_correction_moves_a_group_when_the_curves_mislead():
    """Curves that call the useless layer dear and layer 0 free: the knapsack's layout empties
    layer 0; measured in context, the correction puts a group back there and takes one from the
    useless layer instead, lowering the measured loss."""
    model = llama()
    mask = HeadMask.for_model(model)
    units = kv_group_heads(model)
    plan = unit_plan(torch.rand(4, 4), mask.alive(), MeasuredPolicy(), units)
    probe = Probe.of(model, mask, batches(model))
    base = mask.mask.clone()
    wrong = [0, 2, 2, 2]
    misleading = [{0: 0.0, 1: 0.0, 2: 0.0}] + [{0: 9.0, 1: 8.0, 2: 0.0}] * 3
    costs = kv_costs(model, 1, 16)
    limit = 0.75 * costs.dense
    before = probe.loss(trial_mask(base, plan.ranked, wrong, units))
    kept, loss, records = correct(probe, base, plan.ranked, wrong, plan.choices, units, costs, limit, misleading,
                                  passes=3, candidates=4)
    assert records[0]["accepted"] == {"put_back": 0, "removed": USELESS, "loss": records[0]["accepted"]["loss"]}
    assert kept[0] >= 1 and kept[USELESS] <= 1 and sum(kept) == 6
    assert loss < before


def test_attention_drop_ranks_the_zeroed_layer_first_and_drops_whole_layers():
    model = llama()
    mask = HeadMask.for_model(model)
    change, tokens = attention_change(model, mask, batches(model))
    assert tokens == 8 * 16
    assert change[USELESS] == pytest.approx(0.0, abs=1e-6)
    assert min(c for l, c in enumerate(change) if l != USELESS) > 1e-3
    heads, report, shortfall, costs = allocate(AttentionDropPolicy(), model, 0.75)
    assert shortfall is None and report["attention_drop"]["dropped"] == [USELESS]
    assert report["kept_units_per_layer"] == [2, 2, 0, 2]
    assert sorted(heads) == [(USELESS, h) for h in range(4)]
    _, report, _, _ = allocate(AttentionDropPolicy(), model, 0.5)
    assert report["attention_drop"]["dropped"][0] == USELESS and report["kept_units_per_layer"].count(0) == 2


def test_attention_drop_keeps_protected_layers_and_says_when_it_falls_short():
    model = llama()
    choices = [[0, 1, 2]] * 4
    costs = kv_costs(model, 1, 16)
    kept, dropped, fits = drop_layers([0.3, 0.1, 0.0, 0.2], choices, costs, 0.5 * costs.dense)
    assert (kept, dropped, fits) == ([2, 0, 0, 2], [2, 1], True)
    _, report, shortfall, _ = allocate(AttentionDropPolicy(protect_first=1, protect_last=2), model, 0.5)
    assert report["kept_units_per_layer"] == [2, 0, 2, 2] and "cannot be met" in shortfall


def test_a_measuring_policy_needs_a_cost_budget():
    policy = MeasuredPolicy()
    with pytest.raises(ValueError, match=r"layer_policy=measured allocates a cost budget.*budget=kv, flops or latency"):
        policy(torch.rand(2, 4), torch.ones(2, 4, dtype=torch.bool), 2)


@pytest.mark.parametrize("field,value", [("profile_samples", 0), ("passes", -1), ("candidates", 0),
                                         ("protect_first", -1)])
def test_bad_measured_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"layer_policy.{field}"):
        MeasuredPolicy(**{field: value})


def test_prune_round_masks_the_measured_layout():
    model = llama()
    mask = HeadMask.for_model(model)
    costs = kv_costs(model, 1, 16)

    def metric(model, mask, loader, **options):
        return torch.rand(mask.num_layers, mask.num_heads, generator=torch.Generator().manual_seed(1))

    result = prune_round(model, mask, metric, MeasuredPolicy(profile_samples=None), 0, batches(model),
                         cost_budget=(costs, 0.75))
    assert mask.heads_per_layer() == [4, 4, 0, 4] and result.budget["measured"]["passes_run"] >= 1
    assert result.record()["budget"]["kept_units_per_layer"] == [2, 2, 0, 2]


# -- the train app --------------------------------------------------------------------------------------
TINY_GPT2 = [*TINY_LM_MODEL, "+model.config_overrides.n_positions=64", "data.block_size=32", "data.max_train_samples=16",
             "data.score_samples=8", "data.max_validation_samples=8", "data.batch_size=4", "data.eval_batch_size=4",
             "logger=none", "callbacks=none", "trainer.num_sanity_val_steps=0", "schedule=one_shot",
             "schedule.target_sparsity=0.5", "schedule.baseline_epochs=0", "schedule.epochs_per_round=0",
             "diagnostics.enabled=false", "budget=kv"]


@pytest.mark.parametrize("policy", ["measured", "attention_drop"])
def test_both_policies_run_from_the_cli_and_export_an_attention_free_layer(policy, cfg_factory, tmp_path):
    run(cfg_factory(*TINY_GPT2, f"layer_policy={policy}", "budget.target=0.5"))
    res = results(tmp_path)
    (round1,) = res["rounds"]
    assert sorted(round1["budget"]["kept_units_per_layer"]) in ([0, 4], [1, 3], [2, 2])
    assert sum(round1["budget"]["kept_units_per_layer"]) == 4 and round1["budget"]["predicted_share"] == 0.5
    key = "measured" if policy == "measured" else "attention_drop"
    assert round1["budget"][key]["tokens"] > 0 and round1["budget"][key]["seconds"] > 0
    if policy == "attention_drop":
        assert 0 in round1["budget"]["kept_units_per_layer"]
    loaded = load_pruned(tmp_path / "export").eval()
    assert [len(k) for k in loaded.headprune_layout] == res["final"]["heads_per_layer"]
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(loaded(input_ids=ids).logits).all()


def test_a_measuring_policy_with_the_heads_budget_fails_before_work(cfg_factory):
    cfg = cfg_factory(*[o for o in TINY_GPT2 if o != "budget=kv"], "layer_policy=measured")
    with pytest.raises(ValueError, match=r"layer_policy=measured allocates a cost budget.*budget=heads"):
        run(cfg)


@pytest.mark.slow
@pytest.mark.parametrize("recovery", sorted(RECOVERIES))
def test_an_emptied_layer_works_with_every_recovery(recovery, cfg_factory, tmp_path):
    extra = {"distill": ["recovery.steps=2", "data.max_train_samples=null"],
             "lora": ["recovery.steps=2", "data.max_train_samples=null"]}.get(recovery, [])
    run(cfg_factory(*TINY_GPT2, "layer_policy=attention_drop", "budget.target=0.5", f"recovery={recovery}", *extra))
    res = results(tmp_path)
    assert sorted(res["final"]["heads_per_layer"]) == [0, 4]
    assert res["final"]["val"]["ppl"] > 1.0
    loaded = load_pruned(tmp_path / "export").eval()
    assert sorted(len(k) for k in loaded.headprune_layout) == [0, 4]


class TableProbe:
    """A probe whose losses come from tables keyed by the layout (units kept per layer): `whole`
    for a layout measured as a whole, `partial` for one measured from a carried layer; so a test
    can make the in-context numbers promise what the whole layout does not deliver."""

    def __init__(self, ranked, units, whole, partial):
        self.ranked, self.units, self.whole, self.partial = ranked, units, whole, partial
        self.num_layers = len(ranked)

    def layout(self, trial):
        return tuple(sum(bool(trial[l, self.units[u]].any()) for u in units) for l, units in enumerate(self.ranked))

    def loss(self, trial, layer=0, hidden=None):
        table = self.whole if hidden is None else self.partial
        return table[self.layout(trial)]

    def carried(self, trial):
        for layer in range(self.num_layers):
            yield layer, "carried"


def test_a_move_the_whole_layout_measures_worse_is_not_kept():
    """In context, putting a group back into layer 0 gains 0.5 and taking one from layer 1 costs
    0.1, but the two together, measured as a whole, are worse: the layout stays."""
    units = [[0, 1], [2, 3]]
    ranked = [[0, 1], [0, 1]]
    base = torch.ones(2, 4)
    whole = {(1, 1): 1.0, (2, 0): 1.5}
    partial = {(2, 1): 0.5, (1, 0): 1.1, (0, 1): 2.0, (1, 2): 0.9}
    probe = TableProbe(ranked, units, whole, partial)
    costs = type("Costs", (), {"cost": [{0: 0.0, 1: 1.0, 2: 2.0}] * 2})()
    kept, loss, records = correct(probe, base, ranked, [1, 1], [[0, 1, 2]] * 2, units, costs, 2.0,
                                  [{0: 2.0, 1: 1.0, 2: 0.5}] * 2, passes=3, candidates=2)
    assert (kept, loss) == ([1, 1], 1.0)
    (record,) = records
    assert record["accepted"] is None
    assert record["tried"][0] == {"put_back": 0, "removed": 1, "predicted": pytest.approx(0.6), "measured": 1.5}


# -- a layer with no heads in the decode bench (bench/llm.py) ----------------------------------------------
@pytest.mark.slow  # ~10 s: a bench run
def test_the_decode_bench_runs_an_uneven_export_with_an_attention_free_layer(tmp_path):
    """3 layers x 6 query / 3 KV heads: the export keeps 3, 0 and 2 KV groups (layer 1 attention-free,
    as layer_policy=measured or attention_drop leave it); the bench decodes it and its KV bytes are
    exactly 5 / 9 of the dense model's."""
    from headprune import heads_of_kv_groups, prune_heads, save_pruned
    from headprune.apps.bench import run as bench
    from tests.helpers import compose_bench

    def model():
        return tiny_llama_lm(**SIX_HEADS)

    model().save_pretrained(tmp_path / "dense")
    save_pruned(prune_heads(model(), heads_of_kv_groups(model(), {1: [0, 1, 2], 2: [0]})), tmp_path / "uneven",
                origin=str(tmp_path / "dense"))
    rows = bench(compose_bench(tmp_path / "bench", "bench.encoder.enabled=false", "bench.train_step.enabled=false",
                               "bench.onnxruntime.enabled=false", "bench.decoder.enabled=false", "bench.llm.enabled=true",
                               f"bench.llm.pruned_dirs=[{tmp_path / 'uneven'}]", "bench.llm.batches=[1]",
                               "bench.llm.prefill_batches=[1]"))["llm"]
    dense, uneven = rows
    assert uneven["kv_heads_kept"] == 5 and uneven["kv_exact"] is True
    assert uneven["kv_cache_bytes"] * 9 == dense["kv_cache_bytes"] * 5
    assert uneven["per_token_ms"] > 0
