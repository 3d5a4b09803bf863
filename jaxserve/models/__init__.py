"""Flax model families. `decoder_config_from_hf` picks the family from HF `architectures`."""

from jaxserve.models.config import SUPPORTED_ARCHITECTURES, DecoderConfig, UnsupportedModelError, decoder_config_from_hf
from jaxserve.models.decoder import Decoder

__all__ = ["SUPPORTED_ARCHITECTURES", "Decoder", "DecoderConfig", "UnsupportedModelError", "decoder_config_from_hf"]
