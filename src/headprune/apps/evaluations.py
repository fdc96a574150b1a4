"""Compatibility import: the LLM evaluation suite moved to `headprune.evaluation.llm_suite`.

Kept only for experiments/llm_kv_modes/evaluate_export.py, which a long SmolLM2 run in progress
uses and which is not edited while it runs; everything else imports headprune.evaluation.llm_suite.
Remove this module once that script imports the new place.
"""
from headprune.evaluation.llm_suite import EvaluationSettings, evaluate_llm, header, settings

__all__ = ["EvaluationSettings", "evaluate_llm", "header", "settings"]
