"""Latency, FLOPs and KV-cache measurement of pruned models (the `headprune-bench` app).

sections.py   what a section is (run, checks, table, summary, plot panel), the registry, `SectionInputs`
encoder.py    section: whole forward and attention sub-layer over a batch x seq grid
train_step.py section: forward + backward + AdamW step, pruned vs masked
runtime.py    section: ONNX Runtime forward of exported dense and pruned models
ort_decode.py section: ONNX Runtime decode graphs of an LLM's exports (windowed units in rings) vs dense
decoder.py    section: prefill, per-token decode with the KV cache, cache bytes
llm.py        section: the same on a pretrained causal LM vs its pruned exports, with Amdahl bounds
serve.py      section: serving with static caches: tokens/s over a batch sweep, sequences that fit a memory budget, time to first token
llamacpp.py   section: decode of the same exports as GGUF files in llama.cpp, with the same columns
scale.py      section: peak memory and seconds of each LLM pipeline stage per model size, one child process each
origin.py     the dense model a pruned export came from (recorded in the export, or bench.dense_model)
variants.py   dense / masked / pruned / unstructured copies of one model
render.py     the markdown table builder, cell formats and plot curves the sections share
report.py     bench.json, bench.md, bench.png and the README table: loops over the sections
config.py     the typed `bench:` settings (common fields + one block per section) and their checks
Timing, FLOP counts and attention replay live in headprune.costs.
"""
# Importing a section registers it; this order is the order of bench.json, bench.md and the run.
from headprune.bench import encoder, train_step, runtime, decoder, llm, ort_decode, serve, llamacpp, scale  # noqa: F401  # isort: skip
