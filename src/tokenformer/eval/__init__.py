"""Evaluation: perplexity over text, lm-evaluation-harness tasks, vision accuracy
(docs/architecture.md)."""
