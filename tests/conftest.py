import os
from pathlib import Path

# Tiny models run fastest on one thread, and the DDP test's two processes must not oversubscribe
# the cores; set before torch is imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

REPO = Path(__file__).resolve().parent.parent
DATA_DIR = Path(os.environ.get("HEADPRUNE_DATA_DIR") or REPO.parent / "shared" / "data").resolve()

TINY = dict(num_hidden_layers=3, num_attention_heads=4, hidden_size=32, intermediate_size=64)


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The shared data folder. Missing data is a failure, locally as in CI: a test that needs it
    must not pass as skipped."""
    if not (DATA_DIR / "sst2" / "train.tsv").is_file():
        pytest.fail(f"shared data not found at {DATA_DIR}: put ../shared/data beside the repository or set "
                    "HEADPRUNE_DATA_DIR")
    return DATA_DIR


@pytest.fixture(scope="session")
def tokenizer():
    from headprune.models import load_tokenizer

    return load_tokenizer("minilm")


def compose_train(out, data_dir, *overrides):
    """The train config as `headprune-train` would compose it, writing to `out`, reading `data_dir`."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from headprune.apps.config_paths import config_dir

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            return compose("train", overrides=[f"paths.output_dir={out}", f"data.data_dir={data_dir}", *overrides])
    finally:
        GlobalHydra.instance().clear()


def tiny_bert(attn: str = "sdpa", seed: int = 0, num_labels: int = 2, **overrides):
    from headprune.models import build_model

    cfg = dict(TINY, **overrides)
    model = build_model("minilm", num_labels=num_labels, random_init=True, attn_implementation=attn,
                        config_overrides=cfg, seed=seed)
    return model.eval()


def tiny_batch(tokenizer, n: int = 6, seed: int = 0) -> dict:
    texts = ["a gripping , funny film", "dull and lifeless", "the plot makes no sense at all",
             "wonderful performances from the whole cast", "i wanted to leave", "not bad",
             "an instant classic", "tedious"][:n]
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    g = torch.Generator().manual_seed(seed)
    enc["labels"] = torch.randint(0, 2, (len(texts),), generator=g)
    return dict(enc)
