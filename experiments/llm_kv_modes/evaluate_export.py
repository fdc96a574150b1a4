"""Finish a run whose process ended after its export was saved but before the export's evaluation
(on this shared machine the kernel's out-of-memory killer ended one during it): the evaluations
headprune-train runs on the export (`evaluation.llm_suite.evaluate_llm`, the settings and data of the
run's own results.json `config`), on the export loaded as the run loads it (`load_pruned`, float32,
CPU), written into the run's results.json as `evaluation.pruned` with `evaluation.pruned.by` naming
this script, and the stage's seconds.

    python experiments/llm_kv_modes/evaluate_export.py ../llmruns/llm_kv_modes/attention_mass
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from headprune.evaluation import llm_suite
from headprune.runs.components import build
from headprune.atomic import write_json_atomic
from headprune.deploy.hf import load_pruned
from headprune.models import load_tokenizer


def finish(run: Path) -> dict:
    path = run / "results.json"
    data = json.loads(path.read_text())
    if "pruned" in data.get("evaluation", {}):
        raise ValueError(f"{path} already holds evaluation.pruned")
    cfg = OmegaConf.create(data["config"])
    tokenizer = load_tokenizer(cfg.model.pretrained)
    datamodule = build(cfg.data, tokenizer=tokenizer)
    datamodule.setup("fit")
    settings = llm_suite.EvaluationSettings(**data["config"]["evaluation"])
    model = load_pruned(run / "export", device=torch.device("cpu"), dtype=torch.float32).eval()
    start = time.perf_counter()
    block = data.setdefault("evaluation", llm_suite.header(settings, datamodule))
    block["pruned"] = llm_suite.evaluate_llm(model, tokenizer, datamodule, settings, cfg.data.get("data_dir"))
    block["pruned"]["model"] = str(run / "export")
    block["pruned"]["by"] = "experiments/llm_kv_modes/evaluate_export.py (the run's process ended before this stage)"
    llm_suite.ruler_floor(block)  # the RULER mean over the tasks where dense scores >= 20%, when dense is in the file
    data.setdefault("stages", {})["evaluate_pruned"] = round(time.perf_counter() - start, 3)
    write_json_atomic(path, data)
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path)
    args = parser.parse_args()
    finish(args.run)


if __name__ == "__main__":
    main()
