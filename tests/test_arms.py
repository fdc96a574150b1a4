"""The experiments' arms files (conf/experiment/<experiment>/arms.yaml, apps/arms.py): every arm is a
config Hydra serves as experiment=<experiment>/<arm>, equal to the base experiment plus the arm's
overrides typed on the command line; grids multiply out; a malformed file is refused naming the file
and the entry."""
import pytest
from hydra.errors import HydraException

from headprune.apps import arms

ALL = [(e, a) for e in arms.experiments_with_arms() for a in arms.arms(e)]


def test_every_experiment_with_arms_keeps_its_arms():
    counts = {e: len(arms.arms(e)) for e in arms.experiments_with_arms()}
    assert counts == {"llm_calibration": 12, "llm_iterative": 4, "llm_kv": 19, "llm_kv_modes": 40,
                      "llm_uneven": 12, "recovery": 6, "retraining_free": 7}, counts


def test_a_grid_is_the_product_of_its_levels_named_in_axis_order():
    names = list(arms.arms("llm_calibration"))
    assert len(names) == 2 * 2 * 3 and names[0] == "uniform_refit_corpus" and names[-1] == "attention_drop_ls_mix"
    assert arms.arms("llm_calibration")["attention_drop_ls_self"]["overrides"] == [
        "budget.target=0.67", "evaluation.zero_shot_tasks=[]", "evaluation.generate=false",
        "layer_policy=attention_drop", "pruning.rearrange=false", "recovery=least_squares", "data.calibration=self"]
    assert {"uniform", "uniform_refit", "uniform_refit_kl"} <= set(arms.arms("llm_uneven"))  # a level named ""


def test_like_starts_from_the_other_arms_overrides():
    entries = arms.arms("llm_kv_modes")
    kl = entries["measured_kl"]["overrides"]
    assert entries["retrieval_33_kl"]["overrides"][:len(kl)] == kl
    assert entries["retrieval_33_kl"]["overrides"][len(kl):] == [
        "kv_modes.layout=experiments/llm_kv_modes/results/retrieval_33.json", "budget.target=0.67"]


@pytest.mark.slow
@pytest.mark.parametrize("experiment,arm", ALL)
def test_an_arm_is_its_overrides_on_the_command_line(experiment, arm, train_config):
    """`experiment=E/A` composes what `python -m headprune.apps.arms E A` prints, typed after
    headprune-train: the arms file's overrides are the arm, nothing hidden."""
    from omegaconf import OmegaConf

    as_config = OmegaConf.to_container(train_config(f"experiment={experiment}/{arm}"))
    spelled = OmegaConf.to_container(train_config(*arms.command(experiment, arm)))
    assert as_config == spelled


def test_hydra_refuses_an_unknown_arm_naming_the_file_and_the_arms(train_config):
    with pytest.raises(HydraException) as err:
        train_config("experiment=llm_kv_modes/no_such_arm")
    assert "llm_kv_modes/arms.yaml: no arm 'no_such_arm'; allowed: attention_mass" in str(err.value)
    assert "retrieval_85" in str(err.value)


def write(tmp_path, experiment, text):
    folder = tmp_path / "experiment" / experiment
    folder.mkdir(parents=True)
    (folder / "arms.yaml").write_text(text)
    return folder / "arms.yaml"


@pytest.mark.parametrize("text,named", [
    ("arms:\n  a: {overrides: [budget.target]}\n", "arms.a.overrides: 'budget.target' is not an override"),
    ("arms:\n  a: {like: b}\n", "arms.a.like: 'b' is not an arm; allowed: a"),
    ("arms:\n  a: {like: b}\n  b: {like: a}\n", "a cycle"),
    ("arms:\n  a: {overrides: [x=1], seed: 3}\n", "arms.a: a mapping with keys ['about', 'like', 'overrides']"),
    ("arm:\n  a: {}\n", "top-level keys allowed"),
    ("arms:\n  Big: {}\n", "arm name 'Big'"),
    ("arms:\n  a_b: {}\ngrid:\n  x: {a: {}}\n  y: {b: {}}\n", "grid arm a_b is also an entry of `arms`"),
])
def test_a_malformed_arms_file_is_refused_naming_the_file_and_entry(tmp_path, text, named):
    path = write(tmp_path, "toy", text)
    with pytest.raises(arms.ArmsError) as err:
        arms.arms("toy", tmp_path)
    assert str(path) in str(err.value) and named in str(err.value), str(err.value)


def test_an_unknown_arm_is_refused_naming_the_allowed(tmp_path):
    write(tmp_path, "toy", "base: /experiment/llm_kv\narms:\n  a: {overrides: [kv_modes=given, budget.target=0.5]}\n")
    (tmp_path / "kv_modes").mkdir()  # a config group: kv_modes=given picks its option
    assert arms.arm_config("toy", "a", tmp_path) == {
        "defaults": ["/experiment/llm_kv", {"override /kv_modes": "given"}, "_self_"], "budget": {"target": 0.5}}
    with pytest.raises(arms.ArmsError, match="no arm 'b'; allowed: a"):
        arms.arm_config("toy", "b", tmp_path)


def test_the_command_line_lists_and_spells_out_arms(capsys):
    assert arms.main(["recovery"]) == 0
    assert capsys.readouterr().out.split() == list(arms.arms("recovery"))
    assert arms.main(["llm_kv_modes", "retrieval_85"]) == 0
    assert capsys.readouterr().out.strip() == "experiment=llm_kv_modes kv_modes=retrieval budget.target=0.15"
    assert arms.main(["llm_kv_modes", "nope"]) == 2 and "allowed: attention_mass" in capsys.readouterr().err
    assert arms.main(["quickstart"]) == 2 and "experiments with arms: llm_calibration" in capsys.readouterr().err
