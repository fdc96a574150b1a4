"""KL steps after the KV modes are chosen (`kv_modes=... recovery=distill recovery.steps=N`, issue
40's "with the KL steps"): every step's student is the windowed model (the layout attached before
the recovery trains), the export keeps the layout with the trained weights, a killed run resumes
in its steps with the windows back on (a real process, SIGKILL) to the uninterrupted weights, and
the repairs that cannot see windows stay refused. Tiny Llama built from a config."""
import json
import sys

import pytest
import torch
from safetensors.torch import load_file

from headprune.apps.train import run
from headprune.heads.windows import KV_LAYOUT_ATTR, KVLayout
from headprune.recovery.distill import Distill
from tests.helpers import compose_train, kv_modes_cli, tiny_llama_folder

SINK, WINDOW, STEPS = 2, 6, 4
KL = ["recovery=distill", f"recovery.steps={STEPS}", "recovery.alpha=1.0", "recovery.lr=1e-3",
      "recovery.checkpoint_every=0", "data.max_train_samples=8", "data.batch_size=2", "trainer.accelerator=cpu"]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return tiny_llama_folder(tmp_path_factory.mktemp("tiny_llama_kv_kl"))


def _cli(llama_dir, *overrides):
    return kv_modes_cli(llama_dir, SINK, WINDOW, "kv_modes=attention_mass", *overrides)


def test_kl_steps_train_the_windowed_model_and_its_export_keeps_the_layout(tmp_path, llama_dir, data_dir,
                                                                            monkeypatch):
    """The layout is chosen before any step (the same as the run without steps), every training
    loss is computed on the model with that layout attached, the steps change the weights, and
    load_pruned gives back the layout with the trained weights."""
    from headprune.deploy.hf import load_pruned

    seen = []
    original = Distill.training_loss

    def spy(self, model, batch, task):
        seen.append(getattr(model, KV_LAYOUT_ATTR, None))
        return original(self, model, batch, task)

    monkeypatch.setattr(Distill, "training_loss", spy)
    res = run(compose_train(tmp_path / "kl", data_dir, *_cli(llama_dir, *KL)))
    plain = run(compose_train(tmp_path / "none", data_dir, *_cli(llama_dir)))
    layout = KVLayout.from_json(res["final"]["kv_layout"])
    assert layout == KVLayout.from_json(plain["final"]["kv_layout"]) and "window" in str(layout.modes)
    assert len(seen) == STEPS and all(s == layout for s in seen)
    report = res["rounds"][0]["distill"]
    assert report["steps"] == STEPS and report["loss_first"] > 0
    assert res["rounds"][0]["val_after_recovery"] == res["final"]["val"] != plain["final"]["val"]
    trained, untrained = (load_file(str(tmp_path / d / "export" / "model.safetensors")) for d in ("kl", "none"))
    assert any(not torch.equal(trained[k], untrained[k]) for k in trained)
    loaded = load_pruned(tmp_path / "kl" / "export")
    assert loaded.headprune_kv_layout == layout
    assert all(torch.equal(p, trained[n]) for n, p in loaded.state_dict().items() if n in trained)


def test_gradient_checkpointing_trains_the_same_weights_recomputing_each_layer(tmp_path, llama_dir, data_dir,
                                                                          monkeypatch):
    """model.gradient_checkpointing=true (what a long-context KL step needs to fit in memory): the
    steps run with every decoder layer checkpointed, each layer's attention (and its window hook)
    runs again in the backward, and the trained weights equal the run without it (float rounding)."""
    from headprune.models.build import checkpoint_activations

    calls = {"forwards": 0, "checkpointed": []}
    original = Distill.training_loss

    def spy(self, model, batch, task):
        calls["checkpointed"].append([bool(getattr(m, "gradient_checkpointing", False)) for m in model.model.layers])
        return original(self, model, batch, task)

    def count(module, args):
        if torch.is_grad_enabled() and module.training:
            calls["forwards"] += 1

    monkeypatch.setattr(Distill, "training_loss", spy)
    from transformers.models.llama import modeling_llama

    handle = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda module, args: count(module, args) if isinstance(module, modeling_llama.LlamaAttention) else None)
    try:
        run(compose_train(tmp_path / "ckpt", data_dir, *_cli(llama_dir, *KL, "model.gradient_checkpointing=true")))
        with_checkpoints = calls["forwards"]
        calls["forwards"] = 0
        run(compose_train(tmp_path / "plain", data_dir, *_cli(llama_dir, *KL)))
    finally:
        handle.remove()
    assert all(all(layers) for layers in calls["checkpointed"][:STEPS]) and len(calls["checkpointed"]) == 2 * STEPS
    assert not any(any(layers) for layers in calls["checkpointed"][STEPS:])
    assert with_checkpoints == 2 * calls["forwards"] > 0  # each layer's attention once more in every backward
    ckpt, plain = (load_file(str(tmp_path / d / "export" / "model.safetensors")) for d in ("ckpt", "plain"))
    assert all(torch.allclose(ckpt[k], plain[k], atol=1e-6) for k in plain)
    with pytest.raises(ValueError, match=r"Linear does not support activation checkpointing .*allowed: "
                                         r"model.gradient_checkpointing=false"):
        checkpoint_activations(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("override,pattern", [
    (["recovery=distill", "recovery.steps=0"], r"no epochs after pruning .* or recovery.steps > 0"),
    (["recovery=lora", "recovery.steps=0"], r"recovery.steps=0 must be >= 1"),
    (["recovery=bias_compensation"], r"applies no repair .*allowed: recovery=none, or recovery=distill\|lora"),
    (["recovery=chain", "+recovery.options.refit.damps=[0.01]", "data.max_train_samples=8"], r"got recovery=Chain; allowed: recovery=none"),
])
def test_repairs_and_epoch_training_stay_refused_before_any_work(override, pattern, tmp_path, llama_dir, data_dir):
    with pytest.raises(ValueError, match=pattern):
        run(compose_train(tmp_path, data_dir, *_cli(llama_dir, *override)))
    assert not (tmp_path / "results.json").exists()


def test_a_run_without_steps_still_refuses_a_resume(tmp_path, llama_dir, data_dir):
    with pytest.raises(ValueError, match=r"no checkpoint to resume; allowed: ckpt_path=null"):
        run(compose_train(tmp_path, data_dir, *_cli(llama_dir, f"ckpt_path={tmp_path / 'last.ckpt'}")))


@pytest.mark.slow
def test_a_killed_kl_run_resumes_with_its_windows_to_the_uninterrupted_weights(tmp_path, llama_dir, data_dir):
    """SIGKILL (a real process, progress bar on) after the recovery's first checkpoint, then
    ckpt_path=<run dir>/recovery/last.ckpt: the same layout, weights, losses and final val as the
    run never interrupted (without the windows put back the resumed steps would train another model)."""
    from tests.test_recovery_fit import _kill_after_first_checkpoint, _same_weights

    steps = ["recovery.steps=24", "recovery.checkpoint_every=6", "data.max_train_samples=24"]
    overrides = _cli(llama_dir, *KL, *steps)
    whole = run(compose_train(tmp_path / "whole", data_dir, *overrides))
    killed = tmp_path / "killed"
    cmd = [sys.executable, "-m", "headprune.apps.train", *overrides, f"data.data_dir={data_dir}",
           f"hydra.run.dir={killed}"]
    step = _kill_after_first_checkpoint(cmd, killed)
    assert 0 < step < 24 and not (killed / "export").exists()
    resumed = run(compose_train(killed, data_dir, *overrides, f"ckpt_path={killed / 'recovery' / 'last.ckpt'}"))
    _same_weights(tmp_path / "whole", killed)
    assert resumed["final"]["kv_layout"] == whole["final"]["kv_layout"]
    assert resumed["rounds"][0]["distill"]["resumed_at_step"] == step
    for key in ("loss_first", "loss_last", "steps"):
        assert resumed["rounds"][0]["distill"][key] == whole["rounds"][0]["distill"][key]
    assert resumed["final"]["val"] == whole["final"]["val"]
    saved = json.loads((killed / "export" / "headprune_layout.json").read_text())["kv_modes"]
    assert KVLayout.from_json(saved) == KVLayout.from_json(whole["final"]["kv_layout"])


@pytest.mark.slow
@pytest.mark.parametrize("change,setting", [
    (["kv_modes.window=10"], "kv_modes.window"),
    (["kv_modes=retrieval"], "kv_modes.choice"),
    (["kv_modes=none"], "kv_modes.choice"),
])
def test_a_resume_with_changed_kv_modes_is_refused_naming_the_setting(change, setting, tmp_path, llama_dir, data_dir):
    """The checkpoint carries the layout its settings chose; a resume under other kv_modes settings
    (another window, another choice, or none at all) would record settings the trained model does
    not have (or fail after training, kv_modes=none): refused before anything is written."""
    overrides = _cli(llama_dir, *KL, "recovery.checkpoint_every=2")
    run(compose_train(tmp_path, data_dir, *overrides))
    ckpt = tmp_path / "recovery" / "last.ckpt"
    assert ckpt.is_file()
    written = {p: p.stat().st_mtime_ns for p in (tmp_path / "results.json", ckpt, tmp_path / ".hydra" / "config.yaml")
               if p.exists()}
    with pytest.raises(ValueError, match=rf"other settings than this resume: .*{setting}"):
        run(compose_train(tmp_path, data_dir, *overrides, *change, f"ckpt_path={ckpt}"))
    assert {p: p.stat().st_mtime_ns for p in written} == written
