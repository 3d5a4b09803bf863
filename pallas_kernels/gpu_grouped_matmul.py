"""Grouped matmul for a mixture of experts on GPUs (Pallas Triton), with its reference and
validator: rows sorted by expert, each multiplied by its own expert's kernel.

    x [rows, K] sorted by expert, counts [experts], w [experts, K, N] -> out [rows, N]

Why a kernel: XLA:GPU rewrites `lax.ragged_dot` as one dense product over every expert (compiled
for an H100: Qwen3-30B-A3B's 128 experts as a [rows, 8, 16 x 2048] x [8, 16 x 2048, 768] dot),
reading and multiplying every expert's weights for every row. Here each program owns one tile of
`block_rows` rows of one expert and `block_n` output columns, and loads only that expert's
weights: a decode step reads the experts its tokens were routed to, a prefill step each expert
once per tile of its rows.

The tiles are laid out on the host side of the kernel (`tile_table`, plain jnp on the device):
every expert's rows in tiles of `block_rows`, the last one partial; the grid has a static upper
bound of tiles (rows / block_rows + experts), and the tiles past the step's real ones do nothing.
Rows of a tile past its expert's are masked out of the loads and the stores, so tiles never
write each other's rows; rows past the last expert's are left unwritten (the caller weighs them
by zero).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels._common import dot_precision

# Pallas is imported by the kernel only: the model's CPU loop imports this module for its tile table.

MIN_DOT = 16  # Triton's tl.dot needs every dimension >= 16
MAX_BLOCK_ROWS = 64


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def block_rows_for(rows: int, experts: int) -> int:
    """Rows per tile: about the rows an expert gets when every expert is used, 16 to 64."""
    return min(MAX_BLOCK_ROWS, max(MIN_DOT, _next_pow2(-(-rows // experts))))


def _block(size: int, largest: int) -> int:
    """The largest power of two <= `largest` (and >= 16) that divides `size`; 0 if none does."""
    block = largest
    while block >= MIN_DOT:
        if size % block == 0:
            return block
        block //= 2
    return 0


def supports(k: int, n: int) -> bool:
    """Whether the kernel takes weights [experts, k, n]: both whole blocks of 16 or more."""
    return bool(_block(k, 64) and _block(n, 128))


def validate_inputs(x: jax.Array, counts: jax.Array, w: jax.Array, scale: jax.Array | None = None) -> None:
    """Shapes and dtypes the kernel needs; raises ValueError naming the one that is off."""
    if (w.dtype == jnp.int8) != (scale is not None):
        raise ValueError(f"int8 weights need their scales and only they take scales; got w {w.dtype}, "
                         f"scale {None if scale is None else scale.shape}")
    if scale is not None and scale.shape != (w.shape[0], w.shape[2]):
        raise ValueError(f"scale {scale.shape} must be [experts, N] = {(w.shape[0], w.shape[2])}")
    if x.ndim != 2 or w.ndim != 3 or counts.ndim != 1:
        raise ValueError(f"x [rows, K], counts [experts], w [experts, K, N]; got {x.shape}, {counts.shape}, {w.shape}")
    if x.shape[1] != w.shape[1] or counts.shape[0] != w.shape[0]:
        raise ValueError(f"x {x.shape}, counts {counts.shape} and w {w.shape} disagree on K or the experts")
    if not jnp.issubdtype(counts.dtype, jnp.integer):
        raise ValueError(f"counts must be integers, got {counts.dtype}")
    if not supports(w.shape[1], w.shape[2]):
        raise ValueError(f"w {w.shape}: K and N must each be a multiple of 16 (Triton's smallest dot)")


def grouped_matmul_reference(x: jax.Array, counts: jax.Array, w: jax.Array, scale: jax.Array | None = None
                             ) -> jax.Array:
    """Each row times its expert's kernel, gathered per row (float32 accumulation; int8 weights
    times their scales [experts, N]); rows past the last expert's are zero."""
    rows = x.shape[0]
    ends = jnp.cumsum(counts)
    expert = row_experts(counts, rows)
    out = jnp.einsum("rk,rkn->rn", x, w[expert].astype(x.dtype), preferred_element_type=jnp.float32,
                     precision=dot_precision(x.dtype))
    if scale is not None:
        out = out * scale[expert]
    return jnp.where((jnp.arange(rows) < ends[-1])[:, None], out, 0).astype(x.dtype)


def row_experts(counts: jax.Array, rows: int) -> jax.Array:
    """The expert [rows] of each row sorted by expert (rows past the last expert's: the last)."""
    return jnp.minimum(jnp.searchsorted(jnp.cumsum(counts), jnp.arange(rows), side="right"), counts.shape[0] - 1)


def num_tiles_for(rows: int, experts: int, block_rows: int) -> int:
    """The static bound on a step's tiles: every row in full tiles, plus a partial one per expert."""
    return -(-rows // block_rows) + min(experts, rows)


def tile_table(counts: jax.Array, block_rows: int, num_tiles: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(expert, first row, rows) [num_tiles] int32 of every tile: each expert's rows in tiles of
    `block_rows` in expert order, then empty tiles (0 rows) up to `num_tiles`."""
    counts = counts.astype(jnp.int32)
    starts = jnp.cumsum(counts) - counts
    tiles = (counts + block_rows - 1) // block_rows
    tile_end = jnp.cumsum(tiles)
    t = jnp.arange(num_tiles, dtype=jnp.int32)
    expert = jnp.minimum(jnp.searchsorted(tile_end, t, side="right"), counts.shape[0] - 1).astype(jnp.int32)
    local = t - (tile_end[expert] - tiles[expert])
    first = starts[expert] + local * block_rows
    rows = jnp.where(t < tile_end[-1], jnp.clip(counts[expert] - local * block_rows, 0, block_rows), 0)
    return expert, first.astype(jnp.int32), rows.astype(jnp.int32)


def _kernel(
    expert_ref,  # [1] int32: this tile's expert
    first_ref,  # [1] int32: its first row
    rows_ref,  # [1] int32: its rows (0: an empty tile past the step's)
    x_ref,  # [rows, K]: every row (the program loads its tile's)
    w_ref,  # [experts, K, block_n]: this column block of every expert (it loads its expert's)
    *refs,  # (scale_ref [experts, block_n] float32 of int8 weights,) o_ref [rows, block_n]: this
    # column block of every row (it stores its tile's)
    block_rows: int,
    block_k: int,
    precision: jax.lax.Precision,
):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    scale_ref, o_ref = refs if len(refs) == 2 else (None, refs[0])
    e, first, rows = expert_ref[0], first_ref[0], rows_ref[0]

    @pl.when(rows > 0)
    def _():
        mine = (jnp.arange(block_rows) < rows)[:, None]
        acc = jnp.zeros((block_rows, o_ref.shape[1]), jnp.float32)

        def body(i, acc):
            xs = plt.load(x_ref.at[pl.ds(first, block_rows), pl.ds(i * block_k, block_k)], mask=mine, other=0)
            # int8 weights are widened after the load: memory moves one byte per weight.
            ws = w_ref[e, pl.ds(i * block_k, block_k), :].astype(xs.dtype)
            return acc + jnp.dot(xs, ws, precision=precision, preferred_element_type=jnp.float32)

        acc = jax.lax.fori_loop(0, x_ref.shape[1] // block_k, body, acc)
        if scale_ref is not None:
            acc = acc * scale_ref[e, :][None, :]
        plt.store(o_ref.at[pl.ds(first, block_rows), :], acc.astype(o_ref.dtype), mask=mine)


def grouped_matmul_gpu(x: jax.Array, counts: jax.Array, w: jax.Array, scale: jax.Array | None = None, *,
                       block_rows: int | None = None, num_warps: int = 4, num_stages: int = 2,
                       interpret: bool | None = None) -> jax.Array:
    """The kernel, with the reference's signature and result on the rows of every expert (rows
    past the last expert's are unspecified). scale: int8 weights' float32 scales [experts, N]
    (w ~= w_int8 * scale per expert and column)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pl_triton

    from pallas_kernels.gpu_paged_attention import default_interpret

    validate_inputs(x, counts, w, scale)
    rows, k = x.shape
    experts, _, n = w.shape
    block_rows = block_rows or block_rows_for(rows, experts)
    block_k, block_n = _block(k, 64), _block(n, 128)
    num_tiles = num_tiles_for(rows, experts, block_rows)
    expert, first, tile_rows = tile_table(counts, block_rows, num_tiles)
    scalar = pl.BlockSpec((1,), lambda t, j: (t,))
    scales = [] if scale is None else [pl.BlockSpec((experts, block_n), lambda t, j: (0, j))]
    return pl.pallas_call(
        functools.partial(_kernel, block_k=block_k, block_rows=block_rows, precision=dot_precision(x.dtype)),
        grid=(num_tiles, n // block_n),
        in_specs=[scalar, scalar, scalar,
                  pl.BlockSpec((rows, k), lambda t, j: (0, 0)),
                  pl.BlockSpec((experts, k, block_n), lambda t, j: (0, 0, j)), *scales],
        out_specs=pl.BlockSpec((rows, block_n), lambda t, j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((rows, n), x.dtype),
        compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=default_interpret() if interpret is None else interpret,
        name="jaxserve_grouped_matmul",
    )(expert, first, tile_rows, x, w, *([] if scale is None else [scale.astype(jnp.float32)]))
