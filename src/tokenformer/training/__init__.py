"""Training: the task-agnostic loop and its components, the language-model front end, DDP/FSDP,
vision training and plots (docs/training.md, docs/architecture.md)."""
