"""docs/extending.md's KV unit valuation recipe, as written: the page's function registered through
`register_valuation` and the page's yaml put in a scratch config folder (`hydra.searchpath`), then
`headprune-train kv_modes=window_share` chooses, records and applies a layout with it; nothing else
of the package is touched. Also the registry's refusals (a taken name, a keyword it does not offer,
values of the wrong shape, a setting the valuation does not read). Tiny Llama built from a config."""
import re
from pathlib import Path

import pytest

from headprune.apps.train import run
from headprune.selection import valuations
from tests.helpers import compose_train, kv_modes_cli, tiny_llama_folder

SINK, WINDOW = 2, 6
PAGE = (Path(__file__).resolve().parent.parent / "docs" / "extending.md").read_text()
SECTION = PAGE[PAGE.index("## A KV unit valuation"):PAGE.index("## An architecture")]


@pytest.fixture()
def registry():
    """The valuation registry, as it was again after the test (the page's registration leaves nothing behind)."""
    saved = dict(valuations.VALUATIONS)
    yield valuations.VALUATIONS
    valuations.VALUATIONS.clear()
    valuations.VALUATIONS.update(saved)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return tiny_llama_folder(tmp_path_factory.mktemp("tiny_llama_valuation"))


def _page(tmp_path) -> Path:
    """Run the section's Python block (it registers `window_share`) and write its yaml under a
    scratch config folder; returns the folder."""
    (code,) = re.findall(r"```python\n(.*?)```", SECTION, re.S)
    (yaml,) = re.findall(r"```yaml\n(.*?)```", SECTION, re.S)
    exec(code, {})  # noqa: S102 - the page's own code
    conf = tmp_path / "conf"
    (conf / "kv_modes").mkdir(parents=True)
    (conf / "kv_modes" / "window_share.yaml").write_text(yaml)
    return conf


@pytest.mark.slow  # a headprune-train run (~3 s)
def test_the_pages_valuation_chooses_and_records_a_layout(registry, tmp_path, llama_dir, data_dir):
    """Half of the KV bytes at seq 32: a window keeps 8 of 32 keys, so every windowed value is a
    quarter of the unit's full value (the metric's unit score), and the layout is within budget."""
    conf = _page(tmp_path)
    assert "window_share" in registry
    res = run(compose_train(tmp_path / "run", data_dir, f"hydra.searchpath=[file://{conf}]",
                            *kv_modes_cli(llama_dir, SINK, WINDOW, "kv_modes=window_share")))
    report = res["rounds"][0]["budget"]["kv_modes"]
    assert report["choice"] == "window_share" and report["kept_share"] == 0.25
    full = [v for layer in report["full_value"] for v in layer]
    assert [v for layer in report["window_value"] for v in layer] == pytest.approx([0.25 * v for v in full])
    assert max(full) > 0
    assert res["final"]["cost_share"] <= 0.5 + 1e-9 and res["final"]["kv_layout"]["modes"]
    assert res["budget"]["kv_modes"]["choice"] == "window_share"


def test_a_setting_the_pages_valuation_does_not_read_is_refused_before_any_work(registry, tmp_path, llama_dir,
                                                                                 data_dir):
    conf = _page(tmp_path)
    with pytest.raises(ValueError, match=r"kv_modes=window_share does not read it; allowed: kv_modes.unit_value=metric "
                                         r"with kv_modes=none or measured or window_share"):
        run(compose_train(tmp_path / "run", data_dir, f"hydra.searchpath=[file://{conf}]",
                          *kv_modes_cli(llama_dir, SINK, WINDOW, "kv_modes=window_share", "kv_modes.unit_value=uniform")))
    assert not (tmp_path / "run" / "results.json").exists()


def test_the_registry_refuses_a_taken_name_an_unoffered_keyword_and_misshapen_values(registry):
    import torch

    from headprune.heads.mask import HeadMask
    from headprune.selection.budgets import KVBudget
    from headprune.selection.kv_modes import KVModes
    from headprune.selection.layer_policies import GlobalPolicy
    from tests.helpers import llama

    with pytest.raises(ValueError, match=r"'given' is already a kv_modes choice"):
        valuations.register_valuation("given", lambda model, batches, units, sink, window: None)
    with pytest.raises(ValueError, match=r"parameter 'tokenizer' is not offered; allowed: mask, task, unit_scores"):
        valuations.register_valuation("bad", lambda model, batches, units, sink, window, *, tokenizer: None)
    valuations.register_valuation("one_layer", lambda model, batches, units, sink, window: ([[1.0] * len(units)],
                                                                                             [[0.5] * len(units)], {}))
    model = llama(attn="sdpa", vocab_size=64, max_position_embeddings=256)
    costs = KVBudget(target=0.5, seq=32).mode_table(model, sink=SINK, window=WINDOW)
    loader = [{"input_ids": torch.randint(0, 64, (1, 32), generator=torch.Generator().manual_seed(0))}]
    with pytest.raises(ValueError, match=r"'one_layer': full must hold one value per layer and unit \(2 x 2\)"):
        KVModes("one_layer", SINK, WINDOW).choose(model, HeadMask.for_model(model), torch.ones(2, 4), loader, costs,
                                                  0.5, GlobalPolicy(min_heads_per_layer=0))
