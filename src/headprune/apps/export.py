"""`headprune-export`: a pruned model as ONNX, checked against PyTorch with ONNX Runtime.

    headprune-export outputs/<run dir> --onnx model.onnx        # the run's export/ folder
    headprune-export <a save_pruned folder> --onnx model.onnx
    headprune-export <folder> --onnx-decode decode.onnx         # causal LMs: the KV-cache decode graph
    headprune-export <folder> --onnx model.onnx --onnx-decode decode.onnx

--onnx writes the full-sequence graph (input_ids, attention_mask -> logits) and compares ONNX
Runtime's logits with PyTorch's on a batch of another shape than the export's. --onnx-decode
(causal LMs only) writes the decode graph with past key/values (deploy/onnx_decode.py) and
compares a prefill and --decode-steps greedy decode steps with PyTorch's own KV cache. Each check
passes when all of these hold (deploy/onnx.py `agreement`):

  max_abs_diff = max |ONNX Runtime - PyTorch| over the compared logits  <= --tolerance (absolute)
  rel_diff     = max_abs_diff / max |PyTorch logit|                      <= --rel-tolerance
  argmax_agreement (positions whose argmax, class or next token, is equal) >= --min-argmax-agreement
  and, for the decode graph: equal greedy tokens, and every layer's ONNX past has the KV heads
  the pruned PyTorch model keeps.

Prints the figures and writes them beside each file as <name>.check.json (with the export's
seconds and bytes); exits 1 when a check fails, saying which bound on stderr. Arguments that
cannot work (a negative or non-finite tolerance, a --min-argmax-agreement outside [0, 1], an
output path that is a folder or lies under a file, the same path twice, --onnx-decode for an
encoder or a sliding-window decoder, neither --onnx nor --onnx-decode) exit 2 before the export.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
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


def onnx_bytes(path: Path) -> int | None:
    """The bytes of an .onnx file and of its external-data file, if the exporter wrote one (None: no file)."""
    data = path.with_name(path.name + ".data")
    if not path.is_file():
        return None
    return path.stat().st_size + (data.stat().st_size if data.is_file() else 0)


def main(argv: list[str] | None = None) -> int:
    from headprune.deploy.onnx import ABS_TOLERANCE, MIN_ARGMAX_AGREEMENT, REL_TOLERANCE

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="a headprune-train run dir or a save_pruned folder")
    parser.add_argument("--onnx", type=Path, help="the full-sequence .onnx file to write")
    parser.add_argument("--onnx-decode", type=Path,
                        help="causal LMs: the decode-graph .onnx file to write (past key/values in, present out)")
    parser.add_argument("--tolerance", type=float, default=ABS_TOLERANCE,
                        help=f"largest allowed max |ONNX Runtime - PyTorch| logit (absolute; default {ABS_TOLERANCE:g})")
    parser.add_argument("--rel-tolerance", type=float, default=REL_TOLERANCE,
                        help=f"largest allowed max |ONNX Runtime - PyTorch| / max |PyTorch logit| (default {REL_TOLERANCE:g})")
    parser.add_argument("--min-argmax-agreement", type=float, default=MIN_ARGMAX_AGREEMENT,
                        help="smallest allowed fraction of compared positions whose argmax is the same "
                             f"(default {MIN_ARGMAX_AGREEMENT:g}: all)")
    parser.add_argument("--decode-steps", type=int, default=4,
                        help="greedy decode steps the decode graph is checked over (default 4)")
    args = parser.parse_args(argv)
    problem = argument_problem(args)
    if problem:
        parser.error(problem)  # exit 2 before the (tens of seconds) export
    folder = model_folder(args.source)
    if args.onnx_decode is not None:
        from transformers import AutoConfig

        from headprune.deploy.onnx_decode import decode_problem

        problem = decode_problem(AutoConfig.from_pretrained(folder))
        if problem:
            parser.error(f"--onnx-decode: {problem}")
    try:
        from headprune.deploy.onnx import check_onnx, export_onnx, judge
        from headprune.deploy.onnx_decode import check_onnx_decode, export_onnx_decode, judge_decode
    except ImportError as err:  # pragma: no cover - the message is the point
        raise SystemExit(f"headprune-export needs the onnx extra: pip install \"headprune[onnx]\" ({err})") from None
    from headprune.deploy.hf import load_pruned

    model = load_pruned(folder).eval()
    bounds = {"tolerance": args.tolerance, "rel_tolerance": args.rel_tolerance, "min_argmax": args.min_argmax_agreement}
    jobs = []
    if args.onnx is not None:
        jobs.append(("onnx", args.onnx, export_onnx, check_onnx, judge))
    if args.onnx_decode is not None:
        jobs.append(("onnx_decode", args.onnx_decode, export_onnx_decode,
                     lambda m, p: check_onnx_decode(m, p, steps=args.decode_steps), judge_decode))
    failed = []
    for kind, path, export, check, verdict in jobs:
        start = time.perf_counter()
        export(model, path)
        seconds = time.perf_counter() - start
        report = {"source": str(folder), kind: str(path), "export_s": round(seconds, 1), "onnx_bytes": onnx_bytes(path),
                  **check(model, path)}
        failures = verdict(report, **bounds)
        report.update(bounds={"tolerance": args.tolerance, "rel_tolerance": args.rel_tolerance,
                              "min_argmax_agreement": args.min_argmax_agreement}, passed=not failures, failures=failures)
        write_json_atomic(path.with_suffix(".check.json"), report)
        print(json.dumps(report, indent=2))
        if failures:
            failed.append(f"--{kind.replace('_', '-')} {path}: " + "; ".join(failures))
    if not failed:
        return 0
    for line in failed:
        print(f"headprune-export: {line} (ONNX Runtime differs from PyTorch); exit 1", file=sys.stderr)
    return 1


def argument_problem(args: argparse.Namespace) -> str | None:
    """Why the arguments cannot work, checked before the export; None when they can."""
    if args.onnx is None and args.onnx_decode is None:
        return "nothing to write: give --onnx PATH (full-sequence graph), --onnx-decode PATH (causal LMs' decode graph) or both"
    for name, value in (("--tolerance", args.tolerance), ("--rel-tolerance", args.rel_tolerance)):
        if not math.isfinite(value) or value < 0:
            return f"{name} {value}: allowed: a finite number >= 0"
    if not 0 <= args.min_argmax_agreement <= 1:
        return f"--min-argmax-agreement {args.min_argmax_agreement}: allowed: a fraction in [0, 1]"
    if args.decode_steps < 1:
        return f"--decode-steps {args.decode_steps}: allowed: an integer >= 1"
    if args.onnx is not None and args.onnx_decode is not None and args.onnx.resolve() == args.onnx_decode.resolve():
        return f"--onnx and --onnx-decode are the same path ({args.onnx}); allowed: two different files"
    for name, onnx in (("--onnx", args.onnx), ("--onnx-decode", args.onnx_decode)):
        if onnx is None:
            continue
        if onnx.is_dir():
            return f"{name} {onnx}: is a folder; allowed: a file path (e.g. {onnx / 'model.onnx'})"
        for parent in onnx.parents:
            if parent.exists():
                if not parent.is_dir():
                    return f"{name} {onnx}: {parent} is a file, not a folder; allowed: a path in a folder"
                break
    return None


if __name__ == "__main__":
    sys.exit(main())
