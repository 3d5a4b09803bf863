"""Random weights of a checkpoint's shapes (`--load-format dummy`), made on the device in their shards.

For benchmarks and capacity planning: a Llama-3-70B-shaped server can be timed from its
config.json and a tokenizer, with no 140 GB download. Every leaf is drawn by its own jitted
function whose output sharding is the leaf's serving sharding, so under tensor parallelism each
device only ever holds its own shard (the same rule as loading real weights). Values are chosen
to keep activations finite through any depth: matrices N(0, 0.02^2), norm scales 1, biases 0.
The draw is deterministic in `seed`, so two runs of a benchmark serve the same model.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from tqdm import tqdm

from jaxserve.models.config import DecoderConfig
from jaxserve.models.decoder import Decoder
from jaxserve.weights.tree import ShardingFn, abstract, leaf_paths, merge, path_name, set_leaf

INIT_STD = 0.02


def init_kind(path: tuple[str | int, ...]) -> str:
    """How a parameter is initialised: 'ones' (norm scales), 'zeros' (biases) or 'normal'."""
    if any("norm" in str(part) for part in path):
        return "ones"
    if path[-1] == "bias":
        return "zeros"
    return "normal"


@functools.lru_cache(maxsize=None)
def _drawer(kind: str, shape: tuple[int, ...], dtype: Any, sharding: jax.sharding.Sharding):
    def draw(key: jax.Array) -> jax.Array:
        if kind == "ones":
            return jnp.ones(shape, dtype)
        if kind == "zeros":
            return jnp.zeros(shape, dtype)
        # Drawn in the target dtype: a float32 draw of a stacked 70B MLP would need twice the memory.
        return (jax.random.normal(key, shape, dtype) * INIT_STD).astype(dtype)

    return jax.jit(draw, out_shardings=sharding)


def build_random(cfg: DecoderConfig, dtype: Any, sharding: ShardingFn, seed: int = 0) -> Decoder:
    """A Decoder of `cfg`'s shapes with random weights, each leaf placed with `sharding(path, shape)`."""
    graphdef, state, tree = abstract(lambda: Decoder(cfg, dtype))
    leaves = leaf_paths(tree)
    key = jax.random.key(seed)
    nbytes = sum(math.prod(s.shape) * jnp.dtype(dtype).itemsize for _, s in leaves)
    with tqdm(total=nbytes, unit="B", unit_scale=True, desc="random weights", leave=False, disable=None) as bar:
        for i, (path, spec) in enumerate(leaves):
            shape = tuple(spec.shape)
            draw = _drawer(init_kind(path), shape, jnp.dtype(dtype), sharding(path, shape))
            arr = draw(jax.random.fold_in(key, i))
            set_leaf(tree, path, arr)
            bar.update(arr.nbytes)
            bar.set_postfix_str(path_name(path))
    return merge(graphdef, state, tree)
