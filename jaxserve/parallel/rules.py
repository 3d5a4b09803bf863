"""Logical axis rules: which parameter dimensions are split over the mesh's "model" axis.

Megatron-style tensor parallelism expressed as shardings only: q/k/v projections split their
output (head) columns and o_proj its input rows, gate/up split the MLP hidden columns and down_proj
its rows, and the embedding / LM head split the vocabulary. GSPMD then inserts the all-reduces
after o_proj and down_proj (and the gathers around the vocab split) by itself. Norms, biases of the
replicated hidden dimension and the rotary tables stay replicated: they are tiny.

A logical axis is only split when its size divides evenly by the mesh size (whole heads per
device); otherwise that axis is replicated, which costs memory but never correctness. The KV cache
[layers, kv_heads, pages, page_size, head_dim] follows the kv_heads rule.
"""

from __future__ import annotations

import logging
from typing import Callable

from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.models.config import DecoderConfig
from jaxserve.parallel.mesh import MODEL_AXIS

log = logging.getLogger("jaxserve.parallel")

# (parameter path, shape) -> sharding: the loader's callback type
ParamSharding = Callable[[tuple[str | int, ...], tuple[int, ...]], NamedSharding]

# Parameter path (below "layers", i) -> logical name of each dimension.
# Anything not listed (norm weights, q/k norms) is replicated.
LOGICAL_AXES: dict[tuple[str, ...], tuple[str | None, ...]] = {
    ("embed_tokens",): ("vocab", None),
    ("lm_head",): ("vocab", None),
    ("self_attn", "q_proj", "kernel"): (None, "heads"),
    ("self_attn", "q_proj", "bias"): ("heads",),
    ("self_attn", "k_proj", "kernel"): (None, "kv_heads"),
    ("self_attn", "k_proj", "bias"): ("kv_heads",),
    ("self_attn", "v_proj", "kernel"): (None, "kv_heads"),
    ("self_attn", "v_proj", "bias"): ("kv_heads",),
    ("self_attn", "o_proj", "kernel"): ("heads", None),
    ("mlp", "gate_proj", "kernel"): (None, "mlp"),
    ("mlp", "gate_proj", "bias"): ("mlp",),
    ("mlp", "up_proj", "kernel"): (None, "mlp"),
    ("mlp", "up_proj", "bias"): ("mlp",),
    ("mlp", "down_proj", "kernel"): ("mlp", None),
    # A mixture of experts splits its experts over the devices (expert parallelism: whole experts
    # per device, jaxserve.models.moe.shard_experts) when their number divides evenly; otherwise
    # every expert's width, as a dense MLP's. The router stays whole. Qwen2-MoE's shared expert
    # splits as a dense MLP.
    ("mlp", "experts", "gate_proj", "kernel"): ("experts", None, "expert_mlp"),
    ("mlp", "experts", "up_proj", "kernel"): ("experts", None, "expert_mlp"),
    ("mlp", "experts", "down_proj", "kernel"): ("experts", "expert_mlp", None),
    ("mlp", "shared_expert", "gate_proj", "kernel"): (None, "shared_mlp"),
    ("mlp", "shared_expert", "up_proj", "kernel"): (None, "shared_mlp"),
    ("mlp", "shared_expert", "down_proj", "kernel"): ("shared_mlp", None),
    # LoRA factors (jaxserve.models.lora) split with their projection: b [S * r, out] by the output
    # columns of the column-parallel projections, a [in, S * r] by the input rows of the row-parallel
    # ones; the other factor is small and replicated.
    ("self_attn", "q_proj", "lora_b"): (None, "heads"),
    ("self_attn", "k_proj", "lora_b"): (None, "kv_heads"),
    ("self_attn", "v_proj", "lora_b"): (None, "kv_heads"),
    ("self_attn", "o_proj", "lora_a"): ("heads", None),
    ("mlp", "gate_proj", "lora_b"): (None, "mlp"),
    ("mlp", "up_proj", "lora_b"): (None, "mlp"),
    ("mlp", "down_proj", "lora_a"): ("mlp", None),
}


class ShardingPlan:
    """The shardings of one model on one mesh: parameters by path, the KV cache, and the rest."""

    def __init__(self, mesh: Mesh, cfg: DecoderConfig):
        self.mesh = mesh
        n = mesh.shape[MODEL_AXIS]
        sizes = {"heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads, "mlp": cfg.intermediate_size,
                 "vocab": cfg.vocab_size}
        if cfg.moe is not None:
            sizes["experts"] = cfg.moe.num_experts
            sizes["expert_mlp"] = cfg.moe.intermediate_size
            sizes["shared_mlp"] = cfg.moe.shared_intermediate_size
        # logical axis -> mesh axis (None: replicated because it does not split evenly)
        self.rules: dict[str, str | None] = {name: MODEL_AXIS if size % n == 0 else None
                                             for name, size in sizes.items()}
        if self.rules.get("experts") and n > 1:
            # Whole experts per device rather than a slice of each: every device's grouped products
            # are full width (a 768-wide Qwen3-MoE expert split 8 ways is 96 columns, not a whole
            # TPU lane tile of 128, which XLA:TPU's ragged dot copies every step to pad).
            self.rules["expert_mlp"] = None
        elif "experts" in self.rules:
            self.rules["experts"] = None
        self._sizes = sizes

    @property
    def size(self) -> int:
        return self.mesh.shape[MODEL_AXIS]

    def spec(self, path: tuple[str | int, ...]) -> PartitionSpec:
        """PartitionSpec of the parameter at `path` (as the loader names it: ("layers", i, ...) for
        a layer's parameters)."""
        logical = LOGICAL_AXES.get(tuple(path[2:]) if path[0] == "layers" else tuple(path))
        if logical is None:
            return PartitionSpec()
        return PartitionSpec(*(self.rules[name] if name else None for name in logical))

    def param_sharding(self, path: tuple[str | int, ...], shape: tuple[int, ...]) -> NamedSharding:
        """The loader's sharding callback: each device's shard is read straight from the checkpoint."""
        return NamedSharding(self.mesh, self.spec(path))

    def kv_cache(self) -> NamedSharding:
        """[layers, kv_heads, pages, page_size, head_dim]: one group of kv heads per device, so the
        attention of a head group reads only local pages; replicated when kv heads do not divide."""
        return NamedSharding(self.mesh, PartitionSpec(None, self.rules["kv_heads"]))

    @property
    def kv_shards(self) -> int:
        """How many ways the KV cache is split: each device holds 1/kv_shards of every page."""
        return self.size if self.rules["kv_heads"] else 1

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def logits(self) -> NamedSharding:
        """[rows, vocab] logits as the LM head leaves them: split over the vocabulary when the head
        is. Nothing gathers them, so the sampler runs on the shards (its reductions across them)."""
        return NamedSharding(self.mesh, PartitionSpec(None, self.rules["vocab"]))

    def describe(self) -> list[str]:
        """Start-up log lines: what is split, and what is replicated and why."""
        n = self.size
        if n == 1:
            return [f"one device ({self.mesh.devices.flat[0]}), on a mesh of size 1: the same sharded step as "
                    "tensor parallelism, with every axis whole"]
        lines = [f"tensor parallel over {n} devices ({', '.join(str(d) for d in self.mesh.devices.flat)})"]
        for name, what in (("heads", "attention q/o projections"), ("kv_heads", "k/v projections and KV cache"),
                           ("mlp", "MLP gate/up/down"), ("experts", "experts (expert parallel)"),
                           ("expert_mlp", "every expert's gate/up/down"),
                           ("shared_mlp", "shared expert's gate/up/down"), ("vocab", "embedding and LM head")):
            size = self._sizes.get(name)
            # Experts split either whole (expert parallel) or by their width: one line says which.
            unused = "expert_mlp" if self.rules.get("experts") else "experts"
            if not size or name == unused:
                continue
            if self.rules[name]:
                lines.append(f"{what}: {name} {size} split {size // n} per device")
            else:
                lines.append(f"{what}: REPLICATED on every device ({name} {size} is not divisible by {n})")
        return lines

    def log(self) -> None:
        for line in self.describe():
            log.info("%s", line)


def param_sharding_for(mesh: Mesh) -> Callable[[DecoderConfig], ParamSharding]:
    """The loader's `sharding_for`: the rules depend on the head counts, which the loader reads from
    the checkpoint; logs what is split and what is replicated once they are known."""

    def sharding_for(cfg: DecoderConfig) -> ParamSharding:
        plan = ShardingPlan(mesh, cfg)
        plan.log()
        return plan.param_sharding

    return sharding_for
