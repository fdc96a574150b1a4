"""`headprune-evaluate`: finish or redo a causal-LM run's evaluations (`runs/evaluate.py`).

    headprune-evaluate <run dir>                      # the blocks the run did not finish (its export's, say)
    headprune-evaluate <run dir>/export               # evaluation.pruned of that run's export
    headprune-evaluate <run dir> --which pruned --redo
    headprune-evaluate <run dir> --which dense --which pruned --redo evaluation.passkey_samples=10
    headprune-evaluate <folder> --settings <run dir> --out eval.json   # an export outside any run

The evaluations are the run's own (`evaluation:` of its results.json `config`, the same data and
code as headprune-train), on the dense model built as the run built it and on the export loaded
from its folder as a user loads it. Each block written records `by` (this command, when, the
torch threads) and its seconds under `stages`. A changed setting (`evaluation.<field>=<value>`)
is accepted only when dense and pruned are both computed again, so the two stay comparable.
A path that is not a run, a block already there without --redo, a missing export, an unknown
setting or an existing --out exit 2 with the reason before any model is loaded; results.json is
rewritten once, atomically, at the end.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", type=Path, help="a headprune-train run dir, its export/ folder, or a save_pruned folder")
    parser.add_argument("overrides", nargs="*", metavar="evaluation.FIELD=VALUE",
                        help="evaluation settings changed from the run's (dense and pruned then both again)")
    parser.add_argument("--which", action="append", choices=["dense", "pruned"],
                        help="the block to compute (repeatable; default: the missing ones)")
    parser.add_argument("--redo", action="store_true", help="compute a block that is already there again")
    parser.add_argument("--settings", type=Path, help="for a folder outside any run: the run whose settings and data apply")
    parser.add_argument("--out", type=Path, help="for a folder outside any run: the new JSON file to write")
    parser.add_argument("--device", default="cpu", help="where the models run (default cpu)")
    args = parser.parse_intermixed_args(argv)
    from headprune.runs.evaluate import evaluate

    command = "headprune-evaluate " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    try:
        doc = evaluate(args.path, which=args.which, redo=args.redo, overrides=args.overrides,
                       settings_from=args.settings, out=args.out, device=args.device, command=command)
    except (ValueError, FileNotFoundError) as err:
        parser.error(str(err))
    block = doc["evaluation"]
    for which in ("dense", "pruned"):
        if which in block:
            ppl = {k: v["ppl"] for k, v in block[which].get("perplexity", {}).items()}
            print(f"{which}: perplexity {ppl}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
