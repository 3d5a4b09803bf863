"""Multi-host serving: one process per host under `jax.distributed`, one mesh over every device.

Process 0 runs the HTTP server and the scheduler. Every other process loads its shards of the
same model, compiles the same command shapes in the same order, and then only follows: for each
command process 0 runs (a device-batch update or a step, jaxserve.engine.step_inputs), it receives
the command's key and payload and runs the same compiled program on its devices (a
multi-controller SPMD program must be entered by every process, in the same order). The sampled
tokens are replicated over the mesh, so process 0 reads them from its own devices.

The control channel is JAX's own: a broadcast over the device mesh
(`multihost_utils.broadcast_one_to_all`), not an RPC layer. Each command sends two fixed-size
int32 arrays: a header (STEP, the key's index), then the payload packed into one buffer whose size
is fixed by the key, so every broadcast program is compiled once, at start-up, with the steps.
Payloads are the engine's diffs (new rows, new pages, grammar masks, the step's tokens and
positions), bounded by the bucket, never by max_model_len.

The coordinator (`--coordinator-address`) is JAX's coordination service: it trusts every
peer that reaches it, so it belongs on a private network. Given an address, it binds to that
address only (or to `--coordinator-bind-address`), never to all interfaces. When JAX auto-detects
the job (TPU pods, GKE), it picks the address itself and binds as JAX does by default (all
interfaces) unless `--coordinator-bind-address` says where.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import jax
import numpy as np

from jaxserve.config import DistributedConfig

log = logging.getLogger("jaxserve.parallel")

STEP, STOP = 1, 2  # header commands


def initialize_kwargs(cfg: DistributedConfig) -> dict[str, Any]:
    """The keyword arguments of `jax.distributed.initialize` for `cfg` (absent: auto-detected)."""
    kwargs: dict[str, Any] = dict(initialization_timeout=cfg.initialization_timeout)
    if cfg.coordinator_address is not None:
        kwargs["coordinator_address"] = cfg.coordinator_address
    # JAX's default binds the coordinator to every interface; bind only where configured.
    bind = cfg.coordinator_bind_address or cfg.coordinator_address
    if bind is not None:
        kwargs["coordinator_bind_address"] = bind
    if cfg.num_processes is not None:
        kwargs["num_processes"] = cfg.num_processes
    if cfg.process_id is not None:
        kwargs["process_id"] = cfg.process_id
    return kwargs


def initialize(cfg: DistributedConfig) -> None:
    """Join the job: `jax.distributed.initialize` with the configured (or auto-detected) values."""
    if not cfg.enabled:
        return
    kwargs = initialize_kwargs(cfg)
    # Collectives between CPU processes (tests, CPU clusters) need a cross-process backend; the
    # setting only concerns the CPU backend, so it is harmless on GPU and TPU hosts.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**kwargs)
    log.info("jax.distributed: process %d of %d, %d local / %d global devices", jax.process_index(),
             jax.process_count(), jax.local_device_count(), jax.device_count())


def is_leader() -> bool:
    return jax.process_index() == 0


def smallest_over_processes(value: int) -> int:
    """The smallest of every process's `value` (itself in a single process): what all can afford."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    return int(np.min(multihost_utils.process_allgather(np.array([value], np.int64))))


@dataclasses.dataclass(frozen=True)
class _Leaf:
    shape: tuple[int, ...]
    dtype: np.dtype
    offset: int  # bytes into the payload
    nbytes: int


class _Layout:
    """Where each array of a command's payload sits in that command's int32 buffer."""

    def __init__(self, spec: dict[str, tuple[tuple[int, ...], Any]]):
        abstract = {name: jax.ShapeDtypeStruct(shape, dtype) for name, (shape, dtype) in spec.items()}
        leaves, self.treedef = jax.tree_util.tree_flatten(abstract)
        self.leaves: list[_Leaf] = []
        offset = 0
        for leaf in leaves:
            dtype = np.dtype(leaf.dtype)
            nbytes = int(np.prod(leaf.shape, dtype=np.int64)) * dtype.itemsize
            self.leaves.append(_Leaf(tuple(leaf.shape), dtype, offset, nbytes))
            offset += -(-nbytes // 4) * 4  # every leaf starts on a 4-byte boundary
        self.words = max(1, offset // 4)

    def pack(self, tree: Any) -> np.ndarray:
        buf = np.zeros(self.words, np.int32)
        raw = buf.view(np.uint8)
        leaves = jax.tree_util.tree_leaves(tree)
        if len(leaves) != len(self.leaves):
            raise ValueError(f"step inputs have {len(leaves)} leaves, the layout {len(self.leaves)}")
        for spec, leaf in zip(self.leaves, leaves):
            arr = np.asarray(leaf, spec.dtype)
            if arr.shape != spec.shape:
                raise ValueError(f"payload array of shape {arr.shape} where the command has {spec.shape}")
            raw[spec.offset : spec.offset + spec.nbytes] = np.frombuffer(arr.tobytes(), np.uint8)
        return buf

    def unpack(self, buf: np.ndarray) -> Any:
        raw = np.ascontiguousarray(buf, np.int32).view(np.uint8)
        leaves = [raw[s.offset : s.offset + s.nbytes].view(s.dtype).reshape(s.shape).copy() for s in self.leaves]
        return jax.tree_util.tree_unflatten(self.treedef, leaves)


class StepChannel:
    """Process 0 -> every process: each command's (key, payload), or the order to stop.

    Built identically on every process from the same key list, so key i means the same shape
    everywhere. `warm_up()` runs one broadcast of every size the channel will use (all processes
    together), so serving compiles nothing new.
    """

    def __init__(self, keys: list[Any], abstract: Callable[[Any], dict[str, tuple[tuple[int, ...], Any]]]):
        self.keys = list(keys)
        self._index = {k: i for i, k in enumerate(self.keys)}
        self._layouts = [_Layout(abstract(k)) for k in self.keys]

    @staticmethod
    def _broadcast(buf: np.ndarray) -> np.ndarray:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.broadcast_one_to_all(buf, is_source=is_leader()))

    def warm_up(self) -> None:
        self._broadcast(np.zeros(4, np.int32))
        for words in sorted({layout.words for layout in self._layouts}):
            self._broadcast(np.zeros(words, np.int32))

    # ---- process 0 ----
    def send(self, key: Any, payload: Any) -> None:
        i = self._index[key]
        self._broadcast(np.array([STEP, i, 0, 0], np.int32))
        self._broadcast(self._layouts[i].pack(payload))

    def stop(self) -> None:
        self._broadcast(np.array([STOP, 0, 0, 0], np.int32))

    # ---- every other process ----
    def receive(self) -> tuple[Any, Any] | None:
        """The next command's (key, payload), or None when process 0 stops."""
        header = self._broadcast(np.zeros(4, np.int32))
        if int(header[0]) == STOP:
            return None
        if int(header[0]) != STEP:
            raise RuntimeError(f"unknown control command {int(header[0])} from process 0")
        i = int(header[1])
        layout = self._layouts[i]
        return self.keys[i], layout.unpack(self._broadcast(np.zeros(layout.words, np.int32)))


def follow(channel: StepChannel, run: Callable[[Any, Any], Any]) -> int:
    """A follower's whole serving life: run every command process 0 sends, until it says stop.
    Returns the number of commands run."""
    commands = 0
    while (received := channel.receive()) is not None:
        key, payload = received
        run(key, payload)
        commands += 1
    log.info("process %d: process 0 stopped after %d commands; exiting", jax.process_index(), commands)
    return commands


def to_host(tree: Any) -> Any:
    """Numpy copies of a step's (replicated) outputs, read from this process's own devices: an
    array that spans other hosts' devices cannot be fetched whole, but any replica is the value."""

    def one(a: Any) -> np.ndarray:
        if isinstance(a, jax.Array) and not a.is_fully_addressable:
            return np.asarray(a.addressable_data(0))
        return np.asarray(a)

    return jax.tree_util.tree_map(one, tree)
