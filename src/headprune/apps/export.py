"""`headprune-export`: a pruned model as ONNX, checked against PyTorch with ONNX Runtime.

    headprune-export outputs/<run dir> --onnx model.onnx        # the run's export/ folder
    headprune-export <a save_pruned folder> --onnx model.onnx

Writes the .onnx file and prints (and writes beside it as <name>.check.json) the largest
difference between ONNX Runtime's and PyTorch's logits on a batch of another shape than the
export's; exits 1 when it exceeds --tolerance (saying so on stderr). Arguments that cannot work
(a negative or non-finite --tolerance, an --onnx path that is a folder or lies under a file) exit
2 before the export.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from headprune.atomic import write_json_atomic


def model_folder(path: Path) -> Path:
    """A run dir's export/ folder, or the folder itself."""
    if (path / "results.json").is_file():
        export = path / "export"
        if not (export / "config.json").is_file():
            raise FileNotFoundError(f"{path} is a run dir without an exported model ({export}): run it with export=true")
        return export
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is neither a run dir (results.json) nor a model folder (config.json)")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="a headprune-train run dir or a save_pruned folder")
    parser.add_argument("--onnx", type=Path, required=True, help="the .onnx file to write")
    parser.add_argument("--tolerance", type=float, default=1e-4, help="largest allowed |ONNX Runtime - PyTorch|")
    args = parser.parse_args(argv)
    problem = argument_problem(args)
    if problem:
        parser.error(problem)  # exit 2 before the (tens of seconds) export
    try:
        from headprune.deploy.onnx import check_onnx, export_onnx
    except ImportError as err:  # pragma: no cover - the message is the point
        raise SystemExit(f"headprune-export needs the onnx extra: pip install \"headprune[onnx]\" ({err})") from None
    from headprune.deploy.hf import load_pruned

    folder = model_folder(args.source)
    model = load_pruned(folder).eval()
    export_onnx(model, args.onnx)
    check = {"source": str(folder), "onnx": str(args.onnx), **check_onnx(model, args.onnx), "tolerance": args.tolerance}
    write_json_atomic(args.onnx.with_suffix(".check.json"), check)
    print(json.dumps(check, indent=2))
    if check["max_abs_diff"] <= args.tolerance:
        return 0
    print(f"headprune-export: max_abs_diff {check['max_abs_diff']} exceeds --tolerance {args.tolerance} "
          "(ONNX Runtime's logits differ from PyTorch's); exit 1", file=sys.stderr)
    return 1


def argument_problem(args: argparse.Namespace) -> str | None:
    """Why the arguments cannot work, checked before the export; None when they can."""
    if not math.isfinite(args.tolerance) or args.tolerance < 0:
        return f"--tolerance {args.tolerance}: allowed: a finite number >= 0 (the largest |ONNX Runtime - PyTorch|)"
    onnx = args.onnx
    if onnx.is_dir():
        return f"--onnx {onnx}: is a folder; allowed: a file path (e.g. {onnx / 'model.onnx'})"
    for parent in onnx.parents:
        if parent.exists():
            if not parent.is_dir():
                return f"--onnx {onnx}: {parent} is a file, not a folder; allowed: a path in a folder"
            break
    return None


if __name__ == "__main__":
    sys.exit(main())
