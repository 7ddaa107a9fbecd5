"""Kiln's attention kernel (runtime/kernels/attention.c, ai.kiln::GroupQueryAttention) in a real ONNX
Runtime session, against com.microsoft::GroupQueryAttention on the same inputs: the same numbers bit for
bit (the kernel follows the order of ONNX Runtime 1.32's sums), the KV buffers written in place when
bound as past and present, each row's numbers independent of its neighbours; and over an fp16 cache
(ai.kiln::GroupQueryAttentionFp16Cache), the fp32 op's numbers for the same cached values. Skipped where
this machine cannot run the kernels."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from runtime import cpu_kernels

LIBRARY, WHY_NOT = cpu_kernels.library()
pytestmark = pytest.mark.skipif(LIBRARY is None, reason=f"Kiln's CPU kernels: {WHY_NOT}")
MASKED = -10000.0  # what the compiler's bias adds to a pad slot


def attention_session(domain: str, heads: int, kv_heads: int, d: int, packed: bool = True, rotary: bool = True,
                      bias: bool = False, half_cache: bool = False, int8_cache: bool = False,
                      **attributes) -> ort.InferenceSession:
    """One GroupQueryAttention node as the compiler writes it: packed q/k/v (or three inputs), past and
    present buffers (fp16 ones: Kiln's GroupQueryAttentionFp16Cache), seqlens_k and total_sequence_length,
    cos/sin caches, an additive bias."""
    cache_type = TensorProto.FLOAT16 if half_cache else TensorProto.INT8 if int8_cache else TensorProto.FLOAT
    slot_width = d + d // 4 if int8_cache else d
    width = (heads + 2 * kv_heads) * d if packed else heads * d
    inputs = [helper.make_tensor_value_info("query", TensorProto.FLOAT, ["b", "s", width])]
    names = ["query", "", ""]
    if not packed:
        inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["b", "s", kv_heads * d]) for n in ("key", "value")]
        names = ["query", "key", "value"]
    inputs += [helper.make_tensor_value_info(n, cache_type, ["b", kv_heads, "slots", slot_width])
               for n in ("past_key", "past_value")]
    inputs += [helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["b"]),
               helper.make_tensor_value_info("total", TensorProto.INT32, [])]
    names += ["past_key", "past_value", "seqlens_k", "total"]
    if rotary:
        inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["positions", "half"]) for n in ("cos", "sin")]
    names += ["cos", "sin"] if rotary else ["", ""]
    if bias:
        inputs.append(helper.make_tensor_value_info("bias", TensorProto.FLOAT, ["b", 1, "s", "t"]))
        names += ["", "bias"]
    op = cpu_kernels.ATTENTION_FP16_CACHE_OP if half_cache else cpu_kernels.ATTENTION_INT8_CACHE_OP if int8_cache \
        else "GroupQueryAttention"
    node = helper.make_node(op, names, ["out", "present_key", "present_value"], domain=domain,
                            num_heads=heads, kv_num_heads=kv_heads, do_rotary=int(rotary), **attributes)
    outputs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)]
    outputs += [helper.make_tensor_value_info(n, cache_type, None) for n in ("present_key", "present_value")]
    model = helper.make_model(helper.make_graph([node], "g", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(domain, 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    if domain == cpu_kernels.DOMAIN:
        options.register_custom_ops_library(str(LIBRARY))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def inputs_for(rng, heads, kv_heads, d, batch, seq, slots, lengths, first_prompt, packed=True, rotary=True,
               bias=False, half=None):
    width = (heads + 2 * kv_heads) * d if packed else heads * d
    feeds = {"query": rng.standard_normal((batch, seq, width), np.float32),
             "past_key": rng.standard_normal((batch, kv_heads, slots, d), np.float32),
             "past_value": rng.standard_normal((batch, kv_heads, slots, d), np.float32),
             "seqlens_k": np.array(lengths, np.int32) - 1,
             "total": np.array(seq if first_prompt else max(lengths), np.int32)}
    if not packed:
        feeds["key"] = rng.standard_normal((batch, seq, kv_heads * d), np.float32)
        feeds["value"] = rng.standard_normal((batch, seq, kv_heads * d), np.float32)
    if rotary:
        angles = rng.uniform(0, 2 * np.pi, (slots + 8, half or d // 2)).astype(np.float32)
        feeds["cos"], feeds["sin"] = np.cos(angles), np.sin(angles)
    if bias:
        feeds["bias"] = np.zeros((batch, 1, seq, int(feeds["total"])), np.float32)
        feeds["bias"][..., 0] = MASKED  # a pad in front, as in a left-padded row
    return feeds


def run(session, feeds, shared):
    """(out, present_key, present_value); `shared` binds one buffer as past and present of each kind."""
    if not shared:
        return session.run(None, feeds)
    binding = session.io_binding()
    arrays = {name: feeds[name].copy() for name in ("past_key", "past_value")}  # the OrtValues use their memory
    buffers = {name: ort.OrtValue.ortvalue_from_numpy(array) for name, array in arrays.items()}
    for name, value in feeds.items():
        if name in buffers:
            binding.bind_ortvalue_input(name, buffers[name])
        else:
            binding.bind_cpu_input(name, value)
    binding.bind_output("out")
    binding.bind_ortvalue_output("present_key", buffers["past_key"])
    binding.bind_ortvalue_output("present_value", buffers["past_value"])
    session.run_with_iobinding(binding)
    return [binding.copy_outputs_to_cpu()[0], arrays["past_key"], arrays["past_value"]]


CASES = {  # heads, kv heads, head size, batch, new tokens, slots, row lengths, first prompt, and options
    "decode": (9, 3, 64, 4, 1, 24, [5, 10, 24, 1], False, {}),
    "decode, 32 rows": (9, 3, 64, 32, 1, 64, list(range(10, 42)), False, {}),
    "decode, a long cache": (9, 3, 64, 2, 1, 1600, [1500, 333], False, {}),
    "prompt": (9, 3, 64, 2, 40, 64, [40, 40], True, {}),
    "prompt of 129 (a query block of one row)": (9, 3, 64, 1, 129, 160, [129], True, {}),
    "prompt of 300 (two slices of values)": (9, 3, 64, 1, 300, 320, [300], True, {}),
    # past ONNX Runtime's KV block (its L2 cache over 32 x head size: 512 keys with 1 MiB), summed a block
    # at a time with a running rescale; the last query block of one row
    "prompt of 513 (two KV blocks)": (9, 3, 64, 1, 513, 520, [513], True, {}),
    "prompt after 600 past tokens": (9, 3, 64, 1, 40, 700, [640], False, {}),
    # past the 2048 keys a work item keeps transposed for all its positions: later blocks per position
    "prompt of 40 after 2060 past tokens": (9, 3, 64, 1, 40, 2112, [2100], False, {}),
    "prompt after past tokens": (9, 3, 64, 1, 5, 32, [15], False, {}),
    "bias": (9, 3, 64, 1, 9, 16, [9], True, {"bias": True}),
    "decode, bias": (9, 3, 64, 2, 1, 24, [10, 24], False, {"bias": True}),
    "q, k, v apart": (9, 3, 64, 4, 1, 24, [5, 10, 24, 3], False, {"packed": False}),
    "no rotary": (9, 3, 64, 4, 1, 24, [5, 10, 24, 3], False, {"rotary": False}),
    "interleaved rotary": (9, 3, 64, 4, 1, 24, [5, 10, 24, 3], False, {"rotary_interleaved": 1}),
    "partial rotary": (9, 3, 64, 4, 1, 24, [5, 10, 24, 3], False, {"half": 16}),
    "head size 128": (8, 2, 128, 1, 200, 256, [200], True, {}),
    "head size 80, 7 heads a group": (14, 2, 80, 4, 1, 24, [5, 10, 24, 3], False, {"half": 40}),
    # an int8 cache's decode step takes 4 blocks of 16 at a time: 96 ends in 2, 48 is 3 alone
    "decode, head size 96": (6, 2, 96, 3, 1, 40, [33, 7, 40], False, {"half": 48}),
    "decode, head size 48, 5 heads a group": (5, 1, 48, 2, 1, 20, [20, 17], False, {"half": 24}),
    "scale": (9, 3, 64, 4, 1, 24, [5, 10, 24, 3], False, {"scale": 0.3}),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("shared", [True, False], ids=["in place", "copied"])
def test_kiln_attention_gives_onnx_runtimes_numbers_bit_for_bit(name, shared):
    heads, kv_heads, d, batch, seq, slots, lengths, first_prompt, options = CASES[name]
    data = {k: options[k] for k in ("packed", "rotary", "bias", "half") if k in options}
    attributes = {k: v for k, v in options.items() if k not in data}
    feeds = inputs_for(np.random.default_rng(len(name)), heads, kv_heads, d, batch, seq, slots, lengths, first_prompt,
                       **data)
    node_options = {k: v for k, v in data.items() if k != "half"}
    ours = run(attention_session(cpu_kernels.DOMAIN, heads, kv_heads, d, **node_options, **attributes), feeds, shared)
    theirs = run(attention_session("com.microsoft", heads, kv_heads, d, **node_options, **attributes), feeds, shared)
    assert ours[0].shape == theirs[0].shape == (batch, seq, heads * d)
    assert ours[1].shape == theirs[1].shape
    assert np.array_equal(ours[0], theirs[0])
    for row, length in enumerate(lengths):  # the slots in use; ONNX Runtime leaves the others as they were
        used = seq if first_prompt else length
        assert np.array_equal(ours[1][row, :, :used], theirs[1][row, :, :used])
        assert np.array_equal(ours[2][row, :, :used], theirs[2][row, :, :used])


HALF_CASES = ["decode", "decode, 32 rows", "decode, a long cache", "prompt", "prompt of 129 (a query block of one row)",
              "prompt of 513 (two KV blocks)", "prompt after 600 past tokens", "prompt of 40 after 2060 past tokens",
              "bias", "decode, bias", "q, k, v apart", "head size 128", "head size 80, 7 heads a group",
              "decode, head size 96", "decode, head size 48, 5 heads a group"]


def half_exact(feeds):
    """The feeds with every number fp16 can hold exactly (a cache, keys and values rounded to fp16 lose
    nothing more), the caches as fp16."""
    exact = {k: v.astype(np.float16).astype(np.float32) if v.dtype == np.float32 else v for k, v in feeds.items()}
    halves = {k: v.astype(np.float16) for k, v in exact.items() if k in ("past_key", "past_value")}
    return exact, {**exact, **halves}


@pytest.mark.parametrize("name", HALF_CASES)
@pytest.mark.parametrize("shared", [True, False], ids=["in place", "copied"])
def test_an_fp16_cache_gives_the_fp32_ops_numbers_for_the_values_it_holds(name, shared):
    """Without rotation and with inputs fp16 holds exactly, both caches hold the same values: the outputs
    are the fp32 op's bit for bit (every sum in fp32, in the same order), the cache its values in fp16."""
    heads, kv_heads, d, batch, seq, slots, lengths, first_prompt, options = CASES[name]
    data = {k: options[k] for k in ("packed", "bias") if k in options}
    feeds = inputs_for(np.random.default_rng(len(name)), heads, kv_heads, d, batch, seq, slots, lengths, first_prompt,
                       rotary=False, **data)
    exact, half = half_exact(feeds)
    fp32 = run(attention_session(cpu_kernels.DOMAIN, heads, kv_heads, d, rotary=False, **data), exact, shared)
    fp16 = run(attention_session(cpu_kernels.DOMAIN, heads, kv_heads, d, rotary=False, half_cache=True, **data),
               half, shared)
    assert fp16[1].dtype == fp16[2].dtype == np.float16
    assert np.array_equal(fp16[0], fp32[0])
    for row, length in enumerate(lengths):
        used = seq if first_prompt else length
        for kind in (1, 2):
            assert np.array_equal(fp16[kind][row, :, :used], fp32[kind][row, :, :used].astype(np.float16))


@pytest.mark.parametrize("name", ["decode, 32 rows", "prompt", "interleaved rotary", "partial rotary"])
def test_an_fp16_cache_holds_rotated_keys_rounded_once(name):
    """With rotation: the new keys are the fp32 op's rotated keys rounded to fp16 (to nearest even, as
    numpy rounds), and the outputs within fp16's rounding of the fp32 op's."""
    heads, kv_heads, d, batch, seq, slots, lengths, first_prompt, options = CASES[name]
    data = {k: options[k] for k in ("half",) if k in options}
    attributes = {k: v for k, v in options.items() if k not in data}
    feeds = inputs_for(np.random.default_rng(len(name)), heads, kv_heads, d, batch, seq, slots, lengths, first_prompt,
                       **data)
    exact, half = half_exact(feeds)
    fp32 = run(attention_session(cpu_kernels.DOMAIN, heads, kv_heads, d, **attributes), exact, True)
    fp16 = run(attention_session(cpu_kernels.DOMAIN, heads, kv_heads, d, half_cache=True, **attributes), half, True)
    for row, length in enumerate(lengths):
        used = seq if first_prompt else length
        assert np.array_equal(fp16[1][row, :, :used], fp32[1][row, :, :used].astype(np.float16))
        assert np.array_equal(fp16[2][row, :, :used], fp32[2][row, :, :used].astype(np.float16))
    assert np.allclose(fp16[0], fp32[0], rtol=0, atol=2e-2)
    assert not np.array_equal(fp16[0], fp32[0])  # the rounded new keys do count


def test_an_fp16_cache_holds_a_number_past_its_range_at_its_largest():
    """A key or value past fp16's range is stored as fp16's largest number, not inf, which would make a
    masked slot's probability of 0 times it NaN."""
    feeds = inputs_for(np.random.default_rng(6), 9, 3, 64, 1, 1, 16, [5], False, rotary=False)
    half = half_exact(feeds)[1]
    half["query"][0, 0, 9 * 64] = 1e6  # kv head 0's new key, dimension 0
    half["query"][0, 0, 12 * 64 + 1] = -1e6  # its new value, dimension 1
    out = run(attention_session(cpu_kernels.DOMAIN, 9, 3, 64, rotary=False, half_cache=True), half, True)
    assert out[1][0, 0, 4, 0] == 65504 and out[2][0, 0, 4, 1] == -65504
    assert np.isfinite(out[0]).all()


@pytest.mark.parametrize("cache", ["fp32", "fp16", "int8"], ids=lambda c: f"{c} cache")
def test_a_rows_numbers_do_not_depend_on_its_neighbours(cache):
    rng = np.random.default_rng(1)
    lengths = [7, 60, 33, 12]
    feeds = inputs_for(rng, 9, 3, 64, 4, 1, 64, lengths, False)
    if cache == "fp16":
        feeds = half_exact(feeds)[1]
    if cache == "int8":
        feeds = {**feeds, "past_key": int8_slots(feeds["past_key"]), "past_value": int8_slots(feeds["past_value"])}
    session = attention_session(cpu_kernels.DOMAIN, 9, 3, 64, half_cache=cache == "fp16", int8_cache=cache == "int8")
    together = run(session, feeds, True)
    for row in range(4):
        alone = {k: (v[row:row + 1] if k in ("query", "past_key", "past_value", "seqlens_k") else v)
                 for k, v in feeds.items()}
        alone["total"] = np.array(lengths[row], np.int32)
        got = run(session, alone, True)
        assert np.array_equal(got[0][0], together[0][row])


def test_a_right_padded_first_prompt_gives_each_row_its_numbers_alone():
    """Rows of a first prompt shorter than the step (right-padded: the backend's batched prefill) get ONNX
    Runtime's numbers for the row alone, where ONNX Runtime's own change with the padding: a row of 129
    tokens alone ends in a query block of one row (SGEMM's M = 1 kernel), padded to 300 it does not.
    A row's pads get zeros; its slots in use hold what they hold alone."""
    lengths = [129, 300, 60, 140]
    feeds = inputs_for(np.random.default_rng(5), 9, 3, 64, 4, 300, 320, lengths, True)
    ours = run(attention_session(cpu_kernels.DOMAIN, 9, 3, 64), feeds, True)
    session = attention_session("com.microsoft", 9, 3, 64)
    padded = run(session, feeds, True)
    for row, length in enumerate(lengths):
        alone = {k: v[row:row + 1] for k, v in feeds.items() if k in ("past_key", "past_value", "seqlens_k")}
        alone.update(query=feeds["query"][row:row + 1, :length], total=np.array(length, np.int32),
                     cos=feeds["cos"], sin=feeds["sin"])
        theirs = run(session, alone, True)
        assert np.array_equal(ours[0][row, :length], theirs[0][0])
        assert not ours[0][row, length:].any()
        for kind in (1, 2):
            assert np.array_equal(ours[kind][row, :, :length], theirs[kind][0, :, :length])
        if length == 129:  # what this departs from
            assert not np.array_equal(padded[0][row, :length], theirs[0][0])


def test_what_it_does_not_take_is_refused_in_one_line():
    with pytest.raises(Exception, match="softcap, local_window_size and smooth_softmax are not taken"):
        attention_session(cpu_kernels.DOMAIN, 9, 3, 64, softcap=30.0)
    session = attention_session(cpu_kernels.DOMAIN, 9, 3, 64)
    feeds = inputs_for(np.random.default_rng(2), 9, 3, 64, 1, 5, 16, [3], False)  # 5 new tokens in a row of 3
    feeds["total"] = np.array(9, np.int32)
    with pytest.raises(Exception, match="seqlens_k \\+ 1 must be at least the new tokens and at most"):
        run(session, feeds, True)


# -- an 8-bit cache (ai.kiln::GroupQueryAttentionInt8Cache) -------------------------------------------

def int8_slots(x: np.ndarray) -> np.ndarray:
    """x [..., d] as an int8 cache holds it, computed here in numpy: per slot d codes, each block of 16
    rint(x * (127 / max|x|)), then the blocks' scales max|x| / 127 (fp32)."""
    blocks = x.reshape(*x.shape[:-1], -1, 16)
    largest = np.abs(blocks).max(-1, keepdims=True)
    inverse = np.where(largest > 0, np.float32(127) / np.where(largest > 0, largest, 1), 0).astype(np.float32)
    codes = np.clip(np.rint(blocks * inverse), -127, 127).astype(np.int8).reshape(x.shape)
    scales = (largest / np.float32(127)).astype(np.float32)[..., 0]
    return np.concatenate([codes, np.ascontiguousarray(scales).view(np.int8)], axis=-1)


def int8_values(slots: np.ndarray) -> np.ndarray:
    """What an int8 cache's slots hold: code times its block's scale, in fp32."""
    d = slots.shape[-1] * 4 // 5
    scales = np.ascontiguousarray(slots[..., d:]).view(np.float32)
    return (slots[..., :d].astype(np.float32).reshape(*slots.shape[:-1], -1, 16) * scales[..., None]).reshape(
        *slots.shape[:-1], d)


def new_slots(feeds, heads, kv_heads, d, lengths, seq, first_prompt):
    """(row, kv head, slot, token, (input, offset) of its key, (input, offset) of its value) of every token
    the step writes: in the packed query, or in the key and value inputs."""
    packed = "key" not in feeds
    for row, length in enumerate(lengths):
        past = 0 if first_prompt else length - seq
        for i in range(seq):
            for g in range(kv_heads):
                yield (row, g, past + i, i, ("query", (heads + g) * d) if packed else ("key", g * d),
                       ("query", (heads + kv_heads + g) * d) if packed else ("value", g * d))


@pytest.mark.parametrize("name", HALF_CASES)
@pytest.mark.parametrize("shared", [True, False], ids=["in place", "copied"])
def test_an_int8_cache_gives_the_fp32_ops_numbers_for_the_values_it_holds(name, shared):
    """The int8 op's outputs equal the fp32 op's run over the values its cache holds (its past dequantized,
    the new keys and values as it stored them): bit for bit in a prompt, within 1e-4 in a decode step (its
    own arithmetic: the query as 15-bit codes, integer dot products); and what it stored is numpy's
    quantization of the new keys and values."""
    heads, kv_heads, d, batch, seq, slots, lengths, first_prompt, options = CASES[name]
    data = {k: options[k] for k in ("packed", "bias") if k in options}
    feeds = inputs_for(np.random.default_rng(len(name)), heads, kv_heads, d, batch, seq, slots, lengths, first_prompt,
                       rotary=False, **data)
    packed = {**feeds, "past_key": int8_slots(feeds["past_key"]), "past_value": int8_slots(feeds["past_value"])}
    ours = run(attention_session(cpu_kernels.DOMAIN, heads, kv_heads, d, rotary=False, int8_cache=True, **data),
               packed, shared)
    assert ours[1].dtype == np.int8 and ours[1].shape == (batch, kv_heads, max(slots, int(feeds["total"])), d + d // 4)
    held = {**{k: v.copy() for k, v in feeds.items()}, "past_key": int8_values(ours[1]),
            "past_value": int8_values(ours[2])}
    for row, g, slot, i, key, value in new_slots(feeds, heads, kv_heads, d, lengths, seq, first_prompt):
        for (source, at), stored, cache in ((key, ours[1], "past_key"), (value, ours[2], "past_value")):
            assert np.array_equal(stored[row, g, slot], int8_slots(feeds[source][row, i, at:at + d]))
            held[source][row, i, at:at + d] = held[cache][row, g, slot]  # what the int8 op holds for it
    fp32 = run(attention_session(cpu_kernels.DOMAIN, heads, kv_heads, d, rotary=False, **data), held, shared)
    if seq > 1:
        assert np.array_equal(ours[0], fp32[0])
    else:  # a decode step's own arithmetic (its query as 15-bit codes, integer dot products with the keys' codes)
        np.testing.assert_allclose(ours[0], fp32[0], rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", ["decode, 32 rows", "prompt", "interleaved rotary", "partial rotary"])
def test_an_int8_cache_holds_rotated_keys_quantized_once(name):
    """With rotation: the stored keys are numpy's quantization of the fp32 op's rotated keys, and the
    outputs near the fp32 op's (within the 8-bit rounding of the keys and values)."""
    heads, kv_heads, d, batch, seq, slots, lengths, first_prompt, options = CASES[name]
    data = {k: options[k] for k in ("half",) if k in options}
    attributes = {k: v for k, v in options.items() if k not in data}
    feeds = inputs_for(np.random.default_rng(len(name)), heads, kv_heads, d, batch, seq, slots, lengths, first_prompt,
                       **data)
    fp32 = run(attention_session(cpu_kernels.DOMAIN, heads, kv_heads, d, **attributes), feeds, True)
    packed = {**feeds, "past_key": int8_slots(feeds["past_key"]), "past_value": int8_slots(feeds["past_value"])}
    ours = run(attention_session(cpu_kernels.DOMAIN, heads, kv_heads, d, int8_cache=True, **attributes), packed, True)
    for row, g, slot, *_ in new_slots(feeds, heads, kv_heads, d, lengths, seq, first_prompt):
        assert np.array_equal(ours[1][row, g, slot], int8_slots(fp32[1][row, g, slot]))
        assert np.array_equal(ours[2][row, g, slot], int8_slots(fp32[2][row, g, slot]))
    assert np.allclose(ours[0], fp32[0], rtol=0, atol=0.1)
    assert not np.array_equal(ours[0], fp32[0])



def test_an_all_zero_slot_is_stored_with_scale_zero_and_reads_as_zeros():
    feeds = inputs_for(np.random.default_rng(2), 9, 3, 64, 1, 1, 16, [5], False, rotary=False)
    feeds["query"][0, 0, 9 * 64:10 * 64] = 0  # kv head 0's new key
    packed = {**feeds, "past_key": int8_slots(feeds["past_key"]), "past_value": int8_slots(feeds["past_value"])}
    out = run(attention_session(cpu_kernels.DOMAIN, 9, 3, 64, rotary=False, int8_cache=True), packed, True)
    assert not out[1][0, 0, 4].any() and np.isfinite(out[0]).all()


def test_a_block_too_small_to_scale_is_stored_as_zeros():
    """A block whose largest number is below 127 / FLT_MAX (1e-37 here) is stored as zero codes and a zero
    scale (its inverse would be infinite, every code saturated), and a query block below 32767 / FLT_MAX
    counts as zeros: the outputs stay those of the cache's other numbers."""
    feeds = inputs_for(np.random.default_rng(2), 9, 3, 64, 1, 1, 16, [5], False, rotary=False)
    feeds["query"][0, 0, 9 * 64:9 * 64 + 16] = 1e-37  # kv head 0's new key, its first block
    feeds["query"][0, 0, :16] = 1e-36  # query head 0's first block
    packed = {**feeds, "past_key": int8_slots(feeds["past_key"]), "past_value": int8_slots(feeds["past_value"])}
    out = run(attention_session(cpu_kernels.DOMAIN, 9, 3, 64, rotary=False, int8_cache=True), packed, True)
    assert not out[1][0, 0, 4, :16].any() and int8_values(out[1])[0, 0, 4, 0] == 0
    assert np.isfinite(out[0]).all()


def test_an_int8_block_with_a_nan_reads_back_as_nan():
    """The fp32 op passes a NaN key on to the outputs; an int8 cache must not turn it into numbers."""
    feeds = inputs_for(np.random.default_rng(3), 9, 3, 64, 1, 1, 16, [5], False, rotary=False)
    feeds["query"][0, 0, 12 * 64 + 3] = np.nan  # kv head 0's new value, dimension 3
    packed = {**feeds, "past_key": int8_slots(feeds["past_key"]), "past_value": int8_slots(feeds["past_value"])}
    out = run(attention_session(cpu_kernels.DOMAIN, 9, 3, 64, rotary=False, int8_cache=True), packed, True)
    assert np.isnan(int8_values(out[2])[0, 0, 4, :16]).all() and np.isfinite(int8_values(out[2])[0, 0, 4, 16:]).all()
    heads = out[0][0, 0, :3 * 64].reshape(3, 64)  # the query heads of kv head 0 read it: the block's dimensions
    assert np.isnan(heads[:, :16]).all() and np.isfinite(heads[:, 16:]).all()
