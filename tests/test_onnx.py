"""deploy/onnx.py: the ONNX export (through headprune-export) checked with ONNX Runtime."""
import json

import pytest
import torch

from headprune import load_pruned, prune_heads, save_pruned
from headprune.apps.export import main as export_main
from tests.helpers import PRUNE, inputs, tiny


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_onnx_export_equals_the_pruned_model(family, tmp_path):
    """Uneven heads per layer and a layer with every head removed (PRUNE), exported with the
    headprune-export CLI: ONNX Runtime's logits equal PyTorch's within 1e-4 on another shape."""
    model = prune_heads(tiny(family), PRUNE)
    assert model.headprune_layout[0] == []
    save_pruned(model, tmp_path / "model")
    assert export_main([str(tmp_path / "model"), "--onnx", str(tmp_path / "model.onnx")]) == 0
    check = json.loads((tmp_path / "model.check.json").read_text())
    assert check["max_abs_diff"] < 1e-4 and check["batch"] == 3 and check["seq"] == 11
    from headprune.deploy.onnx import onnx_session

    session = onnx_session(tmp_path / "model.onnx")
    batch = inputs(batch=2, tokens=7, seed=4)
    feed = {i.name: batch[i.name].numpy() if i.name in batch else torch.zeros_like(batch["input_ids"]).numpy()
            for i in session.get_inputs()}
    got = torch.from_numpy(session.run(None, feed)[0])
    with torch.no_grad():
        want = load_pruned(tmp_path / "model").eval()(**batch).logits
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(got[real] if got.dim() == 3 else got, want[real] if want.dim() == 3 else want,
                               atol=1e-4, rtol=0)
