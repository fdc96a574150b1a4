#!/usr/bin/env bash
# Creates kvpress 0.5.5's own virtual environment beside the repository (kvpress pins
# transformers < 5.3; headprune runs on transformers 5.x, so the two never share a venv).
# torch stays at 2.13.0, the project's version (the CPU wheel where pip's find-links has it).
# Usage: bash experiments/peers_kvpress/setup.sh        (KVPRESS_VENV overrides the folder)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
venv="${KVPRESS_VENV:-$repo/../kvpress_venv}"
if [ ! -x "$venv/bin/python" ]; then
  python3.11 -m venv "$venv"
fi
"$venv/bin/pip" install torch==2.13.0 kvpress==0.5.5
# the installed versions, for the README's conditions
"$venv/bin/python" - <<'PY'
import importlib.metadata as m
for name in ("torch", "transformers", "kvpress", "accelerate", "safetensors"):
    try:
        print(name, m.version(name))
    except m.PackageNotFoundError:
        print(name, "absent")
PY
