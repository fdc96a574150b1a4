"""Repository tooling, not shipped in the wheel: the coverage harness (tools/coverage.py) and the
configuration reference generator (tools/config_reference.py). Run from the repository root:
`python -m tools.coverage ...`, `python -m tools.config_reference`."""
