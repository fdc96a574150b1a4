"""headprune-evaluate: a run's evaluation finished after the run (the export's block computed again
equals the one the run wrote), redone, and refused before any work when it cannot be right."""
import json

import pytest

from headprune.apps.evaluate import main
from headprune.apps.train import run
from tests.helpers import TINY_LM_MODEL, compose_train

TINY_LM = [*TINY_LM_MODEL, "data.max_train_samples=32", "data.score_samples=16", "data.max_validation_samples=8",
           "schedule=one_shot", "schedule.target_sparsity=0.5", "schedule.baseline_epochs=0",
           "schedule.epochs_per_round=0", "logger=none", "diagnostics.enabled=false", "metric=magnitude",
           "evaluation.enabled=true", "evaluation.perplexity_seqs=[64]", "evaluation.perplexity_tokens=512",
           "evaluation.zero_shot_tasks=[]", "evaluation.generate=false"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory, data_dir):
    out = tmp_path_factory.mktemp("run")
    run(compose_train(out, data_dir, *TINY_LM))
    return out, json.loads((out / "results.json").read_text())


def _copy(finished, tmp_path, drop=()):
    out, data = finished
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    data = json.loads(json.dumps(data))
    for which in drop:
        del data["evaluation"][which]
    (run_dir / "export").symlink_to(out / "export")
    data["final"]["export_dir"] = str(run_dir / "export")
    (run_dir / "results.json").write_text(json.dumps(data))
    return run_dir


def test_a_killed_runs_export_evaluation_is_finished_as_the_run_would_have(finished, tmp_path):
    run_dir = _copy(finished, tmp_path, drop=["pruned"])
    assert main([str(run_dir)]) == 0
    got = json.loads((run_dir / "results.json").read_text())["evaluation"]
    want = finished[1]["evaluation"]
    assert got["pruned"]["perplexity"] == want["pruned"]["perplexity"]
    assert got["dense"] == want["dense"]  # the block that was there is left as it was
    assert got["pruned"]["by"]["command"].startswith("headprune-evaluate ")
    assert got["pruned"]["source"] == "export"


def test_the_export_folder_names_its_run_and_a_redo_recomputes_the_same(finished, tmp_path):
    run_dir = _copy(finished, tmp_path)
    assert main([str(run_dir / "export"), "--redo"]) == 0
    got = json.loads((run_dir / "results.json").read_text())
    assert got["evaluation"]["pruned"]["perplexity"] == finished[1]["evaluation"]["pruned"]["perplexity"]
    assert "evaluate_pruned" in got["stages"]


def test_dense_recomputed_from_the_runs_model_config(finished, tmp_path):
    run_dir = _copy(finished, tmp_path, drop=["dense"])
    assert main([str(run_dir), "--which", "dense"]) == 0
    got = json.loads((run_dir / "results.json").read_text())["evaluation"]["dense"]
    assert got["perplexity"] == finished[1]["evaluation"]["dense"]["perplexity"]


@pytest.mark.parametrize("args, message", [
    ([], "evaluation already holds dense, pruned; allowed: --redo"),
    (["--which", "pruned"], "evaluation.pruned is already there; allowed: --redo"),
    (["--which", "pruned", "--redo", "evaluation.perplexity_seqs=[32]"],
     r"evaluation settings \['perplexity_seqs'\] differ from those evaluation.dense was computed with"),
    (["--redo", "--which", "pruned", "evaluation.perplexity_sequence=[32]"], "is not an evaluation setting"),
    (["--out", "x.json"], "lies in the run"),
])
def test_what_cannot_be_right_is_refused_before_any_model_loads(finished, tmp_path, capsys, args, message):
    run_dir = _copy(finished, tmp_path)
    before = (run_dir / "results.json").read_text()
    with pytest.raises(SystemExit) as err:
        main([str(run_dir), *args])
    assert err.value.code == 2
    assert __import__("re").search(message, capsys.readouterr().err)
    assert (run_dir / "results.json").read_text() == before


def test_a_changed_setting_recomputes_both_blocks(finished, tmp_path):
    run_dir = _copy(finished, tmp_path)
    assert main([str(run_dir), "--which", "dense", "--which", "pruned", "--redo", "evaluation.perplexity_seqs=[32]"]) == 0
    ev = json.loads((run_dir / "results.json").read_text())["evaluation"]
    assert ev["settings"]["perplexity_seqs"] == [32]
    assert set(ev["dense"]["perplexity"]) == set(ev["pruned"]["perplexity"]) == {"seq32"}


def test_an_export_outside_any_run_needs_a_runs_settings_and_a_new_file(finished, tmp_path, capsys):
    out, _ = finished
    with pytest.raises(SystemExit):
        main([str(out / "export"), "--settings", str(out)])
    # the export of `finished` lies in its run: copy the folder's files elsewhere
    import shutil
    folder = tmp_path / "model"
    shutil.copytree(out / "export", folder)
    with pytest.raises(SystemExit):
        main([str(folder)])
    assert "--settings RUN" in capsys.readouterr().err
    target = tmp_path / "eval.json"
    assert main([str(folder), "--settings", str(out), "--out", str(target)]) == 0
    doc = json.loads(target.read_text())
    assert doc["evaluation"]["pruned"]["perplexity"] == finished[1]["evaluation"]["pruned"]["perplexity"]
    with pytest.raises(SystemExit):
        main([str(folder), "--settings", str(out), "--out", str(target)])  # never overwritten
