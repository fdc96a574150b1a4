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
file's content (sha256 of 98 MB: under 0.1 s, computed once per process and file), so a replaced
file converts again and a copy elsewhere reuses the folder. The folder is written under a
temporary name beside it and renamed when complete (atomic.py `staged_folder`, as exports are,
with 0666 / 0777 less the umask so other users of a shared cache can read it), under a per-key
lock, so a kill leaves no half folder and concurrent processes (DDP ranks) convert once (the
empty `.<key>.lock` files stay). A cached folder that is damaged (no or unreadable config.json,
a truncated model.safetensors, a tokenizer.json / tokenizer_config.json missing or not JSON) is
converted again, with a warning.

Which reader converts: transformers' for the files it reads right (SmolLM2's and other plain
Llama / Mistral / Qwen2 files), after checking it drops none of the file's biases (a file whose
biases its model class has no parameter for is refused naming them); headprune's own
(deploy/gguf_import.py) for `deci` files, the files headprune-export writes (`llama`, `deci`,
`qwen3`) and `llama` files holding biases, which transformers misreads or does not read: they convert into the pruned model
they hold (a save_pruned folder), so an export used as `model.pretrained` computes what was
exported.

Clear the cache by deleting the folder (`rm -rf ~/.cache/headprune/models`); the next load
converts again.

A file that is not a GGUF file is refused before conversion, and one that ends early (a cut
download or copy) is named as truncated when reading it fails; a cache that cannot be written
(read-only, or a file) is an error naming HEADPRUNE_CACHE.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import struct
import tempfile
import time
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path

import torch

from headprune.atomic import current_umask, remove_stale, staged_folder
from headprune.models.packaged import PACKAGED

log = logging.getLogger(__name__)

GGUF_BUILTINS = PACKAGED  # model.pretrained name -> its packaged GGUF source (models/packaged.py)
SOURCE_FILE = "headprune_gguf.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")  # every conversion writes both


def cache_root() -> Path:
    """Where converted models go: `$HEADPRUNE_CACHE/models`, else `$XDG_CACHE_HOME/headprune/models`,
    else `~/.cache/headprune/models`."""
    root = os.environ.get("HEADPRUNE_CACHE") or (
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "headprune")
    return Path(os.path.expanduser(root)) / "models"


def packaged_root() -> Path:
    """Where GGUF files assembled or joined from pip packages go (models/packaged.py): `gguf/`
    beside `cache_root()`."""
    return cache_root().parent / "gguf"


def gguf_source(name: str) -> Path | None:
    """The GGUF file behind `model.pretrained=name`, or None when `name` is no GGUF source (a hub
    id, a folder with config.json, ...). A built-in name (`GGUF_BUILTINS`) gives its packaged file,
    assembled or joined once into `packaged_root()` and verified (models/packaged.py). Raises,
    naming model.pretrained, for a built-in whose packages are missing (with the pip line to run)
    or damaged, and for a folder holding several GGUF files."""
    if name in GGUF_BUILTINS:
        return GGUF_BUILTINS[name].locate(name, packaged_root(), file_key)
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


_KEYS: dict[tuple, str] = {}  # (file, inode, size, mtime, ctime) -> sha256: hashed once per process
RACY_S = 2.0  # a file changed this recently is hashed again (its times may not show a rewrite yet)


def file_key(path: Path) -> str:
    """sha256 of the file's bytes (hex), remembered for the process while the file is unchanged
    (same inode, size and times; a file changed in the last `RACY_S` seconds is hashed again, since
    a rewrite within the file system's time resolution would keep its times)."""
    stat = Path(path).stat()
    identity = (str(Path(path).resolve()), stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)
    if identity in _KEYS:
        return _KEYS[identity]
    digest = _sha256(Path(path))
    if time.time() - max(stat.st_mtime, stat.st_ctime) > RACY_S:
        _KEYS[identity] = digest
    return digest


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def converted(path: Path, cache: Path | None = None) -> Path:
    """The plain folder converted from the GGUF file `path`: read from the cache when there (and
    whole), else converted now (once, atomically) into `cache` (default `cache_root()`)."""
    cache = Path(cache) if cache is not None else cache_root()
    digest = file_key(path)
    key = digest[:16]
    if (found := _cached(cache, key)) is not None and (damage := damaged(found)) is None:
        _share(found)
        return found
    check_gguf(path)
    _check_cache_writable(cache, path)
    with _locked(cache / f".{key}.lock"):
        if (found := _cached(cache, key)) is not None:
            if (damage := damaged(found)) is None:  # another process converted it meanwhile
                return found
            log.warning("the cached conversion %s is damaged (%s): converting %s again", found, damage, path)
            aside = Path(tempfile.mkdtemp(prefix=f".{key}.", suffix=".old", dir=cache))
            os.replace(found, aside / found.name)
            shutil.rmtree(aside, ignore_errors=True)
        remove_stale(cache, f".{key}.", min_age=0)  # a killed conversion's: no other holds this key's lock
        folder = cache / f"{path.stem}-{key}"
        start = time.perf_counter()
        log.info("converting GGUF %s once into %s (dequantized to float32)", path, folder)
        with staged_folder(folder, prefix=f".{key}.") as tmp:
            convert(path, tmp)
            (tmp / SOURCE_FILE).write_text(json.dumps(_source_record(path, digest), indent=2))
        log.info("converted %s in %.1f s", path.name, time.perf_counter() - start)
    return folder


def _share(folder: Path) -> None:
    """Files of a folder converted before conversions got 0666 less the umask (safetensors wrote
    model.safetensors 0600) get it now, when this process owns them; others are left as they are."""
    mode = 0o666 & ~current_umask()
    for path in folder.iterdir():
        try:
            if path.is_file() and path.stat().st_uid == os.getuid() and path.stat().st_mode & 0o777 != mode:
                os.chmod(path, mode)
        except OSError:
            pass


def _cached(cache: Path, key: str) -> Path | None:
    """The complete folder converted from a file with this key, under whatever name it was
    converted from (temporary folders start with a dot)."""
    found = [f for f in cache.glob(f"*-{key}") if f.is_dir() and not f.name.startswith(".")] if cache.is_dir() else []
    return found[0] if found else None


def damaged(folder: Path) -> str | None:
    """Why a cached folder cannot be used as it is (None: it can): config.json missing or not
    JSON, no weights, a weights file that is truncated (its header says more bytes than it holds),
    or a tokenizer file (tokenizer.json, tokenizer_config.json) missing or not JSON."""
    from headprune.deploy.hf import weight_shapes

    for name in ("config.json", *TOKENIZER_FILES):
        try:
            json.loads((folder / name).read_text())
        except (OSError, ValueError) as err:
            return f"{folder / name} cannot be read ({type(err).__name__}: {err})"
    if not list(folder.glob("*.safetensors")):
        return f"{folder} holds no model.safetensors"
    try:
        weight_shapes(folder)
    except ValueError as err:
        return str(err).split(": the weights file")[0]
    return None


def check_gguf(path: Path) -> None:
    """Refuse, naming the file, one that is not a GGUF file (cheap: its first 4 bytes); a file that
    is one but ends early is named by `convert` when reading it fails (`truncation`)."""
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"GGUF file {path} is not a GGUF file (it starts with {magic!r}, not b'GGUF'); allowed: a "
                         ".gguf file as llama.cpp writes it")


def truncation(path: Path) -> str | None:
    """Why the GGUF file ends early (a cut download or copy), or None when its header and tensor
    table fit in the file. Slow on a real model (the gguf package parses the whole vocabulary in
    Python: seconds for SmolLM2), so only asked after reading the file failed."""
    from gguf import GGUFReader

    size = path.stat().st_size
    try:
        reader = GGUFReader(str(path))
        end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    except Exception as err:  # noqa: BLE001 - struct.error, ValueError, IndexError: all mean a cut file here
        return f"its header or tensor table ends early ({size} bytes; {type(err).__name__}: {err})"
    return f"its tensors end at byte {end}, the file has {size}" if end > size else None


def _check_cache_writable(cache: Path, path: Path) -> None:
    """The cache folder exists (created if needed) and a file can be created in it; otherwise an
    error naming HEADPRUNE_CACHE, the setting that moves it."""
    try:
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=cache):
            pass
    except OSError as err:
        setting = os.environ.get("HEADPRUNE_CACHE")
        where = f"HEADPRUNE_CACHE={setting}" if setting else "the default model cache (HEADPRUNE_CACHE unset)"
        kind = NotADirectoryError if isinstance(err, (NotADirectoryError, FileExistsError)) else PermissionError
        raise kind(f"{where}: {cache} cannot be written ({err.strerror or err}), and the GGUF file {path.name} is "
                   "converted into it once before its first use; allowed: HEADPRUNE_CACHE=<a folder you can write>, "
                   "or a cache that already holds this conversion") from None


def convert(path: Path, into: Path) -> None:
    """Convert the GGUF file into a plain folder `into`: with headprune's own reader
    (deploy/gguf_import.py) for the files transformers' loader would read wrongly or not at all
    (`deci`, the files headprune writes, `llama` files holding biases), else with transformers
    (dequantized, float32: the plain model class rebuilt from its config without
    quantization_config), after checking that it drops none of the file's biases; the GGUF's
    tokenizer beside it."""
    from transformers import AutoModelForCausalLM

    from headprune.deploy.gguf_import import load_gguf, own_reader_reason

    reader = _reader(path)
    reason = own_reader_reason(reader)
    if reason is not None:
        from headprune.deploy.hf import _write as write_pruned  # save_pruned's writer; the cache stages the folder

        log.info("%s: %s; read with headprune's GGUF reader", path, reason)
        model = load_gguf(path, reader)
        write_pruned(model, into, _tokenizer(path, own_reader=True), None)
        return
    folder, file = str(path.parent), path.name
    try:
        tokenizer = _tokenizer(path, own_reader=False)
        quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    except (ValueError, KeyError, OSError, IndexError, struct.error) as err:
        raise _unreadable(path, err) from None
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):  # no random init of weights that are replaced next
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict(), assign=True, strict=True)
    dropped = dropped_biases(reader, plain)
    if dropped:
        raise ValueError(f"GGUF file {path}: transformers' {config.model_type} loader would drop "
                         f"{', '.join(dropped)} (the {type(plain).__name__} it builds has no such parameters), so the "
                         "loaded model would not compute what the file holds; allowed: GGUF files whose tensors the "
                         "model class holds")
    plain.generation_config = quantized.generation_config
    plain.save_pretrained(into)
    tokenizer.save_pretrained(into)


def _reader(path: Path):
    """The gguf package's reader of the file; a file it cannot parse is named as truncated when it
    ends early, else as unreadable."""
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except Exception as err:  # noqa: BLE001 - struct.error, ValueError, IndexError, OSError: named below
        raise _unreadable(path, err) from None


def _unreadable(path: Path, err: Exception) -> ValueError:
    """The error for a file reading failed on: truncated (named so), else what failed."""
    cut = truncation(path)
    if cut is not None:  # not a struct or reshape error naming nothing
        return ValueError(f"GGUF file {path} is truncated: {cut}; download or copy it again")
    return ValueError(f"GGUF file {path} could not be read ({type(err).__name__}: {err}); "
                      "allowed: GGUF files transformers reads (llama, mistral, qwen2, ...) and the llama / deci "
                      "files headprune-export writes")


def _tokenizer(path: Path, own_reader: bool):
    """The tokenizer the GGUF's `tokenizer.*` metadata describes. transformers' AutoTokenizer picks
    the class from the model config it builds from the file, which fails for the files headprune's
    reader takes (`deci`; a pruned `llama` whose heads do not divide the hidden size); for those
    the fast tokenizer AutoTokenizer itself returns for a `llama` GGUF is built directly (the
    same files: tokenizer.json, tokenizer_config.json, chat template)."""
    from transformers import AutoTokenizer, TokenizersBackend

    folder, file = str(path.parent), path.name
    if own_reader:
        return TokenizersBackend.from_pretrained(folder, gguf_file=file)
    return AutoTokenizer.from_pretrained(folder, gguf_file=file)


def dropped_biases(reader, model) -> list[str]:
    """The bias tensors of the GGUF file that no parameter of `model` (built by transformers from
    the file) receives, by the gguf package's tensor names (the mapping transformers loads with)."""
    import gguf

    arch = reader.fields["general.architecture"].contents()
    kinds = [k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch]
    if not kinds:
        return []
    names = gguf.get_tensor_name_map(kinds[0], int(model.config.num_hidden_layers))
    covered = set()
    for key in model.state_dict():
        base, _, suffix = key.rpartition(".")
        mapped = names.get_name(base)
        if mapped is not None:
            covered.add(f"{mapped}.{suffix}")
    return [t.name for t in reader.tensors if t.name.endswith(".bias") and t.name not in covered]


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

