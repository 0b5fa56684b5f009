"""torchao, the library whose tensor subclasses use FSDP2's all-gather extensions
(``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``), on W = 2 gloo ranks against torch's FSDP2.

1. QLoRA as torchtune writes it: every Linear a ``LoRALinear`` whose base weight is a frozen
   ``NF4Tensor`` (``to_nf4``, applied with ``linear_nf4``) and whose ``lora_a`` / ``lora_b`` train;
   sharded per layer and at the root. ``NF4Tensor`` all-gathers its three quantized inner tensors
   and rebuilds the unsharded ``NF4Tensor`` from them. Checked: parameter and local types, the
   unsharded NF4 weights bit-equal to the unsharded model's, AdamW on the adapters (losses,
   gradients, parameters) against the unsharded model, ``state_dict()`` types, and a DCP
   save / load into a freshly sharded model.
2. float8 training with float8 all-gathers: ``convert_to_float8_training`` with
   ``Float8LinearConfig(enable_fsdp_float8_all_gather=True)`` (weights become
   ``WeightWithDynamicFloat8CastTensor``, whose ``fsdp_pre_all_gather`` casts the shard to
   float8 with an all-reduced amax and ``fsdp_post_all_gather`` builds a ``Float8TrainingTensor``),
   sharded per block as torchtitan does. torch's CPU build runs ``torch._scaled_mm`` for float8, so
   forward, backward and AdamW run here; the unsharded float8 data and scales are required
   bit-equal to a cast of the full weights, with dynamic scales and with the scales of
   ``precompute_float8_dynamic_scale_for_fsdp``. On gloo torch's FSDP2 cannot all-gather a
   unit whose inputs are all float8 (gloo has no float8 type: "Invalid scalar type"); the blocks
   here hold a LayerNorm too, so FSDP2 packs them into a ``uint8`` buffer as flashfsdp always does.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F

from tests.clients.common import (
    IMPLS,
    against_torch,
    assert_close_tree,
    assert_grads_contract,
    assert_params_contract,
    assert_same,
    assert_shards_of,
    assert_sharded_by,
    average_grads,
    fsdp2_contract,
    local,
    local_chunk,
    local_grads,
    run,
    state_dict_summary,
)

pytest.importorskip("torchao", reason="torchao: pip install -e .[clients]")
from torchao.float8 import (  # noqa: E402
    Float8LinearConfig,
    convert_to_float8_training,
    precompute_float8_dynamic_scale_for_fsdp,
)
from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8  # noqa: E402
from torchao.float8.float8_utils import amax_to_scale  # noqa: E402
from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, linear_nf4, to_nf4  # noqa: E402

D, HEADS, SEQ, VOCAB, LORA_RANK, LORA_ALPHA = 32, 2, 8, 64, 4, 8.0
# torchtune's LoRALinear passes its quantization kwargs to to_nf4; the defaults (64, 256) need
# weights of 16384 elements, so the toy sizes use smaller blocks.
NF4_BLOCKS = dict(block_size=16, scaler_block_size=8)
NF4_INNER = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4")


# ------------------------------------------------------------------ NF4 QLoRA (torchtune's modules)
class LoRALinear(nn.Module):
    """torchtune's ``LoRALinear(quantize_base=True)``: a frozen NF4 base weight applied with
    ``linear_nf4``, plus ``(alpha / rank) * lora_b(lora_a(x))`` (``lora_a`` Kaiming-uniform,
    ``lora_b`` zero, as torchtune initialises them)."""

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        linear = nn.Linear(in_dim, out_dim, bias=False)
        self.weight = nn.Parameter(to_nf4(linear.weight, **NF4_BLOCKS))
        self.lora_a = nn.Linear(in_dim, LORA_RANK, bias=False)
        self.lora_b = nn.Linear(LORA_RANK, out_dim, bias=False)
        nn.init.kaiming_uniform_(self.lora_a.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_b.weight)
        self.scaling = LORA_ALPHA / LORA_RANK

    def forward(self, x):
        return linear_nf4(input=x, weight=self.weight) + self.scaling * self.lora_b(self.lora_a(x))


class QLoRALayer(nn.Module):
    """A Llama-shaped decoder layer with LoRA on every projection (torchtune's
    ``lora_attn_modules=[q, k, v, output]`` and ``apply_lora_to_mlp``)."""

    def __init__(self):
        super().__init__()
        self.sa_norm, self.mlp_norm = nn.RMSNorm(D), nn.RMSNorm(D)
        self.q_proj, self.k_proj, self.v_proj, self.output_proj = (LoRALinear(D, D) for _ in range(4))
        self.w1, self.w2 = LoRALinear(D, 2 * D), LoRALinear(2 * D, D)

    def forward(self, x):
        b, t, d = x.shape
        h = self.sa_norm(x)
        q, k, v = (p(h).view(b, t, HEADS, d // HEADS).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.output_proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.w2(F.silu(self.w1(self.mlp_norm(x))))


class QLoRAModel(nn.Module):
    """Token embedding, two QLoRA layers, a final RMSNorm and a LoRA output projection."""

    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(QLoRALayer() for _ in range(2))
        self.norm = nn.RMSNorm(D)
        self.output = LoRALinear(D, VOCAB)

    def forward(self, tokens):
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def qlora_model(seed: int = 0) -> QLoRAModel:
    """The model with torchtune's ``set_trainable_params``: only the LoRA factors train."""
    torch.manual_seed(seed)
    model = QLoRAModel()
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    return model


def shard_layers(model: nn.Module, layers, api) -> None:
    """torchtune's / torchtitan's wrapping: each layer, then the root."""
    for layer in layers:
        api.fully_shard(layer)
    api.fully_shard(model)
    assert_sharded_by(model, api)


def local_types(model: nn.Module) -> dict:
    """Each parameter's local tensor class (the DTensor's ``_local_tensor``; an unsharded plain
    ``nn.Parameter`` counts as ``Tensor``, a subclass parameter is of its subclass)."""
    return {n: _tensor_class(getattr(p, "_local_tensor", p)) for n, p in model.named_parameters()}


def _tensor_class(t: torch.Tensor) -> str:
    return "Tensor" if type(t) is nn.Parameter else type(t).__name__


def nf4_parts(w: torch.Tensor) -> dict:
    """An ``NF4Tensor``'s inner tensors and its dequantised value, as plain tensors."""
    assert isinstance(w, NF4Tensor), type(w).__name__
    parts = {name: getattr(w, name).detach().clone() for name in NF4_INNER}
    return {**parts, "dequantized": w.get_original_weight().detach().clone(), "shape": tuple(w.shape)}


def record_nf4_unsharded(model: nn.Module) -> tuple[dict, list]:
    """Forward pre-hooks that record each LoRALinear's weight (the unsharded ``NF4Tensor`` during
    forward) at every forward; returns the records and the hook handles."""
    seen: dict = {}

    def hook(module, args, name):
        seen[name] = nf4_parts(module.weight)

    handles = [m.register_forward_pre_hook(lambda m, a, n=n: hook(m, a, n))
               for n, m in model.named_modules() if isinstance(m, LoRALinear)]
    return seen, handles


def adapter_shards(model: nn.Module) -> dict:
    """The trainable (LoRA) parameters' local shards (``local_params`` would clone the NF4 weights,
    which re-quantises them with ``to_nf4``'s default block sizes)."""
    return {n: local(p).clone() for n, p in model.named_parameters() if p.requires_grad}


def _nf4_shard_values(model: nn.Module) -> dict:
    out = {}
    for name, p in model.named_parameters():
        t = local(p)
        out[name] = {k: getattr(t, k) for k in NF4_INNER} if isinstance(t, NF4Tensor) else t
    return out


def _nf4_checkpoint(api, model: nn.Module, path: str, tokens) -> torch.Tensor:
    """DCP save of the sharded ``state_dict()``, load into a freshly sharded model of another seed:
    every local shard (NF4 inner tensors included) and the logits equal the saved model's."""
    dcp.save(model.state_dict(), checkpoint_id=path)
    fresh = qlora_model(seed=1)
    shard_layers(fresh, fresh.layers, api)
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=path)
    fresh.load_state_dict(state)
    assert_close_tree(_nf4_shard_values(fresh), _nf4_shard_values(model), "shards after DCP save / load",
                      rtol=0, atol=0)
    with torch.no_grad():
        logits = fresh(tokens)
        torch.testing.assert_close(logits, model(tokens), rtol=0, atol=0)
    return logits


def _qlora_training(api, rank, path, steps=3):
    model, ref = qlora_model(), qlora_model()
    shard_layers(model, model.layers, api)
    assert_params_contract(model, ref, rank)
    assert_same(local_types(model), local_types(ref), "local tensor types (NF4Tensor base weights)")
    assert {n for n, t in local_types(model).items() if t == "NF4Tensor"} == {
        f"{n}.weight" for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    seen, _ = record_nf4_unsharded(model)
    want = {n: nf4_parts(m.weight) for n, m in ref.named_modules() if isinstance(m, LoRALinear)}
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in (model, ref)]
    gen = torch.Generator().manual_seed(100 + rank)
    losses, grads = [], []
    for step in range(steps):
        tokens = torch.randint(VOCAB, (2, SEQ), generator=gen)
        loss, ref_loss = (F.cross_entropy(m(tokens).view(-1, VOCAB), tokens.view(-1)) for m in (model, ref))
        loss.backward()
        ref_loss.backward()
        average_grads(ref)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        assert_grads_contract(model, ref, rank)  # LoRA factors only: the NF4 weights get none
        assert_shards_of(local_grads(model), ref, rank, f"LoRA gradients, step {step}", grads=True)
        grads.append(local_grads(model))
        for o in opts:
            o.step()
            o.zero_grad()
        losses.append(loss.detach())
        # The first forward builds each unsharded NF4Tensor, the later ones refill it (out=).
        assert_close_tree(seen, want, f"unsharded NF4 weights, step {step}", rtol=0, atol=0)
    adapters = adapter_shards(model)
    want = {n: local_chunk(p.detach(), rank) for n, p in ref.named_parameters() if p.requires_grad}
    assert_close_tree(adapters, want, f"LoRA factors after {steps} steps")
    state = model.state_dict()
    assert_same(state_dict_summary(state), fsdp2_contract(ref.state_dict().items(), rank, parameter=False),
                "state_dict() values")
    assert {k: _tensor_class(v.to_local()) for k, v in state.items()} == local_types(ref)
    logits = _nf4_checkpoint(api, model, f"{path}/{api.__name__}", torch.randint(VOCAB, (2, SEQ), generator=gen))
    return {"losses": losses, "grads": grads, "adapters": adapters, "unsharded_nf4": dict(seen),
            "logits": logits}


def _qlora_case(rank, world_size, impl, path):
    against_torch(impl, _qlora_training, rank, path, rtol=0, atol=0)


@pytest.mark.parametrize("impl", IMPLS)
def test_nf4_qlora(impl, tmp_path):
    """torchtune's QLoRA under ``fully_shard`` per layer and at the root: the NF4 base weights stay
    ``NF4Tensor`` locals of ``(Shard(0),)`` DTensors, are unsharded through NF4Tensor's own
    all-gather extensions bit-equal to the unsharded model's at every step, three AdamW steps on
    the LoRA factors match the unsharded model, ``state_dict()`` holds NF4 DTensors, and DCP
    save / load restores every shard exactly; flashfsdp gives torch's FSDP2's values bit for bit."""
    run(_qlora_case, impl, str(tmp_path))


# ------------------------------------------------------------------ float8 training, float8 all-gathers
FLOAT8 = torch.float8_e4m3fn  # the weights' cast (tensorwise dynamic scaling)
FLOAT8_STEPS, PRECOMPUTE_FROM = 4, 2
FLOAT8_TOL = dict(rtol=1e-5, atol=1e-6)


class Float8Block(nn.Module):
    """torchtitan's block at toy size: a LayerNorm (so the unit all-gathers float8 and float32
    inputs, see the module docstring) and an MLP of bias-free Linears, converted to float8."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.w1, self.w2 = nn.Linear(D, 2 * D, bias=False), nn.Linear(2 * D, D, bias=False)

    def forward(self, x):
        return x + self.w2(F.silu(self.w1(self.norm(x))))


class Float8Model(nn.Module):
    """Two float8 blocks and a high-precision output head (torchtitan's ``module_filter_fn``
    leaves the output layer unconverted)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Float8Block() for _ in range(2))
        self.output = nn.Linear(D, 16)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.output(x)


def float8_model(seed: int = 0) -> Float8Model:
    """The model after torchao's ``convert_to_float8_training`` with float8 all-gathers."""
    torch.manual_seed(seed)
    model = Float8Model()
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn != "output")
    return model


def plain(t: torch.Tensor) -> torch.Tensor:
    """A local tensor as a plain tensor (a ``WeightWithDynamicFloat8CastTensor``'s high-precision one)."""
    t = local(t)
    return getattr(t, "_tensor", t)


def full_float8_weights(model: nn.Module) -> dict:
    """The full high-precision weights of the float8 Linears, all-gathered from the local shards
    (the rows divide evenly)."""
    out = {}
    for name, m in model.named_modules():
        if type(m).__name__ == "Float8Linear":
            shard = plain(m.weight).contiguous()
            parts = [torch.empty_like(shard) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, shard)
            out[name] = torch.cat(parts)
    return out


def record_float8_unsharded(model: nn.Module) -> tuple[dict, list]:
    """Forward pre-hooks recording each float8 Linear's unsharded weight: its class and its float8
    data and scale as integers (bitwise)."""
    seen: dict = {}

    def hook(module, args, name):
        w = module.weight
        seen[name] = {"type": type(w).__name__, "orig_dtype": str(getattr(w, "_orig_dtype", None)),
                      "data": w._data.detach().view(torch.uint8).clone(),
                      "scale": w._scale.detach().reshape(1).view(torch.int32).clone()}

    handles = [m.register_forward_pre_hook(lambda m, a, n=n: hook(m, a, n))
               for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"]
    return seen, handles


def float8_cast(full: torch.Tensor) -> dict:
    """What the unsharded weight must hold: the full weight cast to float8 with the tensorwise
    scale of its amax (dynamic scaling all-reduces the shards' amax; the precomputed scale is
    computed from the same amax)."""
    scale = amax_to_scale(full.abs().max(), FLOAT8)
    data = hp_tensor_and_scale_to_float8(full, scale, FLOAT8)._data
    return {"type": "Float8TrainingTensor", "orig_dtype": str(full.dtype), "data": data.view(torch.uint8),
            "scale": scale.reshape(1).view(torch.int32)}


def _float8_training(api, rank):
    model, ref = float8_model(), float8_model()
    shard_layers(model, model.layers, api)
    assert_params_contract(model, ref, rank)
    assert_same(local_types(model), local_types(ref), "local tensor types (WeightWithDynamicFloat8CastTensor)")
    seen, _ = record_float8_unsharded(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref)]
    gen = torch.Generator().manual_seed(100 + rank)
    out = {"losses": [], "unsharded": [], "grads": []}
    for step in range(FLOAT8_STEPS):
        want = {name: float8_cast(w) for name, w in full_float8_weights(model).items()}
        x = torch.randn(4, SEQ, D, generator=gen)
        loss, ref_loss = (m(x).pow(2).mean() for m in (model, ref))
        loss.backward()
        ref_loss.backward()
        average_grads(ref)
        assert_close_tree(dict(seen), want, f"unsharded float8 weights, step {step}", rtol=0, atol=0)
        torch.testing.assert_close(loss, ref_loss, **FLOAT8_TOL)
        assert_grads_contract(model, ref, rank)
        grads = {n: None if p.grad is None else plain(p.grad).clone() for n, p in model.named_parameters()}
        assert_close_tree(grads, {n: local_chunk(p.grad, rank) for n, p in ref.named_parameters()},
                          f"gradients, step {step}", **FLOAT8_TOL)
        for o in opts:
            o.step()
            o.zero_grad()
        if step + 1 >= PRECOMPUTE_FROM:  # torchtitan: after each optimizer step, one all-reduce
            precompute_float8_dynamic_scale_for_fsdp(model)
            scales = {n: m.weight._local_tensor._precomputed_scale for n, m in model.named_modules()
                      if type(m).__name__ == "Float8Linear"}
            after = {n: amax_to_scale(w.abs().max(), FLOAT8) for n, w in full_float8_weights(model).items()}
            assert_close_tree(scales, after, "precomputed scales", rtol=0, atol=0)
        out["losses"].append(loss.detach())
        out["unsharded"].append(dict(seen))
        out["grads"].append(grads)
    out["params"] = {n: plain(p).clone() for n, p in model.named_parameters()}
    assert_close_tree(out["params"], {n: local_chunk(p.detach(), rank) for n, p in ref.named_parameters()},
                      f"parameters after {FLOAT8_STEPS} steps", **FLOAT8_TOL)
    return out


def _float8_case(rank, world_size, impl):
    against_torch(impl, _float8_training, rank, rtol=0, atol=0)


@pytest.mark.parametrize("impl", IMPLS)
def test_float8_training_with_float8_all_gather(impl):
    """``convert_to_float8_training(enable_fsdp_float8_all_gather=True)`` under ``fully_shard``
    per block and at the root: the float8 weights are ``(Shard(0),)`` DTensors over
    ``WeightWithDynamicFloat8CastTensor`` locals, each forward's unsharded weight is a
    ``Float8TrainingTensor`` whose float8 data and scale are bit-equal to the full weight's cast
    (dynamic scales for two steps, then ``precompute_float8_dynamic_scale_for_fsdp``'s, which
    are checked too), and four AdamW steps follow the unsharded float8 model; flashfsdp gives
    torch's FSDP2's values bit for bit."""
    run(_float8_case, impl)
