"""One ``load_model`` for every model spec (a preset, our folders, Hugging Face folders, released
checkpoints) and the conversions between formats (docs/architecture.md)."""
