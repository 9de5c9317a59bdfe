"""Product-key Pattention: each input row reads k of n = s² parameter tokens at O(√n·d) cost.

The n key parameter tokens are not stored: token t = i·s + j has the key [a_i ; b_j], the
concatenation of sub-key a_i (one of s, ``sub_keys_a`` [s, d_in/2]) and b_j (``sub_keys_b``
[s, d_in − d_in/2]) (Lample et al. 2019, "Large memory layers with product keys"; PEER, He 2024).
Its score is x·[a_i ; b_j] = x₁·a_i + x₂·b_j, so the k best of all n scores are found by scoring
the two halves against their s sub-keys, taking the top k' = min(k, s) of each half, and the top k
of the k'×k' sums (every one of the k best pairs has both halves among its half's top k': if a
pair (i, j) is in the top k, the ≤ k−1 pairs (i', j) above it include every i' with a higher first
half). Each row then reads its k value rows (``value_param_tokens`` [n, d_out]).

Θ is the model's Θ variant applied over the k selected scores only, with factor ``scale``
(default √k for the L2 variants, k for L1/softmax: the dense layer's rule with n → k). Over k,
not n, because the normaliser over all n scores needs all n scores, which is exactly the cost
product keys avoid; the k selected are the ones that dominate that norm for peaked rows. The
factor follows k, not n, for the dense layer's reason: a/‖a‖ over m entries has RMS 1/√m, so √m
keeps the pre-activations O(1).

Growth (:meth:`ProductKeyPattention.grown`): s → s' sub-keys per half, n → s'². What is
preserved: every old token's key [a_i ; b_j] and value (token i·s + j moves to index i·s' + j), k
and Θ's factor. The function is preserved for a row whose top k contains no new token; it is not
preserved in general, because a new sub-key pairs with every old sub-key of the other half and its
tokens compete for the k slots (no key makes a dot product −∞ for every input), unlike dense
growth where zero keys add nothing to Θ's norm.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from .theta import check_theta, default_scale, theta


def product_top_k(x: torch.Tensor, sub_keys_a: torch.Tensor, sub_keys_b: torch.Tensor, k: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores [rows, k], token indices [rows, k]) of the k largest x·[a_i ; b_j] over all s²
    pairs, for ``x`` [rows, d_in]; scores are differentiable in x and both sub-key sets."""
    s, half = sub_keys_a.shape[0], sub_keys_a.shape[1]
    kk = min(k, s)
    score_a = F.linear(x[:, :half], sub_keys_a)  # [rows, s]
    score_b = F.linear(x[:, half:], sub_keys_b)
    top_a, idx_a = score_a.topk(kk, dim=-1)
    top_b, idx_b = score_b.topk(kk, dim=-1)
    pairs = (top_a.unsqueeze(-1) + top_b.unsqueeze(-2)).flatten(1)  # [rows, kk·kk]
    scores, flat = pairs.topk(k, dim=-1)
    index = idx_a.gather(-1, flat // kk) * s + idx_b.gather(-1, flat % kk)
    return scores, index


class ProductKeyPattention(nn.Module):
    """``Y = Θ(top-k scores)·V[top-k]`` over n = s² product-key parameter tokens; drop-in for a
    Pattention (maps ``[..., in_features]`` to ``[..., out_features]``). Module docstring."""

    def __init__(self, in_features: int, out_features: int, num_tokens: int, top_k: int,
                 norm: str = "l2_norm_gelu", *, scale: float | None = None, eps: float = 0.0,
                 key_init_std: float = 0.02, value_init_std: float = 0.02,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None
                 ) -> None:
        super().__init__()
        check_theta(norm)
        s = math.isqrt(num_tokens) if isinstance(num_tokens, int) and num_tokens > 0 else 0
        if s * s != num_tokens:
            raise ConfigError(f"product keys need a square number of tokens (s² for s sub-keys "
                              f"per half), got {num_tokens!r}")
        if in_features < 2:
            raise ConfigError(f"product keys split the input in two halves; in_features must be "
                              f">= 2, got {in_features}")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_tokens:
            raise ConfigError(f"product-key top_k must be a count in [1, {num_tokens}], "
                              f"got {top_k!r}")
        self.in_features, self.out_features = in_features, out_features
        self.top_k, self.norm, self.eps = top_k, norm, float(eps)
        self.scale = float(scale) if scale is not None else default_scale(norm, top_k)
        self.key_init_std, self.value_init_std = key_init_std, value_init_std
        factory = {"device": device, "dtype": dtype}
        half = in_features // 2
        self.sub_keys_a = nn.Parameter(torch.empty(s, half, **factory))
        self.sub_keys_b = nn.Parameter(torch.empty(s, in_features - half, **factory))
        self.value_param_tokens = nn.Parameter(torch.empty(num_tokens, out_features, **factory))
        self.reset_parameters()

    @property
    def num_sub_keys(self) -> int:
        return self.sub_keys_a.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.value_param_tokens.shape[0]

    def reset_parameters(self) -> None:
        nn.init.normal_(self.sub_keys_a, std=self.key_init_std)
        nn.init.normal_(self.sub_keys_b, std=self.key_init_std)
        nn.init.normal_(self.value_param_tokens, std=self.value_init_std)

    def keys(self) -> torch.Tensor:
        """The n materialised keys [n, d_in] (row i·s + j = [a_i ; b_j]): for tests and
        inspection; the forward never builds them."""
        s = self.num_sub_keys
        return torch.cat((self.sub_keys_a.repeat_interleave(s, dim=0),
                          self.sub_keys_b.repeat(s, 1)), dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        scores, index = product_top_k(rows, self.sub_keys_a, self.sub_keys_b, self.top_k)
        weights = theta(scores, self.norm, self.scale, self.eps)
        # One fused gather-and-weighted-sum per row: reads k value rows, never a [rows, k, d_out]
        # copy; its backward scatters into V's gradient and gives the weights' gradient.
        value = self.value_param_tokens
        if torch.is_autocast_enabled(x.device.type):  # as autocast casts a matmul's operands
            value = value.to(torch.get_autocast_dtype(x.device.type))
        out = F.embedding_bag(index, value, per_sample_weights=weights.to(value.dtype),
                              mode="sum")
        return out.view(*x.shape[:-1], self.out_features)

    @torch.no_grad()
    def grown(self, num_sub_keys: int, generator: torch.Generator | None = None
              ) -> ProductKeyPattention:
        """A copy with ``num_sub_keys`` ≥ s sub-keys per half (n = num_sub_keys²): old sub-keys
        and values kept (token i·s + j → i·s' + j), new sub-keys N(0, key_init_std²), new values
        N(0, value_init_std²); same k and Θ factor. Module docstring says what is preserved."""
        s, s2 = self.num_sub_keys, num_sub_keys
        if s2 < s:
            raise ConfigError(f"cannot grow from {s} to {s2} sub-keys")
        ref = self.value_param_tokens
        new = ProductKeyPattention(self.in_features, self.out_features, s2 * s2, self.top_k,
                                   self.norm, scale=self.scale, eps=self.eps,
                                   key_init_std=self.key_init_std,
                                   value_init_std=self.value_init_std, device=ref.device,
                                   dtype=ref.dtype)
        for name in ("sub_keys_a", "sub_keys_b", "value_param_tokens"):
            p = getattr(new, name)
            p.copy_(torch.empty(p.shape).normal_(0.0, self.key_init_std if "key" in name
                                                 else self.value_init_std, generator=generator))
        new.sub_keys_a[:s] = self.sub_keys_a
        new.sub_keys_b[:s] = self.sub_keys_b
        new.value_param_tokens.view(s2, s2, -1)[:s, :s] = ref.view(s, s, -1)
        new.train(self.training)
        return new

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"num_tokens={self.num_tokens} ({self.num_sub_keys}² product keys), "
                f"top_k={self.top_k}, norm={self.norm!r}, scale={self.scale:.6g}")
