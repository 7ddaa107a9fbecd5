"""Kiln's own CPU kernels, run by ONNX Runtime as custom ops (runtime/kernels/: library.c registers
int8_blocks.c's, attention.c's, swiglu.c's and matmul_fp32.c's ops in the domain ai.kiln).

A variant whose graph has 8-bit or 4-bit MatMulNBits nodes in blocks of 32 with int8 activations,
GroupQueryAttention nodes the attention kernel takes, or MatMuls by fp32 weights, gets a second graph
beside model.onnx, KERNEL_MODEL_FILE:
- each such MatMulNBits as ai.kiln::MatMulInt8Blocks or MatMulInt4Blocks over the same weights packed in
  the kernels' layout (KERNEL_DATA_FILE; every other weight read from model.onnx.data), so that AVX-512
  VNNI instructions work on 16 output columns at once; a 4-bit node that reads its activations' block
  means beside them (a Q4_1 grid's correction) reads the activations alone, the correction folded into
  its weights, and a SwiGLU's gate/up projection writes silu(gate) * up itself (`gated`: bit for bit the
  Split, SiLU and Mul it replaces, three nodes a layer fewer);
- each GroupQueryAttention as ai.kiln::GroupQueryAttention (same inputs and attributes): bit for bit
  what ONNX Runtime 1.32's CPU kernel computes (the same roundings in the same order, MLAS's exponential
  included), one work item a (row, kv head) whose query heads share each block of keys, the new keys
  rotated straight into the cache; with the recipe's `kv_cache: float16`, where every attention is the
  kernel's, ai.kiln::GroupQueryAttentionFp16Cache over fp16 past and present (the manifest's
  `kernel_kv_cache`), the same sums over the values the cache holds;
- after an fp32 MatMul of a SwiGLU's packed gate and up projections, its Split, Sigmoid and two Muls as
  one ai.kiln::SwiGLU, bit for bit the same numbers in one pass (an fp32 variant's MLP, or a layer a
  quantized variant kept in fp32);
- each MatMul by fp32 weights (an initializer [K, N], or the transpose of one [N, K]: a tied LM head) as
  ai.kiln::MatMulFp32 over the same initializer, which the op packs into panels of 16 columns when the
  session starts (ONNX Runtime's pages of them given back, a tied LM head's too: the embeddings' Gather
  reads a row's page from the file again, once): each output summed in an order fixed by K alone
  (rows, tiles and threads aside), so a row's numbers are the same in any batch, to MLAS's accuracy but
  not its bits.
fp32 variants get a kernels' graph for their MatMuls, attention and SwiGLUs. A 4-bit node with the recipe's
`activations: bf16` (int4's default) is ai.kiln::MatMulInt4BlocksBf16: its activations rounded to bf16
rather than in int8 blocks, its codes in bf16_layout's order (the manifest's `kernel_activations`): on
AVX-512 BF16's instructions where the CPU has them, else the same numbers bit for bit on fused
multiply-adds (bf16()).
The int8 kernels round each activation as MLAS does but sum in another order, and int8 activations carry
a last-bit difference into other roundings a layer later, so the compiler measures the graph against
eager under the variant's gates as it measures model.onnx, and ships it only where it passes; the
manifest names it as the variant's `kernel_model`. A CPU host runs it where the library was built at
install (setup.py; a host without a C compiler skips it) and the CPU has AVX-512 VNNI; anywhere else, or
with KILN_CPU_KERNELS=0, the runtime runs model.onnx, which every ONNX Runtime opens.

Measured on SmolLM2-135M (2 threads, AMD EPYC with AVX-512 VNNI, bench/ab_step.py --alone): a batch-1 decode
step 1.13x MLAS's at 8 bits, where both read the weights at about the memory's rate, and 1.6x at 4 bits with
int8 activations, which MLAS unpacks more slowly; from 32 rows up MLAS is bound by its per-block work (1.4x
to 1.7x). With bf16 activations the 4-bit step is 0.93x the int8-activation kernel's at batch 1, 0.70x and
0.66x at 8 and 32: VDPBF16PS makes half of VNNI's products an instruction, and this CPU issues it no faster
than an FMA. On FMAs alone, as a CPU without AVX-512 BF16 runs it: 0.91x, 0.66x and 0.65x the bf16
instructions' step, 1.59x, 1.12x and 1.08x MLAS's int4 step (which has int8 activations). The attention op
alone: 1.98x ONNX Runtime's at batch 1, 2.30x and 1.92x at batch 8 and 32 (decode,
45 to 77 cached tokens), 1.83x for a 49-token prompt; a batch-32 decode step of int8 1.16x, int4 1.19x and
fp32 1.07x faster with it. The fp32 MatMuls: SmolLM2's fp32 decode step 1.19x, 1.26x and 1.08x MLAS's at
batch 1, 8 and 32, a 32-prompt prefill 1.05x (matmul_fp32.c says why).
"""

from __future__ import annotations

import ctypes
import functools
import os
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path
from typing import Any

import numpy as np

KERNEL_MODEL_FILE = "model_kernels.onnx"
KERNEL_DATA_FILE = "model_kernels.onnx.data"
DOMAIN = "ai.kiln"
INT8_BLOCKS_OP = "MatMulInt8Blocks"
INT4_BLOCKS_OP = "MatMulInt4Blocks"
INT4_BF16_OP = "MatMulInt4BlocksBf16"  # its weights in bf16_layout's order, its activations in bf16
ATTENTION_OP = "GroupQueryAttention"  # in DOMAIN: com.microsoft's inputs, attributes and numbers
ATTENTION_FP16_CACHE_OP = "GroupQueryAttentionFp16Cache"  # the same over an fp16 KV cache (recipe kv_cache)
ATTENTION_INT8_CACHE_OP = "GroupQueryAttentionInt8Cache"  # over an 8-bit one: codes and a scale a slot
SWIGLU_OP = "SwiGLU"  # silu(first half) * second half, after an fp32 MatMul of a SwiGLU MLP's gate and up
FP32_MATMUL_OP = "MatMulFp32"  # ONNX MatMul by fp32 weights [K, N]: each output's blocks of K in a fixed order
DISABLE_VARIABLE = "KILN_CPU_KERNELS"
BF16_PATH_VARIABLE = "KILN_CPU_KERNELS_BF16"  # "fma": the bf16 op's FMA path on a CPU with AVX-512 BF16 too
LIBRARY_VERSION = 9  # kiln_cpu_kernels_version() in runtime/kernels/library.c
BF16_ACTIVATIONS = "bfloat16"  # the manifest's kernel_activations where 4-bit nodes round activations to bf16


@functools.cache
def library() -> tuple[Path | None, str]:
    """The kernel library and "" where this host can run it; else None and why not, in a few words."""
    if os.environ.get(DISABLE_VARIABLE, "1") == "0":
        return None, f"{DISABLE_VARIABLE}=0"
    here = Path(__file__).resolve().parent
    path = next((here / f"_cpu_kernels{suffix}" for suffix in EXTENSION_SUFFIXES
                 if (here / f"_cpu_kernels{suffix}").is_file()), None)
    if path is None:
        return None, "not built (no C compiler when Kiln was installed, or not an x86-64 CPU)"
    try:
        loaded = ctypes.CDLL(str(path))
    except OSError as error:
        return None, f"{path.name} could not be loaded: {error}"
    version = getattr(loaded, "kiln_cpu_kernels_version", None)
    if version is None or version() != LIBRARY_VERSION:
        return None, f"{path.name} was built from other sources than this Kiln's: reinstall Kiln to rebuild it"
    if not loaded.kiln_cpu_kernels_supported():
        return None, "this CPU has no AVX-512 VNNI"
    return path, ""


def bf16() -> bool:
    """Whether the library loaded here multiplies bf16 activations with AVX-512 BF16's instructions; else
    (no AVX-512 BF16, or KILN_CPU_KERNELS_BF16=fma) with fused multiply-adds, the same numbers bit for bit."""
    path = library()[0]
    return bool(path and ctypes.CDLL(str(path)).kiln_cpu_kernels_bf16())


def library_for(graph: Path) -> Path | None:
    """The library a graph file needs where it is a variant's KERNEL_MODEL_FILE and this host runs it."""
    return library()[0] if graph.name == KERNEL_MODEL_FILE else None


def pack_int8_blocks(codes: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None) -> np.ndarray:
    """MatMulNBits' 8-bit weights (codes [N, K/32, 32], scales and zero points [N * K/32]; zero points
    128 where absent) in MatMulInt8Blocks' layout (int8_blocks.c): for each tile of 16 columns and
    block of 32 rows, the codes as 8 groups of 4 rows x 16 columns x 4 bytes, then the 16 scales
    (fp32) and the 16 zero points. Columns past N, to a whole tile, get scale 0."""
    n, blocks, size = codes.shape
    if size != 32:
        raise ValueError(f"codes in blocks of {size}; the kernel takes blocks of 32")
    zero_points = np.full(n * blocks, 128, np.uint8) if zero_points is None else zero_points
    groups = _code_groups(codes)
    tiles = len(groups)
    return np.concatenate([groups.reshape(tiles, blocks, 512), _tile_columns(scales, n, blocks, tiles, np.float32),
                           _tile_columns(zero_points, n, blocks, tiles, np.uint8)], axis=2).reshape(-1)


def pack_int4_blocks(codes: np.ndarray, scales: np.ndarray, zero_points: np.ndarray,
                     offsets: np.ndarray) -> np.ndarray:
    """4-bit weights w = scale * (code - zero point) + offset (codes [N, K/32, 32] of 0..15, the others
    [N, K/32]) in MatMulInt4Blocks' layout (int8_blocks.c): for each tile of 16 columns and block of 32
    rows, pack_int8_blocks' 8 groups of codes with group j in the low nibbles and group j + 4 in the
    high ones (256 bytes), the 16 scales and 16 offsets (fp16), the 16 zero points. Columns past N, to
    a whole tile, get scale and offset 0."""
    n, blocks, size = codes.shape
    if size != 32:
        raise ValueError(f"codes in blocks of {size}; the kernel takes blocks of 32")
    if max(codes.max(initial=0), np.max(zero_points, initial=0)) > 15:
        raise ValueError("4-bit codes and zero points must be 0 to 15")
    if not (np.isfinite(scales).all() and np.isfinite(offsets).all()
            and np.abs(scales).max(initial=0) <= 65504 and np.abs(offsets).max(initial=0) <= 65504):
        raise ValueError("4-bit scales and offsets must be finite and within fp16's range (|x| <= 65504)")
    groups = _code_groups(codes)
    tiles = len(groups)
    nibbles = groups[:, :, :4] | (groups[:, :, 4:] << 4)
    return np.concatenate([nibbles.reshape(tiles, blocks, 256),
                           *(_tile_columns(values, n, blocks, tiles, dtype) for values, dtype in
                             ((scales, np.float16), (offsets, np.float16), (zero_points, np.uint8)))],
                          axis=2).reshape(-1)


def bf16_layout(packed: np.ndarray, k: int) -> np.ndarray:
    """pack_int4_blocks' bytes for K rows in MatMulInt4BlocksBf16's layout: in each tile's block,
    the codes as 8 vectors of 32 bytes, vector p holding for each of the 16 columns the codes of rows 2p
    and 2p + 1 in its low nibbles and of rows 16 + 2p and 17 + 2p in its high ones (one VDPBF16PS
    operand each, widened to 16-bit words); the scales, offsets and zero points where they were."""
    blocks = k // 32
    tiled = packed.reshape(-1, blocks, 336).copy()
    nibbles = tiled[:, :, :256].reshape(-1, blocks, 4, 64)
    groups = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=2)  # [tile, block, group of 4 rows, 16 x 4]
    codes = groups.reshape(-1, blocks, 8, 16, 4).transpose(0, 1, 3, 2, 4).reshape(-1, blocks, 16, 2, 8, 2)
    tiled[:, :, :256] = (codes[:, :, :, 0] | (codes[:, :, :, 1] << 4)).transpose(0, 1, 3, 2, 4).reshape(-1, blocks, 256)
    return tiled.reshape(-1)


def _code_groups(codes: np.ndarray) -> np.ndarray:
    """Codes [N, blocks, 32] as [tiles, blocks, 8, 64], N padded with zeros to whole tiles of 16: per
    group of 4 rows, 16 columns of 4 bytes, what one VNNI instruction multiplies."""
    n, blocks, _ = codes.shape
    tiles = -(-n // 16)
    padded = np.zeros((tiles * 16, blocks, 32), np.uint8)
    padded[:n] = codes
    return padded.reshape(tiles, 16, blocks, 8, 4).transpose(0, 2, 3, 1, 4).reshape(tiles, blocks, 8, 64)


def _tile_columns(values: np.ndarray, n: int, blocks: int, tiles: int, dtype: Any) -> np.ndarray:
    """One value per column and block ([N * blocks], or per column more than `blocks`, the first ones
    kept) as `dtype`, as each tile's block holds them: [tiles, blocks, 16 values' bytes], columns past
    N zero."""
    column = np.zeros((tiles * 16, blocks), dtype)
    column[:n] = np.asarray(values).reshape(n, -1)[:, :blocks]
    return column.reshape(tiles, 16, blocks).transpose(0, 2, 1).copy().view(np.uint8)
