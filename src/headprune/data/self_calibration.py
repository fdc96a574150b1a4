"""Self-generated calibration (Williams et al. 2024, "self-calibration", arXiv 2410.17170): the
calibration text sampled from the dense model itself instead of read from a corpus.

Why: every repair fitted on Tiny Shakespeare (refit, least squares, bias compensation, the KL steps)
overfits it, losing 4-9x more on a corpus it never saw (issue 40, section 2). Text the model writes
itself carries the model's own distribution rather than one corpus's.

`data.calibration` picks the source of the calibration blocks (`score_set`: scoring, every repair's
fit, the measured layer policy) and of the training blocks a recovery's steps or the epochs read:

- `corpus`: the data's own corpus (the default; `data.self_calibration.train_samples` must stay 0);
- `self`: `data.score_samples` blocks of `data.block_size` tokens sampled from the dense model, and
  `data.self_calibration.train_samples` more for training (required > 0 when the run trains);
- `mix`: half of each: `score_samples // 2` generated blocks after the corpus's
  `score_samples - score_samples // 2`, and likewise for the training blocks.

Each block starts with the tokenizer's BOS (the model's `bos_token_id`, else its EOS, as GPT-2
begins a text), then the tokens of `prompt` if given, then tokens sampled one at a time with the
KV cache (temperature, then top-p), batched `batch_size` sequences at a time, sequence i with a
private generator seeded by (`seed`, i) (the global RNG is untouched). End-of-sequence tokens do
not stop a sequence: a chat model writes the next turn, so every block is full length.

The blocks are cached beside the run (`<run dir>/calibration/self_calibration.pt`, written
atomically) with the settings that made them; a resumed (or re-run) run with the same settings and
model reuses them instead of sampling again. Under data parallelism rank 0 samples and writes, the
other ranks read the file (after a barrier when the process group is up) and every rank's blocks
are compared (a digest through all_gather): the ranks agree or the run stops.
"""
from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from headprune.atomic import staged_file
from headprune.distributed import all_equal, is_distributed

log = logging.getLogger(__name__)

CALIBRATIONS = ("corpus", "self", "mix")
CACHE = Path("calibration") / "self_calibration.pt"  # under the run dir


@dataclass
class SelfCalibration:
    """`data.self_calibration`: how the dense model samples its calibration text (module doc).
    The number of calibration blocks and their length are data.score_samples and data.block_size."""

    temperature: float = 1.0   # > 0: the logits are divided by it before top-p
    top_p: float = 0.95        # (0, 1]: the smallest set of tokens holding this probability is sampled from
    seed: int = 0              # the sampling generator's seed (not the run's `seed`: the text stays when that changes)
    prompt: str | None = None  # text after BOS that every block starts with (null: BOS alone)
    batch_size: int = 16       # sequences sampled together
    train_samples: int = 0     # generated training blocks for a run that trains (recovery steps, epochs)

    def check(self, calibration: str) -> None:
        """Ranges, naming the field; `train_samples` > 0 only where generated text trains."""
        if calibration not in CALIBRATIONS:
            raise ValueError(f"data.calibration={calibration!r}; allowed: {', '.join(CALIBRATIONS)}")
        if not isinstance(self.temperature, (int, float)) or self.temperature <= 0:
            raise ValueError(f"data.self_calibration.temperature={self.temperature!r} must be > 0")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"data.self_calibration.top_p={self.top_p!r} must be in (0, 1]")
        for name in ("seed", "batch_size", "train_samples"):
            value = getattr(self, name)
            low = 1 if name == "batch_size" else 0
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"data.self_calibration.{name}={value!r} must be an integer >= {low}")
        if calibration == "corpus" and self.train_samples:
            raise ValueError(f"data.self_calibration.train_samples={self.train_samples} with data.calibration=corpus "
                             "(nothing is generated); allowed: 0, or data.calibration=self|mix")

    @classmethod
    def of(cls, block: dict | None, calibration: str) -> "SelfCalibration":
        """The checked settings from a config block (unknown keys named)."""
        block = dict(block or {})
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(block) - known)
        if unknown:
            raise ValueError(f"data.self_calibration: unknown {unknown}; allowed: {', '.join(sorted(known))}")
        settings = cls(**block)
        settings.check(calibration)
        return settings


def generated_share(calibration: str, n: int) -> int:
    """How many of `n` blocks are generated under `calibration` (mix: n // 2, the corpus the rest)."""
    return {"corpus": 0, "self": n, "mix": n // 2}[calibration]


def check_model(model: nn.Module, calibration: str, trains: bool, train_samples: int) -> None:
    """Before any work: a model that cannot generate (an encoder) cannot write its calibration text,
    and generated training blocks exist exactly when the run trains."""
    if calibration == "corpus":
        return
    can = getattr(model, "can_generate", None)
    if not (callable(can) and can()) or getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(f"data.calibration={calibration} samples the calibration text from the model, but "
                         f"{type(model).__name__} cannot generate (an encoder); allowed: data.calibration=corpus, or a "
                         "decoder-only causal LM")
    if trains and train_samples == 0:
        raise ValueError(f"data.calibration={calibration} with a run that trains (recovery steps or epochs) needs "
                         "data.self_calibration.train_samples > 0 generated training blocks (with 0 the steps would "
                         "read the corpus); allowed: an integer >= 1, or data.calibration=corpus")
    if not trains and train_samples:
        raise ValueError(f"data.self_calibration.train_samples={train_samples}, but this run trains nothing (no "
                         "recovery steps, no epochs); allowed: 0")


def start_ids(model: nn.Module, tokenizer, prompt: str | None) -> list[int]:
    """BOS (the model's, else its EOS, as GPT-2 starts a text), then the prompt's tokens."""
    config = model.config
    bos = next((i for i in (getattr(tokenizer, "bos_token_id", None), getattr(config, "bos_token_id", None),
                            getattr(tokenizer, "eos_token_id", None), getattr(config, "eos_token_id", None))
                if isinstance(i, int)), None)
    if bos is None:
        raise ValueError("data.calibration=self|mix starts each sequence with BOS, but neither the tokenizer nor the "
                         "model config names a BOS or EOS token; allowed: data.calibration=corpus")
    return [bos, *(tokenizer.encode(prompt, add_special_tokens=False) if prompt else [])]


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """`logits` (B, V) with every token outside the smallest set holding `top_p` of the probability
    set to -inf (the most likely token always stays)."""
    if top_p >= 1:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V)
    before = sorted_logits.softmax(-1).cumsum(-1) - sorted_logits.softmax(-1)  # mass above each token
    drop_sorted = before >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


@torch.no_grad()
def sample_blocks(model: nn.Module, start: list[int], samples: int, length: int,
                  settings: SelfCalibration) -> torch.Tensor:
    """`samples` sequences of `length` tokens (B, T) = start tokens then sampled ones, sampled with
    the KV cache `settings.batch_size` at a time, sequence i from a generator seeded by
    (`settings.seed`, i)."""
    if len(start) >= length:
        raise ValueError(f"data.self_calibration.prompt: BOS + prompt is {len(start)} tokens, not shorter than "
                         f"data.block_size={length}; allowed: a shorter prompt")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    out = []
    try:
        for first in range(0, samples, settings.batch_size):
            batch = min(settings.batch_size, samples - first)
            # one generator per sequence, seeded by (seed, its index): sequence i's draws do not depend on
            # how many sequences are sampled, so mix's generated blocks are the first of self's
            generators = [torch.Generator(device="cpu").manual_seed(settings.seed * 1_000_003 + first + i)
                          for i in range(batch)]
            ids = torch.tensor([start] * batch, dtype=torch.long, device=device)  # (B, P)
            step = model(input_ids=ids, use_cache=True)
            tokens = [ids.cpu()]
            for _ in range(length - len(start)):
                logits = step.logits[:, -1, :].float().cpu() / settings.temperature  # (B, V)
                probs = top_p_filter(logits, settings.top_p).softmax(-1)
                nxt = torch.stack([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generators)])  # (B, 1)
                tokens.append(nxt)
                if len(tokens) - 1 + len(start) == length:
                    break
                step = model(input_ids=nxt.to(device), cache=step.cache, use_cache=True)  # the KV cache grows by one
            out.append(torch.cat(tokens, dim=1))
    finally:
        model.train(was_training)
    return torch.cat(out)  # (N, T)


def digest(blocks: torch.Tensor) -> str:
    """sha256 of the blocks' token ids (int64, row-major): what the ranks and the cache compare."""
    return hashlib.sha256(blocks.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()


def model_fingerprint(model: nn.Module) -> list[float]:
    """Sum and sum of squares of every parameter (float64): the cache is reused only for the same weights."""
    params = [p.detach().double() for p in model.parameters()]
    return [round(float(sum(p.sum() for p in params)), 6), round(float(sum(p.pow(2).sum() for p in params)), 6)]


def cache_key(settings: SelfCalibration, start: list[int], score: int, train: int, length: int, model) -> dict:
    """What made the blocks: a cached file with another key is sampled again."""
    return {"settings": {k: v for k, v in asdict(settings).items() if k != "train_samples"}, "start_ids": start,
            "score_samples": score, "train_samples": train, "length": length, "model": model_fingerprint(model)}


def _load(path: Path, key: dict) -> dict | None:
    if not path.is_file():
        return None
    saved = torch.load(path, map_location="cpu", weights_only=True)
    if saved.get("key") != key or digest(torch.cat([saved["score"], saved["train"]])) != saved.get("sha256"):
        log.info("self-calibration: %s was made with other settings or model; sampling again", path)
        return None
    return saved


def obtain(model: nn.Module, tokenizer, settings: SelfCalibration, score: int, train: int, length: int,
           run_dir: Path, rank_zero: bool = True) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(score blocks (score, length), train blocks (train, length), record for results.json): read
    from the run's cache when it holds these settings' blocks, else sampled (rank 0) and cached
    atomically. Under an initialized process group the other ranks wait for rank 0, read its file,
    and every rank's digest is compared."""
    import torch.distributed as dist

    start = start_ids(model, tokenizer, settings.prompt)
    key = cache_key(settings, start, score, train, length, model)
    path = Path(run_dir) / CACHE
    distributed = is_distributed()
    rank_zero = rank_zero and (not distributed or dist.get_rank() == 0)
    began = time.perf_counter()
    saved, reused = None, True
    if rank_zero:
        saved = _load(path, key)
        if saved is None:
            reused = False
            blocks = sample_blocks(model, start, score + train, length, settings)
            saved = {"key": key, "score": blocks[:score].clone(), "train": blocks[score:].clone(),
                     "sha256": digest(blocks)}
            with staged_file(path) as tmp:
                torch.save(saved, tmp)
    if distributed:
        dist.barrier()
    if saved is None:  # another rank: rank 0 has written the file
        saved = _load(path, key)
        if saved is None:
            raise RuntimeError(f"self-calibration: this rank found no blocks for these settings in {path}, which "
                               "rank 0 writes before the other ranks read it")
    blocks = torch.cat([saved["score"], saved["train"]])
    if not all_equal(torch.tensor(list(bytes.fromhex(digest(blocks))), dtype=torch.int64)):
        raise RuntimeError("self-calibration: the ranks hold different calibration blocks")
    record = {"generated_score_blocks": score, "generated_train_blocks": train, "length": length,
              "generated_tokens": (score + train) * length, "start_ids": start, "settings": asdict(settings),
              "sha256": saved["sha256"], "cache": str(path), "reused": reused,
              "seconds": round(time.perf_counter() - began, 3)}
    return saved["score"], saved["train"], record


def check_datamodule(datamodule, model: nn.Module, trains: bool) -> None:
    """`check_model` for a run's data module (data modules without `calibration` take corpus text only)."""
    settings = getattr(datamodule, "self_calibration", None)
    if settings is not None:
        check_model(model, datamodule.calibration, trains, settings.train_samples)


def prepare(datamodule, model: nn.Module, tokenizer, run_dir: Path, rank_zero: bool = True) -> dict | None:
    """The run's calibration, put into `datamodule` and returned for results.json `calibration`:
    the corpus record, or (self / mix) the sampled blocks put in (`obtain`: the run dir's cache or
    the dense `model`) with what made them; `rank_zero`: this process samples and writes the cache
    (the others read it). None for a data module without calibration blocks."""
    if getattr(datamodule, "calibration", "corpus") == "corpus":
        return datamodule.calibration_record() if hasattr(datamodule, "calibration_record") else None
    score, train = datamodule.generated_counts()
    score_blocks, train_blocks, made = obtain(model, tokenizer, datamodule.self_calibration, score, train,
                                              datamodule.block_size, run_dir, rank_zero=rank_zero)
    return {**datamodule.use_generated(score_blocks, train_blocks), "generated": made}
