"""Pallas GPU kernels for speculative decoding, each beside the pure-jnp reference that specifies it.

One file per kernel; each exports its op with ``impl="auto" | "pallas" | "interpret" | "reference"``.
This package imports neither ``jspec`` nor ``models``.
"""
