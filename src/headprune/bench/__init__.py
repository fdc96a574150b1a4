"""Latency, FLOPs and KV-cache measurement of pruned models (the `headprune-bench` app).

timing.py   interleaved, synchronised timing (medians and quartiles)
flops.py    analytic attention FLOPs: the theoretical speed-up
variants.py dense / masked / pruned / unstructured copies of one model
encoder.py  whole forward and attention sub-layer over a batch x seq grid
decoder.py  prefill, per-token decode with the KV cache, cache bytes
report.py   bench.json, bench.md, bench.png
config.py   the typed `bench:` settings and their checks
"""
