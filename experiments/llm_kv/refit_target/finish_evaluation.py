"""Finish the `evaluation.pruned` block of an llm_kv run whose process was killed after its export
was saved (the machine's out-of-memory killer ended the refit runs of 2026-12-01 during their
evaluation): the saved export is loaded as the app loads it (`load_pruned`, float32, CPU), the
data module is rebuilt from the run's own `.hydra/config.yaml`, and the same code as the app
(`headprune.evaluation.llm_suite.evaluate_llm`, the run's evaluation settings) evaluates it. The
run's results.json gains `evaluation` (header + pruned) and `finished_by` (this command, when,
why); nothing else in it changes.

    python experiments/llm_kv/refit_target/finish_evaluation.py experiments/llm_kv/runs/<arm>_<budget>
"""
from __future__ import annotations

import json
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path


def main(run: Path) -> None:
    import torch
    from omegaconf import OmegaConf

    from headprune.evaluation import llm_suite as evaluations
    from headprune.runs.components import build
    from headprune.apps.config_schema import register_schemas
    from headprune.deploy.hf import load_pruned
    from headprune.models import load_tokenizer

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    register_schemas()
    path = run / "results.json"
    res = json.loads(path.read_text())
    if "export_dir" not in res["final"]:
        raise SystemExit(f"{run}: no export saved; rerun the arm instead")
    cfg = OmegaConf.load(run / ".hydra" / "config.yaml")
    tokenizer = load_tokenizer(cfg.model.pretrained)
    datamodule = build(cfg.data, tokenizer=tokenizer)
    datamodule.setup("fit")
    options = evaluations.EvaluationSettings(**OmegaConf.to_container(cfg.evaluation, resolve=True))
    model = load_pruned(run / "export", device="cpu", dtype=torch.float32).eval()
    start = time.perf_counter()
    block = evaluations.header(options, datamodule)
    block["pruned"] = evaluations.evaluate_llm(model, tokenizer, datamodule, options, cfg.data.get("data_dir"))
    block["pruned"]["model"] = str(res["final"]["export_dir"])
    res["evaluation"] = block
    res.setdefault("stages", {})["evaluate_pruned"] = round(time.perf_counter() - start, 3)
    res["finished_by"] = {"command": "python experiments/llm_kv/refit_target/finish_evaluation.py " + str(run),
                          "at": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
                          "why": "the run's process was killed (out of memory) during its evaluation, after the export",
                          "threads": torch.get_num_threads()}
    path.write_text(json.dumps(res, indent=2) + "\n")
    print({k: v["ppl"] for k, v in block["pruned"]["perplexity"].items()}, flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
