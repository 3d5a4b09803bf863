"""Structured output: constrain generation to a regex, JSON schema, choice list or grammar.

Host-side only (no jax): `spec` validates what a request asks for, `compiler` turns it into a
shared `Grammar` (outlines-core or llguidance), `matcher` walks it per sequence and writes the
token masks the engine applies inside the jitted step.
"""
