"""An orbax checkpoint cache of converted parameters.

Converting a checkpoint (dequantizing GGUF blocks, transposing, casting) costs
seconds to minutes; restoring the converted arrays from an orbax checkpoint is a straight read
into each device's shard. The cache key is the source's fingerprint plus the dtype, so a changed
file or another dtype never restores stale weights.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

log = logging.getLogger("jaxserve.weights")

# Bump when the parameter layout or the cached config changes, so old caches are ignored rather
# than misread. 2: GGUF configs record the stored (e.g. quantized) dtype, which --dtype auto reads.
# 3: one buffer per layer (layers.0.mlp..., no stacked [num_layers, ...] axis).
LAYOUT_VERSION = 3


def entry_dir(cache_dir: Path, fingerprint: str) -> Path:
    """One directory per source checkpoint: its HF config plus one orbax checkpoint per dtype."""
    return Path(cache_dir).expanduser().resolve() / "weights" / f"v{LAYOUT_VERSION}-{fingerprint}"


def read_config(entry: Path) -> dict | None:
    try:
        return json.loads((entry / "config.json").read_text())
    except (OSError, ValueError):
        return None


def exists(path: Path) -> bool:
    # orbax writes into a temporary directory and renames on success, so a directory that exists
    # under the final name is complete.
    return (path / "state").is_dir()


def save(path: Path, tree: dict, hf_config: dict) -> None:
    """Write the converted parameters under `path` (<entry>/<dtype>) and the config beside them."""
    import orbax.checkpoint as ocp

    try:
        path.mkdir(parents=True, exist_ok=True)
        (path.parent / "config.json").write_text(json.dumps(hf_config))
        with ocp.StandardCheckpointer() as ckpt:
            ckpt.save(path / "state", tree)
            ckpt.wait_until_finished()
        log.info("wrote the orbax weight cache %s", path)
    except Exception as e:  # a cache that cannot be written must not stop serving
        log.warning("could not write the orbax weight cache %s: %s", path, e)
        shutil.rmtree(path, ignore_errors=True)


def restore(path: Path, abstract_tree: dict) -> Any:
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckpt:
        return ckpt.restore(path / "state", abstract_tree)
