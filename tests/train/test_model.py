"""The Llama model of `flashfsdp.models`: shapes, tying, rotary embeddings, causality, presets."""

import pytest
import torch

from flashfsdp.models import PRESETS, Block, Llama, LlamaConfig, config_from_preset
from flashfsdp.models.llama import apply_rotary, rotary_cos_sin, rotary_inv_freq

TINY = LlamaConfig(dim=32, n_layers=2, n_heads=4, multiple_of=16, max_seq_len=16)


def _model(cfg: LlamaConfig = TINY, seed: int = 0) -> Llama:
    model = Llama(cfg)
    model.init_weights(seed)
    return model


def test_forward_shape_and_dtype():
    model = _model()
    tokens = torch.randint(0, 256, (3, 11))
    logits = model(tokens)
    assert logits.shape == (3, 11, 256)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_bf16_forward_and_backward():
    model = _model().to(torch.bfloat16)
    logits = model(torch.randint(0, 256, (2, 8)))
    assert logits.dtype == torch.bfloat16
    logits.float().sum().backward()
    assert model.tok_embeddings.weight.grad is not None


def test_tied_embeddings_share_storage():
    model = _model()
    assert model.output.weight is model.tok_embeddings.weight
    assert model.output.weight.data_ptr() == model.tok_embeddings.weight.data_ptr()
    untied = Llama(LlamaConfig(**{**TINY.__dict__, "tie_embeddings": False}))
    assert untied.output.weight.data_ptr() != untied.tok_embeddings.weight.data_ptr()
    assert untied.num_params() == untied.config.num_params()


def test_shardable_structure():
    model = _model()
    assert all(isinstance(b, Block) for b in model.layers)
    assert all(p.is_floating_point() for p in model.parameters())
    assert not any("rope" in k for k in model.state_dict())  # rotary tables are not persistent
    assert model.num_params() == TINY.num_params()


def test_init_is_deterministic_and_seeded():
    a, b, c = _model(seed=1), _model(seed=1), _model(seed=2)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if pa.dim() == 2:
            assert not torch.equal(pa, pc), name
    wo = a.layers[0].attention.wo.weight
    assert wo.std() < 0.02 * 0.8  # residual projections are scaled down


def test_meta_device_then_init_matches():
    with torch.device("meta"):
        meta = Llama(TINY)
    meta.to_empty(device="cpu")
    meta.init_weights(3)
    ref = _model(seed=3)
    tokens = torch.randint(0, 256, (2, 9))
    torch.testing.assert_close(meta(tokens), ref(tokens))


def test_rotary_matches_complex_reference():
    head_dim, seq = 8, 12
    x = torch.randn(2, 3, seq, head_dim)
    cos, sin = rotary_cos_sin(rotary_inv_freq(head_dim, 10000.0), seq)
    assert cos.shape == sin.shape == (1, seq, head_dim) and cos.dtype == torch.float32
    # Reference: channel pairs (x[i], x[i + head_dim/2]) as complex numbers, times exp(j·m·θ_i).
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).double() / head_dim))
    angles = torch.outer(torch.arange(seq).double(), inv_freq)
    freqs_cis = torch.polar(torch.ones_like(angles), angles)
    half = head_dim // 2
    xc = torch.complex(x[..., :half].double(), x[..., half:].double())
    rotated = xc * freqs_cis
    expected = torch.cat((rotated.real, rotated.imag), dim=-1).float()
    torch.testing.assert_close(apply_rotary(x, cos, sin), expected, atol=1e-5, rtol=1e-5)
    out_bf16 = apply_rotary(x.bfloat16(), cos, sin)
    assert out_bf16.dtype == torch.bfloat16


def test_causal():
    model = _model()
    tokens = torch.randint(0, 256, (2, 12))
    changed = tokens.clone()
    changed[:, 7:] = torch.randint(0, 256, (2, 5))
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :7], b[:, :7])
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_too_long_sequence_raises():
    with pytest.raises(ValueError, match="max_seq_len"):
        _model()(torch.zeros(1, TINY.max_seq_len + 1, dtype=torch.long))


def test_generate_length_and_determinism():
    model = _model()
    prompt = torch.tensor([[100, 101, 102]] * 2)
    out = model.generate(prompt, 20, temperature=1.0, top_k=10,
                         generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 23) and out.dtype == torch.long
    assert torch.equal(out[:, :3], prompt)
    again = model.generate(prompt, 20, temperature=1.0, top_k=10,
                           generator=torch.Generator().manual_seed(0))
    assert torch.equal(out, again)
    greedy = model.generate(prompt, 3, temperature=0)
    assert greedy.shape == (2, 6)
    # Longer than max_seq_len: the context is cropped, generation goes on.
    assert model.generate(prompt, TINY.max_seq_len + 2, temperature=0).shape[1] == 3 + 18


def test_generate_bad_args():
    model = _model()
    with pytest.raises(ValueError, match="prompt_len"):
        model.generate(torch.zeros(1, 0, dtype=torch.long), 2)
    with pytest.raises(ValueError, match="top_k"):
        model.generate(torch.zeros(1, 1, dtype=torch.long), 2, top_k=0)


@pytest.mark.parametrize("name, low, high", [("tiny", 0.5e6, 2e6), ("small", 15e6, 40e6),
                                             ("1b", 1.0e9, 1.2e9)])
def test_preset_parameter_counts(name, low, high):
    cfg = config_from_preset(name)
    assert low < cfg.num_params() < high
    with torch.device("meta"):
        assert Llama(cfg).num_params() == cfg.num_params()


def test_presets_and_overrides():
    assert set(PRESETS) == {"tiny", "small", "1b", "8b", "70b"}
    assert PRESETS["8b"].num_params() == 8_030_261_248  # Llama 3 8B (grouped-query attention, untied)
    cfg = config_from_preset("tiny", n_layers=2, dim=64, n_heads=None)
    assert (cfg.n_layers, cfg.dim, cfg.n_heads) == (2, 64, PRESETS["tiny"].n_heads)
    assert cfg.ffn_dim == 32 * -(-int(8 * 64 / 3) // 32)  # recomputed for the new width
    assert PRESETS["tiny"].n_layers == 4  # the preset itself is unchanged


def test_unknown_preset_names_choices():
    with pytest.raises(ValueError, match="tiny, small, 1b"):
        config_from_preset("huge")


def test_bad_config_names_fields():
    with pytest.raises(ValueError, match="n_heads"):
        LlamaConfig(dim=30, n_heads=4)
    with pytest.raises(ValueError, match="even"):
        LlamaConfig(dim=12, n_heads=4)
    with pytest.raises(ValueError, match="n_layers"):
        LlamaConfig(n_layers=0)


def test_grouped_query_attention_shapes_and_count():
    cfg = LlamaConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2)
    model = Llama(cfg)
    assert model.layers[0].attention.wk.weight.shape == (2 * cfg.head_dim, 64)
    assert model.num_params() == cfg.num_params()
    assert model(torch.randint(0, 256, (1, 8))).shape == (1, 8, 256)
    with pytest.raises(ValueError, match="n_kv_heads"):
        LlamaConfig(dim=64, n_heads=4, n_kv_heads=3)
