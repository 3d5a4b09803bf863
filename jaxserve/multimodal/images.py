"""A vision-language model's image input on the server side: load an image a request names, run
the model's image processor, and expand each placeholder token of the prompt into the image's
tokens (host only: the engine's vision encoder turns the pixels into embeddings).

A prompt marks each image with one placeholder token (LLaVA's `<image>`), written by the chat
template for an image part or by the client in a raw prompt; it becomes as many tokens as the
image has embeddings, as the HF processors expand it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any, Protocol

from jaxserve.engine.embeds import ImageItem
from jaxserve.errors import InvalidRequestError
from jaxserve.multimodal import VISION_LANGUAGE_ARCHITECTURES
from jaxserve.multimodal.media import MediaPolicy, check_count, image_hash, load_image


class ImageProcessor(Protocol):
    """A model's image preprocessing (jaxserve.multimodal.llava_processing): pixels in, the vision
    encoder's input out, with `num_tokens`: the image's placeholder tokens."""

    def preprocess(self, image: Any, multi_image: bool = False) -> Any: ...

    def with_kwargs(self, kwargs: dict[str, Any], param: str, capped: bool = True) -> Any: ...


@dataclasses.dataclass(frozen=True)
class PreparedImage:
    key: str  # the pixels' hash: the prefix cache and the encoder cache key the image by it
    data: Any  # the processor's output (its num_tokens: how many tokens the image takes)

    @property
    def num_tokens(self) -> int:
        return int(self.data.num_tokens)


@dataclasses.dataclass(frozen=True)
class ImageSupport:
    processor: ImageProcessor
    image_token_id: int
    image_token: str  # the placeholder's text, for messages
    policy: MediaPolicy
    # Keys the prepared images apart when a request's mm_processor_kwargs change the processing
    # (the same pixels then give other embeddings): "" for the server's own processor.
    variant: str = ""

    def with_kwargs(self, kwargs: dict[str, Any] | None, param: str = "mm_processor_kwargs") -> ImageSupport:
        """This support with a request's mm_processor_kwargs (vLLM's) applied to its processor;
        InvalidRequestError naming the key when the processor cannot take one."""
        if not kwargs:
            return self
        if not isinstance(kwargs, dict):
            raise InvalidRequestError(param, "expected an object")
        try:
            processor = self.processor.with_kwargs(kwargs, param)
        except ValueError as e:
            raise InvalidRequestError(param, str(e).removeprefix(f"{param}: ")) from None
        if processor == self.processor:
            return self
        return dataclasses.replace(self, processor=processor, variant="/" + json.dumps(kwargs, sort_keys=True))

    def prepare(self, spec: str, param: str, multi_image: bool = False) -> PreparedImage:
        """Load and preprocess one image (blocking: Pillow work)."""
        return self.prepare_image(load_image(spec, self.policy, param), multi_image, param)

    def prepare_image(self, image: Any, multi_image: bool = False, param: str = "image") -> PreparedImage:
        """Preprocess a decoded image. multi_image: one of several in its prompt, which some models
        read differently (LLaVA-OneVision: one tile), so it is keyed apart. An image the processor
        cannot take (an extreme aspect ratio, too many patches) is an InvalidRequestError naming
        `param`."""
        image = image.convert("RGB") if image.mode != "RGB" else image
        multi_image = multi_image and getattr(self.processor, "reads_multi_image", False)
        key = image_hash(image) + ("/multi" if multi_image else "") + self.variant
        try:
            return PreparedImage(key, self.processor.preprocess(image, multi_image=multi_image))
        except ValueError as e:
            raise InvalidRequestError(param, str(e)) from None

    async def prepare_all(self, specs: list[tuple[str, str]]) -> list[PreparedImage]:
        """One prompt's images, each (spec, parameter name), loaded and preprocessed off the event loop."""
        if specs:
            check_count(len(specs), self.policy, specs[0][1])
        multi = len(specs) > 1
        return await asyncio.gather(*(asyncio.to_thread(self.prepare, spec, param, multi) for spec, param in specs))

    def check_placeholders(self, prompt: list[int], num_images: int, param: str) -> None:
        """Refuse a prompt whose placeholders do not match its images one to one (before any is loaded)."""
        count = prompt.count(self.image_token_id)
        if count != num_images:
            raise InvalidRequestError(param, f"the prompt holds {count} image placeholder{'s' * (count != 1)} "
                                      f"({self.image_token}) for {num_images} image{'s' * (num_images != 1)}; "
                                      "it needs one per image")

    async def load_into(self, prompt: list[int], specs: list[tuple[str, str]],
                        param: str) -> tuple[list[int], list[ImageItem]]:
        """A request's path: the prompt's placeholders checked against its images (each (spec,
        parameter name)) before any is loaded, then the images loaded and preprocessed and the
        placeholders expanded (`expand`)."""
        self.check_placeholders(prompt, len(specs), param)
        return self._expand(prompt, await self.prepare_all(specs))

    def expand(self, prompt: list[int], images: list[PreparedImage], param: str) -> tuple[list[int], list[ImageItem]]:
        """The prompt with its i-th placeholder token repeated for images[i]'s tokens, and where
        each image's tokens are."""
        self.check_placeholders(prompt, len(images), param)
        return self._expand(prompt, images)

    def _expand(self, prompt: list[int], images: list[PreparedImage]) -> tuple[list[int], list[ImageItem]]:
        ids: list[int] = []
        items: list[ImageItem] = []
        pending = iter(images)
        for token in prompt:
            if token != self.image_token_id:
                ids.append(token)
                continue
            image = next(pending)
            items.append(ImageItem(len(ids), image.num_tokens, image.key, image.data))
            ids += [token] * image.num_tokens
        return ids, items


def image_processor(model_dir: Path, config: dict[str, Any],
                    overrides: dict[str, Any] | None = None) -> tuple[ImageProcessor, int]:
    """The vision-language checkpoint's image processor and its placeholder token id. overrides:
    the server's --mm-processor-kwargs (ValueError naming the flag when one is wrong)."""
    path = model_dir / "preprocessor_config.json"
    preprocessor = json.loads(path.read_text()) if path.is_file() else {}
    processor: ImageProcessor
    if "Qwen2_5_VLForConditionalGeneration" in (config.get("architectures") or []):
        from jaxserve.multimodal.qwen2_vl_processing import Qwen2VLImageProcessor

        processor, token_id = Qwen2VLImageProcessor.from_hf(preprocessor, config), int(config.get("image_token_id",
                                                                                                   151655))
    else:
        from jaxserve.multimodal.llava_processing import LlavaImageProcessor

        processor, token_id = LlavaImageProcessor.from_hf(preprocessor, config), int(config["image_token_index"])
    return processor.with_kwargs(overrides or {}, "--mm-processor-kwargs", capped=False), token_id


def image_support(model_dir: Path, config: dict[str, Any], tokenizer: Any, policy: MediaPolicy,
                  overrides: dict[str, Any] | None = None) -> ImageSupport | None:
    """The image input of the vision-language checkpoint at `model_dir` (config: its config.json),
    or None for a text-only model. tokenizer: the HF tokenizer (names the placeholder). overrides:
    as image_processor's."""
    archs = config.get("architectures") or []
    if not any(a in VISION_LANGUAGE_ARCHITECTURES for a in archs):
        return None
    processor, token_id = image_processor(model_dir, config, overrides)
    token = tokenizer.convert_ids_to_tokens(token_id) if tokenizer is not None else "<image>"
    return ImageSupport(processor, token_id, token, policy)
