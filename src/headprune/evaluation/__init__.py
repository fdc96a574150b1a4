"""Evaluation of (pruned) pretrained causal LMs beyond the training task's validation loss:
perplexity in fixed windows (`perplexity.py`, the causal-LM Task's `evaluate` on them),
zero-shot accuracy through lm-eval-harness with shipped local tasks (`zero_shot.py`, `tasks/`),
greedy answers to fixed chat prompts (`generation.py`), passkey retrieval (`retrieval.py`), and
the suite a causal-LM run's `evaluation:` block runs on the dense model and on the export
(`llm_suite.py`: `EvaluationSettings`, `evaluate_llm`). lm-eval is imported only when
`zero_shot` runs (the `llm` extra)."""
from headprune.evaluation.generation import PROMPTS, generate_answers
from headprune.evaluation.perplexity import Windows, perplexity, text_windows
from headprune.evaluation.zero_shot import LOCAL_TASKS, chance_level, prepare_local_tasks, zero_shot

__all__ = ["LOCAL_TASKS", "PROMPTS", "Windows", "chance_level", "generate_answers", "perplexity",
           "prepare_local_tasks", "text_windows", "zero_shot"]
