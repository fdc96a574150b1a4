"""Causal-LM DataModule over one plain-text corpus (a local file, or hub splits joined in order).

The text is tokenized once (with the byte tokenizer a token is a byte). The first
`1 - validation_share` of the tokens are the training part and the rest is validation:
contiguous, so no validation text is ever trained on (random blocks of a running text would
share passages across the split). Each part is cut into non-overlapping blocks of `block_size`
tokens, the incomplete tail dropped. `score_samples` blocks, drawn with `seed` from the training
part, are held out to rank heads; the other training blocks (capped at `max_train_samples`) are
trained on, reshuffled every epoch. `calibration_corpora` (e.g. [tinyshakespeare, sst2]) draws
the score blocks from several corpora instead, `score_samples` split evenly in the listed order
(the first ones get the remainder): the data's own corpus (its `name`) as above, any other
corpus of headprune.data.corpora from that corpus's training part (never its held-out part,
which the evaluation's other-corpus perplexity and the last-word task read). `calibration` (self |
mix) replaces all or half of the score blocks, and of the training blocks, by text the dense model
samples itself (headprune.data.self_calibration; `use_generated`, called once the model is
loaded). Batches are {"input_ids": (B, block_size)}: every token is
real, and the model learns to predict each next token of a block from the ones before it.
"""
from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from headprune.data.loaders import seeded_loader
from headprune.data.self_calibration import SelfCalibration, generated_share
from headprune.data.textdata import resolve_data_file

log = logging.getLogger(__name__)


# A corpus's token ids, per process: (text digest, tokenizer fingerprint) -> (N,) ids, the newest
# last. One process often runs many runs over one corpus (a sweep's trials, a test module), and
# tokenizing the whole of Tiny Shakespeare took ~2.7 s of a tiny model's ~5.5 s run.
_TOKENIZED: OrderedDict[tuple[str, str], torch.Tensor] = OrderedDict()
_TOKENIZED_KEEP = 4  # corpora x tokenizers kept (Tiny Shakespeare: 1.1M ids, 9 MB each)


def tokenizer_fingerprint(tokenizer) -> str | None:
    """A digest of what a fast (Rust-backed) tokenizer encodes with: its class, its Python-side
    `split_special_tokens` and its whole JSON (vocabulary, merges, normalizer, pre-tokenizer, added
    tokens; SmolLM2's: ~0.2 s). None for any other tokenizer, whose ids are then never reused."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    what = f"{type(tokenizer).__qualname__}\n{getattr(tokenizer, 'split_special_tokens', None)}\n{backend.to_str()}"
    return hashlib.blake2b(what.encode(), digest_size=16).hexdigest()


def tokenize_corpus(tokenizer, text: str) -> torch.Tensor:
    """`text`'s token ids (N,), without special tokens: encoded once per process for each text and
    fast tokenizer (a copy of the first encoding afterwards, so no run sees another's tensor)."""
    fingerprint = tokenizer_fingerprint(tokenizer)
    key = None if fingerprint is None else (hashlib.blake2b(text.encode(), digest_size=16).hexdigest(), fingerprint)
    if key in _TOKENIZED:
        _TOKENIZED.move_to_end(key)
        return _TOKENIZED[key].clone()
    ids = torch.tensor(tokenizer.encode(text, add_special_tokens=False), dtype=torch.long)  # (N,)
    if key is not None:
        _TOKENIZED[key] = ids.clone()
        while len(_TOKENIZED) > _TOKENIZED_KEEP:
            _TOKENIZED.popitem(last=False)
    return ids


def held_out_start(n_tokens: int, validation_share: float) -> int:
    """Where the held-out part of an `n_tokens` corpus starts: round((1 - validation_share) *
    n_tokens). The one split rule: training blocks, score blocks, `val` blocks and every
    evaluation window (headprune.evaluation) read it from here."""
    return round((1 - validation_share) * n_tokens)


def split_blocks(n_tokens: int, block_size: int, validation_share: float, score_samples: int,
                 seed: int) -> dict[str, list[int]]:
    """Start offsets of the "train", "score" and "validation" blocks of an `n_tokens` corpus.

    Train and score blocks lie in [0, cut), validation blocks in [cut, n_tokens), where
    cut = held_out_start(n_tokens, validation_share); blocks never overlap. The score blocks are a
    seeded random choice of the training part's blocks, listed in text order.
    """
    cut = held_out_start(n_tokens, validation_share)
    train = list(range(0, cut - block_size + 1, block_size))
    validation = list(range(cut, n_tokens - block_size + 1, block_size))
    if not validation:
        raise ValueError(f"data.validation_share={validation_share} leaves {n_tokens - cut} validation tokens, "
                         f"less than one block (data.block_size={block_size})")
    if score_samples >= len(train):
        raise ValueError(f"data.score_samples={score_samples} leaves no training data ({len(train)} training "
                         f"blocks of data.block_size={block_size} tokens)")
    g = torch.Generator().manual_seed(seed)
    held = set(torch.randperm(len(train), generator=g)[:score_samples].tolist())
    return {"train": [s for i, s in enumerate(train) if i not in held],
            "score": [s for i, s in enumerate(train) if i in held],
            "validation": validation}


class Blocks(Dataset):
    """Fixed-length windows of one token tensor: item i is {"input_ids": ids[start_i : start_i + size]}."""

    def __init__(self, ids: torch.Tensor, starts: list[int], size: int):
        self.ids, self.starts, self.size = ids, starts, size

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict:
        start = self.starts[i]
        return {"input_ids": self.ids[start:start + self.size]}  # (block_size,)


class TextLMDataModule(L.LightningDataModule):
    """Blocks of one text for causal-LM training, head scoring and validation (see the module doc)."""

    task = "causal_lm"
    num_labels = None

    def __init__(self, tokenizer, file: str | None = None, data_dir: str | None = None, hub: dict | None = None,
                 block_size: int = 128, validation_share: float = 0.1, score_samples: int = 64,
                 max_train_samples: int | None = None, max_validation_samples: int | None = None,
                 batch_size: int = 32, eval_batch_size: int = 64, num_workers: int = 0, seed: int = 0,
                 name: str | None = None, calibration_corpora: list[str] | None = None,
                 calibration: str = "corpus", self_calibration: dict | None = None):
        super().__init__()
        if not isinstance(block_size, int) or block_size < 2:
            raise ValueError(f"data.block_size={block_size!r} must be an integer >= 2 (one input and one target)")
        if not isinstance(validation_share, (int, float)) or not 0 < validation_share < 1:
            raise ValueError(f"data.validation_share={validation_share!r} must be in (0, 1)")
        for field, value in (("score_samples", score_samples), ("max_train_samples", max_train_samples),
                             ("max_validation_samples", max_validation_samples)):
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"data.{field}={value!r} must be a non-negative integer or null")
        self.tokenizer, self.file, self.data_dir, self.hub = tokenizer, file, data_dir, hub
        self.block_size, self.validation_share, self.score_samples = block_size, validation_share, score_samples
        self.max_train_samples, self.max_validation_samples = max_train_samples, max_validation_samples
        self.batch_size, self.eval_batch_size, self.num_workers = batch_size, eval_batch_size, num_workers
        self.seed, self.name = seed, name
        self.calibration_corpora = self._check_calibration(calibration_corpora)
        self.calibration = calibration
        self.self_calibration = SelfCalibration.of(self_calibration, calibration)
        if calibration != "corpus" and self.calibration_corpora:
            raise ValueError(f"data.calibration={calibration} with data.calibration_corpora="
                             f"{self.calibration_corpora}; allowed: one of them (data.calibration=corpus, or "
                             "data.calibration_corpora=null)")
        self._loaded = False

    def _check_calibration(self, names) -> list[str]:
        """The listed corpora, or an error naming data.calibration_corpora and what is allowed."""
        from headprune.data.corpora import CORPORA

        names = list(names or [])
        allowed = list(dict.fromkeys([*([self.name] if self.name else []), *CORPORA]))
        unknown = [n for n in names if n not in allowed]
        if unknown or len(set(names)) != len(names):
            what = f"unknown {unknown}" if unknown else "a corpus named twice"
            raise ValueError(f"data.calibration_corpora={names}: {what}; allowed: a list of distinct names from "
                             f"{', '.join(allowed)} (null: the data's own corpus only)")
        if names and self.score_samples < len(names):
            raise ValueError(f"data.score_samples={self.score_samples} cannot be split over the {len(names)} "
                             f"data.calibration_corpora {names}; allowed: at least {len(names)}")
        return names

    def calibration_counts(self) -> dict[str, int]:
        """{corpus: score blocks drawn from it}: `score_samples` split evenly in the listed order."""
        names = self.calibration_corpora or [self.name or "text"]
        base, extra = divmod(self.score_samples, len(names))
        return {name: base + int(i < extra) for i, name in enumerate(names)}

    def _other_score_blocks(self, name: str, count: int, index: int) -> list[torch.Tensor]:
        """`count` seeded blocks of corpus `name`'s training part, in text order."""
        from headprune.data.corpora import corpus_ids

        ids = corpus_ids(name, "train", self.tokenizer, self.data_dir, "data.calibration_corpora")
        starts = list(range(0, len(ids) - self.block_size + 1, self.block_size))
        if count > len(starts):
            raise ValueError(f"data.calibration_corpora: {name!r} has {len(starts)} training blocks of "
                             f"data.block_size={self.block_size} tokens, fewer than the {count} asked for")
        g = torch.Generator().manual_seed(self.seed + 1000 * (index + 1))
        chosen = sorted(torch.randperm(len(starts), generator=g)[:count].tolist())
        return [ids[starts[i]:starts[i] + self.block_size] for i in chosen]

    # -- reading -----------------------------------------------------------------------------
    def _use_local(self) -> bool:
        return bool(self.data_dir) or not self.hub or Path(str(self.file or "")).is_absolute()

    def _read_local(self) -> str:
        path = resolve_data_file("file", self.file, self.data_dir)
        try:
            return path.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"data.file: {path} is not UTF-8 text ({err.reason} at byte {err.start})") from None

    def _read_hub(self) -> str:
        """The hub dataset's `splits` joined in order (e.g. a corpus the hub split 90/5/5 by position)."""
        from datasets import load_dataset

        hub = dict(self.hub)
        column, splits = hub.pop("text_column", "text"), hub.pop("splits", ["train"])
        ds = load_dataset(hub.pop("path"), hub.pop("name", None), **{k: v for k, v in hub.items() if v is not None})
        parts = []
        for split in splits:
            if split not in ds:
                raise ValueError(f"data.hub.splits: {split!r} is not a split of {self.hub['path']}; splits: {list(ds)}")
            if column not in ds[split].column_names:
                raise ValueError(f"data.hub.text_column={column!r} is not a column of {self.hub['path']}; "
                                 f"columns: {ds[split].column_names}")
            parts += list(ds[split][column])
        return "".join(parts)

    def setup(self, stage: str | None = None) -> None:
        if self._loaded:
            return
        text = self._read_local() if self._use_local() else self._read_hub()
        ids = tokenize_corpus(self.tokenizer, text)  # (N,)
        counts = self.calibration_counts()
        own = counts.get(self.name or "text", 0) - generated_share(self.calibration, self.score_samples)
        starts = split_blocks(len(ids), self.block_size, self.validation_share, own, self.seed)
        train = starts["train"][:self.max_train_samples]
        validation = starts["validation"][:self.max_validation_samples]
        self.train_set = Blocks(ids, train, self.block_size)
        if self.calibration_corpora:  # the listed corpora's blocks, one after another, as one token run
            blocks = []
            for index, (name, count) in enumerate(counts.items()):
                blocks += ([ids[s:s + self.block_size] for s in starts["score"]] if name == (self.name or "text")
                           else self._other_score_blocks(name, count, index))
            self.score_set = Blocks(torch.cat(blocks), [i * self.block_size for i in range(len(blocks))],
                                    self.block_size)
            log.info("calibration: %s score blocks of %d tokens", counts, self.block_size)
        else:
            self.score_set = Blocks(ids, starts["score"], self.block_size)
        self.val_set = Blocks(ids, validation, self.block_size)
        # the held-out tail as one token run (perplexity windows of any length over the same tokens)
        self.held_out_ids = ids[held_out_start(len(ids), self.validation_share):]  # (N_val,)
        self._loaded = True
        log.info("%s: %d tokens -> %d train, %d score, %d validation blocks of %d tokens", self.name or "text",
                 len(ids), len(train), len(starts["score"]), len(validation), self.block_size)

    def generated_counts(self) -> tuple[int, int]:
        """(score blocks, training blocks) the dense model is to sample under `calibration`."""
        return (generated_share(self.calibration, self.score_samples),
                generated_share(self.calibration, self.self_calibration.train_samples))

    def use_generated(self, score: torch.Tensor, train: torch.Tensor) -> dict:
        """Put the sampled blocks (N, block_size) in: the score set becomes the corpus's remaining
        score blocks then `score`; when `train` holds blocks, the training set becomes `train`
        (self) or as many of the corpus's training blocks first (mix: train_samples - train_samples
        // 2 of them, in text order). Returns the calibration record for results.json."""
        want = self.generated_counts()
        if (len(score), len(train)) != want or (score.numel() and score.shape[1] != self.block_size) or \
                (train.numel() and train.shape[1] != self.block_size):
            raise ValueError(f"use_generated: {tuple(score.shape)} score and {tuple(train.shape)} training blocks, "
                             f"expected {want} of {self.block_size} tokens")
        corpus = [self.score_set.ids[s:s + self.block_size] for s in self.score_set.starts]
        blocks = corpus + list(score)
        self.score_set = Blocks(torch.cat(blocks), [i * self.block_size for i in range(len(blocks))], self.block_size)
        corpus_train = 0
        if len(train):
            corpus_train = self.self_calibration.train_samples - len(train)
            if corpus_train > len(self.train_set):
                raise ValueError(f"data.self_calibration.train_samples={self.self_calibration.train_samples}: the "
                                 f"corpus has {len(self.train_set)} training blocks, fewer than the {corpus_train} mix "
                                 "takes from it")
            kept = [self.train_set.ids[s:s + self.block_size] for s in self.train_set.starts[:corpus_train]]
            rows = kept + list(train)
            self.train_set = Blocks(torch.cat(rows), [i * self.block_size for i in range(len(rows))], self.block_size)
        log.info("calibration=%s: %d corpus + %d generated score blocks, %d corpus + %d generated training blocks",
                 self.calibration, len(corpus), len(score), corpus_train, len(train))
        return {"source": self.calibration, "score_blocks": {"corpus": len(corpus), "self": len(score)},
                "train_blocks": {"corpus": corpus_train, "self": len(train)} if len(train) else None,
                "block_size": self.block_size, "tokens": len(blocks) * self.block_size}

    def calibration_record(self) -> dict:
        """results.json `calibration` of a run calibrated on corpora only."""
        return {"source": "corpus", "score_blocks": self.calibration_counts(), "block_size": self.block_size,
                "tokens": len(self.score_set) * self.block_size}

    def val_windows(self) -> dict:
        """What `val` is measured on, in the keys of an evaluation perplexity record: `windows`
        blocks of `seq` = block_size tokens from the held-out part's first token, fed as trained
        on, without BOS, so the first token of each block is context only (`targets`)."""
        n = len(self.val_set)
        return {"seq": self.block_size, "windows": n, "tokens": n * self.block_size,
                "targets": n * (self.block_size - 1), "bos": False}

    # -- loaders -----------------------------------------------------------------------------
    def _loader(self, data: Dataset, batch_size: int, shuffle: bool) -> DataLoader:
        return seeded_loader(data, batch_size, shuffle, self.seed, self.num_workers)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, self.eval_batch_size, shuffle=False)

    def score_dataloader(self, rank: int = 0, world_size: int = 1) -> DataLoader:
        """The held-out training blocks heads are ranked on; under data parallelism each rank gets
        every `world_size`-th block starting at `rank`."""
        shard = Blocks(self.score_set.ids, self.score_set.starts[rank::world_size], self.block_size)
        return self._loader(shard, self.eval_batch_size, shuffle=False)
