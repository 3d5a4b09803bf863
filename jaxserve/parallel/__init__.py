"""Tensor parallelism on one host: a device mesh with a "model" axis (`mesh`) and the logical-axis
rules that give every parameter and the KV cache its `NamedSharding` on it (`rules`)."""

from jaxserve.parallel.mesh import MODEL_AXIS, make_mesh, mesh_of
from jaxserve.parallel.rules import ShardingPlan, param_sharding_for

__all__ = ["MODEL_AXIS", "ShardingPlan", "make_mesh", "mesh_of", "param_sharding_for"]
