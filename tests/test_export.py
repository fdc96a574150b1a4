"""apps/export.py, the headprune-export CLI: what it cannot use, bad arguments refused before
exporting, and why it exits 1. (The ONNX export it runs: test_onnx.py.)"""
import pytest

from headprune import prune_heads, save_pruned
from headprune.apps.export import main as export_main
from tests.helpers import PRUNE, tiny


def test_export_cli_names_what_it_cannot_use(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"neither a run dir \(results\.json\) nor a model folder"):
        export_main([str(tmp_path), "--onnx", str(tmp_path / "x.onnx")])


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

    monkeypatch.setattr(headprune.deploy.onnx, "export_onnx", lambda model, path: path)
    monkeypatch.setattr(headprune.deploy.onnx, "check_onnx", lambda model, path: {"max_abs_diff": 0.5})
    save_pruned(prune_heads(tiny("bert"), PRUNE), tmp_path / "model")
    assert export_main([str(tmp_path / "model"), "--onnx", str(tmp_path / "m.onnx")]) == 1
    assert "exceeds --tolerance" in capsys.readouterr().err
