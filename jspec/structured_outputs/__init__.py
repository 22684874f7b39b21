"""Structured outputs (vLLM's ``structured_outputs`` / ``response_format``): generation constrained by a JSON schema,
a regex, a choice of strings or a grammar, through llguidance. The grammar's state lives on the host; each step
the host computes a token bitmask for every node of the draft tree from that node's path and the verify pass
masks the target's logits with it, so speculation stays lossless against the constrained target."""

from jspec.structured_outputs.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
