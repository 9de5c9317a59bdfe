"""The models: configs with presets and FLOP counts, the TokenFormer LM, the Transformer
baselines, the Vision TokenFormer, and the released-checkpoint layout (docs/architecture.md)."""
