"""Data: the embedded corpus, prepared token datasets, tokenizers and image data
(docs/data.md, docs/architecture.md)."""
