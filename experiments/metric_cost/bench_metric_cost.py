"""Scoring cost of every head-importance metric, relative to one plain forward+backward pass.

MiniLM (all-MiniLM-L6-v2, 6 x 12 heads, sdpa attention) on a slice of SST-2 train sentences.
Each repeat times one plain pass (loss, backward to all weights, eval mode) over the batches
and then each metric over the same batches; the ratio is taken within a repeat and the
median over repeats is reported, since timings on shared CPUs are noisy.

    HF_HUB_OFFLINE=1 HEADPRUNE_DATA_DIR=../shared/data \
        python experiments/metric_cost/bench_metric_cost.py --samples 256 --repeats 3
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

from headprune.heads.mask import HeadMask
from headprune.data.classification import TextClassificationDataModule
from headprune.models import build_model, load_tokenizer
from headprune.tasks import CLASSIFICATION, forward_logits
from headprune.scoring import METRIC_INFO


def plain_pass(model, batches) -> None:
    model.eval()
    for batch in batches:
        CLASSIFICATION.loss(forward_logits(model, batch), batch).mean().backward()
    model.zero_grad(set_to_none=True)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--metrics", nargs="*", default=sorted(METRIC_INFO))
    parser.add_argument("--data-dir", default=os.environ.get("HEADPRUNE_DATA_DIR", "../shared/data"))
    args = parser.parse_args()

    torch.manual_seed(0)
    tokenizer = load_tokenizer("minilm")
    dm = TextClassificationDataModule(tokenizer, train_file="sst2/train.tsv", validation_file="sst2/validation.tsv",
                                      data_dir=args.data_dir, score_samples=args.samples, max_train_samples=0,
                                      max_validation_samples=0, max_length=args.max_length,
                                      eval_batch_size=args.batch_size)
    dm.setup()
    batches = list(dm.score_dataloader())
    model = build_model("minilm", num_labels=2)
    mask = HeadMask.for_model(model)

    plain_pass(model, batches)  # warm-up
    ratios: dict[str, list[float]] = {name: [] for name in args.metrics}
    seconds: dict[str, list[float]] = {name: [] for name in args.metrics}
    base_seconds = []
    for _ in range(args.repeats):
        for name in args.metrics:
            base = timed(lambda: plain_pass(model, batches))
            cost = timed(lambda: METRIC_INFO[name].fn(model, mask, batches))
            base_seconds.append(base)
            seconds[name].append(cost)
            ratios[name].append(cost / base)

    tokens = sum(int(b["attention_mask"].sum()) for b in batches)
    print(f"MiniLM-L6 (6 x 12 heads, sdpa), {args.samples} SST-2 sentences in {len(batches)} batches of "
          f"{args.batch_size} ({tokens} tokens), default metric options; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}; "
          f"plain forward+backward median {statistics.median(base_seconds):.2f} s; medians of {args.repeats} "
          "paired repeats.\n")
    print("| metric | scoring time (s) | cost / (forward+backward) | needs |")
    print("| --- | ---: | ---: | --- |")
    for name in sorted(args.metrics, key=lambda n: statistics.median(ratios[n])):
        print(f"| `{name}` | {statistics.median(seconds[name]):.2f} | {statistics.median(ratios[name]):.2f} | "
              f"{METRIC_INFO[name].uses} |")


if __name__ == "__main__":
    main()
