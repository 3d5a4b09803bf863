"""The HTTP layer: a Quart app speaking OpenAI, SGLang and Triton over one AsyncEngine."""
