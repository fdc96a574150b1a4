"""The arms of experiments/llm_uneven, llm_calibration and llm_iterative are grids in their arms files,
conf/experiment/<experiment>/arms.yaml (served as experiment=<experiment>/<arm> by apps/arms.py), and each composes to the settings its committed raw results
ran with: the `config` block of every results.json of that arm (the run dir's paths and run.sh's
per-run choices aside). An arm, or a default under it, that drifts from what a committed result
recorded fails here, so the tables stay what `headprune-train experiment=<experiment>/<arm>` gives.
Each run.sh runs these configs (experiment=<experiment>/$arm), with no arrays of overrides of its own."""
import json
import re

import pytest
from omegaconf import OmegaConf

from headprune.apps import arms as arms_files
from tests.helpers import EXPERIMENTS

EXPERIMENTS_WITH_ARMS = ("llm_uneven", "llm_calibration", "llm_iterative")
# llm_uneven runs each arm at two budgets, the run dir <arm>_<budget> (run.sh's BUDGET); the others
# have one run per arm, the run dir <arm>
BUDGETS = {"llm_uneven": {"kv67": 0.67, "kv34": 0.34}}
# what is not an arm's setting: where its run wrote and read, and run.sh's choices per run (the
# dense model evaluated in the first run only; overwrite=true or ckpt_path=<dir>/recovery/last.ckpt
# to resume); the budget is compared with the run dir's tag instead
PER_RUN = re.compile(r"^(paths\.|logger\.\w+\.save_dir$|trainer\.default_root_dir$|data\.data_dir$|overwrite$|"
                     r"ckpt_path$|evaluation\.dense$)")
# arms whose run is recorded in another experiment's raw file (collect.py reads it from there), with
# the keys where that run differs from the arm, and why
ELSEWHERE = {
    ("llm_uneven", "uniform"): [("llm_kv/results/fisher_re_bias_kv67.json", 0.67, {
        "evaluation.zero_shot_tasks": "llm_kv's run had zero-shot SST-2 and answers on; llm_uneven's bias arms perplexity only",
        "evaluation.generate": "the same",
        "optim.scheduler._target_": "headprune.lightning.lr_schedules moved to headprune.lr_schedules since (the same "
                                    "function; nothing trains in this arm)"})],
    ("llm_uneven", "uniform_refit"): [("llm_kv/results/fisher_re_refit_kv67.json", 0.67, {
        "evaluation.zero_shot_tasks": "llm_kv's run predates the last-word task",
        "optim.scheduler._target_": "moved module, the same function; nothing trains in this arm"})],
    ("llm_uneven", "uniform_refit_kl"): [("llm_kv/results/fisher_re_refit_kl_kv67.json", 0.67, {}),
                                         ("llm_kv/results/fisher_re_refit_kl_kv34.json", 0.34, {})],
    ("llm_calibration", "attention_drop_refit_corpus"): [("llm_uneven/results/attention_drop_refit_kv67.json", 0.67, {
        "evaluation.zero_shot_tasks": "llm_uneven's refit run also ran zero-shot and answers (README)",
        "evaluation.generate": "the same"})],
}


def arms(experiment: str) -> list[str]:
    return sorted(arms_files.arms(experiment))


def recorded_runs(experiment: str, arm: str) -> list[tuple[str, float | None, dict]]:
    """(raw file under experiments/, the budget.target its run dir's tag says or None, keys allowed to
    differ) for each committed run of this arm."""
    if (experiment, arm) in ELSEWHERE:
        return ELSEWHERE[experiment, arm]
    if experiment in BUDGETS:
        return [(f"{experiment}/results/{arm}_{tag}.json", target, {}) for tag, target in BUDGETS[experiment].items()
                if (EXPERIMENTS / experiment / "results" / f"{arm}_{tag}.json").is_file()]
    return [(f"{experiment}/results/{arm}.json", None, {})]


def flat(tree, prefix: str = "") -> dict:
    """{"a.b.c": leaf}; an empty mapping is a leaf (callbacks: {})."""
    if isinstance(tree, dict) and tree:
        return {k: v for key, sub in tree.items() for k, v in flat(sub, f"{prefix}{key}.").items()}
    return {prefix.removesuffix("."): tree}


ARMS = [(e, a) for e in EXPERIMENTS_WITH_ARMS for a in arms(e)]


@pytest.fixture(scope="module")
def arm_config(train_config):
    """arm_config(experiment, arm): experiment=<experiment>/<arm> composed (once per test process:
    conftest.train_config) and resolved, flattened."""
    cache = {}

    def get(experiment, arm):
        if (experiment, arm) not in cache:
            cfg = train_config(f"experiment={experiment}" + (f"/{arm}" if arm else ""))
            cache[experiment, arm] = flat(OmegaConf.to_container(cfg, resolve=True))
        return cache[experiment, arm]
    return get


def test_every_experiment_has_its_arms():
    counts = {e: len(arms(e)) for e in EXPERIMENTS_WITH_ARMS}
    assert counts == {"llm_uneven": 12, "llm_calibration": 12, "llm_iterative": 4}, counts


@pytest.mark.parametrize("experiment,arm", ARMS)
def test_an_arm_composes_to_what_its_committed_runs_recorded(experiment, arm, arm_config):
    runs = recorded_runs(experiment, arm)
    assert runs, f"{experiment}/{arm}: no committed raw file records this arm's run"
    composed = arm_config(experiment, arm)
    for raw, target, allowed in runs:
        recorded = flat(json.loads((EXPERIMENTS / raw).read_text())["config"])
        if target is not None:  # the run dir's budget tag is the run's budget.target
            assert recorded["budget.target"] == target, raw
        differ = {k: (v, composed.get(k, "<missing>")) for k, v in recorded.items()
                  if not PER_RUN.match(k) and k != "budget.target" and k not in allowed and composed.get(k, "<missing>") != v}
        assert not differ, f"experiment={experiment}/{arm} differs from {raw} (recorded, composed): {differ}"
        assert all(recorded.get(k) != composed.get(k) for k in allowed), (raw, "an allowed difference no longer differs")


@pytest.mark.parametrize("experiment", EXPERIMENTS_WITH_ARMS)
def test_run_sh_runs_the_arm_configs(experiment):
    """run.sh calls headprune-train experiment=<experiment>/$arm and keeps no overrides of its own
    per arm (the old `declare -A ARM=(...)` arrays); each arm it names is in the arms file."""
    run_sh = (EXPERIMENTS / experiment / "run.sh").read_text()
    assert f"experiment={experiment}/$arm" in run_sh and "declare -A" not in run_sh, experiment
    code = re.sub(r"(^|\s)#.*", "", run_sh, flags=re.M)  # what runs, the comments aside
    named = set(re.findall(r"\bone (\w+)", code))
    assert named <= set(arms(experiment)), (experiment, named - set(arms(experiment)))


# every experiment built on experiment=llm_kv, whose calibration default changed to self-generated
# text after these runs: each arm pins what its committed runs calibrated on
CALIBRATED = ("llm_kv", "llm_kv_modes", "llm_uneven", "llm_iterative", "llm_calibration")


def raw_runs(experiment: str, arm: str) -> list:
    """The committed raw files of `arm`: results/<arm>.json, or results/<arm>_<run tag>.json."""
    tag = re.compile(rf"^{re.escape(arm)}(_(kv\d+|q\d+|dense))?\.json$")
    return sorted(p for p in (EXPERIMENTS / experiment / "results").glob("*.json") if tag.match(p.name))


CALIBRATED_ARMS = [(e, a) for e in CALIBRATED for a in arms(e) if raw_runs(e, a)]


@pytest.mark.parametrize("experiment,arm", CALIBRATED_ARMS)
def test_an_arm_calibrates_on_what_its_committed_runs_did(experiment, arm, arm_config):
    """A run recorded before `data.calibration` existed (4d4d93e) calibrated on the corpus."""
    composed = arm_config(experiment, arm)["data.calibration"]
    for raw in raw_runs(experiment, arm):
        recorded = json.loads(raw.read_text())["config"]["data"].get("calibration", "corpus")
        assert composed == recorded, (f"experiment={experiment}/{arm}", raw.name)


def test_llm_kv_calibrates_on_self_generated_text_by_default(arm_config):
    """experiments/llm_calibration: self-generated calibration held best out of domain in every arm."""
    assert arm_config("llm_kv", None)["data.calibration"] == "self"
    assert len(CALIBRATED_ARMS) > 50


GIVEN = [a for a, entry in arms_files.arms("llm_kv_modes").items() if "kv_modes=given" in entry["overrides"]]


@pytest.mark.parametrize("arm", GIVEN)
def test_a_given_layout_arm_reads_a_committed_raw_file(arm, arm_config):
    """An llm_kv_modes arm with kv_modes=given trains or evaluates a layout some committed run chose:
    its kv_modes.layout is a raw results file of that experiment, holding final.kv_layout."""
    from headprune.selection.kv_modes import read_kv_layout

    composed = arm_config("llm_kv_modes", arm)
    assert composed["kv_modes.choice"] == "given"
    source = composed["kv_modes.layout"]
    assert source.startswith("experiments/llm_kv_modes/results/"), source
    assert read_kv_layout(str(EXPERIMENTS.parent / source)).options(), source
