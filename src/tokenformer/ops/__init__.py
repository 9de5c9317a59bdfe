"""Operations on models: growth, pruning, token adapters and MLP widening (docs/architecture.md)."""
