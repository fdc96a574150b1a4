"""ONNX Runtime's GroupQueryAttention (com.microsoft contrib op) with `local_window_size`: one
node's sliding window is headprune's window with no sinks (heads/windows.py `window_allowed`,
sink 0), the evidence behind docs/guide_kv_modes.md's engine table (one window per node, so per
layer; headprune writes no graph of these nodes)."""
import numpy as np
import onnxruntime as ort
import torch

from headprune.heads.windows import window_allowed

B, S, H, KV, D, WINDOW = 1, 40, 4, 2, 8, 6


def gqa_session(window: int):
    from onnx import TensorProto, helper

    node = helper.make_node("GroupQueryAttention", ["q", "k", "v", "", "", "seqlens_k", "total"], ["out", "pk", "pv"],
                            domain="com.microsoft", num_heads=H, kv_num_heads=KV, local_window_size=window)
    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, [B, S, n * D]) for name, n in
              (("q", H), ("k", KV), ("v", KV))]
    inputs += [helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [B]),
               helper.make_tensor_value_info("total", TensorProto.INT32, [1])]
    outputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in ("out", "pk", "pv")]
    model = helper.make_model(helper.make_graph([node], "gqa", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def windowed_attention(q, k, v, window: int) -> np.ndarray:
    """Causal GQA attention (B, S, H*D) with each query seeing `window_allowed(..., sink=0, window)`."""
    query = torch.tensor(q).view(B, S, H, D).transpose(1, 2)  # (B, H, S, D)
    keys, values = (torch.tensor(t).view(B, S, KV, D).transpose(1, 2).repeat_interleave(H // KV, 1) for t in (k, v))
    scores = (query @ keys.transpose(-1, -2)) / D ** 0.5
    scores = scores.masked_fill(~window_allowed(torch.arange(S), torch.arange(S), 0, window), float("-inf"))
    return (scores.softmax(-1) @ values).transpose(1, 2).reshape(B, S, H * D).numpy()


def test_local_window_size_is_a_window_without_sinks():
    """local_window_size=6 over 40 tokens equals headprune's 6-token window with sink 0 (the
    query's own token included), and not a 7-token one."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, S, n * D)).astype(np.float32) for n in (H, KV, KV))
    out = gqa_session(WINDOW).run(["out"], {"q": q, "k": k, "v": v, "seqlens_k": np.array([S - 1], np.int32),
                                            "total": np.array([S], np.int32)})[0]
    assert np.abs(out - windowed_attention(q, k, v, WINDOW)).max() < 1e-5
    assert np.abs(out - windowed_attention(q, k, v, WINDOW + 1)).max() > 1e-2
