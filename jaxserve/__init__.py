"""jaxserve: a JAX/XLA inference server for large language models."""

__version__ = "0.1.0"
