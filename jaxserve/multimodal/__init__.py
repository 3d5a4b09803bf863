"""Media inputs for vision-language models: images from requests, checked and decoded on the host."""

# Checkpoints served with their images (jaxserve.multimodal.images); their language models are
# the decoder's families (jaxserve.models.config.text_config). Here, so host code can test a
# config.json without importing the models (and jax).
VISION_LANGUAGE_ARCHITECTURES = (
    "LlavaOnevisionForConditionalGeneration",
    "LlavaNextForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
)
