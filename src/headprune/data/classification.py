"""Text-classification DataModule: local TSV/CSV/JSONL files or a `datasets` hub dataset.

The training file is split once, with a seed, into a held-out *scoring slice*
(`score_samples`, used only to rank heads), an optional held-out *selection slice*
(`select_samples`, what a stopping rule such as `until_threshold` decides on) and the training
pool (capped at `max_train_samples`). Results are reported on the validation file, which is
never scored or decided on.
"""
from __future__ import annotations

import logging
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader
from transformers import DataCollatorWithPadding

from headprune.data.loaders import seeded_loader
from headprune.data.textdata import TextTable, encode_labels, label_vocabulary, read_table, resolve_data_file

log = logging.getLogger(__name__)


class TextClassificationDataModule(L.LightningDataModule):
    def __init__(self, tokenizer, train_file: str | None = None, validation_file: str | None = None,
                 data_dir: str | None = None, text_column="sentence", label_column="label",
                 text_pair_column=None, header: bool = True, delimiter: str | None = None,
                 hub: dict | None = None, max_train_samples: int | None = None,
                 max_validation_samples: int | None = None, score_samples: int = 512,
                 max_length: int = 128, batch_size: int = 32, eval_batch_size: int = 64,
                 num_workers: int = 0, seed: int = 0, name: str | None = None, select_samples: int = 0):
        super().__init__()
        self.tokenizer = tokenizer
        self.train_file, self.validation_file = train_file, validation_file
        self.data_dir = data_dir
        self.text_column, self.label_column, self.text_pair_column = text_column, label_column, text_pair_column
        self.header, self.delimiter, self.hub = header, delimiter, hub
        for field, value in (("max_train_samples", max_train_samples), ("score_samples", score_samples),
                             ("max_validation_samples", max_validation_samples), ("select_samples", select_samples)):
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"data.{field}={value!r} must be a non-negative integer or null")
        if not isinstance(max_length, int) or max_length < 2:
            raise ValueError(f"data.max_length={max_length!r} must be an integer >= 2")
        self.max_train_samples, self.max_validation_samples = max_train_samples, max_validation_samples
        self.score_samples, self.select_samples, self.max_length = score_samples, select_samples, max_length
        self.batch_size, self.eval_batch_size, self.num_workers = batch_size, eval_batch_size, num_workers
        self.seed, self.name = seed, name
        self.collate = DataCollatorWithPadding(tokenizer)
        self._loaded = False

    # -- reading -----------------------------------------------------------------------------
    def _read_local(self) -> tuple[TextTable, TextTable]:
        kwargs = dict(text_column=self.text_column, label_column=self.label_column,
                      text_pair_column=self.text_pair_column, header=self.header, delimiter=self.delimiter)
        return (read_table(resolve_data_file("train_file", self.train_file, self.data_dir), **kwargs),
                read_table(resolve_data_file("validation_file", self.validation_file, self.data_dir), **kwargs))

    def _read_hub(self) -> tuple[TextTable, TextTable]:
        from datasets import load_dataset

        ds = load_dataset(self.hub["path"], self.hub.get("name"))

        def table(split: str) -> TextTable:
            part = ds[split]
            for field, col in (("text_column", self.text_column), ("label_column", self.label_column)):
                if col not in part.column_names:
                    raise ValueError(f"data.{field}={col!r} is not a column of {self.hub['path']}; "
                                     f"columns: {part.column_names}")
            pairs = part[self.text_pair_column] if self.text_pair_column else None
            return TextTable(list(part[self.text_column]), pairs, list(part[self.label_column]))

        return table(self.hub.get("train_split", "train")), table(self.hub.get("validation_split", "validation"))

    def _use_local(self) -> bool:
        return bool(self.data_dir) or not self.hub or Path(str(self.train_file or "")).is_absolute()

    def setup(self, stage: str | None = None) -> None:
        if self._loaded:
            return
        model_max = getattr(self.tokenizer, "model_max_length", None)
        if model_max and model_max < 100_000 and self.max_length > model_max:
            log.warning("data.max_length=%d exceeds what the model accepts (%d tokens); using %d",
                        self.max_length, model_max, model_max)
            self.max_length = int(model_max)
        train, val = self._read_local() if self._use_local() else self._read_hub()
        if not train.texts:
            raise ValueError("the training data is empty")
        self.label_ids = label_vocabulary(train.labels)
        self.num_labels = len(self.label_ids)
        log.info("classes (label -> id, from the training data): %s",
                 ", ".join(f"{label!r} -> {i}" for label, i in self.label_ids.items()))
        if self.num_labels < 2:
            raise ValueError(f"the training data has a single class {sorted(self.label_ids)}: "
                             "classification needs at least two")
        train_y = encode_labels(train.labels, self.label_ids, "data.train_file")
        val_y = encode_labels(val.labels, self.label_ids, "data.validation_file")

        g = torch.Generator().manual_seed(self.seed)
        order = torch.randperm(len(train.texts), generator=g).tolist()
        held = self.score_samples + self.select_samples
        if held >= len(order):
            raise ValueError(f"data.score_samples={self.score_samples} (+ {self.select_samples} selection examples) "
                             f"leaves no training data ({len(order)} training rows)")
        score_idx, select_idx = order[:self.score_samples], order[self.score_samples:held]
        train_idx = order[held:]
        if self.max_train_samples is not None:
            train_idx = train_idx[:self.max_train_samples]
        val_idx = list(range(len(val.texts)))[:self.max_validation_samples]

        self.train_set = self._encode(train, train_y, train_idx)
        self.score_set = self._encode(train, train_y, score_idx)
        self.select_set = self._encode(train, train_y, select_idx)
        self.val_set = self._encode(val, val_y, val_idx)
        self._loaded = True
        clipped = sum(len(x["input_ids"]) >= self.max_length
                      for x in self.train_set + self.score_set + self.select_set + self.val_set)
        if clipped:
            log.warning("%d examples reached data.max_length=%d tokens and were truncated to it", clipped,
                        self.max_length)

    def _encode(self, table: TextTable, labels: list[int], idx: list[int]) -> list[dict]:
        if not idx:
            return []
        texts = [table.texts[i] for i in idx]
        pairs = [table.pairs[i] for i in idx] if table.pairs is not None else None
        enc = self.tokenizer(texts, pairs, truncation=True, max_length=self.max_length)
        keys = [k for k in ("input_ids", "attention_mask", "token_type_ids") if k in enc]
        return [dict({k: enc[k][j] for k in keys}, labels=labels[i]) for j, i in enumerate(idx)]

    # -- loaders -----------------------------------------------------------------------------
    def _loader(self, data: list[dict], batch_size: int, shuffle: bool) -> DataLoader:
        return seeded_loader(data, batch_size, shuffle, self.seed, self.num_workers, collate_fn=self.collate)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, self.eval_batch_size, shuffle=False)

    def select_dataloader(self) -> DataLoader:
        """The held-out selection slice of the training file that stopping rules decide on."""
        if not self.select_set:
            raise ValueError("no selection slice: set select_samples > 0 (schedule=until_threshold sets it)")
        return self._loader(self.select_set, self.eval_batch_size, shuffle=False)

    def score_dataloader(self, rank: int = 0, world_size: int = 1) -> DataLoader:
        """The held-out slice of the training file that heads are ranked on; under data
        parallelism each rank gets every `world_size`-th example starting at `rank`, and the
        metrics sum their accumulators across ranks."""
        return self._loader(self.score_set[rank::world_size], self.eval_batch_size, shuffle=False)
