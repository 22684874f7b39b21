"""Every Pallas kernel compiled by the real compiler of the hardware it is for, on this CPU: the Mosaic TPU forms
(impl="tpu") for v5e, v6e and v5p, and the GPU forms (impl="pallas") for an H100 by XLA's GPU compiler, through
Triton, which each names (JAX 0.10 lowers a GPU kernel that names none through Mosaic GPU). At the shapes the engine
and the server give them: Llama-3-8B and 70B heads (and their TP shards), bf16 and float32, pages of 16/64/128,
trees of 1-64 nodes, 1-64 rows, Llama-3's vocabulary. The same forms equal their references in Pallas's
interpreters (tests/pallas_kernels). Tree attention's Mosaic GPU forms (TMA, WGMMA), dense and paged, compile for an
H100 at the engine's shapes too. The `aot` tier: ``pip install -e ".[aot]"`` then ``JAX_PLATFORMS=cpu
pytest -m aot tests/aot`` (.ci/run does)."""

import functools
import re

import jax
import jax.numpy as jnp
import pytest

from jspec.tools.aot import GPU_TARGETS, compile_for, devices_for
from pallas_kernels import build_dynamic_tree, tree_attention, tree_from_parents, verify_tree_greedy
from pallas_kernels import verify_tree_sampling
from pallas_kernels.paged_tree_attention import paged_tree_attention
from pallas_kernels.tree_attention_mgpu import paged_tree_attention_mgpu, tree_attention_mgpu

pytestmark = pytest.mark.aot

# Every case compiles for these: v5e has the least VMEM per core of the TPUs (16 MiB scoped by default), where most
# Mosaic rejections showed; the H100 is the one GPU. The largest case (last) compiles for the others as well.
EVERY_CASE = ("v5e", "h100")
LARGEST_CASE = ("v6e", "v5p")
# The custom call each platform's kernels become: a Mosaic TPU kernel, a Triton one (Mosaic GPU's would differ).
KERNEL_CALLS = {"tpu": "tpu_custom_call", "gpu": "__gpu$xla.gpu.triton"}


def on_chips(names: str, cases: list, largest_on: tuple = LARGEST_CASE) -> tuple:
    """parametrize(names + ",chip", ...): every case on :data:`EVERY_CASE`, the last on ``largest_on`` as well."""
    params = [case + (chip,) for chip in EVERY_CASE for case in cases] + [cases[-1] + (c,) for c in largest_on]
    return names + ",chip", params
I32, F32 = jnp.int32, jnp.float32
LLAMA3_VOCAB = 128256
# (query heads, KV heads, head dim) per device: Llama-3-8B whole and over TP 4, Llama-3-70B whole and over TP 8.
HEADS = {"8B": (32, 8, 128), "8B-tp4": (8, 2, 128), "70B": (64, 8, 128), "70B-tp8": (8, 1, 128)}


def sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def compiles(chip, kernel, args):
    """kernel(*args, impl=...) with the chip's compiled form (impl "pallas" on a GPU, "tpu" on a TPU), compiled for
    one ``chip`` (a compiler error fails the test), the kernel inside (on a GPU, every custom call is Triton's)."""
    platform = "gpu" if chip in GPU_TARGETS else "tpu"
    compiled = compile_for(lambda *a: kernel(*a, impl="pallas" if platform == "gpu" else "tpu"), args,
                           devices_for(chip))
    calls = re.findall(r'custom_call_target="([^"]+)"', compiled.as_text())
    assert KERNEL_CALLS[platform] in calls and (platform == "tpu" or set(calls) == {KERNEL_CALLS[platform]}), calls
    return compiled


# (rows B, nodes T, packed mask)
TREE_CASES = [(1, 1, False), (8, 4, False), (8, 16, True), (32, 32, False), (64, 64, True)]


@pytest.mark.parametrize(*on_chips("batch,nodes,packed", TREE_CASES))
def test_tree_from_parents_compiles(batch, nodes, packed, chip):
    compiles(chip, lambda p, s, impl: tree_from_parents(p, s, packed=packed, impl=impl),
             [sds((batch, nodes), I32), sds((batch,), I32)])


# (rows, topk, depth): trees of topk * depth + 1 nodes at most, EAGLE-3's dynamic trees as the engine sizes them
DYNAMIC_CASES = [(1, 1, 1), (8, 4, 4), (32, 8, 4), (64, 8, 8)]


@pytest.mark.parametrize(*on_chips("batch,topk,depth", DYNAMIC_CASES))
def test_build_dynamic_tree_compiles(chip, batch, topk, depth):
    nodes = min(topk * depth, 63) + 1
    compiles(chip, lambda parent_list, selected, s, impl: build_dynamic_tree(
        parent_list, selected, s, topk=topk, num_steps=depth, impl=impl),
        [sds((batch, topk * (depth - 1) + 1), I32), sds((batch, nodes - 1), I32), sds((batch,), I32)])


# (rows, nodes, depth)
VERIFY_CASES = [(1, 1, 1), (8, 4, 3), (32, 16, 6), (64, 64, 10)]


@pytest.mark.parametrize(*on_chips("batch,nodes,depth", VERIFY_CASES))
def test_verify_tree_greedy_compiles(chip, batch, nodes, depth):
    compiles(chip, functools.partial(verify_tree_greedy, num_steps=depth), [sds((batch, nodes), I32)] * 4)


# (rows, nodes, depth, vocabulary): the rejection walk DMAs one vocabulary row at a time
SAMPLING_CASES = [(1, 1, 1, 1000), (32, 16, 6, LLAMA3_VOCAB)]


# the 128k vocabulary ran out of scoped VMEM on v5e and v5p, never on v6e (whose compile of it takes 26 s)
@pytest.mark.parametrize(*on_chips("batch,nodes,depth,vocab", SAMPLING_CASES, largest_on=("v5p",)))
def test_verify_tree_sampling_compiles(chip, batch, nodes, depth, vocab):
    def verify(candidates, next_token, next_sibling, target, draft, key_data, impl):
        return verify_tree_sampling(candidates, next_token, next_sibling, target, jax.random.wrap_key_data(key_data),
                                    num_steps=depth, draft_probs=draft, impl=impl)

    compiles(chip, verify, [sds((batch, nodes), I32)] * 3 + [sds((batch, nodes, vocab), F32)] * 2
             + [sds((2,), jnp.uint32)])


def attention_args(heads, dtype, batch, nodes):
    q_heads, kv_heads, head_dim = HEADS[heads]
    dtype = jnp.dtype(dtype)
    new = sds((batch, nodes, kv_heads, head_dim), dtype)
    return sds((batch, nodes, q_heads, head_dim), dtype), new, sds((batch, nodes, nodes), jnp.bool_)


# (heads, dtype, rows, nodes, cache slots)
DENSE_CASES = [("8B", "bfloat16", 1, 1, 2048), ("8B", "bfloat16", 8, 16, 2048), ("70B", "float32", 8, 8, 2048),
               ("8B-tp4", "bfloat16", 32, 8, 2048), ("70B-tp8", "bfloat16", 8, 16, 2048),
               ("70B", "bfloat16", 8, 64, 1000)]


@pytest.mark.parametrize(*on_chips("heads,dtype,batch,nodes,slots", DENSE_CASES))
def test_tree_attention_compiles(chip, heads, dtype, batch, nodes, slots):
    q, new, mask = attention_args(heads, dtype, batch, nodes)
    cache = sds((batch, slots) + new.shape[2:], new.dtype)
    compiles(chip, tree_attention, [q, cache, cache, sds((batch,), I32), new, new, mask])


# (heads, dtype, rows, nodes, page size); 2048 slots a row
PAGED_CASES = [("8B", "bfloat16", 8, 8, 16), ("8B", "float32", 1, 1, 64), ("8B", "bfloat16", 32, 16, 64),
               ("8B-tp4", "bfloat16", 8, 16, 64), ("70B-tp8", "bfloat16", 8, 8, 16), ("70B", "bfloat16", 64, 32, 128)]


@pytest.mark.parametrize(*on_chips("heads,dtype,batch,nodes,page", PAGED_CASES))
def test_paged_tree_attention_compiles(chip, heads, dtype, batch, nodes, page):
    q, new, mask = attention_args(heads, dtype, batch, nodes)
    per_row = 2048 // page
    pages = sds((1 + batch * per_row, page) + new.shape[2:], new.dtype)
    compiles(chip, paged_tree_attention,
             [q, pages, pages, sds((batch, per_row), I32), sds((batch,), I32), new, new, mask])


# gpt-oss-20b's attention (64 query heads over 8 KV heads of 64) in its sliding layers: a window of 128 and a sink per
# query head, 8 rows of 16-node trees over 2048 slots (pages of 16 in the server)
GPT_OSS_HEADS = (64, 8, 64)


@pytest.mark.parametrize("chip", EVERY_CASE)
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_a_sliding_window_with_sinks_compiles(chip, paged):
    q_heads, kv_heads, head_dim = GPT_OSS_HEADS
    batch, nodes = 8, 16
    q = sds((batch, nodes, q_heads, head_dim), jnp.bfloat16)
    new = sds((batch, nodes, kv_heads, head_dim), jnp.bfloat16)
    common = [sds((batch,), I32), new, new, sds((batch, nodes, nodes), jnp.bool_), sds((q_heads,), F32)]
    if paged:
        pages = sds((1 + batch * 128, 16, kv_heads, head_dim), jnp.bfloat16)

        def kernel(q, k, v, table, lens, k_new, v_new, mask, sinks, impl):
            return paged_tree_attention(q, k, v, table, lens, k_new, v_new, mask, impl=impl, window=128, sinks=sinks)

        compiles(chip, kernel, [q, pages, pages, sds((batch, 128), I32)] + common)
    else:
        cache = sds((batch, 2048, kv_heads, head_dim), jnp.bfloat16)

        def kernel(q, k, v, lens, k_new, v_new, mask, sinks, impl):
            return tree_attention(q, k, v, lens, k_new, v_new, mask, impl=impl, window=128, sinks=sinks)

        compiles(chip, kernel, [q, cache, cache] + common)


# (heads, rows, nodes, cache slots): tree attention's Mosaic GPU form (TMA, WGMMA) at the engine's shapes, bf16, up to
# 256 rows a KV head (64 nodes x 4 heads); 2053 slots: max_seq_len plus a tree's
MGPU_CASES = [("8B", 1, 1, 2048), ("8B", 8, 16, 2053), ("70B-tp8", 8, 16, 2048), ("8B-tp4", 32, 64, 2048)]


@pytest.mark.parametrize("heads,batch,nodes,slots", MGPU_CASES)
def test_tree_attention_mosaic_gpu_form_compiles_for_an_h100(heads, batch, nodes, slots):
    q, new, mask = attention_args(heads, "bfloat16", batch, nodes)
    cache = sds((batch, slots) + new.shape[2:], new.dtype)
    compiled = compile_for(functools.partial(tree_attention_mgpu, scale=0.088), [q, cache, cache, sds((batch,), I32),
                                                                                 new, new, mask], devices_for("h100"))
    assert re.findall(r'custom_call_target="([^"]+)"', compiled.as_text()) == ["mosaic_gpu_v2"]


# (heads, rows, nodes, page size): the paged form, a TMA copy a page through the row's page table; 2048 slots a row
MGPU_PAGED_CASES = [("8B", 8, 8, 16), ("8B-tp4", 32, 16, 64), ("70B-tp8", 8, 16, 16)]


@pytest.mark.parametrize("heads,batch,nodes,page", MGPU_PAGED_CASES)
def test_paged_tree_attention_mosaic_gpu_form_compiles_for_an_h100(heads, batch, nodes, page):
    q, new, mask = attention_args(heads, "bfloat16", batch, nodes)
    per_row = 2048 // page
    pages = sds((1 + batch * per_row, page) + new.shape[2:], new.dtype)
    compiled = compile_for(functools.partial(paged_tree_attention_mgpu, scale=0.088),
                           [q, pages, pages, sds((batch, per_row), I32), sds((batch,), I32), new, new, mask],
                           devices_for("h100"))
    assert re.findall(r'custom_call_target="([^"]+)"', compiled.as_text()) == ["mosaic_gpu_v2"]


# DeepSeek-V3's latent attention per device at TP 8 (tests/models/test_deepseek_v3.py, models/mla.py): 16 query heads
# absorbed into latent space over one latent head of 512 + 64 rope, the latent read as both K and V; 8 rows of
# 4-node chains (its MTP module's) over 2048 slots, pages of 16 (the server's default)
MLA_HEADS = (16, 1, 576)


@pytest.mark.parametrize("chip", EVERY_CASE + LARGEST_CASE)
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_latent_attention_compiles(chip, paged):
    q_heads, kv_heads, head_dim = MLA_HEADS
    batch, nodes = 8, 4
    q = sds((batch, nodes, q_heads, head_dim), jnp.bfloat16)
    new = sds((batch, nodes, kv_heads, head_dim), jnp.bfloat16)
    mask = sds((batch, nodes, nodes), jnp.bool_)
    if paged:
        pages = sds((1 + batch * 128, 16, kv_heads, head_dim), jnp.bfloat16)

        def kernel(q, latent, table, lens, new, mask, impl):
            return paged_tree_attention(q, latent, latent, table, lens, new, new, mask, impl=impl)

        compiles(chip, kernel, [q, pages, sds((batch, 128), I32), sds((batch,), I32), new, mask])
    else:
        def kernel(q, latent, lens, new, mask, impl):
            return tree_attention(q, latent, latent, lens, new, new, mask, impl=impl)

        compiles(chip, kernel, [q, sds((batch, 2048, kv_heads, head_dim), jnp.bfloat16), sds((batch,), I32), new,
                                mask])
