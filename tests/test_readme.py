"""The README's Python API examples run as written (on a few SST-2-like sentences)."""
import re
from pathlib import Path

from tests.helpers import tiny_batch

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def test_python_api_examples_run(tokenizer):
    section = README[README.index("## Python API"):README.index("## Tests")]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 2
    scope = {"train_loader": [tiny_batch(tokenizer, 8, seed=1)], "score_loader": [tiny_batch(tokenizer, 8, seed=2)],
             "val_loader": [tiny_batch(tokenizer, 8, seed=3)]}
    exec(blocks[0], scope)  # noqa: S102 - the README's own code
    report, model = scope["report"], scope["model"]
    assert [r["sparsity"] for r in report["rounds"]] == [0.25, 0.5] and report["final"]["stop_reason"] == "target_reached"
    assert sum(map(len, model.headprune_layout)) == 36 and scope["state"]["rounds"] == report["rounds"]
    exec(blocks[1], scope)  # noqa: S102
    assert scope["report"]["round"]["budget"]["predicted_share"] <= 0.5
    assert sum(map(len, scope["model"].headprune_layout)) < 72
