"""Deploying a pruned model: transformers checkpoints (`hf`), folding gates and scales into the
output projection (`fold`), ONNX (`onnx`)."""
