"""jspec: speculative decoding in JAX, the whole draft/verify loop in one XLA program."""

from jspec.bundle import bundled_model
from jspec.config import SamplingParams, SpecConfig
from jspec.engine import GenerateOutput, GenerateStats, SpecEngine
from jspec.generate import GenerateResult, generate
from jspec.generate_setup import GenerateSetup
from jspec.sampling import SamplingArrays
from jspec.sharding import make_mesh
from jspec.structured_outputs import StructuredOutputsParams

__all__ = ["GenerateOutput", "GenerateResult", "GenerateSetup", "GenerateStats", "SamplingArrays",
           "SamplingParams", "SpecConfig", "SpecEngine", "StructuredOutputsParams", "bundled_model", "generate",
           "make_mesh"]
