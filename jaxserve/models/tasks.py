"""--task: what a checkpoint is served as (generate, classify or embed), and which checkpoints can."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jaxserve.models.classifier import CLASSIFIER_ARCHITECTURES, architectures, classifier_architecture
from jaxserve.models.config import SUPPORTED_ARCHITECTURES, UnsupportedModelError
from jaxserve.models.embedder import is_embedding_checkpoint

TASKS = ("auto", "generate", "classify", "embed")


def resolve_task(requested: str, cfg: dict[str, Any], directory: Path) -> str:
    """auto picks classify for a classifier checkpoint, embed for a bare encoder or decoder body or
    a sentence-transformers directory (its modules.json), generate for a causal LM; an explicit
    task the checkpoint cannot do is refused with the reason. Any causal LM can also be served
    with --task embed (last-token pooling)."""
    if requested not in TASKS:
        raise UnsupportedModelError(f"--task {requested!r} is not one of {', '.join(TASKS)}")
    archs = architectures(cfg)
    classifier = classifier_architecture(cfg)
    generator = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    embedding = is_embedding_checkpoint(cfg, directory)
    if requested == "classify" and classifier is None:
        raise UnsupportedModelError(
            f"--task classify: architecture {archs or '(none given)'} has no classification head; classification "
            f"needs one of {', '.join(CLASSIFIER_ARCHITECTURES)}")
    if requested == "embed" and classifier is not None:
        raise UnsupportedModelError(f"--task embed: {classifier} is a classification model; serve it with --task "
                                    "classify (or auto) and use POST /v1/classify, /v1/score or /v1/rerank")
    if requested == "generate" and generator is None:
        if classifier is not None:
            raise UnsupportedModelError(
                f"--task generate: {classifier} is a classification model with no language-model head; "
                "serve it with --task classify (or auto) and use POST /v1/classify")
        if embedding:
            raise UnsupportedModelError(f"--task generate: {archs} is an embedding model with no language-model "
                                        "head; serve it with --task embed (or auto) and use POST /v1/embeddings")
        return "generate"  # let the generation loader name what is unsupported
    if requested == "auto":
        if classifier is not None and generator is None:
            return "classify"
        return "embed" if embedding else "generate"
    return requested
