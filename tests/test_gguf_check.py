"""`headprune-export --gguf FILE --check` (deploy/gguf_check.py): the written file run in llama.cpp
against PyTorch on tiny random Llamas: its size, perplexity and argmax agreement in <name>.check.json;
a file that is not the model fails the check; bad settings and a missing llama-cpp-python exit 2
before anything is written."""
import json

import pytest
import torch

from headprune import save_gguf, save_pruned
from headprune.apps.export import main as export_main
from headprune.deploy import llamacpp
from headprune.deploy.gguf_check import check_gguf, judge_gguf, random_windows
from tests.helpers import UNEVEN, bpe_tokenizer, tiny_llama

llamacpp.import_llama_cpp()  # the README's test command installs it: missing, it fails here saying how


@pytest.fixture(scope="module")
def tok():
    return bpe_tokenizer()


def test_check_writes_size_perplexity_and_agreement_beside_the_file(tmp_path, tok, capsys):
    save_pruned(tiny_llama(tok, UNEVEN), tmp_path / "model", tokenizer=tok)
    gguf = tmp_path / "m.gguf"
    text = tmp_path / "text.txt"
    text.write_text("the theatre then thought the thing through " * 40)
    assert export_main([str(tmp_path / "model"), "--gguf", str(gguf), "--gguf-weights", "f32", "--check",
                        "--check-windows", "2", "--check-seq", "48", "--check-text", str(text), "--check-held-out", "0.5",
                        "--check-exact"]) == 0
    report = json.loads((tmp_path / "m.check.json").read_text())
    assert report["passed"] and report["failures"] == []
    assert report["gguf_bytes"] == gguf.stat().st_size and (report["windows"], report["seq"]) == (2, 48)
    assert abs(report["gguf_ppl"] / report["pytorch_ppl"] - 1) < 1e-2 and report["argmax_agreement"] >= 0.9
    assert report["positions"] == 96 and report["tokens_from"] == str(text) and report["held_out_share"] == 0.5
    assert report["kv_exact"] and report["kv_bytes_per_token"][1] == 0  # layer 1 keeps no heads: no cache rows
    assert report["exact"]["max_abs_diff"] < 1e-3  # F32 weights, no flash attention: the export itself is exact
    assert '"gguf_ppl"' in capsys.readouterr().out


def test_a_file_that_is_not_the_model_fails_and_the_cli_exits_1(tmp_path, tok, monkeypatch, capsys):
    model = tiny_llama(tok, UNEVEN)
    out = save_gguf(model, tmp_path / "m.gguf", tokenizer=tok, weights="f32")
    windows = random_windows(model.config.vocab_size, 32, 2)
    assert judge_gguf(check_gguf(model, out.path, windows)) == []
    other = tiny_llama(tok, UNEVEN, seed=1)  # same layout, other weights: what a wrong export would serve
    figures = check_gguf(other, out.path, windows)
    failures = judge_gguf(figures)
    assert any("argmax_agreement" in f for f in failures), figures
    # through the CLI: the export writes the other model's file, the check compares with this one
    import headprune.apps.export as export_app

    save_pruned(model, tmp_path / "model", tokenizer=tok)
    real_write = export_app.write_gguf
    monkeypatch.setattr(export_app, "write_gguf", lambda folder, m, path, weights: real_write(folder, other, path, weights))
    assert export_main([str(tmp_path / "model"), "--gguf", str(tmp_path / "x.gguf"), "--gguf-weights", "f32",
                        "--check", "--check-seq", "32", "--check-windows", "2"]) == 1
    assert "llama.cpp differs from PyTorch" in capsys.readouterr().err
    assert json.loads((tmp_path / "x.check.json").read_text())["passed"] is False


def test_check_settings_are_refused_before_anything_is_written(tmp_path, tok, capsys, monkeypatch):
    save_pruned(tiny_llama(tok, UNEVEN), tmp_path / "model", tokenizer=tok)
    short = tmp_path / "short.txt"
    short.write_text("the")
    gguf = tmp_path / "m.gguf"
    cases = [(["--check"], "--check checks a --gguf file"),
             (["--gguf", str(gguf), "--check-text", str(short)], "--check-text is a setting of --check"),
             (["--gguf", str(gguf), "--check", "--check-seq", "1"], "allowed: >= 1 window of >= 2 tokens"),
             (["--gguf", str(gguf), "--check", "--gguf-min-argmax", "2"], "--gguf-min-argmax 2.0: allowed"),
             (["--gguf", str(gguf), "--check", "--check-text", str(tmp_path / "none.txt")], "no such file"),
             (["--gguf", str(gguf), "--check", "--check-text", str(short)], "less than one window of seq=128")]
    for extra, message in cases:
        with pytest.raises(SystemExit) as exit_:
            export_main([str(tmp_path / "model"), *extra])
        assert exit_.value.code == 2 and message in capsys.readouterr().err, extra
    assert not gguf.exists()

    def missing():
        raise ImportError(f"llama.cpp checks need llama-cpp-python: {llamacpp.INSTALL} (no module)")
    monkeypatch.setattr(llamacpp, "import_llama_cpp", missing)
    with pytest.raises(SystemExit) as exit_:
        export_main([str(tmp_path / "model"), "--gguf", str(gguf), "--check"])
    assert exit_.value.code == 2 and 'pip install "headprune[llamacpp]"' in capsys.readouterr().err
    assert not gguf.exists()
