"""heads/layout.py and deploy/layout_file.py: one Layout (kept heads + KV unit modes) read off a
model or a HeadMask, applied by surgery, stored in one sidecar per export, and exports written in
the format before it (tests/fixtures/old_exports, by 54284a7's save_pruned) still load."""
import json
import shutil
from pathlib import Path

import pytest
import torch

from headprune import load_pruned, prune_heads, save_pruned
from headprune.deploy.hf import read_origin
from headprune.deploy.layout_file import read_layout, read_sidecar
from headprune.heads.layout import Layout
from headprune.heads.mask import HeadMask
from headprune.heads.windows import KVLayout
from tests.helpers import llama

OLD = Path(__file__).parent / "fixtures" / "old_exports"
TINY = dict(attn="sdpa", hidden_size=16, intermediate_size=16, vocab_size=32)  # what written_by.py built
WINDOWED = Layout((("window", "full"), ("removed", "window")), sink=1, window=3)
IDS = torch.tensor([[3, 7, 1, 30, 12, 5, 9, 9, 2, 17, 4, 8]])  # (1, 12): past sink + window


@torch.no_grad()
def logits(model):
    return model(input_ids=IDS).logits


def test_kv_layout_is_the_layout():
    assert KVLayout is Layout


def test_an_old_windowed_export_loads_and_saves_as_one_sidecar(tmp_path):
    """The fixture holds headprune_layout.json + headprune_kv_modes.json: loaded, its windows are
    attached (logits equal the rebuilt windowed model's, and differ from the unwindowed one's);
    saved again, the folder holds the one new sidecar, which loads to the same logits."""
    folder = tmp_path / "old"
    shutil.copytree(OLD / "windowed", folder)
    loaded = load_pruned(folder)
    reference = llama(seed=0, **TINY)
    WINDOWED.apply(reference)
    torch.testing.assert_close(logits(loaded), logits(reference), atol=1e-6, rtol=0)
    unwindowed = llama(seed=0, **TINY)
    prune_heads(unwindowed, {1: [0, 1]})
    assert not torch.allclose(logits(loaded), logits(unwindowed), atol=1e-3)
    assert Layout.of_model(loaded) == Layout(WINDOWED.modes, 1, 3, ((0, 1, 2, 3), (2, 3)))

    save_pruned(loaded, tmp_path / "new")
    assert sorted(p.name for p in (tmp_path / "new").glob("headprune_*")) == ["headprune_layout.json"]
    sidecar = json.loads((tmp_path / "new" / "headprune_layout.json").read_text())
    assert sidecar["format"] == 2 and sidecar["kv_modes"] == WINDOWED.to_json() and not sidecar["plain_hf"]
    torch.testing.assert_close(logits(load_pruned(tmp_path / "new")), logits(reference), atol=1e-6, rtol=0)
    assert read_layout(OLD / "windowed") == read_layout(tmp_path / "new") == WINDOWED  # kv_modes=given reads either


@pytest.mark.parametrize("name,seed,removed,plain", [("uneven", 1, {0: [1], 1: [2, 3]}, False),
                                                     ("plain", 2, {0: [2, 3], 1: [2, 3]}, True)])
def test_old_removal_exports_load(name, seed, removed, plain, tmp_path):
    """headprune_layout.json (uneven) and headprune_export.json (plain shapes) of 54284a7 load to the
    pruned model's logits, with the dense model they record; saved again: one sidecar."""
    loaded = load_pruned(OLD / name)
    reference = prune_heads(llama(seed=seed, **TINY), removed)
    torch.testing.assert_close(logits(loaded), logits(reference), atol=1e-6, rtol=0)
    assert read_origin(OLD / name) == "dense-tiny" and read_sidecar(OLD / name).plain_hf is plain
    saved = save_pruned(reference, tmp_path / "new", origin="dense-tiny")
    assert saved.plain_hf is plain
    assert sorted(p.name for p in (tmp_path / "new").glob("headprune_*")) == ["headprune_layout.json"]
    assert read_sidecar(tmp_path / "new").heads == read_sidecar(OLD / name).heads
    torch.testing.assert_close(logits(load_pruned(tmp_path / "new")), logits(reference), atol=1e-6, rtol=0)


def test_the_head_mask_is_the_layouts_runtime_view():
    """Layout.of_mask reads the gates (a unit with no head left is removed); to_mask gives them back;
    apply removes the same heads physically, computing what the masked model computes."""
    model = llama(seed=3, **TINY)
    mask = HeadMask.for_model(model)
    mask.prune([(0, 1), (1, 0), (1, 1)])  # layer 0: one head of unit 0; layer 1: all of unit 0
    layout = Layout.of_mask(model, mask)
    assert layout == Layout((("full", "full"), ("removed", "full")), heads=((0, 2, 3), (2, 3)))
    assert layout.removed_heads(model) == {0: [1], 1: [0, 1]}
    masked = logits(model)
    view = layout.to_mask(model, attach=False)
    assert torch.equal(view.mask, mask.mask)
    mask.detach()
    layout.apply(model)
    assert model.headprune_layout == [[0, 2, 3], [2, 3]] and Layout.of_model(model) == layout
    torch.testing.assert_close(logits(model), masked, atol=1e-6, rtol=0)


def test_a_layout_whose_heads_contradict_its_modes_is_refused():
    model = llama(seed=0, **TINY)
    with pytest.raises(ValueError, match="layer 1 unit 0 is full but keeps heads \\[\\]"):
        Layout((("full", "full"), ("full", "full")), heads=((0, 1, 2, 3), (2, 3))).check(model)
    with pytest.raises(ValueError, match="layer 0 keeps head 4, outside the model's heads 0..3"):
        Layout((("full", "full"), ("full", "full")), heads=((0, 1, 2, 3, 4), (0, 1, 2, 3))).check(model)
    with pytest.raises(ValueError, match="kept heads \\[2, 1\\]; allowed: distinct head ids >= 0, ascending"):
        Layout((("full",),), heads=((2, 1),))


def test_a_damaged_sidecar_is_named(tmp_path):
    save_pruned(prune_heads(llama(seed=0, **TINY), {0: [1]}), tmp_path / "m")
    path = tmp_path / "m" / "headprune_layout.json"
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "format": 3}))
    with pytest.raises(ValueError, match=rf"{path}: field 'format' is 3; allowed: 2"):
        load_pruned(tmp_path / "m")
    path.write_text(json.dumps({**data, "kv_modes": {**data["kv_modes"], "modes": [["full", "sliding"]] * 2}}))
    with pytest.raises(ValueError, match=rf"{path}: field 'kv_modes'.*'sliding' is not allowed"):
        load_pruned(tmp_path / "m")
    path.write_text(json.dumps({**data, "plain_hf": "yes"}))
    with pytest.raises(ValueError, match=rf"{path}: field 'plain_hf' is 'yes'; allowed: true or false"):
        load_pruned(tmp_path / "m")
