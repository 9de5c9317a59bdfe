"""CLI subcommands, one module per area; each defines ``register(subparsers)``."""
