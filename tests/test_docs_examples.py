"""The Python blocks of the documentation site run as written (on a few SST-2-like sentences):
docs/python_api.md's Pruner and prune_to_budget examples and its RunSpec run (in a scratch folder
whose `data` is the shared data), and docs/extending.md's metric, layer policy and recovery,
defined on the page and run together through a Pruner."""
import re
from pathlib import Path

import pytest

from tests.helpers import tiny_batch

DOCS = Path(__file__).resolve().parent.parent / "docs"


def _blocks(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(), re.S)


FRAGMENT = re.compile(r"<!-- fragment: [^>]+ -->\n```python\n")
# the pages whose unmarked Python blocks tests run (test: where), each block as written
RUN = {"python_api.md": "test_python_api_examples_run", "extending.md": "test_extending_examples_run",
       "../README.md": "tests/test_readme.py::test_python_example_runs_as_written"}


def test_every_python_block_runs_in_a_test_or_is_marked_a_fragment():
    """A block a user copies runs as printed (a test runs it), or says it is a fragment and what it
    needs (`<!-- fragment: ... -->` right above it)."""
    pages = sorted(DOCS.glob("*.md")) + [DOCS.parent / "README.md"]
    unmarked = []
    for page in pages:
        text = page.read_text()
        name = page.name if page.parent == DOCS else f"../{page.name}"
        whole = text.count("```python\n")
        marked = len(FRAGMENT.findall(text))
        if whole > marked and name not in RUN:
            unmarked.append(f"{name}: {whole - marked} unmarked block(s)")
    assert not unmarked, unmarked


def _loaders(tokenizer) -> dict:
    return {"train_loader": [tiny_batch(tokenizer, 8, seed=1)], "score_loader": [tiny_batch(tokenizer, 8, seed=2)],
            "val_loader": [tiny_batch(tokenizer, 8, seed=3)]}


@pytest.mark.slow  # ~35 s: a whole schedule and a budgeted prune of MiniLM
def test_python_api_examples_run(tokenizer, tmp_path, data_dir, monkeypatch):
    blocks = _blocks("python_api.md")
    assert len(blocks) == 3
    scope: dict = {}  # each block as a user pastes it: nothing defined beforehand (issue 56: NameError)
    exec(blocks[0], scope)  # noqa: S102 - the page's own code
    report, model = scope["report"], scope["model"]
    assert [r["sparsity"] for r in report["rounds"]] == [0.25, 0.5] and report["final"]["stop_reason"] == "target_reached"
    assert sum(map(len, model.headprune_layout)) == 36 and scope["state"]["rounds"] == report["rounds"]
    scope = {}
    exec(blocks[1], scope)  # noqa: S102
    assert scope["report"]["round"]["budget"]["predicted_share"] <= 0.5
    assert sum(map(len, scope["model"].headprune_layout)) < 72
    (tmp_path / "data").symlink_to(data_dir, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    run_scope: dict = {}
    exec(blocks[2], run_scope)  # noqa: S102 - the RunSpec example, writing runs/tiny
    assert run_scope["results"]["final"]["sparsity"] == 0.5
    assert (tmp_path / "runs" / "tiny" / "results.json").is_file() and (tmp_path / "runs" / "tiny" / "export").is_dir()


@pytest.mark.slow  # ~25 s: a two-round schedule of MiniLM
def test_extending_examples_run(tokenizer):
    """The page's metric scores value rows, its policy empties the last layers first (down to
    min_heads_per_layer=1), and its recovery's label-smoothed loss is the one the Pruner trains on."""
    import torch

    from headprune import HeadMask
    from headprune.tasks import CLASSIFICATION
    from headprune.models import build_model

    blocks = _blocks("extending.md")
    assert len(blocks) == 5  # the fifth, the KV unit valuation, runs in tests/test_kv_valuation_extension.py
    model = build_model("minilm", num_labels=2)
    scope = {"model": model, **_loaders(tokenizer)}
    for block in blocks[:3]:
        exec(block, scope)  # noqa: S102 - the page's own code
    scores = scope["value_norm_importance"](model, HeadMask.for_model(model))
    assert scores.shape == (6, 12) and (scores > 0).all()
    alive = torch.ones(6, 12, dtype=torch.bool)
    picked = scope["DeepestFirst"]()(scores, alive, 13)
    assert {layer for layer, _ in picked} == {5, 4} and sum(layer == 5 for layer, _ in picked) == 11
    recovery = scope["SmoothedFinetune"](smoothing=0.2)
    batch = scope["train_loader"][0]
    logits, loss = recovery.training_loss(model, batch, CLASSIFICATION)
    expected = torch.nn.functional.cross_entropy(logits, batch["labels"], label_smoothing=0.2, reduction="none")
    assert torch.allclose(loss, expected)
    exec(blocks[3], scope)  # noqa: S102
    report = scope["report"]
    assert report["final"]["stop_reason"] == "target_reached" and report["final"]["heads_per_layer"][-1] == 1
