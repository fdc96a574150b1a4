"""The checks of `headprune-export`'s arguments and output paths, run before any work (apps/export.py):
arguments that cannot work, a target inside the model being exported, an existing file or folder that
is not an earlier output of the option's kind, a folder that cannot be written. Each returns the
reason as one line naming the option and the allowed values, or None."""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

# option -> (what it writes, an example file name): the outputs, in the order they are written
OUTPUTS = {"--gguf": ("a GGUF file", "model.gguf"), "--vllm-deci": ("a DeciLM checkpoint folder", "deci"),
           "--vllm-anymodel": ("an AnyModel checkpoint folder", "anymodel"),
           "--onnx": ("an ONNX graph", "model.onnx"), "--onnx-decode": ("an ONNX graph", "decode.onnx")}


def target_path(args: argparse.Namespace, option: str) -> Path | None:
    """The path `option` (e.g. --onnx-decode) was given, or None."""
    return getattr(args, option.removeprefix("--").replace("-", "_"))


def argument_problem(args: argparse.Namespace) -> str | None:
    """Why the arguments cannot work, checked before the export; None when they can."""
    check_options = [name for name, value in (("--check-text", args.check_text), ("--check-held-out", args.check_held_out),
                                              ("--check-exact", args.check_exact or None)) if value is not None]
    if (args.check or check_options) and args.gguf is None:
        return f"{'--check' if args.check else check_options[0]} checks a --gguf file; allowed: with --gguf PATH"
    given = [option for option in OUTPUTS if target_path(args, option) is not None]
    if not given:
        return ("nothing to write: give --onnx PATH (full-sequence graph), --onnx-decode PATH (causal LMs' decode "
                "graph), --gguf PATH (llama.cpp), --vllm-deci FOLDER or --vllm-anymodel FOLDER (vLLM) or several")
    for name, value in (("--tolerance", args.tolerance), ("--rel-tolerance", args.rel_tolerance)):
        if not math.isfinite(value) or value < 0:
            return f"{name} {value}: allowed: a finite number >= 0"
    if not 0 <= args.min_argmax_agreement <= 1:
        return f"--min-argmax-agreement {args.min_argmax_agreement}: allowed: a fraction in [0, 1]"
    if args.decode_steps < 1:
        return f"--decode-steps {args.decode_steps}: allowed: an integer >= 1"
    if check_options and not args.check:
        return f"{check_options[0]} is a setting of --check; allowed: with --check"
    if args.check_windows < 1 or args.check_seq < 2:
        return (f"--check-windows {args.check_windows} --check-seq {args.check_seq}: allowed: >= 1 window of >= 2 "
                "tokens")
    if not (math.isfinite(args.gguf_max_ppl_change) and args.gguf_max_ppl_change >= 0):
        return f"--gguf-max-ppl-change {args.gguf_max_ppl_change}: allowed: a finite number >= 0"
    if not 0 <= args.gguf_min_argmax <= 1:
        return f"--gguf-min-argmax {args.gguf_min_argmax}: allowed: a fraction in [0, 1]"
    if args.check_held_out is not None and (args.check_text is None or not 0 < args.check_held_out < 1):
        return f"--check-held-out {args.check_held_out}: allowed: a share in (0, 1), with --check-text"
    if args.check_text is not None and not args.check_text.is_file():
        return f"--check-text {args.check_text}: no such file; allowed: a text file"
    for i, first in enumerate(given):
        for second in given[i + 1:]:
            path = target_path(args, first)
            if path.resolve() == target_path(args, second).resolve():
                return f"{first} and {second} are the same path ({path}); allowed: different paths"
    return None


def target_problem(option: str, path: Path | None, folder: Path) -> str | None:
    """Why `option` cannot write `path`, checked before any work (None: it can): a folder where a
    file goes, a path under a file, a path inside the model folder being exported (the run's only
    copy of the pruned model when it kept no checkpoint), an existing file or folder of something
    other than what the option writes (replaced only when it is an earlier output of that kind),
    or a folder that cannot be written."""
    if path is None:
        return None
    what, example = OUTPUTS[option]
    where = f"{option} {path}"
    folder_is_output = option in FOLDER_OUTPUTS
    if path.is_dir() and not folder_is_output:
        return f"{where}: is a folder; allowed: a file path (e.g. {path / example})"
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                return f"{where}: {parent} is a file, not a folder; allowed: a path in a folder"
            break
    model, target = folder.resolve(), path.resolve()
    if target == model or model in target.parents:
        return (f"{where}: inside {folder}, the model being exported (a run without training keeps no other copy); "
                "allowed: a path outside it")
    if folder_is_output and target in model.parents:
        return f"{where}: holds {folder}, the model being exported; allowed: a folder outside it"
    existing = _not_of_kind(option, path)
    if existing:
        return f"{where}: exists and is not {existing}"
    return _unwritable(where, path)


def _not_of_kind(option: str, path: Path) -> str | None:
    """What an existing `path` would have to be for `option` to replace it, with what to do, when it
    is something else (None: nothing there, an empty file or folder, or an earlier output of the kind)."""
    if option in FOLDER_OUTPUTS:
        what, architecture = FOLDER_OUTPUTS[option]
        if path.exists() and not path.is_dir():
            return f"a folder; allowed: a new or empty folder, or an earlier {option} checkpoint to replace"
        if path.is_dir() and any(path.iterdir()) and not _is_checkpoint_of(path, architecture):
            return (f"{what} (no config.json with architectures {architecture}); allowed: a new or "
                    f"empty folder, or an earlier {option} checkpoint to replace")
        return None
    if not path.is_file() or path.stat().st_size == 0:
        return None
    if option == "--gguf":
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            return f"a GGUF file (it starts with {magic!r}); allowed: a new path, or an earlier GGUF file to replace"
        return None
    try:
        import onnx

        onnx.load(str(path), load_external_data=False)
    except ImportError:
        return None  # the export itself names the missing extra
    except Exception as err:  # noqa: BLE001 - protobuf's DecodeError and kin: not a graph
        return (f"an ONNX graph (ONNX cannot read it: {type(err).__name__}); allowed: a new path, or an earlier "
                ".onnx graph to replace")
    return None


# the options that write a folder: (what it is, the architecture its config.json names)
FOLDER_OUTPUTS = {"--vllm-deci": ("a DeciLM checkpoint", "DeciLMForCausalLM"),
                  "--vllm-anymodel": ("an AnyModel checkpoint", "AnyModel")}


def _is_checkpoint_of(path: Path, architecture: str) -> bool:
    try:
        return architecture in (json.loads((path / "config.json").read_text()).get("architectures") or [])
    except (OSError, ValueError, AttributeError):
        return False


def _unwritable(where: str, path: Path) -> str | None:
    """Why nothing can be created beside `path` (in its folder, or the nearest existing folder above
    it, where the missing ones would be made), or None."""
    import tempfile

    folder = next(p for p in path.absolute().parents if p.exists())
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        return f"{where}: {folder} cannot be written ({err.strerror or err}); allowed: a path in a folder you can write"
    return None
