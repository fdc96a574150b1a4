"""Pruned models survive saving: save_pruned/load_pruned, Lightning checkpoints, and the
export at the end of `headprune-train`."""
import json

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from torch.utils.data import DataLoader
from transformers import AutoConfig, AutoModelForSequenceClassification

import headprune.apps.train
from headprune import HeadMask, count_params, head_layout, load_pruned, prune_heads, save_pruned
from headprune.heads.surgery import apply_layout
from headprune.apps.config_paths import config_dir
from headprune.lightning.module import HeadPruneModule
from tests.conftest import tiny_batch, tiny_bert
from tests.test_surgery import PRUNE, inputs, tiny


@torch.no_grad()
def logits(model, batch: dict) -> torch.Tensor:
    return model(**{k: v for k, v in batch.items() if k != "labels"}).logits


@pytest.mark.parametrize("family", ["bert", "distilbert", "gpt2", "llama"])
def test_save_load_round_trip(family, tmp_path):
    model = prune_heads(tiny(family), PRUNE)
    batch = inputs()
    save_pruned(model, tmp_path)
    assert json.loads((tmp_path / "headprune_layout.json").read_text())["layout"] == [[], [0, 2, 3], [0, 1]]

    loaded = load_pruned(tmp_path)
    assert type(loaded) is type(model) and not loaded.training
    assert loaded.headprune_layout == model.headprune_layout
    assert count_params(loaded) == count_params(model)
    torch.testing.assert_close(logits(loaded, batch), logits(model, batch), atol=0, rtol=0)

    wide = load_pruned(tmp_path, dtype=torch.float64, device="cpu", attn_implementation="eager")
    assert wide.dtype == torch.float64 and wide.config._attn_implementation == "eager"
    reference = tiny(family, attn="eager").double()
    prune_heads(reference, PRUNE).load_state_dict(model.state_dict())
    # equal_nan: HF's eager float64 Llama gives NaN at fully padded positions, pruned or not
    torch.testing.assert_close(logits(wide, batch), logits(reference, batch), atol=1e-12, rtol=0, equal_nan=True)

    half = load_pruned(tmp_path, dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in half.parameters())
    torch.testing.assert_close(logits(half, batch).float(), logits(model, batch), atol=3e-2, rtol=0)


def test_tokenizer_is_saved_when_given(tmp_path, tokenizer):
    save_pruned(prune_heads(tiny_bert(), {1: [0]}), tmp_path, tokenizer=tokenizer)
    assert (tmp_path / "tokenizer_config.json").is_file()


def test_lightning_checkpoint_after_physical_pruning_reloads(tmp_path, tokenizer):
    batch = tiny_batch(tokenizer)
    examples = [{k: v[i] for k, v in batch.items()} for i in range(len(batch["labels"]))]
    module = HeadPruneModule(tiny_bert(), num_labels=2)
    trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", default_root_dir=tmp_path)
    trainer.fit(module, DataLoader(examples, batch_size=3))

    module.head_mask.prune([(0, 1), (1, 0), (1, 1), (1, 2), (1, 3), (2, 3)])
    prune_heads(module.model, module.head_mask.pruned())
    trainer.save_checkpoint(tmp_path / "pruned.ckpt")

    fresh = HeadPruneModule.load_from_checkpoint(tmp_path / "pruned.ckpt", model=tiny_bert(seed=1), num_labels=2)
    assert fresh.model.headprune_layout == [[0, 2, 3], [], [0, 1, 2]]
    torch.testing.assert_close(logits(fresh.eval().model, batch), logits(module.eval().model, batch), atol=0, rtol=0)


@pytest.fixture
def train_cfg(tmp_path, data_dir):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        yield compose("train", overrides=[f"paths.output_dir={tmp_path}", f"data.data_dir={data_dir}",
                                          "model=tiny_bert", "debug=fast", "data.max_train_samples=64",
                                          "data.score_samples=32", "schedule.step=0.25"])
    GlobalHydra.instance().clear()


def test_train_run_exports_the_pruned_model(train_cfg, tmp_path, tokenizer, monkeypatch):
    seen = {}
    export = headprune.apps.train.export_pruned

    def spy(module, *args, **kwargs):  # the trained model as evaluated, just before the export
        seen["state"] = {k: v.detach().clone() for k, v in module.model.state_dict().items()}
        seen["mask"] = module.head_mask.mask.clone()
        seen["layout"] = head_layout(module.model)  # heads already removed during fit (pruning.physical)
        export(module, *args, **kwargs)

    monkeypatch.setattr(headprune.apps.train, "export_pruned", spy)
    assert train_cfg.export is True  # the default; `export=false` skips it
    res = headprune.apps.train.run(train_cfg)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["final"]["export_dir"] == str(tmp_path / "export") == res["final"]["export_dir"]
    n_pruned = len(saved["final"]["pruned"])
    assert n_pruned > 0
    head_params = 3 * (32 * 8 + 8) + 8 * 32  # one head's Q, K, V rows with biases, and O columns
    for key in ("attention", "total"):
        assert saved["baseline"]["params"][key] - saved["final"]["params"][key] == n_pruned * head_params

    export_dir = tmp_path / "export"
    masked = AutoModelForSequenceClassification.from_config(AutoConfig.from_pretrained(export_dir)).eval()
    apply_layout(masked, seen["layout"])
    masked.load_state_dict(seen["state"])
    HeadMask.for_model(masked).mask.copy_(seen["mask"])
    batch = tiny_batch(tokenizer)
    torch.testing.assert_close(logits(load_pruned(export_dir), batch), logits(masked, batch), atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["bert", "gpt2"])  # Linear and Conv1D output projections
def test_scale_heads_equals_fractional_mask(family):
    from headprune.heads.surgery import scale_heads

    model = tiny(family)
    batch = inputs()
    layers, heads = len(HeadMask.for_model(model, attach=False).mask), model.config.num_attention_heads
    factors = torch.rand(layers, heads, generator=torch.Generator().manual_seed(0))
    factors[1, 2] = 0.0  # removed physically below
    mask = HeadMask.for_model(model)
    mask.mask.copy_(factors)
    with torch.no_grad():
        gated = model(**batch).logits
    mask.detach()
    prune_heads(model, {1: [2]})  # scaling follows the physical layout
    scale_heads(model, factors)
    with torch.no_grad():
        scaled = model(**batch).logits
    assert torch.allclose(gated, scaled, atol=1e-5)
    with pytest.raises(ValueError, match="do not match"):
        scale_heads(model, torch.ones(layers + 1, heads))


def test_export_folds_learned_l0_gates(tmp_path, tokenizer):
    """The exported model computes what the gated model evaluated: closed gates removed, open
    ones scaled into the output projection."""
    from headprune.lightning.module import HeadPruneModule
    from headprune.results import RunResults
    from headprune.apps.train import export_pruned

    module = HeadPruneModule(tiny_bert(), num_labels=2, l0_penalty=0.1).eval()
    gates = module.head_mask.stochastic
    with torch.no_grad():
        gates.log_alpha.copy_(torch.tensor([[5.0, 0.0, -5.0, 1.0], [5.0, 5.0, 5.0, 5.0], [-5.0, -0.5, 5.0, 5.0]]))
    module.head_mask.prune([(1, 3)])
    det = gates.deterministic()
    assert det[0, 2] == 0 and 0 < det[0, 1] < 1 and det[1, 0] == 1
    batch = {k: v for k, v in tiny_batch(tokenizer).items() if k != "labels"}
    with torch.no_grad():
        evaluated = module.model(**batch).logits
    results = RunResults(tmp_path)
    export_pruned(module, tmp_path / "export", results, baseline_params={})
    assert results.data["final"]["l0_gates_folded"] == {"closed_heads": 2, "heads_per_layer": [3, 3, 3]}
    reloaded = load_pruned(tmp_path / "export").eval()
    with torch.no_grad():
        assert torch.allclose(reloaded(**batch).logits, evaluated, atol=1e-5)


def _killed_while_writing(model, monkeypatch):
    """save_pretrained that writes a 0-byte config.json and is then killed (KeyboardInterrupt)."""
    def killed(self, directory, *args, **kwargs):
        from pathlib import Path

        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / "config.json").write_text("")
        raise KeyboardInterrupt("killed while writing the export")

    monkeypatch.setattr(type(model), "save_pretrained", killed)


def test_a_kill_while_saving_leaves_no_half_written_folder(tmp_path, monkeypatch):
    """The folder appears complete or not at all; with overwrite=True the old model stays whole
    until the new one is complete."""
    model = prune_heads(tiny("bert"), PRUNE)
    save_pruned(model, tmp_path / "kept")
    before = {p.name: p.read_bytes() for p in (tmp_path / "kept").iterdir()}
    _killed_while_writing(model, monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        save_pruned(model, tmp_path / "new")
    with pytest.raises(KeyboardInterrupt):
        save_pruned(model, tmp_path / "kept", overwrite=True)
    assert not (tmp_path / "new").exists()
    assert {p.name: p.read_bytes() for p in (tmp_path / "kept").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"]  # no temporary folder left behind
    monkeypatch.undo()
    save_pruned(prune_heads(tiny("bert"), {0: [1]}), tmp_path / "kept", overwrite=True)
    assert load_pruned(tmp_path / "kept").headprune_layout == [[0, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"]


def test_saved_files_get_0666_less_the_umask(tmp_path, tokenizer):
    """model.safetensors and every other file written: 0666 & ~umask, as the README promises."""
    import os
    import stat

    old = os.umask(0o022)
    try:
        save_pruned(prune_heads(tiny_bert(), {1: [0]}), tmp_path / "export", tokenizer=tokenizer)
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "export").iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o644}, modes
    assert stat.S_IMODE((tmp_path / "export").stat().st_mode) == 0o755


def _edit_layout(folder, layer: int, kept: list) -> None:
    path = folder / "headprune_layout.json"
    saved = json.loads(path.read_text())
    saved["layout"][layer] = kept
    path.write_text(json.dumps(saved))


@pytest.mark.parametrize("size", ["empty", "half"])
def test_a_truncated_weights_file_is_named(size, tmp_path):
    """load_pruned and build_model (a run's model.pretrained folder) name the broken file."""
    from headprune.models.build import build_model

    save_pruned(prune_heads(tiny("bert"), PRUNE), tmp_path / "uneven")
    save_pruned(tiny("bert"), tmp_path / "plain")
    (tmp_path / "plain" / "headprune_layout.json").unlink()  # loads through plain from_pretrained
    for folder in (tmp_path / "uneven", tmp_path / "plain"):
        weights = folder / "model.safetensors"
        weights.write_bytes(b"" if size == "empty" else weights.read_bytes()[: weights.stat().st_size // 2])
        with pytest.raises(ValueError, match=rf"{weights}.*(truncated|cannot be read)"):
            load_pruned(folder)
        with pytest.raises(ValueError, match=rf"{weights}.*(truncated|cannot be read)"):
            build_model(str(folder), num_labels=2)


@pytest.mark.parametrize("layer, kept, pattern", [
    (1, [0, 0, 3], r"headprune_layout.json.*layer 1.*head 0 twice"),
    (1, [0, 2, 9], r"headprune_layout.json.*layer 1.*head 9.*0\.\.3"),
    (1, [0, 1, 2, 3], r"headprune_layout.json.*layer 1 keeps 4 heads.*model.safetensors.*layer\.1\."),
    (2, [0], r"headprune_layout.json.*layer 2 keeps 1 heads.*model.safetensors.*layer\.2\."),
])
def test_an_edited_layout_is_refused(layer, kept, pattern, tmp_path):
    """A duplicate or out-of-range head id, or head counts the weights' shapes contradict: refused,
    naming the layout file and the layer, instead of loading with heads re-initialised."""
    save_pruned(prune_heads(tiny("bert"), PRUNE), tmp_path)
    _edit_layout(tmp_path, layer, kept)
    with pytest.raises(ValueError, match=pattern):
        load_pruned(tmp_path)
