"""atomic.py, the one way files and folders are published (issue 41): every writer of a file or a
folder that replaces an earlier one (save_pruned, save_deci, save_gguf, results files, the model
cache) stages it beside its path and publishes it in one step, so that a failure or a kill at any
point leaves the earlier target whole or the new one whole, never none and never a mix."""
import os
import shutil
import stat

import pytest

from headprune import atomic

# The file-system steps a publish is made of; a kill can come between any two of them.
STEPS = [(os, "replace"), (os, "rename"), (os, "unlink"), (os, "rmdir"), (shutil, "rmtree"), (atomic, "_exchange")]


class Killed(BaseException):
    """The process died: nothing after it runs, cleanup code included."""


class Failure(OSError):
    """One step failed (a full disk, a permission): the code's own error handling runs."""


def _inject(monkeypatch, at: int, kill: bool) -> dict:
    """Make the `at`-th publishing step raise (counted from 1); with `kill`, every step after it too.
    Steps inside shutil.rmtree count as one. Returns the counter (`calls`: steps seen)."""
    state = {"calls": 0, "dead": False, "depth": 0}

    def wrap(real):
        def step(*args, **kwargs):
            if state["depth"]:
                return real(*args, **kwargs)
            if state["dead"]:
                raise Killed
            state["calls"] += 1
            if state["calls"] == at:
                state["dead"] = kill
                if kill:
                    raise Killed
                if kwargs.get("ignore_errors"):  # shutil.rmtree(..., ignore_errors=True) swallows it
                    return None
                raise Failure("injected")
            state["depth"] += 1
            try:
                return real(*args, **kwargs)
            finally:
                state["depth"] -= 1
        return step

    for module, name in STEPS:
        if hasattr(module, name):
            monkeypatch.setattr(module, name, wrap(getattr(module, name)))
    return state


def _content(path) -> dict | bytes | None:
    from pathlib import Path

    path = Path(path)
    if path.is_dir():
        return {p.relative_to(path).as_posix(): p.read_bytes() for p in path.rglob("*") if p.is_file()}
    return path.read_bytes() if path.is_file() else None


def _publishers():
    """name -> (publish(model_seed, target), target name): each writer that replaces an earlier target."""
    from headprune import save_gguf, save_pruned
    from headprune.deploy.vllm_deci import save_deci
    from tests.helpers import bpe_tokenizer, tiny_llama

    tok = bpe_tokenizer()

    def model(seed):
        return tiny_llama(tok, {1: list(range(8))}, seed=seed, intermediate_size=256)

    def folder(seed, target):
        with atomic.staged_folder(target) as staging:
            (staging / "a.txt").write_text(f"a{seed}")
            (staging / "sub").mkdir()
            (staging / "sub" / "b.txt").write_text(f"b{seed}")

    return {
        "staged_folder": (folder, "folder"),
        "write_text_atomic": (lambda seed, target: atomic.write_text_atomic(target, f"text {seed}"), "results.json"),
        "save_pruned": (lambda seed, target: save_pruned(model(seed), target, tokenizer=tok, overwrite=True), "model"),
        "save_deci": (lambda seed, target: save_deci(model(seed), target, overwrite=True), "deci"),
        "save_gguf": (lambda seed, target: save_gguf(model(seed), target, tokenizer=tok, overwrite=True), "m.gguf"),
    }


PUBLISHERS = ["staged_folder", "write_text_atomic", "save_pruned", "save_deci", "save_gguf"]


@pytest.mark.parametrize("kill", [False, True], ids=["failure", "kill"])
@pytest.mark.parametrize("publisher", PUBLISHERS)
def test_a_publish_that_stops_at_any_step_leaves_the_old_target_or_the_new_one(publisher, kill, tmp_path,
                                                                               monkeypatch):
    """Stopped at each of its file-system steps in turn (an error: the code's own handling runs; a
    kill: nothing more runs), the target holds the old content or the new, complete; save_deci
    removed the old folder before renaming the new one in, so a failure there lost both."""
    publish, name = _publishers()[publisher]
    monkeypatch.setattr(atomic, "STALE_AFTER_S", 0.0)  # leftovers of a kill count as stale at once
    publish(1, tmp_path / "ref" / name)
    new = _content(tmp_path / "ref" / name)
    target = tmp_path / "out" / name
    publish(0, target)
    old = _content(target)
    assert old != new
    at = 1
    while True:
        with monkeypatch.context() as patch:
            state = _inject(patch, at, kill)
            raised = False
            try:
                publish(1, target)
            except Killed:
                pass
            except Failure:
                raised = True
        now = _content(target)
        assert now in (old, new), f"stopped at step {at}: the target is {'gone' if now is None else 'a mix'}"
        if state["calls"] < at:  # it completed before reaching step `at`
            break
        if raised:  # an error says nothing was published, and the code cleaned up after itself
            assert now == old, f"failed at step {at}: the new content was published anyway"
            assert sorted(p.name for p in target.parent.iterdir()) == [name], f"step {at} left staging behind"
        publish(0, target)  # back to the old content for the next step
        at += 1
    assert now == new and at > 1
    assert sorted(p.name for p in target.parent.iterdir()) == [name]  # nothing left beside it


@pytest.mark.parametrize("publisher", PUBLISHERS)
def test_published_files_get_0666_less_the_umask(publisher, tmp_path):
    publish, name = _publishers()[publisher]
    old = os.umask(0o027)
    try:
        publish(0, tmp_path / name)
    finally:
        os.umask(old)
    target = tmp_path / name
    paths = [target, *target.rglob("*")] if target.is_dir() else [target]
    for path in paths:
        want = 0o750 if path.is_dir() else 0o640
        assert stat.S_IMODE(path.stat().st_mode) == want, path


def test_stale_staging_is_removed_and_a_held_one_is_not(tmp_path):
    """A staging file or folder a killed writer left (`.<name>.<random>.tmp`, or `.old`) is removed by
    the next publish of the same name; one a live writer holds (locked), another name's, and one
    younger than STALE_AFTER_S (perhaps not yet locked by its writer) stay."""
    import fcntl
    import time

    old = time.time() - 3600
    stale = [tmp_path / ".x.json.k1ll3d00.tmp", tmp_path / ".x.json.k1ll3d01.old"]
    stale[0].write_text("half")
    stale[1].mkdir()
    (stale[1] / "x.json").write_text("an earlier one")
    held, other, young = (tmp_path / name for name in (".x.json.l1ve0000.tmp", ".y.json.k1ll3d00.tmp",
                                                        ".x.json.n3w00000.tmp"))
    for path in (held, other, young):
        path.write_text("keep")
    for path in (*stale, held, other):
        os.utime(path, (old, old))
    fd = os.open(held, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        atomic.write_json_atomic(tmp_path / "x.json", {"a": 1})
    finally:
        os.close(fd)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in (held, other, young)) + ["x.json"]
