"""TokenFormerLM: sizes (spec §3), causality, the KV cache, generation, persistence."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from tokenformer import (
    PRESETS,
    CheckpointError,
    ConfigError,
    TokenFormerConfig,
    TokenFormerError,
    TokenFormerLM,
    flops_per_token,
)
from tokenformer.models import generation as gen
from tokenformer.models.generation import positions_from_mask
from tokenformer.models.kv_cache import StaticKVCache

# Spec §3: the exact parameter counts of the released models and of the paper's scaling chain.
OFFICIAL_PARAMETERS = {
    "tokenformer-150m": 151_881_216,
    "tokenformer-450m": 454_166_528,
    "tokenformer-900m": 903_252_480,
    "tokenformer-1-5b": 1_587_219_456,
    "tokenformer-354m-owt2": 353_503_232,
    "tokenformer-757m-owt2": 756_156_416,
    "tokenformer-124m-chain": 123_569_664,
    "tokenformer-354m-chain": 354_190_848,
}


def small_config(**overrides) -> TokenFormerConfig:
    base = dict(vocab_size=100, hidden_size=32, num_layers=2, num_heads=4, qkv_tokens=16,
                proj_tokens=12, ffn_tokens=48, max_seq_len=64, rotary_pct=0.5, eos_token_id=None)
    return TokenFormerConfig(**{**base, **overrides})


def random_model(dtype: torch.dtype = torch.float32, seed: int = 0, **overrides) -> TokenFormerLM:
    """A small model whose blocks matter: the wang init alone leaves the residual stream ≈ E[x]."""
    torch.manual_seed(seed)
    model = TokenFormerLM(small_config(**overrides))
    with torch.no_grad():
        for layer in model.pattentions().values():
            layer.value_param_tokens.normal_(0.0, 0.3)
    return model.to(dtype).eval()


def ids(batch: int, length: int, vocab: int = 100, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------------------- sizes
@pytest.mark.parametrize("name", list(OFFICIAL_PARAMETERS))
def test_num_parameters_of_official_sizes(name: str) -> None:
    config = TokenFormerConfig.from_name(name)
    assert config.num_parameters() == OFFICIAL_PARAMETERS[name]
    assert config.num_parameters(non_embedding=True) == (OFFICIAL_PARAMETERS[name]
                                                         - 50304 * config.hidden_size)
    with torch.device("meta"):  # instantiated without allocating: the modules agree
        model = TokenFormerLM(config)
    assert sum(p.numel() for p in model.parameters()) == OFFICIAL_PARAMETERS[name]


@pytest.mark.parametrize("name", [n for n in PRESETS if n not in OFFICIAL_PARAMETERS])
def test_num_parameters_of_small_presets(name: str) -> None:
    config = TokenFormerConfig.from_name(name)
    model = TokenFormerLM(config)
    assert config.num_parameters() == sum(p.numel() for p in model.parameters())
    assert model.num_parameters() == config.num_parameters()


def test_num_parameters_with_block_norms() -> None:
    config = small_config(block_norm="both")
    model = TokenFormerLM(config)
    assert config.num_parameters() == sum(p.numel() for p in model.parameters())


def test_flops_per_token_by_hand() -> None:
    """The tiny preset, counted by hand with the conventions of ``flops_per_token``."""
    config = TokenFormerConfig.from_name("tiny")  # L 2, d 64, 4 heads, qkv 32/32/128, V 384
    per_score = 2 * (64 + 64) + 8  # two matmuls per parameter token, plus Θ (l2_norm_gelu)
    pattentions = (3 * 32 + 32 + 128) * per_score
    attention = 2 * 2 * 128 * 64 + 5 * 128 * 4 + 3 * 2 * 4 * 4  # QKᵀ, AV, softmax, rotary
    per_layer = pattentions + attention + 2 * 5 * 64
    head = 2 * 384 * 64 + 5 * 64
    fwd = flops_per_token(config)
    assert fwd["per_layer"] == per_layer
    assert fwd["total"] == 2 * per_layer + head
    assert flops_per_token(config, training=True)["total"] == 3 * fwd["total"]


# -------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_config_round_trip(tmp_path: Path, suffix: str) -> None:
    config = small_config(norm="softmax", ffn_scale=3.5, block_norm="weight")
    config.save(tmp_path / f"c{suffix}")
    assert TokenFormerConfig.load(tmp_path / f"c{suffix}") == config


@pytest.mark.parametrize("overrides, message", [
    ({"hidden_size": 30}, "not divisible"),
    ({"rotary_pct": 0.375}, "odd"),  # head_dim 8 × 0.375 = 3
    ({"norm": "relu"}, "norm must be one of l2_norm_gelu"),
    ({"num_layers": 0}, "positive integer"),
])
def test_bad_config(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        small_config(**overrides)


# ------------------------------------------------------------------------------------- forward
def test_causality() -> None:
    model = random_model()
    x = ids(2, 30)
    y = x.clone()
    y[:, 17] = (y[:, 17] + 1) % 100
    with torch.no_grad():
        a, b = model(x).logits, model(y).logits
    torch.testing.assert_close(a[:, :17], b[:, :17], rtol=0, atol=1e-6)
    assert (a[:, 17:] - b[:, 17:]).abs().amax(dim=-1).min() > 1e-3  # every later position moves


def test_batch_independence() -> None:
    model = random_model()
    x = ids(4, 21)
    with torch.no_grad():
        together = model(x).logits
        alone = torch.cat([model(x[i: i + 1]).logits for i in range(4)])
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)


def test_loss_is_shifted_cross_entropy() -> None:
    model = random_model(torch.float64)
    x = ids(2, 12)
    labels = x.clone()
    labels[0, 5] = -100
    out = model(x, labels=labels)
    logp = out.logits.log_softmax(-1)
    terms = [-logp[b, t, labels[b, t + 1]] for b in range(2) for t in range(11)
             if labels[b, t + 1] != -100]
    assert out.loss.item() == pytest.approx(torch.stack(terms).mean().item(), rel=1e-6)


def test_context_limit() -> None:
    model = random_model()
    with pytest.raises(TokenFormerError, match="exceeds the model's context"):
        model(ids(1, 65))
    with pytest.raises(TokenFormerError, match="exceeds the model's context"):
        model.generate(ids(1, 65))
    out = model.generate(ids(1, 60), max_new_tokens=10)
    assert out.shape == (1, 64)  # stops at the context instead of failing


def test_cached_decoding_equals_uncached() -> None:
    model = random_model()
    seq = ids(2, 30)
    with torch.no_grad():
        full = model(seq).logits
        out = model(seq[:, :6], use_cache=True)
        steps = [out.logits]
        for t in range(6, 30):  # 24 single-token steps through the cache
            out = model(seq[:, t: t + 1], past_key_values=out.past_key_values, use_cache=True)
            steps.append(out.logits)
    assert out.past_key_values.get_seq_length() == 30
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


def test_cached_generate_equals_uncached() -> None:
    model = random_model(torch.float64)  # float64: no near-ties can flip an argmax
    prompt = ids(2, 5)
    cached = model.generate(prompt, max_new_tokens=25, use_cache=True)
    uncached = model.generate(prompt, max_new_tokens=25, use_cache=False)
    assert cached.shape == (2, 30)
    assert torch.equal(cached, uncached)
    # Greedy by definition: each new token is the argmax of a plain forward on what precedes it.
    with torch.no_grad():
        logits = model(cached).logits[:, 4:-1, :100]
    assert torch.equal(logits.argmax(-1), cached[:, 5:])


def test_left_padded_batch_equals_single() -> None:
    model = random_model(torch.float64)
    prompts = [ids(1, 4, seed=2)[0], ids(1, 9, seed=3)[0], ids(1, 7, seed=4)[0]]
    width = max(len(p) for p in prompts)
    batch = torch.full((3, width), 1, dtype=torch.long)
    mask = torch.zeros(3, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        batch[i, width - len(p):], mask[i, width - len(p):] = p, 1
    for use_cache in (True, False):
        out = model.generate(batch, max_new_tokens=20, attention_mask=mask, use_cache=use_cache)
        for i, p in enumerate(prompts):
            single = model.generate(p[None], max_new_tokens=20)
            assert torch.equal(out[i, width:], single[0, len(p):]), (i, use_cache)


def test_eos_stops_and_pads() -> None:
    model = random_model(torch.float64)
    prompt = ids(2, 5)
    free = model.generate(prompt, max_new_tokens=12)
    eos = int(free[0, 7])  # row 0's third new token
    out = model.generate(prompt, max_new_tokens=12, eos_token_id=eos)
    first = [int((row[5:] == eos).nonzero()[0]) if (row[5:] == eos).any() else None
             for row in free]
    assert first[0] is not None and first[0] <= 2
    for row, f in enumerate(first):
        if f is None:
            assert torch.equal(out[row], free[row][: out.shape[1]])
        else:  # identical up to its EOS, then only EOS
            assert torch.equal(out[row, : 6 + f], free[row, : 6 + f])
            assert (out[row, 6 + f:] == eos).all()
    if all(f is not None for f in first):
        assert out.shape[1] == 6 + max(first)  # stops once every row has finished


def test_eos_is_read_every_interval_and_the_output_cut_back() -> None:
    """With eos_token_id the rows' finished flags are read every EOS_CHECK_INTERVAL tokens (each
    read a host sync), not at every token: a row that emits eos as its third token runs on to
    the interval's 8th, and what comes back is what stopping at once returns (the free run up
    to that eos), on the dynamic and the static cache."""
    assert gen.EOS_CHECK_INTERVAL == 8
    model = random_model(torch.float64)
    prompt = ids(1, 5)
    free = model.generate(prompt, 12)
    eos = int(free[0, 7])
    first = int((free[0, 5:] == eos).nonzero()[0])  # its first appearance: the 1st to 3rd token
    calls: list[int] = []
    model.register_forward_pre_hook(lambda _, args: calls.append(args[0].shape[1]))
    for cache in ("dynamic", "static"):
        calls.clear()
        out = model.generate(prompt, 12, eos_token_id=eos, cache_implementation=cache)
        assert torch.equal(out, free[:, :6 + first]), cache
        assert calls == [5] + [1] * 7, cache  # the prompt, then 7 steps: 8 tokens, 1 read


def test_seeded_sampling_is_the_same_on_every_path() -> None:
    """One seed, one sample: twice in a row, as row 0 of a batch (the noise is per row), with
    the static cache, and in another capacity bucket (a longer run's first tokens)."""
    model = random_model(torch.float64, max_seq_len=256)
    prompt = ids(3, 6)

    def run(p: torch.Tensor, new: int, **kwargs) -> torch.Tensor:
        return model.generate(p, new, do_sample=True, temperature=1.5, top_k=40, top_p=0.95,
                              generator=torch.Generator().manual_seed(11), **kwargs)

    alone = run(prompt[:1], 10)
    assert torch.equal(run(prompt[:1], 10), alone)
    assert torch.equal(run(prompt, 10)[:1], alone)
    assert torch.equal(run(prompt[:1], 10, cache_implementation="static"), alone)  # bucket 64
    assert torch.equal(run(prompt[:1], 100, cache_implementation="static")[:, :16], alone)  # 128
    assert torch.equal(run(prompt[:1], 100)[:, :16], alone)
    assert not torch.equal(alone, model.generate(prompt[:1], 10))  # sampled, not greedy


# ------------------------------------------------------------------------------------ sampling
def test_sampling_top_k_one_and_tiny_top_p_are_greedy() -> None:
    model = random_model()
    prompt = ids(3, 4)
    greedy = model.generate(prompt, max_new_tokens=15)
    g = torch.Generator().manual_seed(0)
    assert torch.equal(model.generate(prompt, 15, do_sample=True, top_k=1, generator=g), greedy)
    assert torch.equal(model.generate(prompt, 15, do_sample=True, top_p=1e-9, generator=g),
                       greedy)


def test_seeded_sampling_reproduces() -> None:
    model = random_model()
    prompt = ids(2, 4)

    def run(seed: int) -> torch.Tensor:
        return model.generate(prompt, 20, do_sample=True, temperature=1.5,
                              generator=torch.Generator().manual_seed(seed))

    assert torch.equal(run(7), run(7))
    assert not torch.equal(run(7), run(8))


@pytest.mark.parametrize("kwargs", [{"do_sample": True, "temperature": 0.0}, {"top_k": 0},
                                    {"top_p": 0.0}, {"top_p": 1.5}, {"max_new_tokens": -1}])
def test_bad_sampling_options(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        random_model().generate(ids(1, 3), **kwargs)


@pytest.mark.parametrize(("prompt", "kwargs", "words"), [
    (ids(1, 3), {"do_sample": True, "temperature": math.nan}, "temperature must be a finite"),
    (ids(1, 3), {"do_sample": True, "temperature": math.inf}, "temperature must be a finite"),
    (ids(1, 3), {"max_new_tokens": 2.5}, "max_new_tokens must be a whole number, got 2.5"),
    (ids(1, 3), {"do_sample": True, "top_k": 2.0}, "top_k must be a whole number"),
    (ids(1, 0), {}, "at least one prompt token, got shape (1, 0)"),
    (ids(1, 3)[0], {}, "input_ids must be [batch, prompt length]"),
])
def test_generate_refuses_in_its_own_words(prompt: torch.Tensor, kwargs: dict,
                                           words: str) -> None:
    """A NaN or infinite temperature, a fractional token count, an empty or 1-D prompt: a
    ConfigError saying which argument and why, not torch's error from inside the loop."""
    for cache in ("dynamic", "static"):
        with pytest.raises(ConfigError, match=re.escape(words)):
            random_model().generate(prompt, **kwargs, cache_implementation=cache)


def test_never_samples_vocab_padding() -> None:
    model = random_model()
    with torch.no_grad():  # make the padding rows (100..127) the most likely tokens
        model.word_embeddings.weight[100:] *= 50
    out = model.generate(ids(2, 3), 10, do_sample=True, temperature=5.0,
                         generator=torch.Generator().manual_seed(0))
    assert out.max() < 100


# --------------------------------------------------------------------------------- persistence
def test_save_load_round_trip(tmp_path: Path) -> None:
    model = random_model(norm="gelu_l2_norm", qkv_scale=2.0)
    model.save(tmp_path / "m")
    again = TokenFormerLM.load(tmp_path / "m")
    assert again.config == model.config
    x = ids(2, 16)
    with torch.no_grad():
        assert torch.equal(again(x).logits, model(x).logits)
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["config.json",
                                                                "model.safetensors"]


def test_load_corrupt_directory(tmp_path: Path) -> None:
    random_model().save(tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        TokenFormerLM.load(tmp_path / "m")
    with pytest.raises(CheckpointError, match="not found"):
        TokenFormerLM.load(tmp_path / "nothing")


def test_input_must_be_batched() -> None:
    with pytest.raises(TokenFormerError, match=r"\[batch, seq\]"):
        random_model()(torch.tensor([1, 2, 3]))


def test_loss_backward_reaches_every_parameter() -> None:
    model = random_model()
    x = ids(2, 10)
    model(x, labels=x).loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_generate_continues_a_filled_cache() -> None:
    """generate(past_key_values=cache) runs only the uncached tail of the prompt and gives what
    generating from the whole prompt gives; a cache holding the whole prompt is refused."""
    model = random_model(torch.float64)
    prompt = ids(2, 9)
    with torch.no_grad():
        cache = model(prompt[:, :6], use_cache=True).past_key_values
    continued = model.generate(prompt, max_new_tokens=7, past_key_values=cache)
    assert torch.equal(continued, model.generate(prompt, max_new_tokens=7))
    assert cache.get_seq_length() == 9 + 7 - 1  # the last token is never run through the model
    with pytest.raises(TokenFormerError, match="already holds"):
        model.generate(prompt[:, :5], max_new_tokens=2, past_key_values=cache)


def test_logits_to_keep_is_the_last_positions() -> None:
    model = random_model()
    seq = ids(2, 12)
    with torch.no_grad():
        full = model(seq).logits
        last = model(seq, logits_to_keep=3).logits
    assert last.shape == (2, 3, full.shape[-1])
    torch.testing.assert_close(last, full[:, -3:], rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError, match="logits_to_keep"):
        model(seq, labels=seq, logits_to_keep=1)


@pytest.mark.parametrize("masked", [False, True])
def test_bf16_cached_decoding_is_as_close_to_fp32_as_a_full_forward(masked: bool) -> None:
    """bf16 decoding steps (attention over the cache in float32, the rest in bf16), with and
    without an attention mask: as close to the fp32 model's logits as the bf16 model's own
    uncached forward is."""
    model = random_model()
    seq = ids(2, 20)
    with torch.no_grad():
        truth = model(seq).logits.double()
        model = model.to(torch.bfloat16)
        full = model(seq).logits.double()

        def mask(t: int) -> torch.Tensor | None:
            return torch.ones(2, t, dtype=torch.long) if masked else None

        out = model(seq[:, :8], attention_mask=mask(8), use_cache=True)
        steps = [out.logits]
        for t in range(8, 20):
            out = model(seq[:, t: t + 1], attention_mask=mask(t + 1),
                        past_key_values=out.past_key_values, use_cache=True)
            steps.append(out.logits)
    cached = torch.cat(steps, dim=1).double()

    def err(a: torch.Tensor) -> float:
        return (torch.linalg.vector_norm(a - truth) / torch.linalg.vector_norm(truth)).item()

    assert err(cached) < 2e-2 and err(cached) <= 1.5 * err(full) + 1e-3, (err(cached), err(full))


# ------------------------------------------------------------------------------- static cache
def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Three prompts of 9, 4 and 7 tokens, left-padded to 9, and their attention mask."""
    batch, mask = ids(3, 9, seed=5), torch.ones(3, 9, dtype=torch.long)
    mask[1, :5] = mask[2, :2] = 0
    return batch.masked_fill(mask == 0, 1), mask


@pytest.mark.parametrize("masked", [False, True])
def test_static_cache_steps_equal_a_full_forward(masked: bool) -> None:
    """Prefill then one token at a time through a StaticKVCache (buffers of the full capacity,
    masked): every step's logits equal those of one uncached forward over the whole sequence, in
    float tolerance, for a left-padded batch too; the dynamic cache's steps give the same."""
    model = random_model()
    seq, mask = padded_batch()
    seq = torch.cat((seq, ids(3, 12, seed=6)), dim=1)  # 9 prompt positions + 12 decoded
    mask = torch.cat((mask, torch.ones(3, 12, dtype=torch.long)), dim=1) if masked else None
    positions = (positions_from_mask(mask, 21) if masked
                 else torch.arange(21).expand(3, 21))
    with torch.no_grad():
        full = model(seq, attention_mask=mask, position_ids=positions).logits
        static = StaticKVCache.for_model(model, 3, 24)  # 3 slots more than needed
        out = model(seq[:, :9], attention_mask=mask, position_ids=positions[:, :9],
                    past_key_values=static, use_cache=True)
        steps = [out.logits]
        for t in range(9, 21):
            out = model(seq[:, t:t + 1], attention_mask=mask, position_ids=positions[:, t:t + 1],
                        past_key_values=static, use_cache=True)
            steps.append(out.logits)
        dynamic = model(seq[:, :9], attention_mask=None if mask is None else mask[:, :9],
                        position_ids=positions[:, :9], use_cache=True)
        dynamic_steps = [dynamic.logits]
        for t in range(9, 21):
            dynamic = model(seq[:, t:t + 1], attention_mask=None if mask is None else
                            mask[:, :t + 1], position_ids=positions[:, t:t + 1],
                            past_key_values=dynamic.past_key_values, use_cache=True)
            dynamic_steps.append(dynamic.logits)
    real = mask.bool() if masked else torch.ones(3, 21, dtype=torch.bool)  # padding rows: junk
    torch.testing.assert_close(torch.cat(steps, 1)[real], full[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(steps, 1)[real], torch.cat(dynamic_steps, 1)[real],
                               rtol=1e-5, atol=1e-5)
    assert int(static.get_seq_length()) == 21 and static.keys[0].shape[2] == 24


def static_equals_dynamic(model: TokenFormerLM, prompt: torch.Tensor, new: int,
                          seed: int | None = None, **kwargs) -> torch.Tensor:
    """The static cache's generation (``seed``: sampling, a fresh generator each) is the
    dynamic cache's."""
    def generator() -> dict:
        return {} if seed is None else {"generator": torch.Generator().manual_seed(seed)}

    dynamic = model.generate(prompt, new, **kwargs, **generator())
    static = model.generate(prompt, new, cache_implementation="static", **kwargs, **generator())
    assert torch.equal(static, dynamic), (static, dynamic)
    return static


def test_static_generate_equals_dynamic() -> None:
    """Token for token (float64: no near-ties): batch 1, a left-padded batch, eos stopping (rows
    finish at different steps) and seeded sampling."""
    model = random_model(torch.float64)
    batch, mask = padded_batch()
    out = static_equals_dynamic(model, batch[:1], 20)
    assert out.shape == (1, 29)
    static_equals_dynamic(model, batch, 20, attention_mask=mask)
    free = model.generate(batch, 20, attention_mask=mask)
    eos = int(free[1, 12])  # row 1's fourth new token
    stopped = static_equals_dynamic(model, batch, 20, attention_mask=mask, eos_token_id=eos)
    assert (stopped[1, 12:] == eos).all()
    sampled = static_equals_dynamic(model, batch, 15, seed=3, attention_mask=mask,
                                    do_sample=True, temperature=1.5, top_k=20)
    assert not torch.equal(sampled, free[:, :24])  # sampling did not degenerate to greedy


def test_static_capacity_buckets() -> None:
    """Powers of two from 64, capped by the model's context (itself a bucket when it is none)."""
    table = {(1, 2048): 64, (64, 2048): 64, (65, 2048): 128, (129, 2048): 256,
             (1024, 2048): 1024, (1025, 2048): 2048, (2048, 2048): 2048, (600, 1000): 1000,
             (10, 32): 32, (64, 100): 64, (65, 100): 100}
    assert {key: gen.static_capacity(*key) for key in table} == table


def test_decode_state_is_reused_across_prompt_lengths() -> None:
    """A static generation in the capacity bucket of an earlier one (64: 9 + 11 and 6 + 14
    positions) writes into the earlier one's buffers (the addresses a captured CUDA graph
    replays on), emptied: a shorter prompt after a longer one decodes as if the cache were new.
    Another bucket or batch size gets its own state; the KEPT_STATES most recent stay."""
    model = random_model(torch.float64, max_seq_len=256)
    batch, mask = padded_batch()
    model.generate(batch, 11, attention_mask=mask, cache_implementation="static")
    states = gen._DECODE_STATES[model]
    (state,) = states.values()
    address = state.cache.keys[0].data_ptr()
    assert state.cache.max_cache_len == 64 and state.tokens.shape == (3, 64)
    static_equals_dynamic(model, batch[:, 3:], 14, attention_mask=mask[:, 3:])
    assert list(states.values()) == [state] and state.cache.keys[0].data_ptr() == address
    static_equals_dynamic(model, batch, 60, attention_mask=mask)  # 9 + 60: bucket 128
    assert [s.cache.max_cache_len for s in states.values()] == [64, 128]
    for size in (1, 2, 4):
        static_equals_dynamic(model, batch[:1].expand(size, -1), 5)
    assert len(states) == gen.KEPT_STATES and state not in states.values()  # the oldest went


def grown_sparse_model(num_layers: int = 2) -> TokenFormerLM:
    """A model grown by tokens (the paper's recipe: new tokens change the function), each kind of
    Pattention with its own token count, then read with top-k Pattention."""
    from tokenformer import grow

    model = grow(random_model(torch.float64, num_layers=num_layers), qkv="2x", ffn=80,
                 recipe="paper", generator=torch.Generator().manual_seed(0))
    counts = {layer.num_tokens for layer in model.pattentions().values()}
    assert counts == {32, 12, 80}
    for name, layer in model.pattentions().items():
        layer.top_k = 8 if name.endswith("mlp") else 0.5
    return model.eval()


def test_static_generate_grown_and_top_k() -> None:
    model = grown_sparse_model()
    batch, mask = padded_batch()
    static_equals_dynamic(model, batch, 12, attention_mask=mask)
    static_equals_dynamic(model, batch[:1], 12, top_k_tokens="ffn=4")


def test_static_generate_refusals() -> None:
    model = random_model()
    prompt = ids(1, 4)
    with pytest.raises(ConfigError, match="unknown cache_implementation 'sliding'"):
        model.generate(prompt, 2, cache_implementation="sliding")
    with pytest.raises(ConfigError, match="compile=True needs cache_implementation='static'"):
        model.generate(prompt, 2, compile=True)
    with pytest.raises(ConfigError, match="pass neither past_key_values"):
        model.generate(prompt, 2, cache_implementation="static", use_cache=False)
    cache = StaticKVCache.for_model(model, 1, 6)
    with torch.no_grad():
        model(prompt, past_key_values=cache, use_cache=True)
        with pytest.raises(TokenFormerError, match="the static cache holds 6 positions; 7 "):
            model(ids(1, 3), past_key_values=cache, use_cache=True)
    assert torch.equal(model.generate(prompt, 0, cache_implementation="static"), prompt)


@pytest.mark.slow
def test_compiled_static_generate_equals_eager() -> None:
    """``compile=True`` (inductor on the CPU, fullgraph=True: a graph break fails the test) gives
    the eager static path's tokens — grown model, top-k Pattention, a left-padded batch, eos
    stopping and seeded sampling (chosen inside the graph) — and writes the eager step's keys
    and values into the cache, within float tolerance; calls of shapes seen before, and a prompt
    of another length in the same capacity bucket, reuse the compiled step. Two inductor graphs
    (greedy, sampled: the suite's slowest compiles); batch 1 and other batch sizes compile the
    same step (test_compiled_step_serves_twenty_shapes, dynamo's eager backend)."""
    import torch._dynamo

    torch._dynamo.reset()
    model = grown_sparse_model(num_layers=1).float()  # one block: the same code, a smaller graph
    batch, mask = padded_batch()
    eager = model.generate(batch, 10, attention_mask=mask, cache_implementation="static")
    state = next(reversed(gen._DECODE_STATES[model].values()))
    keys = [k.clone() for k in state.cache.keys]
    compiled = model.generate(batch, 10, attention_mask=mask, cache_implementation="static",
                              compile=True)
    assert torch.equal(compiled, eager)
    for got, want in zip(state.cache.keys, keys, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for kwargs in ({"eos_token_id": int(eager[0, 12])},  # row 0 stops at its 4th token
                   {"do_sample": True, "temperature": 2.0}):
        runs = [model.generate(batch, 10, attention_mask=mask, cache_implementation="static",
                               compile=compiled, generator=torch.Generator().manual_seed(0),
                               **kwargs)
                for compiled in (False, True)]
        assert torch.equal(runs[1], runs[0])
    assert runs[0].shape[1] == 19 and not torch.equal(runs[0], eager)  # sampled, not greedy
    sampled = frames + 1  # the sampling step: its own graph; eos is a tensor (none new)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == sampled
    shorter = {"attention_mask": mask[:, 4:], "cache_implementation": "static"}
    assert torch.equal(model.generate(batch[:, 4:], 30, compile=True, **shorter),
                       model.generate(batch[:, 4:], 30, **shorter))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == sampled  # nothing new


def test_compiled_step_serves_twenty_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    """20 prompt lengths in two batch sizes, in one process, compiled: every call runs (before
    capacity buckets the step compiled a graph per prompt length, and the 9th new one failed:
    torch._dynamo's FailOnRecompileLimitHit) and gives the eager tokens; the step compiles one
    graph per batch size and capacity bucket (64 and 128 here): 4, not 20. Graphs and their
    guards are dynamo's, so its ``eager`` backend counts them in seconds; inductor's code for
    the step is checked by test_compiled_static_generate_equals_eager."""
    import functools

    import torch._dynamo

    torch._dynamo.reset()
    monkeypatch.setattr(gen, "_COMPILED_STEPS", {})
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    model = random_model(num_layers=1, max_seq_len=128)
    shapes = [(1, length) for length in (3, 60, 9, 61, 17, 30, 124, 45, 90, 2)]
    shapes += [(2, length) for length in (5, 12, 66, 25, 40, 118, 58, 80, 100, 1)]
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for batch, length in shapes:
        prompt = ids(batch, length, seed=length)
        eager = model.generate(prompt, 4, cache_implementation="static")
        compiled = model.generate(prompt, 4, cache_implementation="static", compile=True)
        assert torch.equal(compiled, eager), (batch, length)
    buckets = {(batch, gen.static_capacity(length + 4, 128)) for batch, length in shapes}
    assert len(buckets) == 4
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == len(buckets)


def test_compiled_step_past_the_graph_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past STEP_GRAPH_LIMIT graphs (1 here, with torch._dynamo's own limit lowered to it) the
    step drops its graphs and compiles again: every call gives the eager tokens (before, the
    second shape failed with a multi-screen FailOnRecompileLimitHit). When torch refuses even
    that (a limit of 0), one TokenFormerError line says what to do. Dynamo's ``eager`` backend
    (no inductor: seconds)."""
    import functools

    import torch._dynamo

    monkeypatch.setattr(gen, "_COMPILED_STEPS", {})
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    monkeypatch.setattr(gen, "STEP_GRAPH_LIMIT", 1)
    # torch's config.patch, not monkeypatch: pytest ≥ 9.2 undoes a module attribute missing from
    # the module's __dict__ with delattr, which hides the setting from torch for the whole session.
    model = random_model(num_layers=1)
    try:
        with torch._dynamo.config.patch(recompile_limit=1):
            for batch in (1, 2):
                eager = model.generate(ids(batch, 5), 3, cache_implementation="static")
                compiled = model.generate(ids(batch, 5), 3, cache_implementation="static",
                                          compile=True)
                assert torch.equal(compiled, eager), batch
        monkeypatch.setattr(gen, "STEP_GRAPH_LIMIT", 0)
        with torch._dynamo.config.patch(recompile_limit=0), pytest.raises(
                TokenFormerError, match="refuses to compile the decoding step again"):
            model.generate(ids(3, 5), 3, cache_implementation="static", compile=True)
    finally:
        torch._dynamo.reset_code(gen._decode_step.__code__)
