"""Tiny random checkpoints of the transformers hybrid families, made and saved by transformers
itself (the independent reference), and the reference's own decoding: prefill then one-token
steps with explicit ``position_ids``, as its ``generate`` runs."""

import math

import torch

VOCAB = 90

CONFIGS = {
    "bamba": lambda: ("BambaConfig", "BambaForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2,
        mamba_d_state=8, mamba_expand=2, mamba_chunk_size=16, pad_token_id=0, eos_token_id=2, bos_token_id=1)),
    "nemotron_h": lambda: ("NemotronHConfig", "NemotronHForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, hybrid_override_pattern="M*M-M",
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, mamba_num_heads=6, mamba_head_dim=8,
        n_groups=2, ssm_state_size=8, chunk_size=16, time_step_limit=[0.001, math.inf], pad_token_id=0,
        eos_token_id=2, bos_token_id=1)),
    # NoPE attention, a top-2 of 4 experts beside the shared MLP, every µP scalar away from 1
    "granitemoehybrid": lambda: ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=16, shared_intermediate_size=40, num_hidden_layers=4,
        layer_types=["mamba", "attention", "mamba", "mamba"], num_attention_heads=4, num_key_value_heads=2,
        mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8, mamba_expand=2, mamba_chunk_size=16,
        num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=3.0, residual_multiplier=0.6,
        attention_multiplier=0.2, logits_scaling=1.7, pad_token_id=0, eos_token_id=2, bos_token_id=1)),
    # mamba_d_ssm apart from expand * hidden, no norm in the Mamba2 gate, every µP multiplier away from 1
    "falcon_h1": lambda: ("FalconH1Config", "FalconH1ForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, mamba_d_ssm=48, mamba_n_heads=6, mamba_n_groups=2, mamba_d_state=8,
        mamba_chunk_size=16, rope_parameters=dict(rope_type="default", rope_theta=1000.0),
        embedding_multiplier=1.5, lm_head_multiplier=0.7, mlp_multipliers=[0.8, 1.2], key_multiplier=0.9,
        attention_in_multiplier=1.3, attention_out_multiplier=0.6, ssm_multipliers=[0.9, 1.1, 0.8, 1.2, 0.7],
        ssm_in_multiplier=1.2, ssm_out_multiplier=0.8, pad_token_id=0, eos_token_id=2, bos_token_id=1)),
    "llama": lambda: ("LlamaConfig", "LlamaForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=0, eos_token_id=2, bos_token_id=1,
        rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=8))),
    "qwen2": lambda: ("Qwen2Config", "Qwen2ForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=0, eos_token_id=2, bos_token_id=1)),
}


def randomize(hf, seed: int):
    """Weights of order-one effect (transformers' 0.02 init makes every logit ~0), and dt biases
    of which some fall below the lower dt limit of the tiny Nemotron-H (0.001), so that its
    prefill-only clamp matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            rand = torch.randn(p.shape, generator=g)
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.arange(1, p.numel() + 1, dtype=torch.float) * 0.5))
            elif name.endswith("dt_bias"):
                p.copy_(torch.linspace(-9.0, -2.0, p.numel()))
            elif name.endswith(".D"):
                p.copy_(1 + 0.3 * rand)
            elif "norm" in name:
                p.copy_(1 + 0.1 * rand)
            elif (p.dim() == 2 and "embed" not in name) or "experts" in name:
                p.copy_(rand / math.sqrt(p.shape[-1]))
            else:
                p.copy_(rand * (0.5 if p.dim() == 3 else 1.0))
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):  # Nemotron-H's router bias: a checkpoint value
                b.copy_(0.3 * torch.randn(b.shape, generator=g))
    return hf


def save_tiny(family: str, path, seed: int = 0, **overrides):
    """A transformers ``save_pretrained`` directory of ``family`` and the loaded reference model."""
    import transformers

    config_cls, model_cls, kw = CONFIGS[family]()
    torch.manual_seed(seed)
    hf = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**kw, **overrides}))
    randomize(hf.eval(), seed)
    hf.save_pretrained(str(path))
    return hf


@torch.no_grad()
def reference_logits(hf, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """Next-token logits after the prompt and after each continuation token ``[1 + len, V]``:
    a prefill, then one-token steps against the cache."""
    out = hf(torch.tensor([prompt]), position_ids=torch.arange(len(prompt))[None], use_cache=True)
    cache, rows = out.past_key_values, [out.logits[0, -1]]
    for t, tok in enumerate(continuation):
        out = hf(torch.tensor([[tok]]), past_key_values=cache, use_cache=True,
                 position_ids=torch.tensor([[len(prompt) + t]]))
        rows.append(out.logits[0, -1])
    return torch.stack(rows)


@torch.no_grad()
def reference_greedy(hf, prompt: list[int], steps: int) -> list[int]:
    """transformers' greedy decoding, one token at a time (what its ``generate`` computes)."""
    out = hf(torch.tensor([prompt]), position_ids=torch.arange(len(prompt))[None], use_cache=True)
    cache, tokens = out.past_key_values, []
    for t in range(steps):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = hf(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True,
                 position_ids=torch.tensor([[len(prompt) + t]]))
    return tokens
