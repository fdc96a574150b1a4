"""apps/train.py, the Hydra app: every config composes, the pipeline runs end to end on a tiny
model (a classifier, and a causal LM: model=tiny_gpt2 data=tinyshakespeare, perplexity in
results.json, every metric scoring an LM), the export at the end of a run reloads with the trained
model's logits, and bad values fail with a message naming the field. (Multirun sweeps:
test_sweeps.py; start-time checks: test_preflight.py; the run dir: test_run_dir.py.)"""
import functools
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import yaml
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from omegaconf import OmegaConf
from transformers import AutoConfig, AutoModelForSequenceClassification

import headprune.apps.train as train_app
import headprune.runs.execute as execute
import headprune.runs.export as run_export
from headprune import HeadMask, head_layout, load_pruned
from headprune.apps.config_paths import config_dir
from headprune.apps.train import run
from headprune.data.language_model import TextLMDataModule
from headprune.heads.surgery import apply_layout
from headprune.lightning.module import HeadPruneModule
from headprune.models import load_tokenizer
from headprune.models.byte_tokenizer import ByteTokenizer
from headprune.recovery import RECOVERIES, Recovery
from headprune.selection.budgets import BUDGETS, Budget
from headprune.selection.layer_policies import LAYER_POLICIES, LayerPolicy
from headprune.selection.schedules import SCHEDULES, Schedule
from headprune.tasks import CAUSAL_LM
from tests.helpers import TINY_LM_MODEL, compose_train, tiny_batch, tiny_bert, train_cli

CONF = config_dir()
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir())
BUILT = {"schedule": Schedule, "metric": None, "layer_policy": LayerPolicy, "recovery": Recovery, "budget": Budget}
TYPED = {"schedule": SCHEDULES, "layer_policy": LAYER_POLICIES, "recovery": RECOVERIES, "budget": BUDGETS}


@functools.cache  # each worker imports this module: the lists and presets read the files once
def _options(group):
    # an experiment's arms (conf/experiment/<experiment>/arms.yaml) are not files: tests/test_arms.py
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@functools.cache
def _base(group, option):
    """The option another option presets (its `defaults` name a sibling file, as budget/kv67 names
    kv), else None."""
    # plain YAML through libyaml: each worker reads all ~150 option files at collection (OmegaConf.load: 0.6 s)
    text = (CONF / group / f"{option}.yaml").read_text()
    defaults = (yaml.load(text, Loader=yaml.CSafeLoader) or {}).get("defaults") or []
    names = [d.removeprefix(f"/{group}/") for d in defaults if isinstance(d, str)]
    siblings = [d for d in names if (CONF / group / f"{d}.yaml").is_file()]
    return siblings[0] if siblings else None


def _class_option(group, option):
    """The option whose class `group=option` builds: its own, or that of the option it presets."""
    base = _base(group, option)
    return option if base is None else _class_option(group, base)


def _combinations() -> list[dict[str, str]]:
    """Every option of every group once, an option of each group together in one config (the
    i-th option of each group with more than i), each experiment (`@package _global_`, it sets
    other groups) alone: 20 composes instead of one per option (~0.25 s each)."""
    groups = [g for g in GROUPS if g != "experiment" and _options(g)]
    width = max(len(_options(g)) for g in groups)
    together = [{g: _options(g)[i] for g in groups if i < len(_options(g))} for i in range(width)]
    return together + [{"experiment": o} for o in _options("experiment")]


COMBINATIONS = _combinations()


@pytest.fixture(scope="module")
def compose_once(train_config):
    """compose_once(*overrides): the train config with these overrides, composed once per test
    process (conftest.train_config: an experiment alone serves the compose test, the preset test, each
    of its arms and the other modules reading arms), read-only."""
    return train_config


@pytest.fixture(scope="module")
def composed(compose_once):
    """composed(group, option): the train config of the combination holding `group=option`."""
    def get(group, option):
        (i,) = [i for i, c in enumerate(COMBINATIONS) if c.get(group) == option]
        return compose_once(*(f"{g}={o}" for g, o in COMBINATIONS[i].items()))
    return get


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in _options(g)])
def test_every_config_composes(group, option, composed):
    cfg = composed(group, option)
    container = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    assert container["seed"] == 0
    for key, base in BUILT.items():  # every typed group builds, into an object of its kind
        built = instantiate(cfg[key])
        assert callable(built) if base is None else isinstance(built, base), (key, type(built))
    if group in BUILT and group != "metric":  # the option chosen is the class built
        assert type(instantiate(cfg[group])) is TYPED[group][_class_option(group, option)], (group, option)


PRESETS = [(g, o) for g in GROUPS for o in _options(g) if _base(g, o) is not None]


@pytest.fixture(scope="module")
def composed_alone(compose_once):
    """composed_alone("group=option"): the train config with that one override (compose_once: a
    base serves each of its presets; an experiment is composed alone once)."""
    return compose_once


@pytest.mark.parametrize("group,option", PRESETS)
def test_a_preset_composes_its_base_and_changes_only_what_it_sets(group, option, composed_alone):
    """A preset (budget=kv67: budget=kv at target 0.67) is its base option with its own keys set, so a
    change to the base reaches it: no copy of the base's other settings to drift."""
    def composed(o):  # an experiment is a global package: the whole config (its own keys are top-level)
        cfg = OmegaConf.to_container(composed_alone(f"{group}={o}"), resolve=False)
        return cfg if group == "experiment" else cfg[group]

    preset, base = composed(option), composed(_base(group, option))
    own = set(OmegaConf.load(CONF / group / f"{option}.yaml")) - {"defaults"}
    if group == "experiment":  # groups it overrides in its defaults are its own too (override /recovery: chain)
        own |= {str(k).removeprefix("override /").strip() for d in OmegaConf.load(CONF / group / f"{option}.yaml")
                .defaults if OmegaConf.is_dict(d) for k in d}
    assert set(base) <= set(preset) and {k for k in preset if preset[k] != base.get(k)} <= own, (group, option)


def _results(path):
    return json.loads((path / "results.json").read_text())


@pytest.mark.slow  # a training run: over ~2 s
def test_fast_dev_run_in_process(cfg_factory, tmp_path):
    cfg = cfg_factory("model=tiny_bert", "debug=fast", "data.max_train_samples=64", "data.score_samples=32")
    data = run(cfg)
    saved = _results(tmp_path)
    assert saved["model"] == {"layers": 3, "heads": 4}
    assert saved["rounds"][0]["round"] == 1 and saved["rounds"][0]["n_pruned"] == 1
    assert saved["final"]["val"] == data["final"]["val"]
    assert saved["config"]["model"]["config_overrides"]["num_hidden_layers"] == 3


@pytest.mark.slow  # a training run: over ~2 s
def test_tiny_iterative_run_writes_every_round(cfg_factory, tmp_path):
    cfg = cfg_factory("model=tiny_bert", "callbacks=none", "logger=csv", "data.max_train_samples=64",
                      "data.score_samples=32", "data.max_validation_samples=64", "schedule.target_sparsity=0.5",
                      "schedule.step=0.25", "schedule.baseline_epochs=1", "schedule.epochs_per_round=1",
                      "layer_policy=uniform")
    run(cfg)
    res = _results(tmp_path)
    assert [r["round"] for r in res["rounds"]] == [1, 2]
    assert [r["sparsity"] for r in res["rounds"]] == [0.25, 0.5]
    assert res["rounds"][0]["heads_per_layer"] == [3, 3, 3]
    assert res["final"]["heads_per_layer"] == [2, 2, 2]
    assert len(res["final"]["pruned"]) == 6
    all_round_heads = [tuple(h) for r in res["rounds"] for h in r["pruned"]]
    assert sorted(all_round_heads) == sorted(tuple(h) for h in res["final"]["pruned"])
    for r in res["rounds"]:
        assert set(r["val"]) == {"acc", "loss"} and 0 <= r["val"]["acc"] <= 1
    assert (tmp_path / "head_mask.png").is_file()
    assert list(tmp_path.glob("csv/*/metrics.csv"))


def test_no_training_prunes_model_as_given(cfg_factory, tmp_path):
    cfg = cfg_factory("model=tiny_bert", "schedule=one_shot", "schedule.baseline_epochs=0",
                      "schedule.epochs_per_round=0", "schedule.target_sparsity=0.5", "logger=none",
                      "callbacks=none", "data.max_train_samples=8", "data.score_samples=16",
                      "data.max_validation_samples=32")
    res = run(cfg)
    assert len(res["rounds"]) == 1 and res["final"]["sparsity"] == 0.5
    assert res["rounds"][0]["val"] == res["rounds"][0]["val_before_finetune"]


@pytest.mark.parametrize("override,error,pattern", [
    ("schedule.target_sparsity=1.2", ValueError, r"schedule\.target_sparsity=1\.2 is outside \[0, 1\)"),
    ("schedule.target_sparsity=-0.1", ValueError, r"schedule\.target_sparsity=-0\.1 is outside \[0, 1\)"),
    ("data.label_column=gold", ValueError, r"data\.label_column='gold' is not a column of the file"),
    ("data.train_file=missing.tsv", FileNotFoundError, r"data\.train_file: file .*missing\.tsv' does not exist"),
    ("model.pretrained=/nonexistent/model", FileNotFoundError, r"model\.pretrained='/nonexistent/model': no such folder"),
])
def test_bad_values_name_the_field(override, error, pattern, cfg_factory, tmp_path):
    cfg = cfg_factory("model=tiny_bert", "debug=fast", override)
    with pytest.raises(error, match=pattern) as info:
        run(cfg)
    assert type(info.value) is error
    assert not (tmp_path / "results.json").exists()


def test_an_empty_model_folder_is_named(cfg_factory, tmp_path):
    (tmp_path / "empty").mkdir()
    cfg = cfg_factory("model=tiny_bert", "debug=fast", f"model.pretrained={tmp_path / 'empty'}")
    with pytest.raises(FileNotFoundError, match=r"model\.pretrained=.*empty': the folder holds no tokenizer"):
        run(cfg)


@pytest.mark.slow  # a training run: over ~2 s
def test_label_mapping_in_results_and_in_the_exported_config(cfg_factory, tmp_path, data_dir):
    cfg = cfg_factory("model=tiny_bert", "debug=fast", "data.max_train_samples=32", "data.score_samples=16")
    res = run(cfg)
    assert res["labels"] == {"label2id": {"0": 0, "1": 1}, "id2label": {"0": "0", "1": "1"}}
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert exported["id2label"] == {"0": "0", "1": "1"} and exported["label2id"] == {"0": 0, "1": 1}


@pytest.mark.slow  # a training run: over ~2 s
def test_until_threshold_decides_on_a_held_out_selection_slice(cfg_factory, tmp_path):
    cfg = cfg_factory(*TINY_RUN, "schedule=until_threshold", "schedule.threshold=1.5", "schedule.step=0.25",
                      "schedule.select_samples=24")
    res = run(cfg)
    assert set(res["baseline"]["selection"]) == {"acc", "loss"} and "selection" in res["rounds"][0]
    assert res["final"]["stop_reason"].startswith("threshold: selection-slice acc")
    assert "24 training examples" in res["stop_rule_reads"]


@pytest.mark.parametrize("override,group", [("metric=nope", "metric"), ("layer_policy=unifrom", "layer_policy")])
def test_unknown_group_option_lists_choices(override, group, cfg_factory):
    with pytest.raises(ConfigCompositionException, match=rf"(?s){group}.*Available options.*"):
        cfg_factory(override)


@pytest.mark.slow
def test_console_script_fast_dev_run(tmp_path, data_dir):
    env = dict(os.environ, HEADPRUNE_DATA_DIR=str(data_dir), HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "headprune.apps.train", "model=tiny_bert", "debug=fast", "data.max_train_samples=32",
           "data.score_samples=16", f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _results(tmp_path)["final"]["rounds_completed"] == 1


# Without the end-of-run diagnostics (7 heatmaps, about a third of such a run; test_diagnostics.py has them).
TINY_RUN = ["model=tiny_bert", "callbacks=none", "logger=none", "data.max_train_samples=64", "data.score_samples=32",
            "data.max_validation_samples=64", "trainer.num_sanity_val_steps=0", "diagnostics.enabled=false"]


@pytest.mark.parametrize("policy", ["global", "uniform", "sensitivity", "depth_prior"])
@pytest.mark.slow  # a training run: over ~2 s
def test_tiny_run_per_layer_policy(policy, cfg_factory, tmp_path):
    extra = ["layer_policy.protect_last=0"] if policy == "depth_prior" else []
    cfg = cfg_factory(*TINY_RUN, f"layer_policy={policy}", *extra, "schedule=iterative", "schedule.target_sparsity=0.5",
                      "schedule.step=0.25", "schedule.epochs_per_round=0", "schedule.baseline_epochs=1")
    run(cfg)
    res = _results(tmp_path)
    assert [r["n_pruned"] for r in res["rounds"]] == [3, 3]
    assert res["final"]["sparsity"] == 0.5 and res["final"]["stop_reason"] == "target_reached"
    assert min(res["final"]["heads_per_layer"]) >= 1
    if policy == "depth_prior":  # the first layer is protected: layers 1 and 2 lose all 6
        assert res["final"]["heads_per_layer"] == [4, 1, 1]
    if policy == "uniform":
        assert res["final"]["heads_per_layer"] == [2, 2, 2]
    if policy == "sensitivity":
        assert len(res["layer_sensitivity"]["loss_rise"]) == 3
        assert (tmp_path / "layer_sensitivity.png").is_file()


@pytest.mark.parametrize("schedule,extra,expect", [
    ("one_shot", [], {"rounds": 1}),
    ("iterative", ["schedule.step=0.25", "schedule.recover_epochs=1", "schedule.reset_optimizer_state=true"],
     {"rounds": 2}),
    ("cubic", ["schedule.rounds=3"], {"rounds": 3}),
    ("until_threshold", ["schedule.threshold=1.5", "schedule.step=0.25"], {"rounds": 1, "stopped": True}),
])
@pytest.mark.slow  # a training run: over ~2 s
def test_tiny_run_per_schedule(schedule, extra, expect, cfg_factory, tmp_path):
    cfg = cfg_factory(*TINY_RUN, f"schedule={schedule}", "schedule.target_sparsity=0.5", *extra)
    run(cfg)
    res = _results(tmp_path)
    assert len(res["rounds"]) == expect["rounds"]
    if expect.get("stopped"):
        assert res["final"]["stop_reason"].startswith("threshold")
        assert res["rounds"][0]["rejected"] is True
        assert res["final"]["sparsity"] == 0.0  # the last good mask (unpruned) was restored
    else:
        assert res["final"]["stop_reason"] == "target_reached" and res["final"]["sparsity"] == 0.5
    metrics = list((tmp_path / "csv").glob("*/metrics.csv")) if (tmp_path / "csv").exists() else []
    assert metrics == []  # logger=none


@pytest.mark.slow  # a training run: over ~2 s
def test_budget_shortfall_is_explained(cfg_factory, tmp_path, caplog):
    cfg = cfg_factory(*TINY_RUN, "schedule=one_shot", "schedule.target_sparsity=0.9", "schedule.epochs_per_round=0",
                      "layer_policy.min_heads_per_layer=2")
    run(cfg)
    res = _results(tmp_path)
    (round1,) = res["rounds"]
    assert round1["n_requested"] == 11 and round1["n_pruned"] == 6
    assert "min_heads_per_layer=2" in round1["shortfall"]
    assert any("pruning 6 heads instead" in r.getMessage() for r in caplog.records)
    assert res["final"]["stop_reason"] == "constrained: the layer policy's limits let 6 of the 11 heads the target asks for go"


@pytest.mark.slow  # Hydra's help composes every group: ~4 s
def test_help_lists_group_choices():
    proc = train_cli("--help")
    assert proc.returncode == 0
    for line in ("layer_policy: attention_drop, depth_prior, global, measured, sensitivity, uniform",
                 "schedule: cubic, iterative, one_shot, until_threshold", "model: bert_base, gemma3_270m, minilm, qwen25_coder_1p5b, smollm2, tiny_bert, tiny_gpt2"):
        assert line in proc.stdout


@pytest.mark.parametrize("override,pattern", [
    ("schedule.stpe=0.2", r"Key 'stpe' not in"),
    ("schedule.step=abc", r"could not be converted to Float"),
    ("layer_policy.min_heads=2", r"Key 'min_heads' not in"),
])
def test_typos_fail_at_compose(override, pattern, cfg_factory):
    with pytest.raises(ConfigCompositionException) as info:
        cfg_factory(override)
    text = str(info.value) + str(info.value.__cause__)
    import re
    assert re.search(pattern, text), text


@pytest.mark.parametrize("override,pattern", [
    ("schedule.step=0", r"schedule\.step=0"),
    ("schedule.target_sparsity=1.0", r"schedule\.target_sparsity=1\.0"),
])
def test_bad_schedule_values_fail_at_start(override, pattern, cfg_factory):
    from hydra.errors import InstantiationException

    cfg = cfg_factory(override)
    with pytest.raises(InstantiationException, match=pattern) as info:
        instantiate(cfg.schedule)
    assert isinstance(info.value.__cause__, ValueError)


@pytest.mark.parametrize("name", ["michel2019_bert_sst2", "michel2019_bert_mnli"])
@pytest.mark.slow  # a training run: over ~2 s
def test_michel2019_configs_smoke(name, cfg_factory, tmp_path, data_dir):
    """The GPU + hub experiments, run here as a fast_dev_run on the tiny model and local SST-2."""
    cfg = cfg_factory(f"experiment={name}", "model=tiny_bert", "trainer=default", "data=sst2",
                      f"data.data_dir={data_dir}", "debug=fast", "data.max_train_samples=32", "data.score_samples=16",
                      "schedule.baseline_epochs=1")  # fast_dev_run trains one epoch
    assert cfg.schedule.target_sparsity == 0.9 and cfg.schedule.epochs_per_round == 0
    res = run(cfg)
    assert res["final"]["rounds_completed"] == 9


@pytest.mark.parametrize("name,extra", [
    ("quickstart", ["schedule.epochs_per_round=0"]),  # every round in fast_dev_run's one epoch
    ("iterative_vs_one_shot", ["schedule.epochs_per_round=0"]),
    ("iterative_vs_one_shot", ["schedule=one_shot", "schedule.epochs_per_round=2"]),
    ("sst2_finetune", []),
    ("metric_curves", ["model.pretrained=sentence-transformers/all-MiniLM-L6-v2", "metric=entropy"]),
    ("layer_sensitivity", ["model.pretrained=sentence-transformers/all-MiniLM-L6-v2", "layer_policy=sensitivity"]),
])
@pytest.mark.slow  # a training run: over ~2 s
def test_minilm_experiments_smoke(name, extra, cfg_factory):
    """The MiniLM experiments' configs, run as a fast_dev_run on the tiny model."""
    cfg = cfg_factory(f"experiment={name}", "model=tiny_bert", "debug=fast", "data.max_train_samples=32",
                      "data.score_samples=16", "data.max_validation_samples=32", "schedule.baseline_epochs=0",
                      *extra)  # fast_dev_run trains a single epoch: prune before it
    res = run(cfg)
    target = cfg.schedule.target_sparsity
    assert res["final"]["sparsity"] == pytest.approx(min(round(target * 12), 9) / 12)  # >= 1 head per layer
    removed = []  # each round's record follows from the heads removed so far
    for r in res["rounds"]:
        removed += [tuple(h) for h in r["pruned"]]
        assert r["n_pruned"] == len(r["pruned"]) and len(set(removed)) == len(removed)  # no head twice
        assert sum(r["heads_per_layer"]) == 12 - len(removed) and r["sparsity"] == pytest.approx(len(removed) / 12)
        assert math.isfinite(r["val"]["loss"]) and r["val"]["loss"] > 0
    assert sorted(removed) == sorted(tuple(h) for h in res["final"]["pruned"])
    assert res["final"]["heads_per_layer"] == (res["rounds"][-1]["heads_per_layer"] if res["rounds"] else [4, 4, 4])


@pytest.mark.slow  # two runs, 7 s of CPU
def test_l0_gates_learned_in_finetune_from_the_metric_config(cfg_factory, tmp_path):
    """metric=l0_gates metric.finetune=true: one place (the metric config) sets the penalty and the
    gates' learning rate, the module learns the gates with the model, and the export folds them."""
    cfg = cfg_factory(*TINY_RUN, "metric=l0_gates", "metric.finetune=true", "metric.penalty=0.05",
                      "schedule=one_shot", "schedule.target_sparsity=0.25")
    res = run(cfg)
    assert "l0_gates_folded" in res["final"]
    cfg = cfg_factory(*TINY_RUN, "metric=l0_gates", "schedule=one_shot", "schedule.target_sparsity=0.25",
                      "overwrite=true")
    assert "l0_gates_folded" not in run(cfg)["final"]  # frozen-model gates: trained and removed at scoring time


# -- the export at the end of a run --------------------------------------------------------------
@torch.no_grad()
def logits(model, batch: dict) -> torch.Tensor:
    return model(**{k: v for k, v in batch.items() if k != "labels"}).logits


@pytest.fixture
def train_cfg(cfg_factory):
    return cfg_factory("model=tiny_bert", "debug=fast", "data.max_train_samples=64", "data.score_samples=32",
                       "schedule.step=0.25")


@pytest.mark.slow  # a training run: over ~2 s
def test_train_run_exports_the_pruned_model(train_cfg, tmp_path, tokenizer, monkeypatch):
    seen = {}
    export = execute.export_pruned

    def spy(module, *args, **kwargs):  # the trained model as evaluated, just before the export
        seen["state"] = {k: v.detach().clone() for k, v in module.model.state_dict().items()}
        seen["mask"] = module.head_mask.mask.clone()
        seen["layout"] = head_layout(module.model)  # heads already removed during fit (pruning.physical)
        export(module, *args, **kwargs)

    monkeypatch.setattr(execute, "export_pruned", spy)
    assert train_cfg.export is True  # the default; `export=false` skips it
    res = train_app.run(train_cfg)
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


def test_export_folds_learned_l0_gates(tmp_path, tokenizer):
    """The exported model computes what the gated model evaluated: closed gates removed, open
    ones scaled into the output projection."""
    from headprune.results import RunResults

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
    run_export.export_pruned(module, tmp_path / "export", results, baseline_params={})
    assert results.data["final"]["l0_gates_folded"] == {"closed_heads": 2, "heads_per_layer": [3, 3, 3]}
    reloaded = load_pruned(tmp_path / "export").eval()
    with torch.no_grad():
        assert torch.allclose(reloaded(**batch).logits, evaluated, atol=1e-5)


# -- a causal LM (model=tiny_gpt2 data=tinyshakespeare) -----------------------------------------
TINY_GPT2 = [*TINY_LM_MODEL, "+model.config_overrides.n_positions=64", "data.block_size=32", "data.max_train_samples=48", "data.score_samples=16", "data.max_validation_samples=16",
             "data.batch_size=8", "data.eval_batch_size=8", "logger=none", "callbacks=none",
             "trainer.num_sanity_val_steps=0"]


@pytest.mark.slow  # a training run: over ~2 s
def test_fast_dev_run_reports_perplexity(cfg_factory, tmp_path):
    run(cfg_factory(*TINY_GPT2, "debug=fast"))
    res = _results(tmp_path)
    assert res["model"] == {"layers": 2, "heads": 4}
    for val in (res["baseline"]["val"], res["rounds"][0]["val"], res["final"]["val"]):
        assert set(val) == {"loss", "ppl"} and val["ppl"] == pytest.approx(math.exp(val["loss"]))
    assert res["baseline"]["val"]["ppl"] > 50  # random init over 258 tokens
    assert res["final"]["params"]["total"] < res["baseline"]["params"]["total"]


@pytest.mark.slow  # a training run: over ~2 s
def test_pruned_export_reloads_with_the_trained_models_logits(cfg_factory, tmp_path, monkeypatch):
    saved, save_pruned = {}, run_export.save_pruned

    def keep_model(model, directory, **kwargs):  # the trained model, pruned in place
        saved["model"] = model
        return save_pruned(model, directory, **kwargs)

    monkeypatch.setattr(run_export, "save_pruned", keep_model)
    run(cfg_factory(*TINY_GPT2, "schedule=iterative", "schedule.target_sparsity=0.5", "schedule.step=0.25",
                    "schedule.baseline_epochs=1", "schedule.epochs_per_round=1", "optim.optimizer.lr=1e-3"))
    res = _results(tmp_path)
    assert [r["sparsity"] for r in res["rounds"]] == [0.25, 0.5] and res["final"]["stop_reason"] == "target_reached"
    assert res["final"]["val"]["ppl"] < res["baseline"]["val"]["ppl"] * 2

    export = tmp_path / "export"
    loaded = load_pruned(export).eval()
    assert [len(kept) for kept in head_layout(loaded)] == res["final"]["heads_per_layer"]
    assert isinstance(load_tokenizer(str(export)), ByteTokenizer)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    trained = saved["model"].eval()
    with torch.no_grad():
        assert torch.equal(trained(input_ids=ids).logits, loaded(input_ids=ids).logits)
    dm = TextLMDataModule(ByteTokenizer(), file="tinyshakespeare/input.txt", data_dir=res["config"]["data"]["data_dir"],
                          block_size=32, score_samples=16, max_validation_samples=16, eval_batch_size=8)
    dm.setup()
    assert CAUSAL_LM.evaluate(loaded, dm.val_dataloader())["ppl"] == pytest.approx(res["final"]["val"]["ppl"], rel=1e-5)


@pytest.mark.parametrize("metric", ["taylor", "fisher", "lrp", "entropy", "confidence", "magnitude", "l0_gates"])
def test_every_metric_scores_a_causal_lm(metric, cfg_factory, tmp_path):
    extra = ["metric.steps=2"] if metric == "l0_gates" else []
    res = run(cfg_factory(*TINY_GPT2, f"metric={metric}", *extra, "schedule=one_shot", "schedule.target_sparsity=0.5",
                          "schedule.baseline_epochs=0", "schedule.epochs_per_round=0", "export=false",
                          "diagnostics.enabled=false"))
    (round1,) = res["rounds"]
    scores = torch.tensor(round1["scores"])
    assert scores.shape == (2, 4) and torch.isfinite(scores).all()
    assert round1["n_pruned"] == 4 and set(round1["val"]) == {"loss", "ppl"}


@pytest.mark.parametrize("overrides,pattern", [
    (["schedule=until_threshold"], r"schedule\.metric='acc' is not reported by a model\.task=causal_lm run "
                                   r"\(its validation metrics: loss, ppl\)"),
    (["data=sst2"], r"model\.task=causal_lm does not fit data=sst2.*allowed: model\.task=classification"),
    (["data.block_size=128"], r"data\.block_size=128 exceeds the model's 64 positions"),
    (["model.random_init=false"], r"model\.pretrained='byte-gpt2' is a built-in config without weights"),
])
def test_bad_causal_lm_settings_name_the_field(overrides, pattern, cfg_factory):
    other_data = overrides[0].startswith("data=")
    base = [o for o in TINY_GPT2 if not (other_data and o.startswith("data"))]
    with pytest.raises(ValueError, match=pattern):
        run(cfg_factory(*base, "debug=fast", *overrides))
