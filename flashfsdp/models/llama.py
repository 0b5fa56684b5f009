"""A small Llama-style decoder-only transformer for byte-level language modelling.

Architecture (Touvron et al. 2023, "LLaMA: Open and Efficient Foundation Language Models"):
pre-norm residual blocks of RMSNorm → causal self-attention with rotary position embeddings →
RMSNorm → SwiGLU feed-forward, a final RMSNorm and an output projection tied to the token
embedding. Parameter names follow torchtitan's llama model (`torchtitan/models/llama3/model.py`):
`tok_embeddings`, `layers.<i>.attention.{wq,wk,wv,wo}`, `layers.<i>.feed_forward.{w1,w2,w3}`
(w1 = gate, w3 = up, w2 = down), `layers.<i>.{attention_norm,ffn_norm}`, `norm`, `output`.

Sharding: every `Block` is its own `nn.Module`, so `fully_shard(block)` for each block and then
`fully_shard(model)` for the root (embedding, final norm, tied output) gives one unit per block
plus the root. All parameters are floating point; the rotary frequencies are non-persistent
buffers (not in the state dict, never sharded) recomputed from the config by `init_weights`.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor


@dataclasses.dataclass
class LlamaConfig:
    """Shape of a `Llama` model.

    Attributes:
        vocab_size: number of token ids; 256 for raw bytes.
        dim: model (residual stream) width.
        n_layers: number of transformer blocks.
        n_heads: attention heads; `dim` must be divisible by it and the head size must be even
            (rotary embeddings rotate pairs of channels).
        n_kv_heads: key/value heads (grouped-query attention, Ainslie et al. 2023: each serves
            n_heads / n_kv_heads query heads); None means n_heads (multi-head attention).
        ffn_dim: SwiGLU hidden width; None means `multiple_of`-rounded 8·dim/3 (Llama's rule).
        multiple_of: rounding for the default `ffn_dim`.
        max_seq_len: longest sequence the model accepts (tokens).
        norm_eps: RMSNorm epsilon.
        rope_theta: rotary base frequency θ.
        tie_embeddings: share one (vocab_size, dim) matrix between `tok_embeddings` and `output`.

    Raises:
        ValueError: on a non-positive size, `dim` not divisible by `n_heads`, an odd head size, or
            `n_heads` not a multiple of `n_kv_heads`.
    """

    vocab_size: int = 256
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    ffn_dim: int | None = None
    multiple_of: int = 256
    max_seq_len: int = 128
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = True
    n_kv_heads: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "multiple_of", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"LlamaConfig.{name} must be a positive integer, got {value!r}")
        if self.dim % self.n_heads:
            raise ValueError(
                f"LlamaConfig: dim ({self.dim}) must be divisible by n_heads ({self.n_heads}); "
                "choose a head count that divides the width"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"LlamaConfig: head size dim/n_heads = {self.head_dim} must be even for rotary "
                "embeddings; choose another dim or n_heads"
            )
        if self.n_kv_heads is not None and (
                not isinstance(self.n_kv_heads, int) or self.n_kv_heads <= 0 or self.n_heads % self.n_kv_heads):
            raise ValueError(
                f"LlamaConfig: n_kv_heads ({self.n_kv_heads!r}) must be a positive integer dividing n_heads "
                f"({self.n_heads}); or None for multi-head attention"
            )
        if self.ffn_dim is None:
            hidden = int(8 * self.dim / 3)
            self.ffn_dim = self.multiple_of * math.ceil(hidden / self.multiple_of)
        elif self.ffn_dim <= 0:
            raise ValueError(f"LlamaConfig.ffn_dim must be positive, got {self.ffn_dim}")

    @property
    def head_dim(self) -> int:
        """Channels per attention head: dim // n_heads."""
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads: n_kv_heads, or n_heads when it is None."""
        return self.n_kv_heads or self.n_heads

    def num_params(self) -> int:
        """Parameter count of `Llama(self)` computed from the shapes (tied weights counted once)."""
        d, f = self.dim, self.ffn_dim
        kv = self.kv_heads * self.head_dim
        per_block = 2 * d * d + 2 * d * kv + 3 * d * f + 2 * d  # wq wo, wk wv, w1 w2 w3, two RMSNorms
        embeddings = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return self.n_layers * per_block + embeddings + d  # + final norm


PRESETS: dict[str, LlamaConfig] = {
    # ~0.8M parameters: learns byte-level Python well below the unigram baseline in a couple of
    # minutes on 2 CPU cores.
    "tiny": LlamaConfig(dim=128, n_layers=4, n_heads=4, multiple_of=32, max_seq_len=128),
    # ~25M parameters: a single GPU or a patient CPU.
    "small": LlamaConfig(dim=512, n_layers=8, n_heads=8, multiple_of=64, max_seq_len=512),
    # ~1.1B parameters (TinyLlama's width and depth, full multi-head attention): one or more GPUs.
    "1b": LlamaConfig(dim=2048, n_layers=22, n_heads=16, multiple_of=256, max_seq_len=2048),
    # Llama 3 8B and 70B shapes (Grattafiori et al. 2024, Table 3; 128K-token vocabulary, untied
    # output): for memory and communication estimates (`flashfsdp.estimate`), not byte training.
    "8b": LlamaConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                      max_seq_len=8192, rope_theta=500000.0, tie_embeddings=False),
    "70b": LlamaConfig(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
                       max_seq_len=8192, rope_theta=500000.0, tie_embeddings=False),
}


def config_from_preset(name: str, **overrides) -> LlamaConfig:
    """A fresh `LlamaConfig` from `PRESETS[name]` with some fields replaced.

    Args:
        name: a key of `PRESETS` ("tiny", "small", "1b", "8b", "70b").
        **overrides: `LlamaConfig` fields to replace; a value of None keeps the preset's. Changing
            `dim` or `multiple_of` without giving `ffn_dim` recomputes the default `ffn_dim`.

    Raises:
        ValueError: unknown preset (the message lists the choices), unknown field, or a config
            that `LlamaConfig` rejects.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    overrides = {k: v for k, v in overrides.items() if v is not None}
    fields = {f.name for f in dataclasses.fields(LlamaConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown LlamaConfig field(s) {unknown}; valid: {sorted(fields)}")
    base = dataclasses.asdict(PRESETS[name])
    if "ffn_dim" not in overrides and ({"dim", "multiple_of"} & set(overrides)):
        base["ffn_dim"] = None
    base.update(overrides)
    return LlamaConfig(**base)


def _placed_like(param: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """`values` (the full value of `param`, on the CPU) in the form `param.copy_` takes: as they
    are for a plain parameter (and inside flashfsdp's init window, which initialises DTensor
    parameters through full-shape stand-ins), or this rank's pieces of them as a DTensor of
    `param`'s mesh and placements for a DTensor parameter (tensor parallelism, torch's FSDP2).
    Every rank holds the same full values, so no collective is needed."""
    if type(param) is not DTensor:
        return values
    return distribute_tensor(values.to(param.device), param.device_mesh, param.placements, src_data_rank=None)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019): x / rms(x) · weight.

    Normalises over the last dimension in fp32 and returns the input's dtype.
    Shapes: x (..., dim) → (..., dim).
    """

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight

    def reset_parameters(self) -> None:
        """Set the weight to ones."""
        nn.init.ones_(self.weight)


def rotary_inv_freq(head_dim: int, theta: float, device=None) -> torch.Tensor:
    """Rotary-embedding inverse frequencies θ^(-2i/head_dim), i < head_dim/2 (Su et al. 2021,
    "RoFormer"), computed in fp32 exactly as transformers' Llama computes them.

    Returns:
        An fp32 tensor of shape (head_dim // 2,).
    """
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=device) / head_dim))


def rotary_cos_sin(inv_freq: torch.Tensor, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the angles m·θ_i for positions m < seq, each frequency repeated for the two
    halves of a head: the same fp32 ops, on the same shapes, as transformers'
    ``LlamaRotaryEmbedding`` (so an exported model computes the same bits).

    Args:
        inv_freq: (head_dim // 2,) from :func:`rotary_inv_freq` (any float dtype; used in fp32).
        seq: number of positions.

    Returns:
        (cos, sin): fp32 tensors of shape (1, seq, head_dim) on ``inv_freq``'s device.
    """
    positions = torch.arange(seq, device=inv_freq.device).unsqueeze(0)
    freqs = positions[..., None].float() * inv_freq.float()
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (x[i], x[i + head_dim/2]) of every head by the position's angle.

    The half-split layout of transformers' Llama (``rotate_half``): the same as multiplying the
    complex number x[i] + j·x[i + head_dim/2] by exp(j·m·θ_i), in fp32 so that bf16 inputs keep
    their digits (transformers rotates bf16 in bf16; in fp32 the ops and results are its own).

    Args:
        x: (batch, heads, seq, head_dim), any float dtype.
        cos, sin: (1, seq, head_dim) fp32, from :func:`rotary_cos_sin`.

    Returns:
        A tensor shaped and typed like `x`.
    """
    x32 = x.float()
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x32.shape[-1] // 2
    rotated = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
    return ((x32 * cos) + (rotated * sin)).type_as(x)


class Attention(nn.Module):
    """Causal multi-head self-attention with rotary embeddings, no biases.

    Shapes: x (batch, seq, dim) → (batch, seq, dim); seq ≤ config.max_seq_len.
    Owns the rotary inverse frequencies as a non-persistent fp32 buffer `rope_inv_freq` of shape
    (head_dim // 2,); each forward computes its positions' cos and sin from it (a few small ops,
    the way transformers' Llama does, so that an exported model's logits are the same bits).
    """

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.kv_heads
        self.head_dim = config.head_dim
        self.max_seq_len = config.max_seq_len
        self.rope_theta = config.rope_theta
        self.wq = nn.Linear(config.dim, config.dim, bias=False)
        self.wk = nn.Linear(config.dim, config.kv_heads * config.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.kv_heads * config.head_dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)
        self.register_buffer("rope_inv_freq", rotary_inv_freq(self.head_dim, self.rope_theta), persistent=False)

    def reset_buffers(self) -> None:
        """Recompute the rotary frequencies in place (after `to_empty` from the meta device)."""
        with torch.no_grad():
            self.rope_inv_freq.copy_(rotary_inv_freq(self.head_dim, self.rope_theta))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        if seq > self.max_seq_len:
            raise ValueError(
                f"sequence length {seq} exceeds max_seq_len {self.max_seq_len}; "
                "crop the input or build the model with a larger max_seq_len"
            )
        # -1 heads: all of them, or under tensor parallelism this rank's n_heads / tp (its
        # column shards of wq/wk/wv, `flashfsdp.models.tp_plan`).
        q = self.wq(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k, v = (w(x).view(batch, seq, -1, self.head_dim).transpose(1, 2) for w in (self.wk, self.wv))
        cos, sin = rotary_cos_sin(self.rope_inv_freq, seq)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # Grouped-query attention (a K/V head per group of query heads) inside SDPA, as transformers
        # calls it without a mask; the scale as transformers passes it.
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.head_dim**-0.5,
                                             enable_gqa=self.n_kv_heads != self.n_heads)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020): w2(silu(w1 x) · w3 x); w1 gate, w3 up, w2 down.

    Shapes: x (..., dim) → (..., dim) through a hidden width `ffn_dim`.
    """

    def __init__(self, dim: int, ffn_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """One pre-norm transformer block: x + attention(norm(x)), then h + feed_forward(norm(h)).

    Shapes: x (batch, seq, dim) → (batch, seq, dim). One flashfsdp unit in training.
    """

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config.dim, config.ffn_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Llama-style decoder: token ids (batch, seq) int64 → logits (batch, seq, vocab_size).

    Construct, then call `init_weights(seed)` for the deterministic initialisation used in
    training (the constructor's own PyTorch default init is not the training init).

    Attributes:
        seq_multiple: the sequence lengths the model takes are multiples of it: 1, or the TP
            degree under sequence parallelism (`flashfsdp.models.tp_plan` sets it).
    """

    seq_multiple: int = 1

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Make `output.weight` the same Parameter as `tok_embeddings.weight` (if
        `config.tie_embeddings`); `to_empty` from the meta device unties them."""
        if self.config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits for every position.

        Args:
            tokens: int64 (batch, seq) ids in [0, vocab_size), seq ≤ config.max_seq_len and a
                multiple of `seq_multiple`.

        Returns:
            (batch, seq, vocab_size) logits in the parameters' (compute) dtype; position t
            depends only on tokens[:, :t+1].

        Raises:
            ValueError: seq not a multiple of `seq_multiple` (sequence parallelism cuts it evenly).
        """
        if tokens.shape[-1] % self.seq_multiple:
            raise ValueError(f"sequence length {tokens.shape[-1]} is not a multiple of {self.seq_multiple}, the "
                             "tensor-parallel degree: sequence parallelism cuts the sequence evenly; pad or crop it")
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Deterministic initialisation, identical on every device and rank for one seed.

        Normal(0, 0.02) for embeddings and linear weights; the projections that write into the
        residual stream (attention.wo, feed_forward.w2) use 0.02 / sqrt(2·n_layers) (GPT-2,
        Radford et al. 2019); RMSNorm weights are ones; rotary frequencies are recomputed. Values are
        drawn on the CPU from a generator seeded with `seed`, then copied to each parameter's
        device, so a model built on the meta device and `to_empty`'d gets the same weights (the
        tied output projection is re-tied first). Call it before sharding, or after ``fully_shard``
        and ``to_empty`` (flashfsdp's init window gives the same values), or on DTensor parameters
        (tensor parallelism, `flashfsdp.models.tp_plan`; torch's FSDP2), each rank keeping its pieces.
        """
        self.tie_weights()
        gen = torch.Generator(device="cpu").manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        seen: set[int] = set()
        for name, module in self.named_modules():
            if isinstance(module, RMSNorm):
                module.reset_parameters()
            elif isinstance(module, Attention):
                module.reset_buffers()
            elif isinstance(module, (nn.Linear, nn.Embedding)):
                if id(module.weight) in seen:  # the tied output projection
                    continue
                seen.add(id(module.weight))
                std = residual_std if name.endswith(("attention.wo", "feed_forward.w2")) else 0.02
                values = torch.empty(module.weight.shape).normal_(0.0, std, generator=gen)
                module.weight.copy_(_placed_like(module.weight, values))

    def num_params(self) -> int:
        """Number of distinct parameter elements (a tied matrix counted once), unsharded."""
        return sum(p.numel() for p in self.parameters())

    def _last_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """(batch, vocab_size) logits of the position after the last of `tokens`, from the last
        tokens that fit the model, right-padded to a multiple of `seq_multiple` (positions are
        causal: the padding after the last token does not change its logits)."""
        m = self.seq_multiple
        context = tokens[:, -(self.config.max_seq_len - self.config.max_seq_len % m):]
        length = context.shape[1]
        pad = -length % m
        if pad:
            context = torch.cat((context, context[:, -1:].expand(-1, pad)), dim=1)
        return self(context)[:, length - 1, :]

    @torch.no_grad()
    def generate(
        self,
        tokens: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Sample a continuation autoregressively (no kv-cache: one full forward per token).

        Calls `self(...)`, so it works when the model's forward is wrapped by sharding hooks;
        under FSDP every rank must call it with the same shapes (the loop length depends only
        on `max_new_tokens`). Sampling draws from `generator` on the CPU, so one seed gives the
        same sample on every device.

        Args:
            tokens: int64 (batch, prompt_len) prompt ids, prompt_len ≥ 1; the context fed to
                the model is cropped to the last `config.max_seq_len` tokens (rounded down to a
                multiple of `seq_multiple`, and right-padded to one).
            max_new_tokens: tokens to append (≥ 0).
            temperature: softmax temperature > 0; 0 means greedy (argmax).
            top_k: keep only the k most likely tokens before sampling (None: all).
            generator: CPU `torch.Generator` for reproducible sampling.

        Returns:
            int64 (batch, prompt_len + max_new_tokens) on `tokens`' device.

        Raises:
            ValueError: empty prompt, negative `max_new_tokens` or `temperature`, `top_k` < 1.
        """
        if tokens.dim() != 2 or tokens.shape[1] == 0:
            raise ValueError(f"generate: tokens must be (batch, prompt_len ≥ 1), got {tuple(tokens.shape)}")
        if max_new_tokens < 0 or temperature < 0:
            raise ValueError("generate: max_new_tokens and temperature must be non-negative")
        if top_k is not None and top_k < 1:
            raise ValueError(f"generate: top_k must be ≥ 1 or None, got {top_k}")
        for _ in range(max_new_tokens):
            logits = self._last_logits(tokens).float().cpu()
            if temperature == 0:
                next_token = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None and top_k < logits.shape[-1]:
                    kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = torch.softmax(logits, dim=-1)
                next_token = torch.multinomial(probs, 1, generator=generator)
            tokens = torch.cat((tokens, next_token.to(tokens.device)), dim=1)
        return tokens
