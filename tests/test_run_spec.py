"""runs/spec.py: the typed run spec, built once from the composed config at the app's entry
(`RunSpec.from_config`), checked there (a bad field refused naming it and what is allowed, before
any work), and `headprune.runs.run(spec)`, the Python API, running a spec written without Hydra as
`headprune-train` runs the same settings."""
import json
from functools import partial
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from headprune.apps.config_schema import register_schemas
from headprune.data.language_model import TextLMDataModule
from headprune.models.build import build_model
from headprune.recovery.none import NoRecovery
from headprune.runs import DataSpec, DiagnosticsSpec, ModelSpec, OutputSpec, PruningSpec, RunSpec, run
from headprune.runs.spec import TrainerSpec
from headprune.scoring import get_metric
from headprune.selection.schedules import OneShot
from tests.helpers import TINY_LM_MODEL, compose_train

register_schemas()


@pytest.mark.parametrize("experiment", ["quickstart", "retraining_free", "llm_kv", "llm_iterative", "decoder_kv",
                                        "layer_sensitivity", "michel2019_bert_sst2"])
def test_from_config_reads_every_part_of_an_experiment(experiment, train_config):
    cfg = train_config(f"experiment={experiment}")  # read-only, composed once per process (conftest)
    spec = RunSpec.from_config(cfg)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    assert spec.record() == resolved  # results.json `config`, the resume's comparison, the loggers' hyperparameters
    assert spec.output == OutputSpec(Path(resolved["paths"]["output_dir"]), resolved["ckpt_path"],
                                     resolved["overwrite"], resolved["export"])
    assert spec.pruning == PruningSpec(**resolved["pruning"])
    assert spec.model.pretrained == resolved["model"]["pretrained"] and spec.task.name == resolved["model"]["task"]
    assert spec.model.random_init == resolved["model"]["random_init"]
    for name in ("name", "data_dir", "block_size", "score_samples", "max_train_samples"):
        assert getattr(spec.data, name) == resolved["data"].get(name), name
    diagnostics = resolved["diagnostics"]
    assert spec.diagnostics.options() == (None if not diagnostics["enabled"] else
                                          {k: v for k, v in diagnostics.items() if k != "enabled"})
    assert spec.evaluation.enabled == resolved["evaluation"]["enabled"]
    assert spec.objectives == tuple(resolved["objectives"]) and spec.seed == resolved["seed"]
    assert type(spec.schedule).__name__.lower().replace("_", "") in resolved["schedule"]["_target_"].lower()
    assert spec.metric.func.__name__ == resolved["metric"]["_target_"].rsplit(".", 1)[1]
    assert spec.trainer.settings == resolved["trainer"]
    assert spec.trains == (spec.schedule.total_epochs() > 0)


@pytest.mark.parametrize("override, pattern", [
    ("pruning.dense_device=gpu", r"pruning.dense_device='gpu' is not allowed; allowed: run .*cpu"),
    ("pruning.physical=yes", r"pruning.physical='yes' is not allowed; allowed: true or false"),
    ("+pruning.dense=cpu", r"pruning.dense is not a setting of pruning; allowed: physical, rearrange, dense_device, "
                           r"model_device"),
    ("++pruning.model_device=gpu", r"pruning.model_device='gpu' is not allowed; allowed: run .*cpu"),
    ("++pruning.model_device=cpu", r"pruning.model_device=cpu streams the pruned model's blocks, which only runs without "
                                  r"training, but the schedule .* trains the model"),
    ("diagnostics.metrics=[nope]", r"diagnostics.metrics=\['nope'\] has unknown names .*allowed: .*taylor"),
    ("diagnostics.special_threshold=2", r"diagnostics.special_threshold=2 must be in \[0, 1\]"),
    ("+trainer.max_epochs=3", r"trainer.max_epochs=3 is not allowed: the schedule sets the number of epochs"),
    ("objectives=[val_ppl]", r"objectives: val_ppl is not reported by a model.task=classification run"),
    ("model.task=causal_lm", r"model.task=causal_lm does not fit data=sst2, which holds classification data; "
                             r"allowed: model.task=classification"),
    ("model.task=regression", r"model.task='regression' is not allowed; allowed: classification, causal_lm"),
    ("overwrite=maybe", r"overwrite='maybe' is not allowed; allowed: true or false"),
    ("seed=0.5", r"seed=0.5 is not allowed; allowed: an integer"),
    ("+evaluation.perplexity_seq=[4096]", r"evaluation.perplexity_seq is not a setting of evaluation; allowed: "
                                          r"enabled, .*perplexity_seqs"),
])
def test_a_bad_field_is_refused_when_the_spec_is_built(override, pattern, tmp_path, data_dir):
    """Refused by RunSpec.from_config itself, naming the field and what is allowed: nothing loaded,
    nothing written."""
    cfg = compose_train(tmp_path / "run", data_dir, "model=tiny_bert", override)
    with pytest.raises(ValueError, match=pattern):
        RunSpec.from_config(cfg)
    assert not (tmp_path / "run").exists()


def test_a_spec_written_in_python_is_checked_too():
    data = DataSpec(load=dict, task="causal_lm", score_samples=0)
    model = ModelSpec("byte-gpt2", task="causal_lm", random_init=True)
    with pytest.raises(ValueError, match=r"data.score_samples=0 leaves no held-out examples"):
        RunSpec(OutputSpec("out"), model, data, get_metric("magnitude"), OneShot(target_sparsity=0.5))
    with pytest.raises(ValueError, match=r"trainer.max_steps=10 is not allowed"):
        TrainerSpec(settings={"max_steps": 10})
    with pytest.raises(ValueError, match=r"diagnostics.duplicate_threshold=-1 must be in \[0, 1\]"):
        DiagnosticsSpec(duplicate_threshold=-1)


LM = dict(block_size=64, score_samples=8, max_train_samples=0, max_validation_samples=4)


def test_the_python_api_runs_a_spec_as_the_app_runs_its_config(tmp_path, data_dir):
    """`headprune.runs.run(spec)` with a spec built in Python (no Hydra, no config files): the tiny
    GPT-2 of the LM tests pruned one-shot to half its heads by magnitude, no recovery, exported. The
    app given the same settings as overrides prunes the same heads to the same validation."""
    overrides = {"n_layer": 2, "n_head": 4, "n_embd": 32}
    spec = RunSpec(
        output=OutputSpec(tmp_path / "api"),
        model=ModelSpec("byte-gpt2", task="causal_lm", random_init=True,
                        load=partial(build_model, "byte-gpt2", task="causal_lm", random_init=True,
                                     config_overrides=overrides, seed=0)),
        data=DataSpec(load=partial(TextLMDataModule, file="tinyshakespeare/input.txt", data_dir=str(data_dir),
                                   name="tinyshakespeare", seed=0, **LM),
                      task="causal_lm", name="tinyshakespeare", data_dir=str(data_dir), block_size=64,
                      score_samples=8, max_train_samples=0),
        metric=get_metric("magnitude"), schedule=OneShot(target_sparsity=0.5, baseline_epochs=0, epochs_per_round=0),
        recovery=NoRecovery(), diagnostics=DiagnosticsSpec(enabled=False))
    api = run(spec)
    saved = json.loads((tmp_path / "api" / "results.json").read_text())
    assert saved["final"] == api["final"] and api["final"]["sparsity"] == 0.5
    assert (tmp_path / "api" / "export" / "config.json").is_file()
    assert saved["config"]["model"] == {"pretrained": "byte-gpt2", "task": "causal_lm", "random_init": True}

    app = __import__("headprune.apps.train", fromlist=["run"]).run(compose_train(
        tmp_path / "app", data_dir, *TINY_LM_MODEL, *(f"data.{k}={v}" for k, v in LM.items()), "metric=magnitude",
        "schedule=one_shot", "schedule.target_sparsity=0.5", "schedule.baseline_epochs=0",
        "schedule.epochs_per_round=0", "recovery=none", "logger=none", "callbacks=none", "diagnostics.enabled=false"))
    assert app["final"]["pruned"] == api["final"]["pruned"]
    assert app["final"]["val"] == pytest.approx(api["final"]["val"], rel=1e-6)
    assert app["baseline"]["val"] == pytest.approx(api["baseline"]["val"], rel=1e-6)


def test_pruning_model_device_reaches_the_pruner_and_the_placement(tmp_path, data_dir):
    """`pruning.model_device=cpu` (a run without training): the spec hands it to the run's
    placement and its Pruner, whose results.json `model_device` block says where the blocks lived."""
    from headprune.apps.train import run as app_run

    res = app_run(compose_train(
        tmp_path, data_dir, *TINY_LM_MODEL, *(f"data.{k}={v}" for k, v in LM.items()), "metric=magnitude",
        "schedule=one_shot", "schedule.target_sparsity=0.5", "schedule.baseline_epochs=0", "schedule.epochs_per_round=0",
        "recovery=none", "logger=none", "callbacks=none", "diagnostics.enabled=false", "export=false",
        "++pruning.model_device=cpu"))
    assert res["model_device"]["where"] == "cpu" and res["config"]["pruning"]["model_device"] == "cpu"
