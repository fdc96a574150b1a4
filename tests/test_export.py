"""apps/export.py, the headprune-export CLI: what it cannot use, bad arguments refused before
exporting, and why it exits 1. (The ONNX export it runs: test_onnx.py.)"""
import pytest

from headprune import prune_heads, save_pruned
from headprune.apps.export import main as export_main
from tests.helpers import PRUNE, tiny


def test_export_cli_names_what_it_cannot_use(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        export_main([str(tmp_path), "--onnx", str(tmp_path / "x.onnx")])
    assert exit_.value.code == 2
    assert "neither a run dir (results.json) nor a model folder" in capsys.readouterr().err


@pytest.mark.parametrize("tolerance", ["-1", "nan", "inf"])
def test_export_cli_refuses_a_bad_tolerance_before_exporting(tolerance, tmp_path, monkeypatch, capsys):
    import headprune.deploy.onnx

    monkeypatch.setattr(headprune.deploy.onnx, "export_onnx", lambda *a, **k: pytest.fail("exported anyway"))
    save_pruned(prune_heads(tiny("bert"), PRUNE), tmp_path / "model")
    with pytest.raises(SystemExit) as exit_:
        export_main([str(tmp_path / "model"), "--onnx", str(tmp_path / "m.onnx"), "--tolerance", tolerance])
    assert exit_.value.code == 2
    assert "--tolerance" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["parent_is_a_file", "is_a_folder"])
def test_export_cli_refuses_an_unwritable_onnx_path_before_exporting(where, tmp_path, monkeypatch, capsys):
    import headprune.deploy.onnx

    monkeypatch.setattr(headprune.deploy.onnx, "export_onnx", lambda *a, **k: pytest.fail("exported anyway"))
    save_pruned(prune_heads(tiny("bert"), PRUNE), tmp_path / "model")
    (tmp_path / "file").write_text("x")
    (tmp_path / "folder.onnx").mkdir()
    target = tmp_path / "file" / "m.onnx" if where == "parent_is_a_file" else tmp_path / "folder.onnx"
    with pytest.raises(SystemExit) as exit_:
        export_main([str(tmp_path / "model"), "--onnx", str(target)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--onnx" in err and str(target) in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "folder.onnx", "model"]  # nothing written


def test_export_cli_says_why_it_exits_1(tmp_path, monkeypatch, capsys):
    """A difference over --tolerance: exit 1 with a line on stderr saying so."""
    import headprune.deploy.onnx

    monkeypatch.setattr(headprune.deploy.onnx, "export_onnx", lambda model, path: _fake_graph(path, 1.0))
    monkeypatch.setattr(headprune.deploy.onnx, "check_onnx", lambda model, path: {"max_abs_diff": 0.5})
    save_pruned(prune_heads(tiny("bert"), PRUNE), tmp_path / "model")
    assert export_main([str(tmp_path / "model"), "--onnx", str(tmp_path / "m.onnx")]) == 1
    assert "exceeds --tolerance" in capsys.readouterr().err


@pytest.mark.parametrize("source, named", [
    ("missing", "no such file or folder; allowed: a headprune-train run dir"),
    ("killed", "the run did not finish (killed, failed or still running: results.json has no final export); it "
               "wrote no checkpoint, so run it again with overwrite=true"),
    ("killed_with_checkpoint", "the run did not finish (killed, failed or still running: results.json has no final "
                               "export); resume it with ckpt_path="),
    ("export_false", "it ran with export=false; run it again with export=true"),
    ("export_moved", "its results.json records the export at"),
])
def test_export_cli_says_what_to_do_when_there_is_no_model(source, named, tmp_path, capsys):
    """A missing source or a run dir without an export: exit 2 with what to do, not a raw
    FileNotFoundError nor "run it with export=true" to a run that ran with it."""
    import json

    run = tmp_path / "run"
    if source != "missing":
        run.mkdir()
        final = {"export_dir": str(run / "export")} if source == "export_moved" else {}
        (run / "results.json").write_text(json.dumps({"config": {"export": source != "export_false"},
                                                      "baseline": {}, "rounds": [], "final": final}))
    if source == "killed_with_checkpoint":
        (run / "checkpoints").mkdir()
        (run / "checkpoints" / "last.ckpt").write_bytes(b"x")
    with pytest.raises(SystemExit) as exit_:
        export_main([str(run), "--onnx-decode", str(tmp_path / "x.onnx")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert named in err and str(run) in err
    assert not list(tmp_path.glob("*.onnx"))


def _fake_graph(path, value: float) -> None:
    """A real one-tensor ONNX graph at `path` (output = its weight, `value`) with its weight in an
    external-data file beside it, as torch's exporter writes `<name>.onnx` + `<name>.onnx.data`."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    weight = numpy_helper.from_array(np.full((4,), value, dtype=np.float32), "w")
    graph = helper.make_graph([helper.make_node("Identity", ["w"], ["y"])], "g", [],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])], [weight])
    onnx.save(helper.make_model(graph), str(path), save_as_external_data=True, location=path.name + ".data",
              size_threshold=0)


def _graph_value(path) -> float:
    """What the graph at `path` computes, run by ONNX Runtime with the weights it references."""
    from headprune.deploy.onnx import onnx_session

    return float(onnx_session(path).run(None, {})[0][0])


def test_an_interrupted_onnx_export_leaves_the_earlier_graph_its_weights_and_its_check(tmp_path, monkeypatch):
    """Ctrl-C while headprune-export overwrites an earlier x.onnx (during the export, or during
    the check): x.onnx still runs with its own weights and x.check.json still describes it;
    nothing is left beside them. A completed export then replaces the whole set."""
    import json

    import headprune.deploy.onnx_decode as decode

    save_pruned(prune_heads(tiny("llama"), PRUNE), tmp_path / "model")
    target = tmp_path / "x.onnx"
    version = {"value": 1.0, "interrupt": None}

    def export(model, path):
        _fake_graph(path, version["value"])
        if version["interrupt"] == "export":
            raise KeyboardInterrupt
        return path

    def check(model, path, steps=4):
        if version["interrupt"] == "check":
            raise KeyboardInterrupt
        return {"graph_value": _graph_value(path)}

    monkeypatch.setattr(decode, "export_onnx_decode", export)
    monkeypatch.setattr(decode, "check_onnx_decode", check)
    monkeypatch.setattr(decode, "judge_decode", lambda report, **bounds: [])
    args = [str(tmp_path / "model"), "--onnx-decode", str(target)]
    assert export_main(args) == 0
    first = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    assert _graph_value(target) == 1.0 and json.loads((tmp_path / "x.check.json").read_text())["graph_value"] == 1.0
    for when in ("export", "check"):
        version.update(value=2.0, interrupt=when)
        with pytest.raises(KeyboardInterrupt):
            export_main(args)
        assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == first, when
        assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["model"], when  # no staging left
        assert _graph_value(target) == 1.0
    version.update(value=3.0, interrupt=None)
    assert export_main(args) == 0
    assert _graph_value(target) == 3.0
    check_json = json.loads((tmp_path / "x.check.json").read_text())
    assert check_json["graph_value"] == 3.0 and check_json["passed"]
    data = [p.name for p in tmp_path.glob("x.onnx*.data")]
    assert len(data) == 1 and check_json["onnx_bytes"] == target.stat().st_size + (tmp_path / data[0]).stat().st_size


def test_a_bfloat16_model_is_exported_and_checked_in_float32(tmp_path, monkeypatch, capsys):
    """ONNX Runtime's CPU kernels do not run a bfloat16 graph (NOT_IMPLEMENTED Mul(14) after the
    file was written): the graph is exported and checked in float32, and the check json says so."""
    import json

    import torch

    import headprune.deploy.onnx_decode as decode

    save_pruned(prune_heads(tiny("llama"), PRUNE).to(torch.bfloat16), tmp_path / "model")
    seen = []

    def export(model, path):
        seen.append(next(model.parameters()).dtype)
        _fake_graph(path, 1.0)
        return path

    monkeypatch.setattr(decode, "export_onnx_decode", export)
    monkeypatch.setattr(decode, "check_onnx_decode", lambda model, path, steps=4: {
        "checked_dtype": str(next(model.parameters()).dtype)})
    monkeypatch.setattr(decode, "judge_decode", lambda report, **bounds: [])
    assert export_main([str(tmp_path / "model"), "--onnx-decode", str(tmp_path / "x.onnx")]) == 0
    assert seen == [torch.float32]
    check = json.loads((tmp_path / "x.check.json").read_text())
    assert (check["dtype"], check["source_dtype"], check["checked_dtype"]) == ("float32", "bfloat16", "torch.float32")
    assert "holds a bfloat16 model; exporting and checking it in float32" in capsys.readouterr().err


# -- export targets checked before any work (issue 42) --------------------------------------------------
OPTIONS = {"--gguf": "m.gguf", "--onnx": "m.onnx", "--onnx-decode": "d.onnx", "--vllm-deci": "deci",
           "--vllm-anymodel": "anymodel"}
FOLDERS = {"--vllm-deci": "a DeciLM checkpoint", "--vllm-anymodel": "an AnyModel checkpoint"}  # folder outputs


@pytest.fixture
def bpe():
    from tests.helpers import bpe_tokenizer

    return bpe_tokenizer()


def _run_dir(tmp_path, tok):
    """A finished run dir as a run without training leaves it: results.json and export/, no
    checkpoint (export/ is the only copy of the pruned model)."""
    import json

    from tests.helpers import tiny_llama

    run = tmp_path / "run"
    save_pruned(tiny_llama(tok, {1: list(range(8)), 3: list(range(8))}, intermediate_size=256), run / "export",
                tokenizer=tok)
    (run / "results.json").write_text(json.dumps({"config": {"export": True}, "baseline": {}, "rounds": [],
                                                  "final": {"export_dir": str(run / "export")}}))
    return run


def _no_work(monkeypatch):
    """Any export work (loading the model) fails the test: a refusal must come before it."""
    import headprune.deploy.hf

    monkeypatch.setattr(headprune.deploy.hf, "load_pruned", lambda *a, **k: pytest.fail("exported anyway"))


def _refused(args, capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        export_main([str(a) for a in args])
    assert exit_.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("option", OPTIONS)
def test_a_target_inside_the_model_folder_is_refused_before_any_work(option, tmp_path, bpe, monkeypatch, capsys):
    """`--gguf <run>/export/model.safetensors` replaced the run's only copy of the pruned model with
    a GGUF and exited 0. A target inside the folder the model is read from is refused, for every
    kind of output; nothing in the run dir changes."""
    from tests.helpers import files

    run = _run_dir(tmp_path, bpe)
    before = files(run)
    _no_work(monkeypatch)
    target = run / "export" / ("model.safetensors" if option not in FOLDERS else "deci")
    err = _refused([run, option, target], capsys)
    assert f"{option} {target}: inside {run / 'export'}" in err and "the model being exported" in err
    assert files(run) == before and not (run / "export" / "deci").exists()


@pytest.mark.parametrize("option", OPTIONS)
def test_an_existing_file_of_another_format_is_refused_before_any_work(option, tmp_path, bpe, monkeypatch, capsys):
    """The run's results.json (or any file that is not what the option writes) given as the target:
    refused before the export, not replaced (and for ONNX not read as an old graph after a 34 s
    export, failing with a protobuf DecodeError)."""
    run = _run_dir(tmp_path, bpe)
    results = (run / "results.json").read_bytes()
    _no_work(monkeypatch)
    err = _refused([run, option, run / "results.json"], capsys)
    kind = {"--gguf": "a GGUF file", "--onnx": "an ONNX graph", "--onnx-decode": "an ONNX graph",
            "--vllm-deci": "a folder", "--vllm-anymodel": "a folder"}[option]
    assert f"{option} {run / 'results.json'}: exists and is not {kind}" in err
    assert (run / "results.json").read_bytes() == results
    if option in FOLDERS:  # a folder of something else is not replaced either
        (tmp_path / "notes").mkdir()
        (tmp_path / "notes" / "a.txt").write_text("mine")
        err = _refused([run, option, tmp_path / "notes"], capsys)
        assert f"exists and is not {FOLDERS[option]}" in err and (tmp_path / "notes" / "a.txt").read_text() == "mine"


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("nested", [False, True])
def test_an_unwritable_target_folder_is_refused_before_any_work(option, nested, tmp_path, bpe, monkeypatch, capsys):
    """A target in a folder that cannot be written: exit 2 naming the folder before the export, not
    a PermissionError traceback from tempfile after 10-22 s of export."""
    from tests.helpers import unwritable_folder

    run = _run_dir(tmp_path, bpe)
    _no_work(monkeypatch)
    folder = unwritable_folder(tmp_path)
    target = folder / "sub" / OPTIONS[option] if nested else folder / OPTIONS[option]
    err = _refused([run, option, target], capsys)
    assert f"{option} {target}: {folder} cannot be written" in err


@pytest.mark.parametrize("other", ["--onnx", "--onnx-decode", "--vllm-deci", "--vllm-anymodel"])
def test_the_same_path_for_two_outputs_is_refused_before_any_work(other, tmp_path, bpe, monkeypatch, capsys):
    """--gguf and --onnx-decode with one path: the GGUF was written, then the ONNX publish read it as
    the old graph and failed (DecodeError), losing the new ONNX. Refused before any work."""
    run = _run_dir(tmp_path, bpe)
    _no_work(monkeypatch)
    target = tmp_path / "same"
    err = _refused([run, "--gguf", target, other, target], capsys)
    assert f"--gguf and {other} are the same path ({target}); allowed: different paths" in err
    assert not target.exists()


def test_a_folder_given_as_the_gguf_path_suggests_a_gguf_file(tmp_path, bpe, monkeypatch, capsys):
    run = _run_dir(tmp_path, bpe)
    _no_work(monkeypatch)
    (tmp_path / "g").mkdir()
    err = _refused([run, "--gguf", tmp_path / "g"], capsys)
    assert f"(e.g. {tmp_path / 'g' / 'model.gguf'})" in err and "model.onnx" not in err


def test_a_killed_exports_leftovers_are_removed_by_the_next_export_to_that_path(tmp_path, bpe, monkeypatch):
    """kill -9 leaves the hidden staging file of a GGUF (`.<name>.<random>.tmp`, hundreds of MB with a
    real model) or the staging folder of an ONNX graph or vLLM checkpoint; the next export to the
    same path removes them. Another path's, and one a running export still holds (locked), stay."""
    import fcntl
    import os
    import time

    import headprune.deploy.onnx_decode as decode

    run = _run_dir(tmp_path, bpe)
    out = tmp_path / "out"
    out.mkdir()
    stale = [out / ".m.gguf.k1ll3d00.tmp", out / ".d.onnx.k1ll3d00.tmp", out / ".deci.k1ll3d00.tmp"]
    stale[0].write_bytes(b"half a gguf")
    for folder, name in ((stale[1], "d.onnx"), (stale[2], "config.json")):
        folder.mkdir()
        (folder / name).write_bytes(b"half")
    other, live = out / ".notes.gguf.k1ll3d00.tmp", out / ".m.gguf.l1ve0000.tmp"
    other.write_bytes(b"another path's")
    live.write_bytes(b"being written")
    hour_ago = time.time() - 3600
    for path in (*stale, other, live):
        os.utime(path, (hour_ago, hour_ago))
    held = os.open(live, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)  # as the export writing it holds it
    try:
        monkeypatch.setattr(decode, "export_onnx_decode", lambda model, path: _fake_graph(path, 1.0))
        monkeypatch.setattr(decode, "check_onnx_decode", lambda model, path, steps=4: {})
        monkeypatch.setattr(decode, "judge_decode", lambda report, **bounds: [])
        assert export_main([str(run), "--gguf", str(out / "m.gguf"), "--gguf-weights", "f32",
                            "--onnx-decode", str(out / "d.onnx"), "--vllm-deci", str(out / "deci")]) == 0
    finally:
        os.close(held)
    assert [p for p in stale if p.exists()] == []
    assert other.exists() and live.exists()
    assert (out / "m.gguf").is_file() and (out / "d.onnx").is_file() and (out / "deci" / "config.json").is_file()
