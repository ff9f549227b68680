"""Evaluators: scores of a model on held-out data beyond the loss (the Task calls `evaluate`)."""
