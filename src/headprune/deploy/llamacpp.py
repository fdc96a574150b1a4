"""A GGUF file run in llama.cpp (through llama-cpp-python): logits, greedy tokens, and the KV
cache llama.cpp actually keeps, for the export checks and the decode bench.

KV bytes, two readings of llama.cpp's own numbers, not of ours:
- per layer: the sequence state llama.cpp serialises (`llama_state_seq_get_data`) holds, for every
  layer of its cache, the K and V row bytes of one cell (src/llama-kv-cache.cpp `state_write_data`:
  per layer a type and a row size, then the rows), parsed by `kv_rows`; the parse must consume
  the state exactly, else it is refused;
- in all: the buffer sizes llama.cpp logs when it allocates the cache ("llama_kv_cache: size =
  ... MiB (... cells, ... layers ...), K (f16): ... MiB, V (f16): ... MiB"), captured from its log.

`flash_attn=True` throughout: without flash attention llama.cpp pads every layer's V cache to the
widest layer's (it warns so), and an uneven layout would not save what it predicts.
"""
from __future__ import annotations

import contextlib
import ctypes
import io
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

INSTALL = 'CMAKE_ARGS="-DGGML_NATIVE=OFF" pip install "headprune[llamacpp]"'


def import_llama_cpp():
    """The llama_cpp module, or an ImportError saying how to install it."""
    try:
        import llama_cpp
    except ImportError as err:
        raise ImportError(f"llama.cpp checks need llama-cpp-python: {INSTALL} ({err})") from None
    return llama_cpp


@dataclass
class Loaded:
    """A llama.cpp model and context, and what llama.cpp logged while loading it."""

    llm: object
    log: str

    def close(self) -> None:
        self.llm.close()


CACHE_TYPES = {"f16": (1, 2), "f32": (0, 4)}  # KV cache type: (ggml type id, bytes per value)


def load(path: str | Path, n_ctx: int, threads: int = 1, logits_all: bool = True, n_batch: int = 512,
         cache: str = "f16", flash_attn: bool = True, swa_full: bool | None = None) -> Loaded:
    """`Llama(path, flash_attn=True)` with llama.cpp's log captured (verbose, into `Loaded.log`).
    `cache`: the KV cache type, "f16" (llama.cpp's default, what users serve) or "f32".
    `flash_attn=False` only for the exactness check of an export: on CPU, llama.cpp's flash
    attention rounds to F16 inside whatever the cache type (dense SmolLM2, F32 weights, 4,096
    tokens: max |logit difference| 5.5e-2 with it, 2.6e-4 without; experiments/llm_kv/decode/
    llamacpp/agreement.json), while without it the V cache is transposed and padded to the widest
    layer (`kv_rows` refuses such a state). `swa_full`: llama.cpp's choice for sliding-window
    layers (None: its default, a full-size cache; False: a cache of the window plus a ubatch)."""
    llama_cpp = import_llama_cpp()
    if cache not in CACHE_TYPES:
        raise ValueError(f"cache={cache!r} is not allowed; allowed: {', '.join(CACHE_TYPES)}")
    buffer = io.StringIO()
    kind = CACHE_TYPES[cache][0]
    with contextlib.redirect_stderr(buffer):
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=min(n_batch, n_ctx),
                              n_ubatch=min(n_batch, n_ctx), logits_all=logits_all, flash_attn=flash_attn,
                              n_threads=threads, n_threads_batch=threads, type_k=kind, type_v=kind, verbose=True,
                              **({} if swa_full is None else {"swa_full": swa_full}))
    if llm is None or "llama_kv_cache" not in buffer.getvalue():
        raise RuntimeError(f"llama.cpp loaded {path} without logging its KV cache: {buffer.getvalue()[-2000:]}")
    from llama_cpp._logger import set_verbose

    set_verbose(False)  # later calls stay quiet (the log callback prints only at verbose level)
    return Loaded(llm, buffer.getvalue())


def logits(loaded: Loaded, tokens: list[int]) -> np.ndarray:
    """llama.cpp's logits (T, V) of `tokens` from an empty cache."""
    llm = loaded.llm
    llm.reset()
    llm.eval(list(tokens))
    return np.array(llm.scores[: len(tokens)], dtype=np.float64)


def greedy(loaded: Loaded, prompt: list[int], steps: int) -> list[int]:
    """`steps` greedy tokens after `prompt` (argmax of llama.cpp's logits, no sampler)."""
    llm = loaded.llm
    llm.reset()
    llm.eval(list(prompt))
    out = []
    for _ in range(steps):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(token)
        llm.eval([token])
    return out


@dataclass(frozen=True)
class KVRows:
    """Per layer of llama.cpp's cache, the K and V bytes one cell holds, and how many cells the
    state held."""

    k: list[int]
    v: list[int]
    cells: int

    @property
    def per_token(self) -> list[int]:
        return [k + v for k, v in zip(self.k, self.v)]


def kv_rows(loaded: Loaded, seq_id: int = 0) -> KVRows:
    """Parse llama.cpp's serialised state of sequence `seq_id` (module docstring) after an eval."""
    llama_cpp = import_llama_cpp()
    ctx = loaded.llm._ctx.ctx
    size = llama_cpp.llama_state_seq_get_size(ctx, seq_id)
    buf = (ctypes.c_uint8 * size)()
    written = llama_cpp.llama_state_seq_get_data(ctx, buf, size, seq_id)
    return parse_seq_state(bytes(buf[:written]))


def parse_seq_state(data: bytes) -> KVRows:
    """The per-layer K/V row bytes in a llama.cpp sequence state (one stream, F16/F32 cache,
    V not transposed: flash attention). Raises ValueError when the bytes do not parse exactly."""
    pos = 0

    def take(fmt: str):
        nonlocal pos
        values = struct.unpack_from("<" + fmt, data, pos)
        pos += struct.calcsize("<" + fmt)
        return values if len(values) > 1 else values[0]

    take("I")  # magic
    take("i")  # seq id
    n_stream = take("I")
    if n_stream != 1:
        raise ValueError(f"llama.cpp state: {n_stream} streams; this parser reads one")
    cells = take("I")
    for _ in range(cells):
        take("i")  # position
        n_seq = take("I")
        pos += 4 * n_seq
    v_trans, n_layer = take("I"), take("I")
    if v_trans:
        raise ValueError("llama.cpp state: V is transposed (no flash attention); load with flash_attn=True")
    k_rows, v_rows = [], []
    for rows in (k_rows, v_rows):
        for _ in range(n_layer):
            take("i")  # ggml type
            row = take("Q")
            rows.append(row)
            pos += row * cells
    if pos != len(data):
        raise ValueError(f"llama.cpp state: parsed {pos} of {len(data)} bytes; the format is not the one expected")
    return KVRows(k_rows, v_rows, cells)


_KV_LINE = re.compile(r"llama_kv_cache: size =\s*([\d.]+) MiB \(\s*(\d+) cells,\s*(\d+) layers.*?K \((\w+)\):\s*"
                      r"([\d.]+) MiB, V \((\w+)\):\s*([\d.]+) MiB")


def kv_allocation(log: str) -> dict:
    """What llama.cpp logged allocating its KV cache: MiB in all, of K and of V (2 decimals), cells,
    layers, cache types. A ValueError when the log holds no such line."""
    found = _KV_LINE.search(log)
    if found is None:
        raise ValueError("llama.cpp's log holds no 'llama_kv_cache: size = ...' line (was it loaded verbose?)")
    total, cells, layers, k_type, k_mib, v_type, v_mib = found.groups()
    return {"mib": float(total), "cells": int(cells), "layers": int(layers), "k_type": k_type, "v_type": v_type,
            "k_mib": float(k_mib), "v_mib": float(v_mib)}


def system_info() -> str:
    """llama.cpp's CPU feature line (which SIMD paths the build uses)."""
    return import_llama_cpp().llama_print_system_info().decode()


def perplexity(window_logits: list[np.ndarray], windows: list[list[int]]) -> float:
    """exp(mean next-token negative log-likelihood) over the windows (each window's first token
    is context only), from llama.cpp's logits."""
    nll, n = 0.0, 0
    for lg, tokens in zip(window_logits, windows):
        lg = lg[:-1]
        top = lg.max(axis=1, keepdims=True)
        logz = np.log(np.exp(lg - top).sum(axis=1)) + top[:, 0]
        target = np.asarray(tokens[1:])
        nll += float((logz - lg[np.arange(len(target)), target]).sum())
        n += len(target)
    return float(np.exp(nll / n))
