"""Mixture of experts: the sparse MLP of Mixtral, Qwen2-MoE and Qwen3-MoE.

Each token's router scores every expert; the token runs through its top-k experts (SwiGLU MLPs
whose weights are stacked [experts, in, out]) and sums their outputs weighted by the router's
probabilities. The tokens of a step are sorted by expert, so that each expert multiplies one
contiguous run of rows, and two implementations of that grouped product are chosen per platform
when the step is lowered (`lax.platform_dependent`):

  TPU        `lax.ragged_dot`: XLA:TPU's grouped matmul (a Mosaic kernel), which reads each
             expert's weights once for all of its rows.
  GPU        a Pallas Triton kernel (`pallas_kernels.gpu_grouped_matmul`): one program per tile of
             one expert's rows, loading only that expert's weights. XLA:GPU rewrites `ragged_dot`
             as one dense product over every expert (every expert read and multiplied for every
             row), and that stays the fallback for widths the kernel does not tile.
  CPU        a loop over chunks of rows of one expert each (a `lax.while_loop` whose trip count is
             the step's real number of chunks): XLA:CPU lowers `ragged_dot` to a dense product
             with every expert masked (num_experts times the work, and a [experts, rows, in]
             temporary), whereas the loop multiplies only the rows each expert was given.

Routing follows HF: logits in the activations' dtype, softmax in float32, top-k, optionally
renormalised over the picked experts.

Under tensor parallelism the experts are split whole over the devices when their number divides
(expert parallelism, `shard_experts`: each device sorts the step's tokens, runs those routed to
its own experts, and one all-reduce of [tokens, hidden] sums the devices' outputs), else each
expert's width is split as a dense MLP's and GSPMD partitions the grouped products. Whole experts
keep every device's products full width: Qwen3-30B-A3B's 768-wide experts split 8 ways are 96
columns, less than a TPU lane tile, and XLA:TPU's ragged dot copied such kernels every step.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.models.config import DecoderConfig
from jaxserve.models.layers import Linear, activation, zeros_param
from jaxserve.models.products import ExpertInt8Weight
from pallas_kernels.gpu_grouped_matmul import num_tiles_for, row_experts, supports, tile_table

Array = jax.Array
Weights = Array | ExpertInt8Weight  # an expert projection's stacked kernels [experts, in, out]

# Rows per chunk of the CPU loop, at most: large enough that a chunk's product is a real matmul,
# small enough that an expert's last, partly empty chunk wastes little.
MAX_CHUNK = 64


class ExpertKernels(nnx.Module):
    """One projection of every expert: `kernel` [experts, in, out] (a Linear kernel per expert)."""

    def __init__(self, experts: int, din: int, dout: int, dtype: Any):
        self.kernel = zeros_param(experts, din, dout, dtype=dtype)


class Experts(nnx.Module):
    def __init__(self, experts: int, hidden: int, width: int, dtype: Any):
        self.gate_proj = ExpertKernels(experts, hidden, width, dtype)
        self.up_proj = ExpertKernels(experts, hidden, width, dtype)
        self.down_proj = ExpertKernels(experts, width, hidden, dtype)


def route(logits: Array, top_k: int, normalize: bool) -> tuple[Array, Array]:
    """Router logits [tokens, experts] -> (weights [tokens, k] float32, expert ids [tokens, k])."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids


def _chunk_rows(rows: int, experts: int) -> int:
    """The CPU loop's chunk: about the rows an expert gets when all are used, a power of two."""
    per_expert = max(1, -(-rows // experts))
    return min(MAX_CHUNK, max(4, 1 << (per_expert - 1).bit_length()))


def _grouped_ragged(x: Array, counts: Array, w: Weights) -> Array:
    # bfloat16 (and int8) products are exact at any precision; asking for more
    # (JAX_DEFAULT_MATMUL_PRECISION=highest) makes XLA:TPU's ragged-dot kernel take float32
    # operands, which Mosaic refuses.
    precision = jax.lax.Precision.DEFAULT if x.dtype == jnp.bfloat16 else None
    if isinstance(w, ExpertInt8Weight):
        # XLA:TPU's ragged dot takes the int8 values as they are (a convert before it would write
        # a dequantized copy of every expert each step); each row is then scaled by its expert's.
        y = jax.lax.ragged_dot(x, w.q, counts, precision=precision, preferred_element_type=jnp.float32)
        return (y * w.scale[row_experts(counts, x.shape[0])]).astype(x.dtype)
    return jax.lax.ragged_dot(x, w, counts, precision=precision if w.dtype == x.dtype else None)


def _grouped_loop(x: Array, counts: Array, w: Weights) -> Array:
    """x [rows, in] sorted by expert, counts [experts] -> x's rows times their expert's w [in, out]:
    one chunk of at most `_chunk_rows` rows of one expert per iteration, only as many iterations
    as the step has chunks."""
    rows, experts = x.shape[0], w.shape[0]
    int8 = isinstance(w, ExpertInt8Weight)
    chunk = _chunk_rows(rows, experts)
    # The GPU kernel's tiles, walked in order: (expert, first row, rows) of each chunk.
    expert, first, chunk_rows = tile_table(counts, chunk, num_tiles_for(rows, experts, chunk))
    x = jnp.pad(x, ((0, chunk), (0, 0)))  # a last chunk reads past the rows
    out = jnp.zeros((rows + chunk, w.shape[2]), x.dtype)

    def product(xs: Array, e: Array) -> Array:
        if not int8:
            return jnp.dot(xs, w[e], preferred_element_type=jnp.float32)
        return jnp.dot(xs, w.q[e].astype(xs.dtype), preferred_element_type=jnp.float32) * w.scale[e]

    def body(state: tuple[Array, Array]) -> tuple[Array, Array]:
        c, out = state
        xs = jax.lax.dynamic_slice_in_dim(x, first[c], chunk)
        y = product(xs, expert[c]).astype(out.dtype)
        # Rows past this expert's belong to the next one: keep what is (or will be) there.
        mine = (jnp.arange(chunk) < chunk_rows[c])[:, None]
        y = jnp.where(mine, y, jax.lax.dynamic_slice_in_dim(out, first[c], chunk))
        return c + 1, jax.lax.dynamic_update_slice_in_dim(out, y, first[c], 0)

    # Every chunk with rows comes before the empty ones: as many iterations as the step has chunks.
    used = jnp.sum(chunk_rows > 0)
    _, out = jax.lax.while_loop(lambda s: s[0] < used, body, (jnp.int32(0), out))
    return out[:rows]


def _grouped_triton(x: Array, counts: Array, w: Weights) -> Array:
    from pallas_kernels.gpu_grouped_matmul import grouped_matmul_gpu

    if isinstance(w, ExpertInt8Weight):
        return grouped_matmul_gpu(x, counts, w.q, scale=w.scale)
    return grouped_matmul_gpu(x, counts, w)


def grouped_matmul(x: Array, counts: Array, w: Weights) -> Array:
    """x [rows, in], its rows sorted by expert with counts [experts] rows each -> [rows, out], each
    row times its expert's kernel (w [experts, in, out]); rows past the last expert's are
    unspecified. The implementation is the platform's: the loop on the CPU, the Pallas Triton
    kernel on CUDA GPUs (where both widths are whole blocks of 16), XLA's ragged dot elsewhere."""
    cuda = _grouped_triton if supports(w.shape[1], w.shape[2]) else _grouped_ragged
    return jax.lax.platform_dependent(x, counts, w, cpu=_grouped_loop, cuda=cuda, default=_grouped_ragged)


def _swiglu_experts(x: Array, weights: Array, ids: Array, gate: Weights, up: Weights, down: Weights,
                    act: Callable[[Array], Array], first: Array | int = 0) -> Array:
    """The weighted sum [tokens, hidden] float32 of what experts first .. first + len(gate) - 1
    (kernels gate, up [n, hidden, width], down [n, width, hidden]) give x's tokens routed to them
    (top-k weights and ids [tokens, k]); tokens' other experts add nothing."""
    tokens, k = ids.shape
    num_experts = gate.shape[0]
    flat = ids.reshape(-1) - first  # [tokens * k] expert of each token-slot, local
    mine = (flat >= 0) & (flat < num_experts)
    flat = jnp.where(mine, flat, num_experts)  # another device's: sorted last, never multiplied
    order = jnp.argsort(flat, stable=True)  # token-slots sorted by expert
    counts = jnp.bincount(flat, length=num_experts + 1)[:num_experts].astype(jnp.int32)
    xs = x[order // k]
    ys = grouped_matmul(act(grouped_matmul(xs, counts, gate)) * grouped_matmul(xs, counts, up), counts, down)
    # Rows past the last expert's belong to other devices' experts (a grouped product leaves
    # them unspecified): they weigh nothing here.
    w = jnp.where(jnp.arange(tokens * k) < jnp.sum(counts), weights.reshape(-1)[order], 0.0)
    ys = jnp.where(w[:, None] != 0, ys.astype(jnp.float32) * w[:, None], 0.0)
    out = jnp.zeros((tokens * k, x.shape[-1]), jnp.float32).at[order].set(ys)
    return out.reshape(tokens, k, -1).sum(axis=1)


def run_experts(x: Array, weights: Array, ids: Array, experts: Experts, act: Callable[[Array], Array],
                mesh: Any = None) -> Array:
    """x [tokens, hidden], its top-k (weights, ids) [tokens, k] -> the weighted sum of its experts'
    SwiGLU outputs [tokens, hidden] in x's dtype. mesh: the experts are split over its model axis
    (expert parallelism: each device holds whole experts): each device runs the tokens routed to
    its own and one all-reduce sums the devices' outputs (the same as tensor parallelism's)."""
    kernels = tuple(p.kernel.get_value() for p in (experts.gate_proj, experts.up_proj, experts.down_proj))
    if mesh is None or mesh.size == 1:
        return _swiglu_experts(x, weights, ids, *kernels, act).astype(x.dtype)
    from jax.sharding import PartitionSpec as P

    from jaxserve.parallel.mesh import MODEL_AXIS

    def local(x: Array, weights: Array, ids: Array, gate: Weights, up: Weights, down: Weights) -> Array:
        first = jax.lax.axis_index(MODEL_AXIS) * gate.shape[0]
        return jax.lax.psum(_swiglu_experts(x, weights, ids, gate, up, down, act, first), MODEL_AXIS)

    split = P(MODEL_AXIS)
    out = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(), split, split, split), out_specs=P(),
                        check_vma=False)(x, weights, ids, *kernels)
    return out.astype(x.dtype)


def shard_experts(model: Any, mesh: Any) -> None:
    """Run `model`'s sparse layers expert-parallel over `mesh` (its experts are split over the
    model axis: jaxserve.parallel.rules); a static setting, so set before the steps are built."""
    for layer in model.layers:
        if isinstance(layer.mlp, SparseMoe):
            layer.mlp.expert_mesh = mesh


class SparseMoe(nnx.Module):
    """The sparse MLP: router (`gate`), experts, and Qwen2-MoE's gated shared expert. Parameter
    names are HF's (mlp.gate, mlp.experts.*, mlp.shared_expert, mlp.shared_expert_gate)."""

    def __init__(self, cfg: DecoderConfig, dtype: Any, shared: nnx.Module | None = None):
        moe = cfg.moe  # a sparse layer's config has one (DecoderConfig.is_sparse)
        self.gate = Linear(cfg.hidden_size, moe.num_experts, False, dtype)
        self.experts = Experts(moe.num_experts, cfg.hidden_size, moe.intermediate_size, dtype)
        self.shared_expert = shared
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, False, dtype) if shared is not None else None
        self.top_k, self.normalize, self.act_name = moe.top_k, moe.norm_topk_prob, cfg.hidden_act
        # Expert parallelism's mesh (`shard_experts`); None: one device, or the experts' width
        # split by tensor parallelism (GSPMD partitions the grouped products itself).
        self.expert_mesh = None

    def __call__(self, x: Array, lora_mask: Array | None = None) -> Array:
        """x [..., hidden]. lora_mask is unused: LoRA adapters are refused for mixtures of
        experts (jaxserve.models.lora.target_shapes)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = route(self.gate(x), self.top_k, self.normalize)
        out = run_experts(x, weights, ids, self.experts, activation(self.act_name), self.expert_mesh)
        if self.shared_expert is not None:
            out = out + jax.nn.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.reshape(shape)
