"""A layer-granular windowed KV layout (heads/windows.py: every kept unit of a windowed layer
windowed, no sink tokens) exported to llama.cpp as `granite_swa` sliding-window layers
(deploy/gguf_export.py) and run there (llama-cpp-python): its logits over a prefill many windows
long and over greedy decode steps equal the windowed PyTorch model's, not the unwindowed one's;
layouts llama.cpp cannot serve are refused by name before anything is written."""
import re

import numpy as np
import pytest
import torch
from transformers.cache_utils import DynamicCache

from headprune import save_gguf
from headprune.deploy import llamacpp
from headprune.deploy.gguf_export import gguf_refusal
from headprune.heads.windows import KVLayout, KVWindows
from tests.helpers import bpe_tokenizer, tiny_llama

llamacpp.import_llama_cpp()

WINDOW = 24
LAYER_MODES = (("full",) * 4, ("window",) * 4, ("full",) * 4, ("window",) * 4)  # 4 layers x 4 KV heads


@pytest.fixture(scope="module")
def tok():
    return bpe_tokenizer()


def tokens(n: int, seed: int = 0, vocab: int = 261) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.slow  # llama.cpp loads and runs ~330 positions: ~3 s
def test_sliding_window_layers_serve_as_pytorch_computes_them(tok, tmp_path):
    """Layers 1 and 3 windowed (24 tokens, sink 0), 0 and 2 full: a 300-token prompt (prefilled in
    ubatches of 64, a window-sized cache: swa_full=False) and 30 greedy steps give llama.cpp's
    logits within 1e-5 of the windowed PyTorch model's with its windowed cache (the same tokens;
    F32 cache without flash attention, which rounds to F16 inside: 1.5e-3 with it),
    while the unwindowed model differs by far more; the file is granite_swa with the layers'
    pattern, and llama.cpp allocates the windowed layers a cache smaller than the context."""
    import gguf

    model = tiny_llama(tok)
    windows = KVWindows(KVLayout(LAYER_MODES, sink=0, window=WINDOW)).attach(model)
    out = save_gguf(model, tmp_path / "swa.gguf", tokenizer=tok, weights="f32")
    assert out.arch == "granite_swa" and out.layout.swa == (False, True, False, True)
    fields = gguf.GGUFReader(str(out.path)).fields
    assert fields["granite_swa.attention.sliding_window"].contents() == WINDOW
    assert fields["granite_swa.attention.sliding_window_pattern"].contents() == [False, True, False, True]
    loaded = llamacpp.load(out.path, n_ctx=1024, n_batch=64, cache="f32", flash_attn=False, swa_full=False)
    try:
        prompt, steps = tokens(300, seed=1), 30
        got = llamacpp.logits(loaded, prompt)  # (300, V)
        generated = llamacpp.greedy(loaded, prompt, steps)
        decode = np.array(loaded.llm.scores[len(prompt) - 1:len(prompt) + steps], dtype=np.float64)  # (steps + 1, V)
        log = loaded.log
    finally:
        loaded.close()
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        want = model(torch.tensor([prompt]), cache=cache, use_cache=True).logits[0].double()
        seq, step_logits = list(prompt), [want[-1]]
        for _ in range(steps):
            seq.append(int(step_logits[-1].argmax()))
            step_logits.append(model(torch.tensor([seq[-1:]]), cache=cache, use_cache=True).logits[0, -1].double())
    assert generated == seq[len(prompt):]
    assert np.abs(got - want.numpy()).max() <= 1e-5  # F32 weights and cache, no flash attention (llamacpp.load)
    assert np.abs(decode - torch.stack(step_logits).numpy()).max() <= 1e-5
    windows.detach()  # the same model without its windows
    with torch.no_grad():
        plain = model(torch.tensor([prompt])).logits[0].double().numpy()
    assert np.abs(got - plain).max() > 1e-2  # positions past the window see fewer keys in both
    sizes = [int(cells) for cells in re.findall(r"llama_kv_cache: size = .*?\(\s*(\d+) cells", log)]
    assert len(sizes) == 2 and min(sizes) < 1024 == max(sizes), sizes  # the SWA layers' cache: window + ubatch


def test_layouts_llamacpp_cannot_serve_are_refused_by_name(tok, tmp_path):
    """Per-head windows (a windowed layer keeping a full unit), sink tokens, and uneven heads with
    windows are refused before anything is written; a layer-granular sink-0 layout is not."""
    model = tiny_llama(tok)
    cases = [(LAYER_MODES, 0, None),
             ((("full",) * 4, ("window", "window", "full", "window"), ("full",) * 4, ("full",) * 4), 0,
              "both windowed and full KV units"),
             (LAYER_MODES, 4, "sink=4: llama.cpp's sliding windows keep no sink tokens")]
    for modes, sink, why in cases:
        windows = KVWindows(KVLayout(modes, sink=sink, window=WINDOW)).attach(model)
        reason = gguf_refusal(model)
        assert (reason is None) if why is None else why in reason, reason
        if why is not None:
            with pytest.raises(ValueError, match="GGUF export refused"):
                save_gguf(model, tmp_path / "refused.gguf", tokenizer=tok)
            assert not (tmp_path / "refused.gguf").exists()
        windows.detach()
    uneven = tiny_llama(tok, {1: [0, 1, 2, 3]})
    KVWindows(KVLayout(LAYER_MODES, sink=0, window=WINDOW)).attach(uneven)
    assert "granite_swa builds every layer with layer 0's head counts" in gguf_refusal(uneven)


def test_export_cli_writes_granite_swa_from_a_windowed_save_pruned_folder(tok, tmp_path, capsys):
    """`headprune-export <folder> --gguf` of a windowed save_pruned folder (whose config.json plain
    transformers refuses) loads it with load_pruned and writes the sliding-window layers; a folder
    with sinks exits 2 with the reason, writing nothing."""
    import gguf

    from headprune import save_pruned
    from headprune.apps.export import main as export_main

    for sink, name in ((0, "swa"), (2, "sinks")):
        model = tiny_llama(tok)
        KVWindows(KVLayout(LAYER_MODES, sink=sink, window=WINDOW)).attach(model)
        save_pruned(model, tmp_path / name, tokenizer=tok)
    assert export_main([str(tmp_path / "swa"), "--gguf", str(tmp_path / "swa.gguf"), "--gguf-weights", "f32"]) == 0
    assert '"sliding_layers": [\n    1,\n    3\n  ]' in capsys.readouterr().out
    fields = gguf.GGUFReader(str(tmp_path / "swa.gguf")).fields
    assert fields["general.architecture"].contents() == "granite_swa"
    with pytest.raises(SystemExit) as exit_:
        export_main([str(tmp_path / "sinks"), "--gguf", str(tmp_path / "sinks.gguf")])
    assert exit_.value.code == 2 and "sink=2: llama.cpp's sliding windows keep no sink tokens" in capsys.readouterr().err
    assert not (tmp_path / "sinks.gguf").exists()
