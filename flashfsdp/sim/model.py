"""What the overlap simulator needs to know about a model: its units, their bytes and compute.

A model is a **root** unit (the outermost ``fully_shard`` call: for a Llama, the embedding, final
norm and output projection) whose forward contains the forwards of its **blocks** (one unit per
transformer block), as the runtime wraps it (docs/architecture.md, The step protocol). Per unit: its parameter count, the
bytes per element of its unsharded parameters (``param_dtype``) and of its gradient reduction
(``reduce_dtype``), and its own forward and backward compute time in **seconds** (nested units
excluded), either measured by ``flashfsdp.profile()`` (``Profile.unit_compute_ms()``, in ms) or
derived from FLOPs (:func:`llama_model`).

Times in this package are seconds and sizes are bytes unless a name says otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

TP_KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def _check_number(owner: str, name: str, value, *, integer: bool = False) -> None:
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or not (value >= 0) or (not integer and not math.isfinite(value)):
        kind = "an integer" if integer else "a finite number"
        raise ValueError(f"{owner}: {name} must be {kind} >= 0, got {value!r}")


@dataclass(frozen=True)
class TPOp:
    """A tensor-parallel collective on a unit's compute path: the compute stream waits for it
    (built from :mod:`flashfsdp.estimate.tp_comm`'s lists by :mod:`flashfsdp.sim.tensor_parallel`).

    Attributes:
        kind: "all_gather" (``nbytes``: its output), "reduce_scatter" (its input) or "all_reduce".
        nbytes: bytes of the buffer, per rank of the TP group.
        pass_: "forward" or "backward".
        part: 0 or 1: before or after the nested units' compute in that pass (the root's
            ``root_forward_before`` / ``root_backward_after`` split); a block's are all in part 0.
        at: the fraction (0..1) of that part's compute done before it.
        what: a label for timelines.

    Raises:
        ValueError: an unknown kind or pass, a part other than 0 or 1, ``at`` outside [0, 1], or
            negative bytes (the message names the field).
    """

    kind: str
    nbytes: int
    pass_: str
    part: int = 0
    at: float = 0.0
    what: str = ""

    def __post_init__(self) -> None:
        if self.kind not in TP_KINDS:
            raise ValueError(f"TPOp: kind must be one of {', '.join(TP_KINDS)}, got {self.kind!r}")
        if self.pass_ not in ("forward", "backward"):
            raise ValueError(f"TPOp: pass_ must be 'forward' or 'backward', got {self.pass_!r}")
        if self.part not in (0, 1) or isinstance(self.part, bool):
            raise ValueError(f"TPOp: part must be 0 or 1, got {self.part!r}")
        if isinstance(self.at, bool) or not isinstance(self.at, (int, float)) or not 0 <= self.at <= 1:
            raise ValueError(f"TPOp: at must be a fraction in [0, 1], got {self.at!r}")
        _check_number("TPOp", "nbytes", self.nbytes, integer=True)


@dataclass(frozen=True)
class Unit:
    """One unit: the parameters of one ``fully_shard`` call.

    Attributes:
        name: the unit's name (the runtime's: ``"<root>"``, ``"layers.0"``, ...).
        numel: parameter elements (the runtime pads to a multiple of W; the simulator does too).
        forward_s: the unit's own forward compute, seconds (nested units excluded).
        backward_s: the unit's own backward compute, seconds.
        param_bytes: bytes per unsharded element (``param_dtype``: 2 for bf16, 4 for fp32).
        reduce_bytes: bytes per element of the reduce-scatter (``reduce_dtype``); None: ``param_bytes``.
        state_bytes: bytes per *sharded* element kept between steps: master weights, gradient and
            optimizer state (16 = fp32 master + fp32 grad + Adam's two fp32 moments).
        all_gather_bytes: bytes per element the all-gather sends, if not ``param_bytes``: 1 + 4/256
            for int8 with a scale per 256 values (``all_gather_dtype=torch.int8``, ZeRO++ qwZ;
            :mod:`flashfsdp.sim.quantized`). None: ``param_bytes``.
        backward_reads_params: False for a unit whose backward reads none of its parameters (an
            embedding wrapped on its own): with backward all-gather elision (the runtime's default)
            it is not gathered for its backward (:mod:`flashfsdp.sim.elision`).
        flat_numel: elements of the flat buffer as the runtime lays it out over one shard group
            (alignment and padding included: ``flashfsdp.estimate.units``), a multiple of its size;
            None: ``numel`` rounded up to a multiple of W.
        reduce_numel: elements of the reduce-scatter's input as the runtime packs it over one
            shard group (per rank its shard and a flag per parameter, padded:
            ``runtime/reduce.py``'s ``ReduceLayout``), a multiple of its size; None: the padded
            flat buffer's.
        tp_ops: the tensor-parallel collectives on the unit's compute path, in step order
            (:class:`TPOp`; none without tensor parallelism).

    Raises:
        ValueError: a negative size or time (the message names the field).
    """

    name: str
    numel: int
    forward_s: float
    backward_s: float
    param_bytes: int = 2
    reduce_bytes: int | None = None
    state_bytes: int = 16
    all_gather_bytes: float | None = None
    backward_reads_params: bool = True
    flat_numel: int | None = None
    reduce_numel: int | None = None
    tp_ops: tuple[TPOp, ...] = ()

    def __post_init__(self) -> None:
        owner = f"Unit {self.name!r}"
        _check_number(owner, "numel", self.numel, integer=True)
        _check_number(owner, "forward_s", self.forward_s)
        _check_number(owner, "backward_s", self.backward_s)
        _check_number(owner, "param_bytes", self.param_bytes, integer=True)
        if self.reduce_bytes is not None:
            _check_number(owner, "reduce_bytes", self.reduce_bytes, integer=True)
        _check_number(owner, "state_bytes", self.state_bytes, integer=True)
        if self.all_gather_bytes is not None:
            _check_number(owner, "all_gather_bytes", self.all_gather_bytes)
        for attr in ("flat_numel", "reduce_numel"):
            if getattr(self, attr) is not None:
                _check_number(owner, attr, getattr(self, attr), integer=True)
        object.__setattr__(self, "tp_ops", tuple(self.tp_ops))
        if not all(isinstance(op, TPOp) for op in self.tp_ops):
            raise ValueError(f"{owner}: tp_ops must hold flashfsdp.sim.TPOp values")

    def padded_numel(self, world_size: int) -> int:
        """Elements of the flat buffer: ``flat_numel`` if given, else ``numel`` rounded up to a
        multiple of W (T = W·S).

        Raises:
            ValueError: ``flat_numel`` is not a multiple of ``world_size`` (laid out for another
                shard group: build the unit for this one).
        """
        if self.flat_numel is None:
            return -(-self.numel // world_size) * world_size
        return self._laid_out("flat_numel", world_size)

    def _laid_out(self, attr: str, world_size: int) -> int:
        """``attr`` (a size laid out for one shard group), checked to be a multiple of W."""
        value = getattr(self, attr)
        if value % world_size:
            raise ValueError(f"Unit {self.name!r}: {attr} {value} was laid out for another shard group than "
                             f"{world_size} ranks (not a multiple); build the model for this world size")
        return value

    def unsharded_bytes(self, world_size: int) -> int:
        """Bytes of the unsharded parameters (the all-gather's output)."""
        return self.padded_numel(world_size) * self.param_bytes

    def all_gather_bytes_total(self, world_size: int) -> float:
        """Bytes the all-gather delivers (its output on the wire): ``unsharded_bytes`` unless
        ``all_gather_bytes`` is set."""
        if self.all_gather_bytes is None:
            return self.unsharded_bytes(world_size)
        return self.padded_numel(world_size) * self.all_gather_bytes

    def reduce_bytes_total(self, world_size: int) -> int:
        """Bytes of the packed gradients (the reduce-scatter's input): ``reduce_numel`` elements if
        given, else ``padded_numel``, in ``reduce_bytes``."""
        numel = self.padded_numel(world_size) if self.reduce_numel is None else self._laid_out("reduce_numel", world_size)
        return numel * (self.param_bytes if self.reduce_bytes is None else self.reduce_bytes)

    def sharded_state_bytes(self, world_size: int) -> int:
        """Bytes this rank keeps of the unit between steps: S elements × ``state_bytes``."""
        return self.padded_numel(world_size) // world_size * self.state_bytes


@dataclass(frozen=True)
class Model:
    """A root unit around a sequence of block units, and the compute outside any unit.

    Attributes:
        root: the root unit. Its forward runs ``root_forward_before`` of its own time before the
            first block and the rest after the last (e.g. embedding before, output head after); its
            backward mirrors that (the head's backward first, ``root_backward_after`` at the end).
        blocks: the block units in forward order.
        root_forward_before: fraction (0..1) of the root's forward run before the first block.
        root_backward_after: fraction (0..1) of the root's backward run after the last block's.
        loss_s: compute between the root's forward and its backward (the loss and its gradient), s.
        optimizer_s: compute after backward (optimizer step, zero_grad, next batch), seconds.
        name: a label for tables.
        tp: the tensor-parallel degree the units were built for (their compute, bytes and
            ``tp_ops`` per rank of a TP group; :mod:`flashfsdp.sim.tensor_parallel`); 1: none.

    Raises:
        ValueError: a fraction outside [0, 1], a negative time, two units with one name, or a
            ``tp`` that is not an integer >= 1.
    """

    root: Unit
    blocks: tuple[Unit, ...]
    root_forward_before: float = 0.0
    root_backward_after: float = 0.0
    loss_s: float = 0.0
    optimizer_s: float = 0.0
    name: str = "model"
    info: dict = field(default_factory=dict, compare=False)
    tp: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "blocks", tuple(self.blocks))
        for attr in ("root_forward_before", "root_backward_after"):
            value = getattr(self, attr)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise ValueError(f"Model {self.name!r}: {attr} must be a fraction in [0, 1], got {value!r}")
        _check_number(f"Model {self.name!r}", "loss_s", self.loss_s)
        _check_number(f"Model {self.name!r}", "optimizer_s", self.optimizer_s)
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"Model {self.name!r}: tp must be an integer >= 1, got {self.tp!r}")
        names = [u.name for u in self.units]
        if len(set(names)) != len(names):
            raise ValueError(f"Model {self.name!r}: unit names must be unique, got {names}")

    @property
    def units(self) -> tuple[Unit, ...]:
        """Root first, then the blocks: the runtime's forward (pre-hook) order."""
        return (self.root, *self.blocks)

    def compute_s(self) -> float:
        """Pure compute of one step, seconds: every unit's forward and backward, loss, optimizer."""
        return sum(u.forward_s + u.backward_s for u in self.units) + self.loss_s + self.optimizer_s

    def num_params(self) -> int:
        """Parameter elements of all units."""
        return sum(u.numel for u in self.units)


# ---------------------------------------------------------------------------------------------
# Llama-style builders


@dataclass(frozen=True)
class LlamaShape:
    """The shape of a Llama-style decoder (GQA attention, SwiGLU feed-forward, RMSNorm).

    Attributes:
        n_layers, dim, ffn_dim, vocab_size, n_heads, n_kv_heads: the usual sizes.
        tie_embeddings: one matrix for the input embedding and the output projection.
    """

    n_layers: int
    dim: int
    ffn_dim: int
    vocab_size: int
    n_heads: int
    n_kv_heads: int
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("n_layers", "dim", "ffn_dim", "vocab_size", "n_heads", "n_kv_heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"LlamaShape: {name} must be a positive integer, got {value!r}")
        if self.dim % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(f"LlamaShape: n_heads ({self.n_heads}) must divide dim ({self.dim}) and be a "
                             f"multiple of n_kv_heads ({self.n_kv_heads})")

    def block_params(self) -> int:
        """Parameters of one block: wq, wk, wv, wo, w1, w2, w3 and two RMSNorm weights."""
        d, kv = self.dim, self.dim // self.n_heads * self.n_kv_heads
        return 2 * d * d + 2 * d * kv + 3 * d * self.ffn_dim + 2 * d

    def root_params(self) -> int:
        """Parameters of the root: embedding, final norm, output projection (unless tied)."""
        return self.vocab_size * self.dim * (1 if self.tie_embeddings else 2) + self.dim

    def root_matmul_params(self) -> int:
        """The root's parameters that take part in matmuls: the output projection (the embedding is a lookup)."""
        return self.vocab_size * self.dim


# Llama 3 (Grattafiori et al. 2024, "The Llama 3 Herd of Models", Table 3).
LLAMA3_8B = LlamaShape(n_layers=32, dim=4096, ffn_dim=14336, vocab_size=128256, n_heads=32, n_kv_heads=8)
LLAMA3_70B = LlamaShape(n_layers=80, dim=8192, ffn_dim=28672, vocab_size=128256, n_heads=64, n_kv_heads=8)


def llama_model(shape: LlamaShape, *, tokens_per_rank: int = 8192, flops_per_s: float = 400e12,
                param_bytes: int = 2, reduce_bytes: int = 4, state_bytes: int = 16,
                seq_len: int | None = None, name: str = "llama") -> Model:
    """A :class:`Model` of a Llama-style decoder with compute derived from FLOPs.

    Each unit's training FLOPs are 6 · (matmul parameters) · tokens (Kaplan et al. 2020), split 1:2
    between forward and backward; time = FLOPs / ``flops_per_s`` (the *achieved* rate, an
    assumption: 400e12 is ~40% of an H100 SXM's dense bf16 peak). With ``seq_len`` given, each
    block also gets the attention-score FLOPs 12 · dim · seq_len per token (PaLM, Chowdhery et al.
    2022, App. B; causal masking not discounted); without it they are left out, as in 6·N·D.

    Args:
        shape: the model's sizes (:data:`LLAMA3_8B`, :data:`LLAMA3_70B`, ...).
        tokens_per_rank: tokens each rank processes per step.
        flops_per_s: achieved FLOP/s per rank.
        param_bytes: bytes per unsharded parameter (2: bf16).
        reduce_bytes: bytes per reduced gradient element (4: fp32, torchtitan's default).
        state_bytes: bytes per sharded element kept between steps (16: fp32 master, grad, Adam m, v).
        seq_len: include attention-score FLOPs for this sequence length (tokens); None: leave out.
        name: the model's label.

    Raises:
        ValueError: a non-positive token count or FLOP rate.
    """
    if isinstance(tokens_per_rank, bool) or not isinstance(tokens_per_rank, int) or tokens_per_rank <= 0:
        raise ValueError(f"llama_model: tokens_per_rank must be a positive integer, got {tokens_per_rank!r}")
    if not (isinstance(flops_per_s, (int, float)) and flops_per_s > 0 and math.isfinite(flops_per_s)):
        raise ValueError(f"llama_model: flops_per_s must be a positive number (FLOP/s), got {flops_per_s!r}")
    if seq_len is not None and (not isinstance(seq_len, int) or seq_len <= 0):
        raise ValueError(f"llama_model: seq_len must be a positive integer or None, got {seq_len!r}")

    def unit(uname: str, numel: int, matmul_params: int, extra_flops_per_token: int = 0) -> Unit:
        flops = (6 * matmul_params + 3 * extra_flops_per_token) * tokens_per_rank
        seconds = flops / flops_per_s
        return Unit(uname, numel, seconds / 3, 2 * seconds / 3, param_bytes=param_bytes,
                    reduce_bytes=reduce_bytes, state_bytes=state_bytes)

    # attention scores: QK^T and AV, 2·2·dim·seq_len FLOPs per token forward = 4·dim·seq (×3 for training)
    attention = 4 * shape.dim * seq_len if seq_len is not None else 0
    block_matmul = shape.block_params() - 2 * shape.dim
    root = unit("<root>", shape.root_params(), shape.root_matmul_params())
    blocks = tuple(unit(f"layers.{i}", shape.block_params(), block_matmul, attention) for i in range(shape.n_layers))
    info = {"tokens_per_rank": tokens_per_rank, "flops_per_s": flops_per_s, "param_bytes": param_bytes,
            "reduce_bytes": reduce_bytes, "state_bytes": state_bytes, "seq_len": seq_len}
    return Model(root, blocks, name=name, info=info)


def llama3_8b(**kwargs) -> Model:
    """Llama-3-style 8B (32 layers, dim 4096, ffn 14336, vocab 128256, 8 KV heads); see :func:`llama_model`."""
    return llama_model(LLAMA3_8B, name=kwargs.pop("name", "Llama-8B"), **kwargs)


def llama3_70b(**kwargs) -> Model:
    """Llama-3-style 70B (80 layers, dim 8192, ffn 28672, vocab 128256, 8 KV heads); see :func:`llama_model`."""
    return llama_model(LLAMA3_70B, name=kwargs.pop("name", "Llama-70B"), **kwargs)


def model_from_measurements(units: dict[str, dict], *, root: str = "<root>", **model_kwargs) -> Model:
    """A :class:`Model` from per-unit measurements.

    Args:
        units: ``{name: {"numel": int, "forward_ms": float, "backward_ms": float, "param_bytes": int,
            "reduce_bytes": int, "state_bytes": int}}`` in forward order (times in **milliseconds**,
            as ``Profile.unit_compute_ms()`` gives them; the byte fields are optional).
        root: the root unit's name (the runtime names it ``"<root>"``).
        **model_kwargs: :class:`Model` fields (``root_forward_before``, ``loss_s``, ...).

    Raises:
        ValueError: no unit named ``root``, or a bad field (named in the message).
    """
    if root not in units:
        raise ValueError(f"model_from_measurements: no root unit named {root!r} among {list(units)}")
    built = {}
    for uname, d in units.items():
        extra = {k: d[k] for k in ("param_bytes", "reduce_bytes", "state_bytes") if k in d}
        built[uname] = Unit(uname, d["numel"], d["forward_ms"] / 1e3, d["backward_ms"] / 1e3, **extra)
    return Model(built[root], tuple(u for n, u in built.items() if n != root), **model_kwargs)
