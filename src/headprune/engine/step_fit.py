"""A recovery's step budget as a Lightning fit: `fit_steps` trains a model's parameters that
require grad for `steps` optimizer steps of a loss, through a Lightning Trainer built from the
run's `Runtime` (device, precision, strategy, gradient accumulation), so a KL, LoRA or next-token
recovery inherits DDP / FSDP, bf16, accumulation, clipping, the loggers, the progress bar and
checkpoints instead of a hand-written loop.

Why a small LightningModule of its own (`StepModule`) rather than the run's `HeadPruneModule`:
the recovery has its own loss, optimizer (AdamW, weight decay 0), learning-rate schedule (linear
warm-up over the first tenth, cosine to zero: `lr_schedules.warmup_cosine`) and step budget, and
runs after a round inside a run with or without a Trainer of its own; it wraps the same
`nn.Module` (the heads stay masked by the mask's hooks, or physically removed), so nothing is
copied. The teacher (if any) lives in the loss function, never in the module: it is not trained,
not wrapped by DDP and not in the checkpoints.

Data order is a function of the step (`StepBatches`): micro-batch m of the fit is examples
[m*B, (m+1)*B) of an endless stream of seeded permutations of the training examples. Under
data parallelism rank r takes micro-batches m = s*W*A + r*A + a of optimizer step s (W ranks, A
accumulated micro-batches), so two processes see what one process accumulating two micro-batches
sees. A resumed fit starts the stream at its checkpoint's step: the same batches, in the same
order, as the uninterrupted fit. Checkpoints (`StepCheckpoint`) are written atomically every
`checkpoint_every` steps and at the end, with what the caller adds (`FitPlan.run_state`, e.g. the
pruning run's state) so a killed run can continue from them.
"""
from __future__ import annotations

import logging
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import lightning as L
import torch
from lightning.pytorch.callbacks import Checkpoint, TQDMProgressBar
from torch import nn
from torch.utils.data import DataLoader, Sampler

from headprune.engine.runtime import Runtime
from headprune.lr_schedules import warmup_cosine

log = logging.getLogger(__name__)
WINDOW = 10  # optimizer steps averaged for the first and last loss in the report (fewer in a short fit)
CHECKPOINT = "last.ckpt"
RUN_STATE = "headprune_run"  # the checkpoint key of what the caller adds (FitPlan.run_state)


@dataclass
class FitPlan:
    """Where and how a step budget trains: `runtime` (None: one process on the model's device, its
    dtype, 32-true); `checkpoint_dir` (None: no checkpoints) and `checkpoint_every` (optimizer steps
    between checkpoints; 0: only at the end); `loggers`: Lightning loggers the fit logs to;
    `run_state()`: what each checkpoint also holds under RUN_STATE; `resume_from`: a checkpoint
    of this fit to continue; `seed`: the data order's seed."""

    runtime: Runtime | None = None
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 0
    loggers: list = field(default_factory=list)
    run_state: Callable[[], dict] | None = None
    resume_from: Path | None = None
    seed: int = 0


class StepBatches(Sampler):
    """Index lists of one rank's micro-batches for optimizer steps [start, steps) (module docstring).
    `shuffle=False` keeps the examples' order in every pass (pre-made batches)."""

    def __init__(self, n: int, batch_size: int, steps: int, *, accumulate: int = 1, rank: int = 0, world: int = 1,
                 start: int = 0, seed: int = 0, shuffle: bool = True):
        if n < 1:
            raise ValueError("the training data holds no example")
        self.n, self.batch_size, self.steps, self.accumulate = n, batch_size, steps, accumulate
        self.rank, self.world, self.start, self.seed, self.shuffle = rank, world, start, seed, shuffle
        self._orders: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        # the whole fit's micro-batches, also when it resumes: Lightning's epoch bookkeeping counts
        # the batches it already saw before the checkpoint; the iterator starts after them
        return self.steps * self.accumulate

    def __iter__(self) -> Iterator[list[int]]:
        for j in range(self.start * self.accumulate, self.steps * self.accumulate):
            step, a = divmod(j, self.accumulate)
            m = step * self.world * self.accumulate + self.rank * self.accumulate + a
            yield [self._example(m * self.batch_size + t) for t in range(self.batch_size)]

    def _example(self, position: int) -> int:
        passes, offset = divmod(position, self.n)
        if not self.shuffle:
            return offset
        if passes not in self._orders:
            self._orders = {passes: torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + passes))}
        return int(self._orders[passes][offset])


EXAMPLE_INDEX = "example_index"  # a batch's (B,) positions of its examples in the training data


def training_examples(loader: Iterable) -> tuple[Any, Callable[[list], dict], int, bool]:
    """(examples, collate, batch size, shuffled) of a training loader: a torch DataLoader's dataset,
    collate function and batch size, re-sampled by step; any other iterable of batches is taken as
    a list of pre-made micro-batches, cycled in order (an "example" is then a whole batch)."""
    if isinstance(loader, DataLoader) and loader.batch_size is not None:
        return loader.dataset, loader.collate_fn, loader.batch_size, True
    batches = list(loader)
    if not batches:
        raise ValueError("the training loader yields no batches")
    return batches, lambda items: items[0], 1, False


def step_loader(loader: Iterable, steps: int, runtime: Runtime, start: int, seed: int) -> DataLoader:
    """The fit's loader over `loader`'s examples (`training_examples`), in the step order of
    `StepBatches`; each batch also carries EXAMPLE_INDEX (where a cached teacher looks it up)."""
    examples, collate, batch_size, shuffle = training_examples(loader)
    sampler = StepBatches(len(examples), batch_size, steps, accumulate=runtime.accumulate_grad_batches,
                          rank=runtime.rank, world=runtime.world_size, start=start, seed=seed, shuffle=shuffle)

    def indexed(positions: list[int]) -> dict:
        return {**collate([examples[i] for i in positions]), EXAMPLE_INDEX: torch.tensor(positions)}

    return DataLoader(_Positions(len(examples)), batch_sampler=sampler, collate_fn=indexed)


class _Positions(torch.utils.data.Dataset):
    """0..n-1: the sampler's indices reach the collate function, which reads the examples."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


class StepModule(L.LightningModule):
    """`model` trained on `loss_fn(model, batch)` for `steps` optimizer steps (module docstring).
    Keeps the per-step losses (mean over the accumulated micro-batches and the ranks) and the tokens
    seen, in its checkpoints too, so a resumed fit reports what the uninterrupted one does."""

    def __init__(self, model: nn.Module, loss_fn: Callable[[nn.Module, dict], torch.Tensor], steps: int, lr: float,
                 label: str, run_state: Callable[[], dict] | None = None):
        super().__init__()
        self.model = model
        self.loss_fn, self.steps, self.lr, self.label, self.run_state = loss_fn, steps, lr, label, run_state
        self.losses: list[float] = []
        self.tokens = 0
        self._micro: list[torch.Tensor] = []
        self._clock: float | None = None
        self._pending_rng: torch.Tensor | None = None

    def on_train_end(self) -> None:
        """Let the model go before the trainer's teardown, which moves the LightningModule to the
        CPU (`Strategy.teardown`): the model belongs to the run, whose mask, evaluation and next
        rounds stay on the device it trained on (on a GPU, a model moved back to the CPU under a
        mask on the GPU failed the evaluation after a recovery). The callbacks' on_train_end (a
        last checkpoint) ran before this hook."""
        self._modules.pop("model", None)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        if self._clock is None:
            self._clock = time.perf_counter()
        loss = self.loss_fn(self.model, batch)
        finite = bool(torch.isfinite(loss.detach()))
        if self.trainer.world_size > 1:
            finite = bool(self.trainer.strategy.reduce_boolean_decision(finite, all=True))
        if not finite:
            raise FloatingPointError(f"{self.label}: the training loss is {loss.item()} at step "
                                     f"{self.trainer.global_step + 1} of {self.steps} (on this rank or another); the "
                                     f"step was not taken. Allowed: a lower learning rate (now {self.lr})")
        self._micro.append(loss.detach().float())
        self.tokens += _tokens(batch)
        if len(self._micro) == self.trainer.accumulate_grad_batches:
            # the optimizer steps after this batch: its loss is recorded now, before any callback
            # (the checkpoint) sees the step
            self._record_step()
        return loss

    def _record_step(self) -> None:
        loss = torch.stack(self._micro).mean()
        self._micro = []
        if self.trainer.world_size > 1:
            loss = self.trainer.strategy.reduce(loss, reduce_op="mean")
        self.losses.append(float(loss))
        lr = self.trainer.optimizers[0].param_groups[0]["lr"]
        seconds = time.perf_counter() - (self._clock or time.perf_counter())
        metrics = {"recovery/loss": float(loss), "recovery/lr": lr}
        if seconds > 0:
            metrics["recovery/tokens_per_s"] = self.tokens * self.trainer.world_size / seconds
        self.log_dict(metrics, prog_bar=False, on_step=True, on_epoch=False, rank_zero_only=True)
        self.log("loss", float(loss), prog_bar=True, logger=False, rank_zero_only=True)
        done = len(self.losses)
        if done % max(1, self.steps // 10) == 0:
            log.info("%s: step %d/%d loss %.4f (%.1f s)", self.label, done, self.steps, float(loss), seconds)

    def configure_optimizers(self):
        params = [p for p in self.model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=self.lr, weight_decay=0.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: warmup_cosine(step, self.steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        rng = torch.get_rng_state()
        if self.trainer.world_size > 1:  # every rank's generator: dropout continues as it would have
            states: list = [None] * self.trainer.world_size
            torch.distributed.all_gather_object(states, rng)
        else:
            states = [rng]
        checkpoint["step_fit"] = {"losses": list(self.losses), "tokens": self.tokens, "rng": states,
                                  "steps": self.steps, "label": self.label}
        if self.run_state is not None:
            checkpoint[RUN_STATE] = self.run_state()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        saved = checkpoint["step_fit"]
        if saved["steps"] != self.steps:
            raise ValueError(f"{self.label}: the checkpoint was written by a fit of {saved['steps']} steps, this fit "
                             f"has {self.steps}; resume with the run's own recovery.steps")
        self.losses, self.tokens = list(saved["losses"]), int(saved["tokens"])
        # applied at the first batch: Lightning draws random numbers between loading and training
        # (the data loader's base seed), which the uninterrupted fit drew before its checkpoint
        self._pending_rng = saved["rng"][min(self.trainer.global_rank, len(saved["rng"]) - 1)]

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        if self._pending_rng is not None:
            torch.set_rng_state(self._pending_rng)
            self._pending_rng = None


class StepCheckpoint(Checkpoint):
    """`<dirpath>/last.ckpt` every `every` optimizer steps and after the last one, written to a
    hidden file beside it and renamed over it (a kill at any moment leaves a complete checkpoint)."""

    def __init__(self, dirpath: Path, every: int):
        self.dirpath, self.every = Path(dirpath), every
        self._saved_at = -1

    @property
    def path(self) -> Path:
        return self.dirpath / CHECKPOINT

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._saved_at or step == 0:
            return
        if (self.every and step % self.every == 0) or step >= trainer.max_steps:
            self.save(trainer)
            self._saved_at = step

    def save(self, trainer: L.Trainer) -> None:
        save_checkpoint_atomic(trainer, self.path)


def save_checkpoint_atomic(trainer: L.Trainer, path: Path, commit: Callable[[Path, Path], Any] = os.replace) -> None:
    """`trainer`'s checkpoint at `path`, written to a hidden sibling and renamed over it by `commit`
    (atomic on one filesystem). Every rank takes part (the checkpoint is gathered); rank 0 writes
    and renames. The recovery's step checkpoints and the epochs' `last.ckpt` are both written so."""
    tmp = path.parent / f".{path.name}.tmp"
    if trainer.is_global_zero:
        path.parent.mkdir(parents=True, exist_ok=True)
    trainer.save_checkpoint(tmp)
    if trainer.is_global_zero:
        commit(tmp, path)


def checkpoint_step(path: Path) -> int:
    """The optimizer step a step-fit checkpoint was taken at."""
    return int(torch.load(path, map_location="cpu", weights_only=False)["global_step"])


def fit_steps(model: nn.Module, loader: Iterable, loss_fn: Callable[[nn.Module, dict], torch.Tensor], steps: int,
              lr: float, max_grad_norm: float = 1.0, plan: FitPlan | None = None, label: str = "recovery") -> dict:
    """Train `model`'s parameters that require grad for `steps` optimizer steps of
    `loss_fn(model, batch)` (a scalar) as a Lightning fit (module docstring); returns a report:
    steps, tokens seen, seconds, first and last loss (each the mean over `loss_window` steps:
    WINDOW, or half the steps when there are fewer than 2 x WINDOW, so the two never share a step),
    trainable parameters, the peak learning rate and where it ran."""
    plan = plan or FitPlan()
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"{label}: no parameter requires grad, nothing to train")
    runtime = plan.runtime or _runtime_of(model)
    start_step = checkpoint_step(plan.resume_from) if plan.resume_from is not None else 0
    train = step_loader(loader, steps, runtime, start_step, plan.seed)
    module = StepModule(model, loss_fn, steps, lr, label, plan.run_state)
    callbacks: list = [StepCheckpoint(plan.checkpoint_dir, plan.checkpoint_every)] if plan.checkpoint_dir is not None else []
    if runtime.enable_progress_bar:
        # tqdm, not rich: a step budget may run inside another fit (between its rounds), whose rich
        # live display cannot have a second one beside it
        callbacks.append(TQDMProgressBar())
    trainer = L.Trainer(**runtime.trainer_kwargs(), max_steps=steps, max_epochs=-1, gradient_clip_val=max_grad_norm,
                        callbacks=callbacks, logger=list(plan.loggers) or False, enable_checkpointing=plan.checkpoint_dir is not None,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                        use_distributed_sampler=False, log_every_n_steps=1,
                        default_root_dir=str(plan.checkpoint_dir) if plan.checkpoint_dir is not None else None)
    was_training = model.training
    model.train()
    begin = time.perf_counter()
    try:
        with warnings.catch_warnings():
            # the step stream starts at the checkpoint's step itself (StepBatches), which Lightning cannot see
            warnings.filterwarnings("ignore", message=r".*resuming from a checkpoint that ended before the epoch ended")
            warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
            warnings.filterwarnings("ignore", message=r".*`training_step` returned `None`.*")
            trainer.fit(module, train_dataloaders=train,
                        ckpt_path=str(plan.resume_from) if plan.resume_from is not None else None)
    finally:
        model.train(was_training)
        for p in params:
            p.grad = None  # no stale gradients (or their memory) after the recovery
    if trainer.global_step < steps:
        raise RuntimeError(f"{label}: the fit stopped after {trainer.global_step} of {steps} steps")
    losses = module.losses
    tokens = module.tokens
    if runtime.world_size > 1:
        tokens = int(trainer.strategy.reduce(torch.tensor(float(tokens), device=trainer.strategy.root_device),
                                             reduce_op="sum"))
    window = max(1, min(WINDOW, len(losses) // 2))
    return {"steps": steps, "tokens": tokens, "lr": lr, "trainable_params": sum(p.numel() for p in params),
            "loss_first": sum(losses[:window]) / window, "loss_last": sum(losses[-window:]) / window,
            "loss_window": window, "resumed_at_step": start_step if plan.resume_from is not None else None,
            "accumulate_grad_batches": runtime.accumulate_grad_batches, "world_size": runtime.world_size,
            "precision": runtime.precision, "train_seconds": round(time.perf_counter() - begin, 3)}


def _tokens(batch: dict) -> int:
    """The real tokens of a batch (its attention mask), else its input ids, else its examples."""
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum())
    if "input_ids" in batch:
        return batch["input_ids"].numel()
    return len(next(iter(batch.values())))


def _runtime_of(model: nn.Module) -> Runtime:
    """One process where `model` is (the Python API without a run's `trainer` settings)."""
    param = next(model.parameters())
    precision = {torch.bfloat16: "bf16-true", torch.float16: "16-true", torch.float64: "64-true"}.get(param.dtype,
                                                                                                       "32-true")
    return Runtime("cuda" if param.device.type == "cuda" else "cpu", 1, precision, "auto",
                   enable_progress_bar=False)
