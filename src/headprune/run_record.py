"""A run's results.json read back as a typed record, its evaluation's corpora named.

headprune-train writes a causal-LM run's perplexities in two places (evaluation.llm_suite): the
corpus the run was trained and calibrated on (`config.data.name`, Tiny Shakespeare in the
experiments) under `evaluation.<which>.perplexity`, every other corpus under
`evaluation.<which>.perplexity_other.<corpus>`. A reader that hard-codes "perplexity means Tiny
Shakespeare" breaks the day a run uses another corpus; this record names the main corpus from the
run's own settings, so `record.ppl("pruned", 2048, "sst2")` and `record.ppl("pruned", 2048)` (the
main corpus) read the right block whatever the run was trained on.

    record = read_record(Path("experiments/llm_kv/results/fisher_kv67.json"))
    record.main_corpus                          # 'tinyshakespeare'
    record.evaluation["pruned"].ppl(2048)       # perplexity at seq 2048 on the main corpus
    record.ppl("dense", 128, "sst2")            # None when the run did not measure it
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WHICH = ("dense", "pruned")


def seq_key(seq: int | str) -> str:
    """The key a perplexity is stored under: 2048 or "seq2048" -> "seq2048"."""
    return seq if isinstance(seq, str) and seq.startswith("seq") else f"seq{int(seq)}"


@dataclass(frozen=True)
class Evaluation:
    """One evaluation block (`dense` or `pruned`): its perplexities by corpus, the main corpus
    named, and the raw block for everything else it holds (zero_shot, generation, ruler...)."""

    main_corpus: str
    perplexity: dict[str, dict[str, dict]]  # corpus -> "seq<N>" -> {"ppl": ..., "windows": ...}
    block: dict = field(repr=False)

    @classmethod
    def of(cls, block: dict, main_corpus: str, where: str = "evaluation") -> "Evaluation":
        """The block as written by evaluation.llm_suite; refused, naming `where`, when an other corpus
        has the main corpus's name (the two would be the same key)."""
        other = block.get("perplexity_other") or {}
        if main_corpus in other:
            raise ValueError(f"{where}.perplexity_other holds {main_corpus!r}, the run's main corpus "
                             "(config.data.name): its perplexity belongs under perplexity")
        return cls(main_corpus, {main_corpus: block.get("perplexity") or {}, **other}, block)

    @property
    def corpora(self) -> list[str]:
        """The corpora measured, the main one first."""
        return list(self.perplexity)

    def ppl(self, seq: int | str, corpus: str | None = None) -> float | None:
        """The perplexity at `seq` (2048 or "seq2048") on `corpus` (default: the main corpus);
        None when the block did not measure it."""
        return (self.perplexity.get(corpus or self.main_corpus, {}).get(seq_key(seq)) or {}).get("ppl")

    def get(self, key: str, default: Any = None) -> Any:
        """Any other field of the raw block (`zero_shot`, `generation`, ...)."""
        return self.block.get(key, default)


@dataclass(frozen=True)
class RunRecord:
    """A run's results.json: its name, the main corpus of its evaluation (`config.data.name`), its
    evaluation blocks (those present of dense and pruned) and the raw document."""

    name: str
    main_corpus: str
    evaluation: dict[str, Evaluation]
    data: dict = field(repr=False)

    @property
    def config(self) -> dict:
        return self.data["config"]

    def ppl(self, which: str, seq: int | str, corpus: str | None = None) -> float | None:
        """evaluation.<which>'s perplexity at `seq` on `corpus` (default the main one); None when
        that block or that figure is missing."""
        if which not in WHICH:
            raise ValueError(f"which={which!r}; allowed: {', '.join(WHICH)}")
        block = self.evaluation.get(which)
        return None if block is None else block.ppl(seq, corpus)


def record(data: dict, name: str, where: str | None = None) -> RunRecord:
    """The record of an already parsed results document; `where` (default `name`) names it in errors."""
    where = where or name
    data_config = (data.get("config") or {}).get("data") if isinstance(data, dict) else None
    main = data_config.get("name") if isinstance(data_config, dict) else None
    if not isinstance(main, str) or not main:
        raise ValueError(f"{where}: config.data.name is missing, so the main corpus of its evaluation is unknown; "
                         "allowed: a results.json written by headprune-train (its config holds data.name)")
    blocks = data.get("evaluation") or {}
    evaluation = {w: Evaluation.of(blocks[w], main, f"{where}: evaluation.{w}") for w in WHICH if w in blocks}
    return RunRecord(name, main, evaluation, data)


def read_record(path: Path, name: str | None = None) -> RunRecord:
    """The record of the results file `path` (a run's results.json, or an experiment's copy of it,
    named by its stem unless `name`)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: cannot be read as a run's results ({err})") from None
    return record(data, name or (path.parent.name if path.name == "results.json" else path.stem), str(path))


def records(runs: dict[str, dict]) -> dict[str, RunRecord]:
    """{name: record} of parsed results documents ({name: data}, as report.load_results gives)."""
    return {name: record(data, name) for name, data in runs.items()}


def dense_of(runs: dict[str, RunRecord]) -> Evaluation:
    """The dense model's evaluation, from the first record that holds evaluation.dense; a
    ValueError when none does."""
    for run in runs.values():
        if "dense" in run.evaluation:
            return run.evaluation["dense"]
    raise ValueError("no run holds evaluation.dense: run one arm with evaluation.dense=true")
