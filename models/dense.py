"""Dense and Embed: ``flax.linen.Dense`` / ``flax.linen.Embed`` whose kernel / table may be weight-only quantized
(a ``qwix.QArray``, models.quantization).

The same parameters (``kernel`` [in, out], optional ``bias``) and, for a float kernel, the same computation as
``nn.Dense``; a quantized kernel goes through ``qwix.dot_general``, which dequantizes it in the compute dtype next
to the matmul (XLA fuses the two), so the weight is read from memory in its stored int8 / fp8 / int4 bytes.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
import qwix
from flax.linen.dtypes import promote_dtype
from jax import lax


class Dense(nn.Dense):

    @nn.compact
    def __call__(self, inputs):
        kernel = self.param("kernel", self.kernel_init, (jnp.shape(inputs)[-1], self.features), self.param_dtype)
        bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype) if self.use_bias else None
        contract = (((inputs.ndim - 1,), (0,)), ((), ()))
        if isinstance(kernel, qwix.QArray):
            dtype = self.dtype or inputs.dtype
            inputs = jnp.asarray(inputs, dtype)
            y = qwix.dot_general(inputs, kernel.astype(dtype), contract, precision=self.precision).astype(dtype)
            bias = None if bias is None else jnp.asarray(bias, dtype)
        else:
            inputs, kernel, bias = promote_dtype(inputs, kernel, bias, dtype=self.dtype)
            y = lax.dot_general(inputs, kernel, contract, precision=self.precision)
        if bias is not None:
            y += jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
        return y


class Embed(nn.Embed):
    """``nn.Embed`` whose table may be a QArray (a scale per vocabulary row, per group of features for int4): the
    looked-up rows are dequantized, and ``attend`` multiplies through ``qwix.dot_general``."""

    def __call__(self, inputs):
        table = self.embedding
        if not isinstance(table, qwix.QArray):
            return super().__call__(inputs)
        rows = qwix.QArray(jnp.take(table.qvalue, inputs, axis=0), jnp.take(table.scale, inputs, axis=0),
                           qtype=table.qtype)
        return qwix.dequantize(rows).astype(self.dtype or table.dtype)

    def attend(self, query):
        table = self.embedding
        if not isinstance(table, qwix.QArray):
            return super().attend(query)
        dtype = self.dtype or query.dtype
        contract = (((query.ndim - 1,), (1,)), ((), ()))
        return qwix.dot_general(jnp.asarray(query, dtype), table.astype(dtype), contract).astype(dtype)

