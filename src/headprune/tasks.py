"""What each task computes: one `Task` object per task owns its loss, its validation metrics and
their evaluation, and how a per-position quantity becomes a per-example one.

The single list of tasks (`TASKS`) lives here. A run's task is chosen once: from config
(`model.task`, `get_task`) by `headprune-train`, which checks the data and the loaded model
against it (`check_model_task`) before any work, and hands that Task to everything below it:
the Pruner, the LightningModule, the RecoveryContext, the metrics and policies that compute a
loss, and the evaluations. Objects built by hand through the Python API without a Task read it
once, when they are built, from the model's head (`checked_task`; plain functions called without
one: `task_for`, once per call); `task_of(model)` is otherwise only a check of a loaded model
against the Task it was given (`check_model_task`), never a decision. Training,
evaluation between rounds and the gradient-based metrics all use the one Task, so they agree on
every number:
- classification: cross-entropy of (B, C) logits; validation {"acc", "loss"} (mean per example);
- causal_lm: mean next-token cross-entropy over each example's real tokens; validation
  {"loss", "ppl"}: the mean loss per token and its exponential, the perplexity;
- seq2seq_lm (encoder-decoders: Whisper, T5): the decoder's cross-entropy against `labels` (-100
  unscored), position t predicting labels t; validation {"loss", "ppl"} as causal_lm. Through
  the Python API only (a Task given, or read from the model by `task_for`); `model.task` (the
  training app) does not offer it: its data modules make no encoder-decoder batches.

Validation has one implementation per task, `Task.batch_sums` (a batch's (loss sum, count,
correct) as a tensor) and `Task.metrics` (the metrics of their totals): `Task.evaluate` sums them
over a loader (the Pruner's `val`, `headprune.evaluation.perplexity`'s windows), and the
LightningModule sums them over its validation epoch and its ranks. Perplexity is the causal-LM
Task's: `val` runs it on the data module's validation blocks (fed as trained on: no BOS, the
first token of each block unscored), and headprune.evaluation.perplexity runs it on fixed
windows of held-out text with BOS stated; the two differ only in the windows and the BOS rule
they name.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "input_features", "pixel_values", "decoder_input_ids",
                "decoder_attention_mask")


def forward_logits(model: nn.Module, batch: dict, **options) -> torch.Tensor:
    """The model's logits on the batch's model inputs; `options` go to the forward (use_cache=False).
    An encoder-decoder batch without `decoder_input_ids` gets them from its `labels` (shifted right,
    the model's own rule)."""
    inputs = {k: batch[k] for k in MODEL_INPUTS if k in batch}
    if getattr(model.config, "is_encoder_decoder", False) and "decoder_input_ids" not in inputs:
        if "labels" not in batch:
            raise ValueError("an encoder-decoder batch needs `decoder_input_ids` or `labels` (the decoder's targets)")
        inputs["decoder_input_ids"] = shift_right(batch["labels"], model.config)
    return model(**inputs, **options).logits


def shift_right(labels: torch.Tensor, config) -> torch.Tensor:
    """(B, T) decoder inputs for (B, T) labels: the decoder start token, then the labels but the
    last, -100 as padding (the rule T5 and Whisper apply when given labels alone)."""
    start, pad = getattr(config, "decoder_start_token_id", None), getattr(config, "pad_token_id", None)
    if start is None or pad is None:
        raise ValueError(f"the {config.model_type} config has no decoder_start_token_id / pad_token_id ({start}, "
                         f"{pad}) to make decoder inputs from labels: pass `decoder_input_ids` in the batch")
    out = labels.new_full(labels.shape, pad)
    out[:, 1:] = labels[:, :-1]
    out[:, 0] = start
    return out.masked_fill(out == -100, config.pad_token_id)


EXAMPLE_INPUTS = ("input_ids", "input_features", "pixel_values")  # a batch's main input: text, audio, images


def batch_size(batch: dict) -> int:
    """Examples in a batch: the first axis of its main input (token ids, audio features or images)."""
    for name in EXAMPLE_INPUTS:
        if name in batch:
            return int(batch[name].shape[0])
    raise ValueError(f"a batch holds none of {', '.join(EXAMPLE_INPUTS)} (its keys: {sorted(batch)}); allowed: a "
                     "dict with the model's main input")


def next_token_loss_sum(logits: torch.Tensor, batch: dict) -> tuple[torch.Tensor, int]:
    """(summed next-token cross-entropy, number of targets) of a causal-LM batch: position t
    predicts token t+1 wherever t+1 is real and labelled (`target_weights`), so the first token
    of every row is context only. The perplexity rule (`CausalLM.batch_sums`, summed by `Task.evaluate`)."""
    targets = batch.get("labels", batch["input_ids"])[:, 1:]  # (B, T-1)
    if "attention_mask" in batch:
        targets = targets.masked_fill(batch["attention_mask"][:, 1:] == 0, -100)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten(), ignore_index=-100, reduction="sum")
    return loss, int((targets != -100).sum())


def target_counts(batch: dict) -> torch.Tensor:
    """(B,) number of next-token targets each causal-LM example's loss averages over, so that
    sum(CausalLM.loss * target_counts) / sum(target_counts) is the per-token mean loss."""
    return target_weights(batch).sum(1)


def target_weights(batch: dict) -> torch.Tensor:
    """(B, T-1) 1.0 where position t+1 is a real, labelled target of position t."""
    targets = batch.get("labels", batch["input_ids"])[:, 1:]  # (B, T-1)
    weights = (targets != -100).float()
    if "attention_mask" in batch:
        weights = weights * batch["attention_mask"][:, 1:].float()
    return weights


def real_tokens(batch: dict) -> torch.Tensor:
    """Bool (B, T): True for real tokens, False for padding."""
    if "attention_mask" in batch:
        return batch["attention_mask"].bool()
    return torch.ones_like(batch["input_ids"], dtype=torch.bool)


def max_positions(config) -> int | None:
    """The longest sequence a config's position embeddings cover (GPT-2 `n_positions`, others
    `max_position_embeddings`), or None when it names none."""
    return getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def headline(val: dict) -> tuple[str, float]:
    """(name, value) of the number that sums up a validation result: accuracy (higher is better)
    for classification, perplexity (lower is better) for causal LM."""
    name = next(task.headline for task in TASKS.values() if task.headline in val)
    return name, val[name]


class Task:
    """What a task computes. `val_metrics`: what `evaluate` reports; `headline`: the one of them
    that sums a result up (`higher_is_better` says which way)."""

    name: str = ""
    val_metrics: tuple[str, ...] = ()
    headline: str = ""
    higher_is_better: bool = True
    forward_options: dict = {}

    def loss(self, logits: torch.Tensor, batch: dict) -> torch.Tensor:
        """(B,) the loss of each example."""
        raise NotImplementedError

    def model_loss(self, model: nn.Module, batch: dict) -> torch.Tensor:
        """(B,) `loss` of the model's forward on `batch` (the gradient metrics' loss); a task may
        compute it without materialising every logit (CausalLM: `lm_head_chunks`)."""
        return self.loss(forward_logits(model, batch), batch)

    def weights(self, batch: dict) -> torch.Tensor:
        """(B,) what each example's loss counts for in a mean over the data (its examples or tokens)."""
        raise NotImplementedError

    def positions(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits that are scored: (B, C), or the (B, T-1, V) positions that predict a next token."""
        return logits

    def per_example(self, values: torch.Tensor, batch: dict) -> torch.Tensor:
        """(B,) from values of `positions(logits)` without the class axis: (B,) as is, (B, T-1)
        averaged over each example's real targets."""
        return values

    @torch.no_grad()
    def evaluate(self, model: nn.Module, dataloader, device: torch.device | str = "cpu",
                 max_batches: int | None = None) -> dict[str, float]:
        """`val_metrics` over `dataloader`, in eval mode: `batch_sums` summed in float64, then `metrics`."""
        was_training = model.training
        model.eval()
        totals = None  # (3,) float64: loss sum, count, correct
        try:
            for i, batch in enumerate(dataloader):
                if max_batches is not None and i >= max_batches:
                    break
                batch = to_device(batch, device)
                sums = self.batch_sums(forward_logits(model, batch, **self.forward_options), batch).double()
                totals = sums if totals is None else totals + sums
        finally:
            model.train(was_training)
        if totals is None or float(totals[1]) == 0:
            raise ValueError("evaluate() got an empty dataloader")
        return self.metrics(*totals.tolist())

    def batch_sums(self, logits: torch.Tensor, batch: dict) -> torch.Tensor:
        """(3,) this batch's (loss sum, count, correct) on the logits' device, without a host sync:
        what `metrics` turns into `val_metrics` once summed over batches (and data-parallel ranks)."""
        raise NotImplementedError

    def metrics(self, loss_sum: float, count: float, correct: float) -> dict[str, float]:
        raise NotImplementedError


class Classification(Task):
    """Sequence classification: cross-entropy of (B, C) logits against `labels`; validation
    {"acc", "loss"}, the loss a mean per example."""

    name, val_metrics, headline, higher_is_better = "classification", ("acc", "loss"), "acc", True

    def loss(self, logits: torch.Tensor, batch: dict) -> torch.Tensor:
        return F.cross_entropy(logits.float(), batch["labels"], reduction="none")

    def weights(self, batch: dict) -> torch.Tensor:
        return torch.ones(batch["input_ids"].shape[0], device=batch["input_ids"].device)

    def batch_sums(self, logits: torch.Tensor, batch: dict) -> torch.Tensor:
        loss = self.loss(logits, batch).detach()  # (B,)
        correct = (logits.detach().argmax(-1) == batch["labels"]).sum()
        return torch.stack([loss.sum(), loss.new_tensor(float(loss.numel())), correct.to(loss.dtype)])

    def metrics(self, loss_sum: float, count: float, correct: float) -> dict[str, float]:
        return {"acc": correct / count, "loss": loss_sum / count}


class CausalLM(Task):
    """Next-token prediction: the mean next-token cross-entropy over each example's real tokens;
    validation {"loss", "ppl"}: the per-token mean of `next_token_loss_sum` over every batch and
    its exponential (the one perplexity; the model runs without its KV cache)."""

    name, val_metrics, headline, higher_is_better = "causal_lm", ("loss", "ppl"), "ppl", False
    forward_options = {"use_cache": False}

    def loss(self, logits: torch.Tensor, batch: dict) -> torch.Tensor:
        targets = batch.get("labels", batch["input_ids"])[:, 1:]  # (B, T-1)
        token_loss = F.cross_entropy(self.positions(logits).float().transpose(1, 2), targets, reduction="none",
                                     ignore_index=-100)  # (B, T-1)
        return self.per_example(token_loss, batch)

    def model_loss(self, model: nn.Module, batch: dict) -> torch.Tensor:
        """`loss` with the output head run on chunks of positions when the (B, T, vocab) logits are
        large (`lm_head_chunks`: Gemma 3's 262k vocabulary at 4096 tokens is 4.3 GB of them); the
        same numbers otherwise."""
        from headprune.lm_head_chunks import chunked_token_loss

        inputs = {k: batch[k] for k in MODEL_INPUTS if k in batch}
        token_loss = chunked_token_loss(model, inputs, batch.get("labels", batch["input_ids"])[:, 1:])  # (B, T-1)
        return super().model_loss(model, batch) if token_loss is None else self.per_example(token_loss, batch)

    def weights(self, batch: dict) -> torch.Tensor:
        return target_counts(batch)

    def positions(self, logits: torch.Tensor) -> torch.Tensor:
        return logits[:, :-1]  # position t predicts token t+1

    def per_example(self, values: torch.Tensor, batch: dict) -> torch.Tensor:
        weights = target_weights(batch)  # (B, T-1)
        return (values * weights).sum(1) / weights.sum(1).clamp_min(1.0)

    def batch_sums(self, logits: torch.Tensor, batch: dict) -> torch.Tensor:
        loss = next_token_loss_sum(logits, batch)[0].detach()  # summed over tokens: a per-token mean
        targets = target_weights(batch).sum()
        return torch.stack([loss, targets.to(loss.dtype), loss.new_zeros(())])

    def metrics(self, loss_sum: float, count: float, correct: float) -> dict[str, float]:
        loss = loss_sum / count
        return {"loss": loss, "ppl": math.exp(loss)}


class Seq2SeqLM(Task):
    """An encoder-decoder's decoder against `labels` (B, T): logits position t predicts labels t,
    -100 unscored; per example the mean over its labelled tokens; validation {"loss", "ppl"} per
    token as CausalLM's. Read from the model only (not in TASKS: the training app's data makes no
    encoder-decoder batches)."""

    name, val_metrics, headline, higher_is_better = "seq2seq_lm", ("loss", "ppl"), "ppl", False
    forward_options = {"use_cache": False}

    def loss(self, logits: torch.Tensor, batch: dict) -> torch.Tensor:
        labels = batch["labels"]  # (B, T)
        token_loss = F.cross_entropy(logits.float().transpose(1, 2), labels, reduction="none",
                                     ignore_index=-100)  # (B, T)
        return self.per_example(token_loss, batch)

    def weights(self, batch: dict) -> torch.Tensor:
        return (batch["labels"] != -100).float().sum(1)

    def per_example(self, values: torch.Tensor, batch: dict) -> torch.Tensor:
        weights = (batch["labels"] != -100).float()  # (B, T)
        return (values * weights).sum(1) / weights.sum(1).clamp_min(1.0)

    def batch_sums(self, logits: torch.Tensor, batch: dict) -> torch.Tensor:
        weights = self.weights(batch)  # (B,)
        loss = (self.loss(logits, batch).detach() * weights).sum()
        return torch.stack([loss, weights.sum().to(loss.dtype), loss.new_zeros(())])

    def metrics(self, loss_sum: float, count: float, correct: float) -> dict[str, float]:
        loss = loss_sum / count
        return {"loss": loss, "ppl": math.exp(loss)}


CLASSIFICATION, CAUSAL_LM, SEQ2SEQ_LM = Classification(), CausalLM(), Seq2SeqLM()
TASKS: dict[str, Task] = {task.name: task for task in (CLASSIFICATION, CAUSAL_LM)}
VAL_METRICS = {name: task.val_metrics for name, task in TASKS.items()}  # what `evaluate` reports, per task


def get_task(name: str) -> Task:
    """The Task a config names (`model.task`)."""
    if name not in TASKS:
        raise ValueError(f"model.task={name!r} is not allowed; allowed: {', '.join(TASKS)}")
    return TASKS[name]


def check_task(name: str) -> str:
    return get_task(name).name


def task_of(model) -> Task:
    """The task a loaded model's head does (a model, or its config): causal LM when its
    architectures (else its class) end in ForCausalLM / LMHeadModel, seq2seq LM for an
    encoder-decoder's ForConditionalGeneration, classification otherwise. A check only
    (`check_model_task`, `task_for`): code below the app is handed its Task, never reads it here."""
    names = _architectures(model)
    config = getattr(model, "config", model)
    if getattr(config, "is_encoder_decoder", False) and any(a.endswith("ForConditionalGeneration") for a in names):
        return SEQ2SEQ_LM
    return CAUSAL_LM if any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in names) else CLASSIFICATION


def _architectures(model) -> list[str]:
    """The architectures a model's (or config's) config names, else the model's class name."""
    config = getattr(model, "config", model)
    names = list(getattr(config, "architectures", None) or [])
    return names or ([type(model).__name__] if hasattr(model, "config") else [])


def check_model_task(model, task: Task, setting: str = "model.task") -> Task:
    """`task` once the loaded `model` (or its config) is seen to have a head for it; a ValueError
    naming `setting`, the model's head and the allowed values otherwise (before any work)."""
    found = task_of(model)
    if found is not task:
        head = ", ".join(_architectures(model)) or "a config naming no architectures"
        names = ", ".join(TASKS)
        raise ValueError(f"{setting}={task.name} does not fit the model: its head ({head}) does {found.name}; allowed: "
                         f"{setting}={found.name} for this model ({setting} takes {names}), or a model with a "
                         f"{task.name} head")
    return task


def task_for(model, task: Task | str | None = None) -> Task:
    """The Task a function below the app computes with: `task` as given (a Task: the run's, checked
    where it was built; a name: `get_task`'s), else the model's head's (`task_of`), which a
    Python-API caller that passed none gets, read once per call."""
    if task is None:
        return task_of(model)
    return get_task(task) if isinstance(task, str) else task


def checked_task(model, task: Task | str | None = None, setting: str = "task") -> Task:
    """The Task an object built on `model` keeps for its life (the Pruner, the LightningModule),
    decided once when it is built: `task` (a Task, or a name `get_task` knows) checked against the
    model's head (`check_model_task`, naming `setting`); without one, the model's head's."""
    if task is None:
        return task_of(model)
    return check_model_task(model, task_for(model, task), setting)
