"""The transformers features a user calls: gradient checkpointing, hidden states, refusals,
inputs_embeds, AutoModel, sequence classification, resize_token_embeddings, PEFT. Each refusal is
checked word for word against the message docs/huggingface.md quotes. Skipped cleanly without the
hf extra (and the PEFT tests without peft)."""

from __future__ import annotations

import copy
import os
import re

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    Trainer,
    TrainingArguments,
)

import tokenformer.hf as H
from tokenformer import ByteTokenizer, TokenFormerConfig, TokenFormerLM
from tokenformer.errors import ConfigError, TokenFormerError
from tokenformer.hf.modeling import (
    LORA_ON_EMBEDDING_WARNING,
    OUTPUT_ATTENTIONS_REFUSED,
    SLIDING_CACHE_REFUSED,
)

CONFIG = dict(vocab_size=257, hidden_size=32, num_layers=3, num_heads=2, qkv_tokens=16,
              proj_tokens=16, ffn_tokens=48, max_seq_len=64, eos_token_id=256)


def causal_lm(seed: int = 0, **overrides) -> H.TokenFormerForCausalLM:
    torch.manual_seed(seed)
    config = H.TokenFormerHFConfig.from_core(TokenFormerConfig(**{**CONFIG, **overrides}))
    return H.TokenFormerForCausalLM(config)


def batch(seed: int = 1, B: int = 2, T: int = 16) -> torch.Tensor:
    return torch.randint(0, 257, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    model = causal_lm()
    with torch.no_grad():  # larger weights than the init: outputs that differ visibly
        for p in model.parameters():
            p.mul_(20)
    return H.save_hf(model.eval(), tmp_path_factory.mktemp("hf") / "m", ByteTokenizer())


# ----------------------------------------------------------------------- gradient checkpointing
def pattention_calls(model: H.TokenFormerPreTrainedModel) -> list[int]:
    """How often the blocks' first Pattention ran (the recomputation stops early, inside the
    block's last Pattention, so later hooks would not see it)."""
    calls = [0]
    for block in model.model.layers:
        block.attention.query.register_forward_hook(
            lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("enable", ["gradient_checkpointing_enable",
                                    "activation_checkpointing_enable"])
def test_gradient_checkpointing_same_loss_and_gradients(enable):
    import transformers

    if not hasattr(transformers.PreTrainedModel, enable):  # the alias is newer than 5.0.0
        pytest.skip(f"transformers {transformers.__version__} has no {enable}")
    plain = causal_lm().train()
    checkpointed = copy.deepcopy(plain)
    getattr(checkpointed, enable)()
    assert checkpointed.is_gradient_checkpointing and not plain.is_gradient_checkpointing
    ids = batch()
    calls = pattention_calls(checkpointed)
    losses = []
    for model in (plain, checkpointed):
        loss = model(ids, labels=ids).loss
        loss.backward()
        losses.append(loss)
    assert calls[0] == 2 * CONFIG["num_layers"]  # every block's forward ran again in backward
    assert torch.equal(losses[0], losses[1])
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-7, msg=name)
    checkpointed.gradient_checkpointing_disable()
    calls[0] = 0
    checkpointed(ids, labels=ids).loss.backward()
    assert calls[0] == CONFIG["num_layers"] and not checkpointed.is_gradient_checkpointing


def trainer_losses(tmp_path, gradient_checkpointing: bool) -> tuple[list[float], object]:
    model = causal_lm()
    data = [{"input_ids": ids, "labels": ids} for ids in batch(seed=3, B=8, T=24)]
    args = TrainingArguments(output_dir=str(tmp_path / f"gc{gradient_checkpointing}"),
                             max_steps=3, per_device_train_batch_size=4, learning_rate=1e-2,
                             logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
                             disable_tqdm=True, gradient_checkpointing=gradient_checkpointing)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    return [r["loss"] for r in trainer.state.log_history if "loss" in r], model


def test_trainer_gradient_checkpointing_same_loss(tmp_path):
    plain, _ = trainer_losses(tmp_path, False)
    checkpointed, model = trainer_losses(tmp_path, True)
    assert model.is_gradient_checkpointing
    assert len(plain) == 3 and checkpointed == pytest.approx(plain, rel=1e-6)
    assert plain[-1] < plain[0]  # it trained


def test_trainer_gradient_accumulation_equals_the_big_batch(tmp_path):
    """Trainer passes num_items_in_batch and leaves the loss unscaled: 2 micro-batches of 2 must
    update the weights like one batch of 4 (same samples, same order; SGD, whose update is linear
    in the gradient, so that rounding is not amplified as Adam does for near-zero gradients)."""
    data = [{"input_ids": ids, "labels": ids} for ids in batch(seed=8, B=8, T=20)]
    trained = []
    for per_device, accumulate in ((4, 1), (2, 2)):
        model = causal_lm()
        args = TrainingArguments(output_dir=str(tmp_path / f"ga{accumulate}"), max_steps=2,
                                 per_device_train_batch_size=per_device,
                                 gradient_accumulation_steps=accumulate, learning_rate=0.5,
                                 optim="sgd", lr_scheduler_type="constant",
                                 report_to=[], use_cpu=True, save_strategy="no",
                                 disable_tqdm=True)
        Trainer(model=model, args=args, train_dataset=data).train()
        trained.append(model)
    moved = 0
    for (name, a), b, start in zip(trained[0].named_parameters(), trained[1].parameters(),
                                   causal_lm().parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6, msg=name)
        moved += not torch.equal(a, start)
    assert moved > 0


# -------------------------------------------------------------------------------- hidden states
def block_io(core: TokenFormerLM, ids: torch.Tensor) -> list[torch.Tensor]:
    """The core's own block inputs and final-norm output, captured with hooks."""
    seen: list[torch.Tensor] = []
    hooks = [b.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
             for b in core.layers]
    hooks.append(core.final_norm.register_forward_hook(lambda m, a, out: seen.append(out)))
    with torch.no_grad():
        core(ids)
    for h in hooks:
        h.remove()
    return seen


@pytest.mark.parametrize("auto", [AutoModelForCausalLM, AutoModel])
def test_output_hidden_states_are_the_core_block_states(folder, auto):
    model = auto.from_pretrained(folder).eval()
    ids = batch()
    expected = block_io(model.model, ids)
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    assert len(out.hidden_states) == CONFIG["num_layers"] + 1
    for got, want in zip(out.hidden_states, expected, strict=True):
        assert torch.equal(got, want)
    # hidden_states[0] is the embedding lookup; the last feeds the tied head.
    assert torch.equal(out.hidden_states[0], model.model.word_embeddings(ids))
    if auto is AutoModel:
        assert torch.equal(out.last_hidden_state, expected[-1])
    else:
        assert torch.equal(out.logits, F.linear(expected[-1], model.model.word_embeddings.weight))
        with torch.no_grad():
            assert model(ids).hidden_states is None


def test_output_attentions_refused(folder):
    model = AutoModelForCausalLM.from_pretrained(folder)
    with pytest.raises(ConfigError, match=f"^{re.escape(OUTPUT_ATTENTIONS_REFUSED)}$"):
        model(batch(), output_attentions=True)


def padded(seed: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Three prompts of 10, 4 and 7 tokens, left-padded, and their attention mask."""
    ids, mask = batch(seed, B=3, T=10), torch.ones(3, 10, dtype=torch.long)
    mask[1, :6] = mask[2, :3] = 0
    return ids.masked_fill(mask == 0, 0), mask


def caches_seen(model: H.TokenFormerPreTrainedModel) -> list[str]:
    """The class names of the caches the core model receives, call by call."""
    seen: list[str] = []
    model.model.register_forward_pre_hook(
        lambda _, args, kwargs: seen.append(type(kwargs.get("past_key_values")).__name__),
        with_kwargs=True)
    return seen


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_static_cache_generate_equals_dynamic(folder, attn):
    """generate(cache_implementation="static") runs over transformers' StaticCache (and, from 5.24,
    the 4-D mask generate builds for it: boolean for sdpa, additive for eager) and gives the
    dynamic cache's tokens, for batch 1 and a left-padded batch."""
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation=attn)
    seen = caches_seen(model)
    ids, mask = padded()
    for kwargs in ({"input_ids": ids[:1]}, {"input_ids": ids, "attention_mask": mask}):
        seen.clear()
        dynamic = model.generate(**kwargs, max_new_tokens=12, min_new_tokens=12)
        assert set(seen) == {"DynamicCache"}
        seen.clear()
        static = model.generate(**kwargs, max_new_tokens=12, min_new_tokens=12,
                                cache_implementation="static")
        assert set(seen) == {"StaticCache"} and len(seen) == 12
        assert torch.equal(static, dynamic)


def test_static_cache_steps_equal_a_full_forward(folder):
    """A StaticCache filled by hand (prefill, then one token per call, no 4-D mask: the core builds
    it from the cache's slots and the padding mask): each step's logits are those of one uncached
    forward over the whole sequence."""
    from transformers import StaticCache

    model = AutoModelForCausalLM.from_pretrained(folder)
    ids, mask = padded()
    seq = torch.cat((ids, batch(5, B=3, T=6)), dim=1)
    full_mask = torch.cat((mask, torch.ones(3, 6, dtype=torch.long)), dim=1)
    cache = StaticCache(config=model.config, max_cache_len=20)
    with torch.no_grad():
        full = model(seq, attention_mask=full_mask).logits
        steps = [model(ids, attention_mask=mask, past_key_values=cache).logits]
        for t in range(10, 16):
            steps.append(model(seq[:, t:t + 1], attention_mask=full_mask[:, :t + 1],
                               past_key_values=cache).logits)
    real = full_mask.bool()  # padding positions' outputs are junk in both
    cached, truth = torch.cat(steps, 1)[real].double(), full[real].double()
    # fp32 roundings in another order (logits up to ~200 with these weights): measured 2e-6,
    # the dynamic cache's own steps 3e-6
    assert (cached - truth).norm() / truth.norm() < 2e-5


def test_compiled_forward_with_static_cache(folder):
    """transformers' recipe, ``model.forward = torch.compile(model.forward, fullgraph=True)``
    (a graph break fails), then generate with the static cache: the dynamic cache's tokens.
    Dynamo's ``aot_eager`` backend: the graph capture and the functionalised cache writes are
    what the model decides; inductor's CPU code for our decoding step is compiled by
    tests/models/test_lm.py::test_compiled_static_generate_equals_eager (≈ 60 s saved here)."""
    import torch._dynamo

    torch._dynamo.reset()
    model = AutoModelForCausalLM.from_pretrained(folder)
    ids, mask = padded()
    dynamic = model.generate(ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8)
    model.forward = torch.compile(model.forward, fullgraph=True, backend="aot_eager")
    static = model.generate(ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8,
                            cache_implementation="static")
    assert torch.equal(static, dynamic)


def test_sliding_window_cache_refused(folder):
    from transformers import StaticCache

    model = AutoModelForCausalLM.from_pretrained(folder)
    config = copy.deepcopy(model.config)
    config.sliding_window, config.layer_types = 4, ["sliding_attention"] * config.num_layers
    cache = StaticCache(config=config, max_cache_len=16)
    assert all(cache.is_sliding)
    with pytest.raises(ConfigError, match=f"^{re.escape(SLIDING_CACHE_REFUSED)}$"):
        model(batch(B=1), past_key_values=cache)


def test_a_sliding_window_in_the_config_says_to_unset_it(folder):
    """With config.sliding_window set transformers builds even the default dynamic cache as a
    sliding window; the refusal used to advise that very cache (issue 42). It now says to unset
    sliding_window, after which generate gives the tokens it gives without one; without a cache
    it runs as it did."""
    model = AutoModelForCausalLM.from_pretrained(folder)
    ids = batch(B=1)
    plain = model.generate(ids, max_new_tokens=6, min_new_tokens=6)
    model.config.sliding_window = 4
    for kwargs in ({}, {"cache_implementation": "static"}):
        with pytest.raises(ConfigError) as refused:
            model.generate(ids, max_new_tokens=6, min_new_tokens=6, **kwargs)
        assert "config.sliding_window is 4" in str(refused.value)
        assert "set model.config.sliding_window = None" in str(refused.value)
        assert str(refused.value) == H.modeling.SLIDING_WINDOW_REFUSED.format(window=4)
    uncached = model.generate(ids, max_new_tokens=6, min_new_tokens=6, use_cache=False)
    model.config.sliding_window = None
    assert torch.equal(model.generate(ids, max_new_tokens=6, min_new_tokens=6), plain)
    assert torch.equal(uncached, plain)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_attn_implementation_accepted(folder, attn):
    reference = AutoModelForCausalLM.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation=attn)
    ids = batch()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


@pytest.mark.parametrize(("attn", "message"), [
    ("flash_attention_2", r"does not support Flash Attention 2(\.0)? yet"),  # 5.0.0 says 2.0
    ("flex_attention", "does not support an attention implementation through torch's flex")])
def test_other_attn_implementations_refused_by_transformers(folder, attn, message):
    with pytest.raises(ValueError, match=message):
        AutoModelForCausalLM.from_pretrained(folder, attn_implementation=attn)


def test_inputs_embeds_forward_and_generate(folder):
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor([list(b"The beginning")])
    embeds = model.get_input_embeddings()(ids)
    with torch.no_grad():
        assert torch.equal(model(inputs_embeds=embeds).logits, model(ids).logits)
    from_ids = model.generate(ids, max_new_tokens=8, do_sample=False)
    from_embeds = model.generate(inputs_embeds=embeds, max_new_tokens=8, do_sample=False)
    assert from_embeds.tolist() == from_ids[:, ids.shape[1]:].tolist()  # the new tokens only
    with pytest.raises(TokenFormerError, match="not both"):
        model(ids, inputs_embeds=embeds)


def test_automodel_is_the_base_model(folder):
    base = AutoModel.from_pretrained(folder).eval()
    lm = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(base) is H.TokenFormerModel and not base.can_generate()
    ids = batch()
    with torch.no_grad():
        hidden = base(ids).last_hidden_state
        assert torch.equal(F.linear(hidden, lm.model.word_embeddings.weight), lm(ids).logits)
    assert lm.get_output_embeddings() is None  # the head is the input embedding matrix


# ------------------------------------------------------------------------ sequence classification
def test_sequence_classification_pools_the_last_real_token(folder, tmp_path):
    model = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=3).eval()
    assert type(model) is H.TokenFormerForSequenceClassification
    lm = AutoModelForCausalLM.from_pretrained(folder)
    for (name, a), b in zip(model.model.state_dict().items(), lm.model.state_dict().values(),
                            strict=True):
        assert torch.equal(a, b), name  # the body comes from the causal LM's folder
    a, b = list(b"a longer sentence"), list(b"short")
    pad = len(a) - len(b)
    ids = torch.tensor([a, b + [256] * pad])
    mask = torch.tensor([[1] * len(a), [1] * len(b) + [0] * pad])
    labels = torch.tensor([2, 0])
    with torch.no_grad():
        out = model(ids, attention_mask=mask, labels=labels)
        alone = model(torch.tensor([b])).logits
        hidden = model.model.body(torch.tensor([b])).last_hidden_state[0, -1]
    torch.testing.assert_close(out.logits[1], alone[0])  # padding changes nothing
    torch.testing.assert_close(alone[0], model.score.weight @ hidden)
    by_hand = -(out.logits.log_softmax(-1)[[0, 1], labels]).mean()
    torch.testing.assert_close(out.loss, by_hand)
    model.save_pretrained(tmp_path / "cls")
    again = AutoModelForSequenceClassification.from_pretrained(tmp_path / "cls").eval()
    with torch.no_grad():
        assert torch.equal(again(ids, attention_mask=mask).logits, out.logits)


def test_sequence_classification_trains(tmp_path):
    torch.manual_seed(0)
    config = H.TokenFormerHFConfig.from_core(TokenFormerConfig(**CONFIG))
    config.num_labels = 2
    model = H.TokenFormerForSequenceClassification(config).train()
    ids = batch(seed=4, B=8, T=12)
    labels = (ids[:, 0] % 2).long()  # a rule the model must read from the first token
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss = model(ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[0] > 0.5 and losses[-1] < 0.1 * losses[0]
    # Its loss is a batch mean: Trainer must scale it for gradient accumulation itself.
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    assert Trainer(model=model, args=args).model_accepts_loss_kwargs is False


# ------------------------------------------------------------------------------------- resize
@pytest.mark.parametrize(("new", "multiple", "rows"), [(300, None, 384), (400, None, 512),
                                                       (300, 64, 320)])
def test_resize_token_embeddings_keeps_padding_and_reloads(folder, tmp_path, new, multiple,
                                                           rows):
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    old = model.get_input_embeddings().weight[:257].clone()
    model.resize_token_embeddings(new, pad_to_multiple_of=multiple)
    assert model.get_input_embeddings().weight.shape[0] == rows
    assert torch.equal(model.get_input_embeddings().weight[:257], old)  # old rows untouched
    assert (model.config.vocab_size, model.config.padded_vocab_size) == (new, rows)
    assert model.model.config.padded_vocab_size == rows  # the core config agrees
    assert model.generation_config.suppress_tokens == list(range(new, rows))
    model.save_pretrained(tmp_path / "resized")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "resized").eval()
    ids = torch.randint(0, new, (2, 12), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)
    assert again.generation_config.suppress_tokens == list(range(new, rows))


# ----------------------------------------------------------------------------------------- PEFT
def test_peft_lora_on_pattention_tokens_trains_reloads_and_merges(folder, tmp_path):
    peft = pytest.importorskip("peft")
    model = AutoModelForCausalLM.from_pretrained(folder)
    targets = H.lora_target_parameters(("key", "mlp"))
    lora = peft.get_peft_model(model, peft.LoraConfig(target_parameters=targets, r=4,
                                                      lora_alpha=8, lora_dropout=0.0))
    trainable = {n for n, p in lora.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    # Both token matrices of a Pattention: two nested PEFT wrappers (the inner is "base_layer").
    adapted = {n.split(".lora_")[0].removeprefix("base_model.model.model.")
               .removesuffix(".base_layer") for n in trainable}
    assert len(trainable) == 2 * 2 * len(adapted)  # lora_A and lora_B per token matrix
    assert adapted == {f"layers.{i}.{m}" for i in range(3)
                       for m in ("attention.key", "mlp")}
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    ids = batch(seed=7, B=4, T=24)
    opt = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(8):
        loss = lora(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05
    lora.eval()
    with torch.no_grad():
        tuned = lora(input_ids=ids).logits
    lora.save_pretrained(tmp_path / "adapter")
    fresh = AutoModelForCausalLM.from_pretrained(folder)
    reloaded = peft.PeftModel.from_pretrained(fresh, tmp_path / "adapter").eval()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, tuned)
        merged = reloaded.merge_and_unload()
        torch.testing.assert_close(merged(input_ids=ids).logits, tuned, rtol=1e-5, atol=1e-5)
    checked = 0
    for name, p in lora.base_model.model.named_parameters():  # training left the base alone
        if name in frozen and "param_tokens" not in name:
            assert torch.equal(p, frozen[name]), name
            checked += 1
    assert checked >= 3  # the embedding and the final norm at least


def test_peft_target_modules_and_tied_embedding(folder):
    peft = pytest.importorskip("peft")
    model = AutoModelForCausalLM.from_pretrained(folder)
    with pytest.raises(ValueError, match=r"Target module Pattention.* is not supported"):
        peft.get_peft_model(model, peft.LoraConfig(target_modules=["query"]))
    with pytest.raises(ValueError, match="no `target_parameters` found"):  # there is no Linear
        peft.get_peft_model(AutoModelForCausalLM.from_pretrained(folder),
                            peft.LoraConfig(target_modules="all-linear"))
    with pytest.raises(ConfigError, match="unknown Pattention 'ffn'"):
        H.lora_target_parameters(["ffn"])
    model = AutoModelForCausalLM.from_pretrained(folder)
    lora = peft.get_peft_model(model, peft.LoraConfig(target_modules=["word_embeddings"], r=2))
    with pytest.warns(UserWarning, match=re.escape(LORA_ON_EMBEDDING_WARNING)):
        lora(input_ids=batch())


def test_lora_target_parameter_names_are_exact():
    assert H.lora_target_parameters(("key",)) == ["key.key_param_tokens",
                                                  "key.value_param_tokens"]
    assert len(H.lora_target_parameters()) == 10
