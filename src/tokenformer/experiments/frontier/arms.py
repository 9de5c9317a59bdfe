"""The frontier's growing arms: one :class:`GrowingArm` per arm, all in :data:`GROWING_ARMS`.

A growing arm is an entry of :data:`GROWING_ARMS` (a :class:`GrowingArm`): its family, its
operator and growth recipe or widening (``method``), and its old-token options (``freeze_old``,
``noise_old``: issue 24's, as in ``--grow-at``). ``chain-official-init`` is the released
initialisation with the optimizer carried; ``chain-official-released`` adds the released run's
restart at each growth: a fresh AdamW and a linear warmup again over ``warmup_steps``. The
released run's new cosine has no place in the one WSD family every run here follows; its
counterpart is each budget's cooldown, which every arm gets. ``chain-stack``/``widen-stack``
(G_stack) and ``widen-duplicate`` (HyperCloning) grow once, into the same final size as the
size-walking chains, from that size at half depth or half width, at a branch point of their own
stages by the same rule (:func:`.chains.reshaped_chain`; their LR: :func:`.schedule.run_schedule`).

A new growing arm is one entry of :data:`GROWING_ARMS`: the extension point for growth operators
(see the comment above it).
"""

from __future__ import annotations

from dataclasses import dataclass

# "per-stage": each stage at its own size's tuned LR, switched at the growth step (the default);
# "final-size": the whole chain at its final size's LR (v2's policy, kept as the compared factor)
LR_POLICIES = ("per-stage", "final-size")
# how a chain's stages differ (GrowingArm.shape): "size" walks the family's sizes (tokens or MLP
# width); "stack" starts at the final size with half its blocks and stacks them (G_stack);
# "clone" starts at the final size with half the hidden size and heads and duplicates them
# (HyperCloning)
SHAPES = {"size": None, "stack": "stack", "clone": "duplicate"}


@dataclass(frozen=True)
class GrowingArm:
    """An arm that grows (a chain): through which family's sizes, by which operator.

    ``kind`` "chain" is a TokenFormer-family arm, "widen" a Transformer++ one. ``shape`` "size"
    walks the family's sizes: a chain grows Pattention tokens with
    ``ops.growth.grow_with_optimizer`` (``method`` is its ``recipe``; ``official-released``
    also restarts the optimizer and the warmup at each growth), a widen arm widens the MLP with
    ``ops.growth``'s ``widen=`` (``method`` is its method). ``shape`` "stack" (method "stack")
    and "clone" (method "duplicate", ``width_noise``: ops.cloning's symmetry-breaking noise)
    reach the final size from a half-depth or half-width model instead (:data:`SHAPES`,
    :func:`.chains.reshaped_chain`). ``anneal``: after an exact growth Θ's factor moves to √n over
    ``anneal_steps``. The chain follows ``family``'s envelope and takes its LRs from that
    family's sweeps by ``lr_policy`` (:data:`LR_POLICIES`,
    :func:`.schedule.stage_lrs`)."""

    arm: str
    family: str
    kind: str
    method: str
    anneal: bool = False
    lr_policy: str = "per-stage"
    label: str = ""
    shape: str = "size"
    width_noise: float = 0.0
    # old tokens after each growth (ops.growth.grow): frozen for N steps or "forever", noised
    freeze_old: int | str | None = None
    noise_old: float = 0.0


# One entry per arm that grows (issues 24, 25). A new field of GrowingArm needs a default that
# keeps the other arms unchanged. Every chain runs each stage at its own size's LR ("per-stage")
# unless it says otherwise.
HYPERCLONING_NOISE = 0.32  # the HyperCloning release's symmetry-breaking noise (SNR 10 dB)
GROWING_ARMS: dict[str, GrowingArm] = {a.arm: a for a in (
    GrowingArm("chain-paper", "tokenformer", "chain", "paper",
               label="paper: new keys zero, new values initialised, Θ's factor follows n"),
    GrowingArm("chain-paper-final-lr", "tokenformer", "chain", "paper", lr_policy="final-size",
               label="paper, the whole chain at its final size's LR (v2's LR policy)"),
    GrowingArm("chain-official-init", "tokenformer", "chain", "official-init",
               label="official-init: the released code's initialisation of new tokens, "
                     "optimizer carried"),
    GrowingArm("chain-official-released", "tokenformer", "chain", "official-released",
               label="official-released: official-init plus a fresh optimizer and a warmup "
                     "restart at each growth (the released run's restart, in this experiment's "
                     "WSD family)"),
    GrowingArm("chain-exact", "tokenformer", "chain", "exact",
               label="exact: function-preserving, Θ's factor held"),
    GrowingArm("chain-exact-anneal", "tokenformer", "chain", "exact", anneal=True,
               label="exact, then Θ's factor annealed to √n"),
    GrowingArm("chain-stack", "tokenformer", "chain", "stack", shape="stack",
               label="G_stack: the final size at half depth, its blocks stacked (TokenFormer)"),
    GrowingArm("widen-zero", "transformer++", "widen", "zero",
               label="Transformer++ MLP widened, new units' outgoing weights zero"),
    GrowingArm("widen-net2net", "transformer++", "widen", "net2net",
               label="Transformer++ MLP widened by Net2Net (duplicated units, split weights)"),
    GrowingArm("widen-stack", "transformer++", "widen", "stack", shape="stack",
               label="G_stack: the final size at half depth, its blocks stacked (Transformer++)"),
    GrowingArm("widen-duplicate", "transformer++", "widen", "duplicate", shape="clone",
               width_noise=HYPERCLONING_NOISE,
               label="HyperCloning: the final size at half hidden size and heads, duplicated "
                     "(zero-sum noise 0.32)"),
    # The plain-GELU control chain under each LR policy, as the TokenFormer chain its gap is
    # compared with (C2): per-stage in v3 (beside chain-paper), final-size in v4 (beside
    # chain-paper-final-lr), so that the two arms of C2 differ only in Θ.
    GrowingArm("chain-gelu", "tokenformer-gelu", "chain", "paper",
               label="plain-GELU control: zero new keys (exactly function-preserving for "
                     "this Θ)"),
    GrowingArm("chain-gelu-final-lr", "tokenformer-gelu", "chain", "paper", lr_policy="final-size",
               label="plain-GELU control: zero new keys (exactly function-preserving for "
                     "this Θ), at its final size's LR"),
    # frozen vs trained old tokens (issue 24): not in a preset's arms until a question uses them
    GrowingArm("chain-exact-frozen", "tokenformer", "chain", "exact", freeze_old="forever",
               label="exact, old tokens frozen for ever (only the new tokens train)"),
    GrowingArm("chain-exact-noised", "tokenformer", "chain", "exact", noise_old=0.01,
               label="exact, old tokens noised at growth (std 1 % of each tensor's rms)"),
    GrowingArm("chain-paper-frozen", "tokenformer", "chain", "paper", freeze_old="forever",
               label="paper, old tokens frozen for ever (only the new tokens train)"),
)}



@dataclass(frozen=True)
class ContinuingArm:
    """An arm of v5's reuse family (issue 46; :class:`.presets.Reuse`): a finished base of
    ``family`` (trained and cooled at k tokens per parameter) continued for X times its compute.
    ``grows``: the :data:`GROWING_ARMS` entry whose operator grows the base into the reuse
    family's final size first (its growth event, :func:`.growing.grow_at`); None: trained on at
    the base's size. Every continuation starts a fresh AdamW (a finished base is its weights)."""

    name: str
    family: str
    grows: str | None
    label: str


CONTINUING_ARMS: dict[str, ContinuingArm] = {a.name: a for a in (
    ContinuingArm("grown", "tokenformer", "chain-paper",
                  "the TokenFormer base grown by the paper's recipe (new keys zero, new values "
                  "initialised, Θ's factor follows n) into the final size, then trained"),
    ContinuingArm("continued", "tokenformer", None,
                  "R3: the TokenFormer base re-warmed and trained on at its own size"),
    ContinuingArm("tpp-grown", "transformer++", "widen-duplicate",
                  "R4: Transformer++'s base of the same k grown by HyperCloning (hidden size "
                  "and heads duplicated, zero-sum noise 0.32) into its final size, then trained"),
)}
