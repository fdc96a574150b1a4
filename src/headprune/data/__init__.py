"""Datamodules: text classification tables (`classification.py`, parsing rules in
`textdata.py`) and plain-text corpora for causal LMs (`language_model.py`)."""
