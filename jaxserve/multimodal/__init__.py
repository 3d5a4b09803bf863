"""Media inputs for vision-language models: images from requests, checked and decoded on the host."""

# Checkpoints served with their images (jaxserve.multimodal.images); their language models are
# the decoder's families (jaxserve.models.config.text_config). Here, so host code can test a
# config.json without importing the models (and jax).
VISION_LANGUAGE_ARCHITECTURES = (
    "LlavaOnevisionForConditionalGeneration",
    "LlavaNextForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
)

# Vision-language checkpoints served as their language model alone: text in, text out, and a
# request with an image refused (400 naming it). Gemma3's vision side would need its image tokens
# to attend to each other both ways inside the paged kernels, which they do not yet.
LANGUAGE_MODEL_ONLY_ARCHITECTURES = ("Gemma3ForConditionalGeneration",)
