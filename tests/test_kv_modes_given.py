"""`kv_modes=given`: an earlier run's KV layout put on the model without measuring it again (read
from its results.json, its export folder or the folder's headprune_layout.json), trained or
evaluated as a chosen one would be, and refused before any work when it does not fit the model,
the window sizes, the budget or the layer policy. Tiny Llama built from a config."""
import json

import pytest
import torch

from headprune.apps.train import run
from headprune.heads.windows import KVLayout
from tests.helpers import compose_train, kv_modes_cli, tiny_llama_folder

SINK, WINDOW = 2, 6
# layer 0: unit 0 full, unit 1 windowed; layer 1: unit 0 removed, unit 1 windowed. KV bytes at 32
# tokens: (1 + 8/32 + 0 + 8/32) / 4 = 0.375 of dense's (budget.target 0.5 in kv_modes_cli)
MODES = [["full", "window"], ["removed", "window"]]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return tiny_llama_folder(tmp_path_factory.mktemp("tiny_llama_kv_given"))


def _cli(llama_dir, *overrides):
    return kv_modes_cli(llama_dir, SINK, WINDOW, *overrides)


def _modes_file(path, modes=MODES, sink=SINK, window=WINDOW):
    path.write_text(json.dumps({"modes": modes, "sink": sink, "window": window}))
    return path


def _export_logits(folder):
    from headprune.deploy.hf import load_pruned

    ids = torch.randint(3, 100, (1, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        return load_pruned(folder).eval()(ids).logits


def test_a_given_layout_is_put_on_the_model_exactly(tmp_path, llama_dir, data_dir):
    """The run keeps the file's modes: its removed unit's heads masked and gone from the export,
    its cost share the mode table's price of that layout, the export loaded with those windows."""
    layout_file = _modes_file(tmp_path / "modes.json")
    res = run(compose_train(tmp_path / "run", data_dir, *_cli(llama_dir, "kv_modes=given",
                                                              f"kv_modes.layout={layout_file}")))
    assert res["final"]["kv_layout"]["modes"] == MODES
    assert res["final"]["cost_share"] == pytest.approx((1 + 8 / 32 + 8 / 32) / 4)
    assert res["final"]["heads_per_layer"] == [4, 2]  # unit 0 of layer 1 (query heads 0, 1) removed
    report = res["rounds"][0]["budget"]
    assert report["modes"] == MODES and report["kv_modes"]["choice"] == "given"
    assert report["kv_modes"]["layout"] == str(layout_file)
    from headprune.deploy.hf import load_pruned

    assert load_pruned(tmp_path / "run" / "export").headprune_kv_layout == KVLayout.from_json(
        {"modes": MODES, "sink": SINK, "window": WINDOW})


def test_a_chosen_layout_given_again_reproduces_the_run(tmp_path, llama_dir, data_dir):
    """An attention_mass run's layout, given back from its results.json, its export folder and its
    headprune_layout.json, gives the same layout, validation loss and exported logits."""
    chosen = run(compose_train(tmp_path / "chosen", data_dir, *_cli(llama_dir, "kv_modes=attention_mass")))
    assert "window" in str(chosen["final"]["kv_layout"]["modes"])
    expected = _export_logits(tmp_path / "chosen" / "export")
    sources = [tmp_path / "chosen" / "results.json", tmp_path / "chosen" / "export",
               tmp_path / "chosen" / "export" / "headprune_layout.json"]
    for i, source in enumerate(sources):
        res = run(compose_train(tmp_path / f"given{i}", data_dir, *_cli(llama_dir, "kv_modes=given",
                                                                         f"kv_modes.layout={source}")))
        assert res["final"]["kv_layout"] == chosen["final"]["kv_layout"]
        assert res["final"]["val"]["loss"] == pytest.approx(chosen["final"]["val"]["loss"], rel=1e-6)
        assert torch.allclose(_export_logits(tmp_path / f"given{i}" / "export"), expected, atol=1e-6)


def _refusals(tmp_path):
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{not json")
    no_layout = tmp_path / "results.json"
    no_layout.write_text(json.dumps({"final": {"val": {"loss": 1.0}}}))
    return [
        (["kv_modes=given"], r"kv_modes.layout=None .* it is required"),
        (["kv_modes=measured", f"kv_modes.layout={_modes_file(tmp_path / 'm0.json')}"],
         r"with kv_modes=measured it must be null"),
        (["kv_modes=given", f"kv_modes.layout={tmp_path / 'missing.json'}"], r"no such file .*missing.json"),
        (["kv_modes=given", f"kv_modes.layout={tmp_path}"], r"holds no KV layout \(no headprune_layout.json"),
        (["kv_modes=given", f"kv_modes.layout={bad_json}"], r"bad.json is not valid JSON"),
        (["kv_modes=given", f"kv_modes.layout={no_layout}"], r"results.json without final.kv_layout"),
        (["kv_modes=given", f"kv_modes.layout={_modes_file(tmp_path / 'm1.json', sink=4)}"],
         r"keeps sink 4 \+ window 6 .* kv_modes.sink=2 .*allowed: kv_modes.sink=4"),
        (["kv_modes=given", f"kv_modes.layout={_modes_file(tmp_path / 'm2.json', MODES + [['full', 'full']])}"],
         r"m2.json: kv_modes has 3 layers .* the model has 2 layers"),
        (["kv_modes=given", f"kv_modes.layout={_modes_file(tmp_path / 'm3.json', [['full', 'full']] * 2)}"],
         r"keeps 1.0000 of the dense bytes, more than the budget's 0.5000"),
        (["kv_modes=given", f"kv_modes.layout={_modes_file(tmp_path / 'm4.json')}", "layer_policy.min_heads_per_layer=4"],
         r"removes 1 unit\(s\) of layer 1; the layer policy lets it lose at most 0"),
        (["kv_modes=given", f"kv_modes.layout={_modes_file(tmp_path / 'm7.json')}", "kv_modes.granularity=layer"],
         r"m7.json: layer 0 keeps 1 unit\(s\) full and 1 windowed, which kv_modes.granularity=layer does not allow"),
        (["kv_modes=given", f"kv_modes.layout={_modes_file(tmp_path / 'm6.json')}", "budget.seq=100000"],
         r"budget.seq=100000 tokens, beyond the model's 256 positions; allowed: budget.seq <= 256"),
        (["kv_modes=given", f"kv_modes.layout={_modes_file(tmp_path / 'm5.json')}", "kv_modes.samples=1"],
         r"kv_modes.samples=1 .* allowed: kv_modes.samples=null"),
    ]


def test_a_layout_that_does_not_fit_is_refused_before_any_work(tmp_path, llama_dir, data_dir):
    for i, (override, pattern) in enumerate(_refusals(tmp_path)):
        out = tmp_path / f"run{i}"
        with pytest.raises(ValueError, match=pattern):
            run(compose_train(out, data_dir, *_cli(llama_dir, *override)))
        assert not (out / "results.json").exists(), override
