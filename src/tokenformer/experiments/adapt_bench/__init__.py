"""``tokenformer adapt-bench``: token adapters vs LoRA vs full fine-tuning on a new domain.

A TokenFormer (and a Transformer++ of matched size, same data, steps and schedule) is pretrained
on the embedded King James Bible; each arm then adapts it to a second embedded corpus, the Python
source of the pinned ``Jinja2`` package (:func:`tokenformer.data.corpora.code_text`), for the
same number of steps:

==============  ===================================================================================
``tok-ffn``     parameter-token adapter on the FFN Pattentions (:func:`tokenformer.adapt`)
``tok-all``     the same on every Pattention (Q, K, V, output projection, FFN)
``lora-ffn``    LoRA from ``peft`` on the same FFN Pattention parameters (``target_parameters``)
``lora-tpp``    LoRA from ``peft`` on every linear of the Transformer++ base
``full``        full fine-tuning of the TokenFormer (every parameter; one budget: 100 %)
==============  ===================================================================================

Adapter arms are sized to trainable-parameter *budgets* (fractions of the TokenFormer base's
parameters): each picks the token count / rank whose count is nearest. The LR of each arm is
picked per budget on a grid, on a tuning seed not used for the reported runs (an LR tuned at one
budget handicaps LoRA at another: its update grows with the rank). Reported:
new-domain (code) validation loss, old-domain (KJV) validation loss with the adapter on
(forgetting) and, for token adapters, off (must equal the base's exactly), trainable parameters,
step time and the adapter file's size; paired t-tests over seeds with t-based 95 % intervals.

Data flows one way: :mod:`.plan` (arms, budgets, LR grids, presets) and :mod:`.corpus` (the two
corpora) → :mod:`.run` (bases, LR tuning, every adaptation run; resumable) → :mod:`.report`
(``results.json`` → intervals, paired comparisons, the verdict, report.md and the Pareto plot).
"""

from .plan import ARMS, LABELS, PRESETS, SCHEMA, BenchPreset, bench_preset, get_preset, tuning_key
from .report import summarize, t_interval, verdict
from .run import knob, run_adapt_bench, run_one, tune_lr

__all__ = ["ARMS", "LABELS", "PRESETS", "SCHEMA", "BenchPreset", "bench_preset", "get_preset",
           "knob", "run_adapt_bench", "run_one", "summarize", "t_interval", "tune_lr", "tuning_key",
           "verdict"]
