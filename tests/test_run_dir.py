"""runs/run_dir.py: a run dir that holds a run is not overwritten, refused runs write nothing into
their run dir (through the CLI, where Hydra writes .hydra/ and train.log), and an unwritable run
dir is named before training."""
import shutil

import pytest

from headprune.apps.train import run
from tests.helpers import compose_iterative, files, train_cli


def _cli(data_dir):
    """The CLI's overrides; train_cli runs Hydra's command line (as headprune-train) in this process."""
    return ["model=tiny_bert", "debug=fast", "data.max_train_samples=32", "data.score_samples=16",
            f"data.data_dir={data_dir}", "callbacks=default"]


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory, data_dir):
    """One finished CLI run (.hydra/, train.log, results.json), started once for this module; the
    tests run against their own copy (`first`)."""
    out = tmp_path_factory.mktemp("cli_run") / "run"
    proc = train_cli(*_cli(data_dir), f"hydra.run.dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.fixture
def first(cli_run, tmp_path):
    """This test's copy of the module's finished CLI run."""
    return shutil.copytree(cli_run, tmp_path / "first")


@pytest.mark.slow
def test_a_refused_run_leaves_the_folder_as_it_was(first, data_dir):
    """The second run lands on the first run's folder without overwrite=true: it is refused before
    anything is written, so .hydra/ and train.log still describe the first run."""
    before = files(first)
    assert first / ".hydra" / "config.yaml" in before and first / "train.log" in before
    proc = train_cli(*_cli(data_dir), f"hydra.run.dir={first}", "seed=7")
    assert proc.returncode != 0 and "already holds a run's results.json" in proc.stderr + proc.stdout
    assert files(first) == before


@pytest.mark.slow
def test_refused_runs_write_nothing_into_their_run_dir(first, tmp_path, data_dir):
    """Through the CLI (Hydra writes .hydra/ and train.log in a run dir): a resume refused at a
    start-time check leaves the first run's record as it was, and a new run refused for its data
    (a check made after the data is read) leaves its run dir without .hydra/ or train.log."""
    cli = _cli(data_dir)
    before = files(first)
    proc = train_cli(*cli, f"hydra.run.dir={first}", "data.score_samples=0", f"ckpt_path={first}/checkpoints/last.ckpt")
    assert proc.returncode != 0 and "data.score_samples=0 leaves no held-out examples" in proc.stderr + proc.stdout
    assert files(first) == before
    fresh = tmp_path / "fresh"
    proc = train_cli(*cli, f"hydra.run.dir={fresh}", "data.train_file=sst2/missing.tsv")
    assert proc.returncode != 0
    assert not (fresh / ".hydra").exists() and not (fresh / "train.log").exists(), proc.stderr[-2000:]


def test_an_unwritable_run_dir_is_named_before_training(tmp_path, data_dir, monkeypatch):
    import headprune.runs.run_dir as run_dir

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(run_dir.tempfile, "TemporaryFile", refuse)
    with pytest.raises(PermissionError, match=r"the run dir .* cannot be written: Permission denied"):
        run(compose_iterative(tmp_path / "ro", data_dir))
    assert not (tmp_path / "ro" / "results.json").exists()


@pytest.mark.slow
def test_an_overwrite_that_dies_midway_leaves_no_results_beside_the_old_export(first, data_dir, monkeypatch):
    """`overwrite=true` over a finished run, dying before its own export (a full disk): the old
    export/ must not stay beside the new run's results.json, which does not describe it (issue 56).
    The run dir holds a matching pair, or no export."""
    import json

    import headprune.runs.execute as execute

    assert (first / "export" / "config.json").is_file()

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(execute, "export_pruned", disk_full)
    from tests.helpers import compose_train

    with pytest.raises(OSError, match="No space left"):
        run(compose_train(first, data_dir, "model=tiny_bert", "debug=fast", "data.max_train_samples=32",
                          "data.score_samples=16", "callbacks=default", "overwrite=true", "seed=7"))
    saved = json.loads((first / "results.json").read_text())
    assert saved["config"]["seed"] == 7  # the new run's record
    assert not (first / "export").exists() or saved["final"].get("export_dir") == str(first / "export")


def test_a_new_run_dir_that_cannot_be_created_is_refused_by_name(tmp_path, data_dir):
    """A run dir on a read-only file system (or under a folder this user cannot write): Hydra would
    create it before the app starts and print its own mkdir traceback; refused first, exit 2, naming
    hydra.run.dir (issue 56)."""
    from tests.helpers import unwritable_folder

    target = unwritable_folder(tmp_path) / "new" / "run"
    proc = train_cli(*_cli(data_dir), f"hydra.run.dir={target}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"hydra.run.dir={target}" in proc.stderr and "cannot be created" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
