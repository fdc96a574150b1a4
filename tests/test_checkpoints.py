"""lightning/checkpoints.py: last.ckpt is replaced atomically, so a kill while saving leaves the
previous checkpoint whole and the run resumes from it."""
import pytest
import torch

from headprune.apps.train import run
from tests.helpers import Crash, compose_iterative


@pytest.mark.slow  # 5 s of CPU
def test_last_checkpoint_survives_a_kill_between_write_and_rename(tmp_path, data_dir, monkeypatch):
    """A failure after the new checkpoint is written and before it replaces last.ckpt (where a kill
    could strike) leaves the previous, complete last.ckpt, and the run resumes from it."""
    from headprune.lightning.checkpoints import LastCheckpoint

    commit, calls = LastCheckpoint._commit, []

    def killed_on_second_save(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            assert src.is_file()  # the new checkpoint is written, only the rename is missing
            raise Crash("killed between writing the new checkpoint and renaming it")
        commit(src, dst)

    monkeypatch.setattr(LastCheckpoint, "_commit", staticmethod(killed_on_second_save))
    with pytest.raises(Crash):
        run(compose_iterative(tmp_path, data_dir, "callbacks=default"))
    monkeypatch.setattr(LastCheckpoint, "_commit", staticmethod(commit))
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert last.is_file() and not last.is_symlink()
    assert torch.load(last, weights_only=False)["epoch"] == 0  # the first epoch's, complete
    res = run(compose_iterative(tmp_path, data_dir, "callbacks=default", f"ckpt_path={last}"))
    assert res["final"]["stop_reason"] == "target_reached"
