#!/usr/bin/env python3
"""Golden files for specula-quant, produced by independent implementations of every block format.

Writes, under OUT/quant/:
  input.f32                   32 rows x 512 little-endian f32 values (seeded numpy; see make_input
                              for what each row is for: Gaussian, uniform, heavy tails, 1e-3 and
                              1e3 scales, all-zero, constant, exact rounding ties, +-0, f32
                              denormals, negative maxima, outliers, values near the fp16 limits...);
  quantize/<type>.bin         every row of input.f32 quantized, rows back to back;
  quantize/iq4_nl_ref.bin     the KV-cache IQ4_NL quantizer (quantize_row_iq4_nl_ref, ntry = -1);
  dequantize/<type>.in        64 seeded random blocks (scale fields forced finite and moderate);
  dequantize/<type>.out       their dequantized values, little-endian f32;
  wht/forward.f32             the fork's forward rotation of every 128-value group of input.f32;
  index.json                  producer, geometry and seed of every file;
  MANIFEST.md                 the same for humans.

Oracles (never specula's own code):
  gguf-py 0.19.0 (`gguf.quants.quantize` / `dequantize`) for q4_0 q4_1 q5_0 q5_1 q8_0 mxfp4 f16
  bf16 quantization and for every dequantizer it has; cross-checked against ggml C when
  --ggml-lib is given (ggml wins and the disagreement is reported and recorded if they differ);
  ggml C (libggml-base.so of the llama.cpp vendored by llama-cpp-python 0.3.36, upstream commit
  0c1e57098, built by reference/build_llama_cpp.sh) through ctypes: `ggml_quantize_chunk` (what
  llama-quantize calls) for q2_k q3_k q4_k q5_k q6_k iq4_nl iq4_xs nvfp4, and
  `quantize_row_iq4_nl_ref`, `quantize_row_q8_1_ref`, `quantize_row_q8_K_ref`,
  `dequantize_row_q8_K`;
  a numpy reimplementation of the TurboQuant fork's quantize_row_turbo{2,3,4}_0_ref (research
  note quant.md section 5.5, sign tables copied from the fork's `turbo_cpu_s1/s2`, post-PR #197
  centroids) for turbo2/3/4; it reproduces the C worked example of quant.md section 8.

Without --ggml-lib (as `cargo xtask golden` runs it) only the gguf-py and numpy files are
rewritten; the ggml files are kept, after checking that input.f32 regenerates byte-identically.
"""

import argparse
import ctypes
import importlib.metadata
import datetime
import json
import platform
import sys
from pathlib import Path

import numpy as np
import gguf
from gguf import GGMLQuantizationType as Q

SEED = 20261129
ROWS = 32
N_PER_ROW = 512
DEQ_BLOCKS = 64
DEQ_FLOAT_VALUES = 2048  # f16 / bf16 "blocks" are single values; use more of them

GGUF_PY = f"gguf-py {importlib.metadata.version('gguf')}"
GGML = "ggml C (llama.cpp vendored by llama-cpp-python 0.3.36, upstream 0c1e57098)"
NUMPY_TURBO = "numpy reimplementation of the TurboQuant fork's quantize_row_turbo*_0_ref"

# name -> (ggml id or None, block values, block bytes); ids from ggml/include/ggml.h, checked
# against ggml_type_name / ggml_blck_size / ggml_type_size when the library is loaded.
TYPES = {
    "f16": (1, 1, 2),
    "bf16": (30, 1, 2),
    "q4_0": (2, 32, 18),
    "q4_1": (3, 32, 20),
    "q5_0": (6, 32, 22),
    "q5_1": (7, 32, 24),
    "q8_0": (8, 32, 34),
    "q8_1": (9, 32, 36),
    "q2_k": (10, 256, 84),
    "q3_k": (11, 256, 110),
    "q4_k": (12, 256, 144),
    "q5_k": (13, 256, 176),
    "q6_k": (14, 256, 210),
    "q8_k": (15, 256, 292),
    "iq4_nl": (20, 32, 18),
    "iq4_xs": (23, 256, 136),
    "mxfp4": (39, 32, 17),
    "nvfp4": (40, 64, 36),
    "turbo2": (None, 128, 34),
    "turbo3": (None, 128, 50),
    "turbo4": (None, 128, 66),
}
GGUF_PY_QUANT = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "mxfp4", "f16", "bf16"]
GGML_CHUNK_QUANT = ["q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs", "nvfp4"]
GGML_REF_QUANT = {  # golden name -> (ggml symbol, type name)
    "iq4_nl_ref": ("quantize_row_iq4_nl_ref", "iq4_nl"),
    "q8_1": ("quantize_row_q8_1_ref", "q8_1"),
    "q8_k": ("quantize_row_q8_K_ref", "q8_k"),
}
GQ = {
    "f16": Q.F16, "bf16": Q.BF16, "q4_0": Q.Q4_0, "q4_1": Q.Q4_1, "q5_0": Q.Q5_0,
    "q5_1": Q.Q5_1, "q8_0": Q.Q8_0, "q2_k": Q.Q2_K, "q3_k": Q.Q3_K, "q4_k": Q.Q4_K,
    "q5_k": Q.Q5_K, "q6_k": Q.Q6_K, "iq4_nl": Q.IQ4_NL, "iq4_xs": Q.IQ4_XS,
    "mxfp4": Q.MXFP4, "nvfp4": Q.NVFP4,
}
# ggml dequantizers exported by libggml-base (gguf-py cross-check, or oracle for q8_k).
GGML_DEQ = {
    "q4_0": "dequantize_row_q4_0", "q4_1": "dequantize_row_q4_1", "q5_0": "dequantize_row_q5_0",
    "q5_1": "dequantize_row_q5_1", "q8_0": "dequantize_row_q8_0", "q2_k": "dequantize_row_q2_K",
    "q3_k": "dequantize_row_q3_K", "q4_k": "dequantize_row_q4_K", "q5_k": "dequantize_row_q5_K",
    "q6_k": "dequantize_row_q6_K", "q8_k": "dequantize_row_q8_K",
    "iq4_nl": "dequantize_row_iq4_nl", "iq4_xs": "dequantize_row_iq4_xs",
    "mxfp4": "dequantize_row_mxfp4", "nvfp4": "dequantize_row_nvfp4",
    "f16": "ggml_fp16_to_fp32_row", "bf16": "ggml_bf16_to_fp32_row",
}
# Offsets of the f16 scale fields inside each block (forced finite in the dequantizer inputs).
F16_FIELDS = {
    "q4_0": [0], "q4_1": [0, 2], "q5_0": [0], "q5_1": [0, 2], "q8_0": [0], "q8_1": [0, 2],
    "q2_k": [80, 82], "q3_k": [108], "q4_k": [0, 2], "q5_k": [0, 2], "q6_k": [208],
    "iq4_nl": [0], "iq4_xs": [0], "turbo2": [0], "turbo3": [0], "turbo4": [0],
}

# ---------------------------------------------------------------------------------------------
# TurboQuant tables (fork, post-PR #197). Signs: `turbo_cpu_s1` / `turbo_cpu_s2` as in the
# fork's CPU source (identical to ggml-cpu/ops.cpp turbo_wht_s1/s2 and the CUDA
# TURBO_WHT_SIGNS1/2); centroids and midpoints as the f32 literals of `turbo-quant.cuh`.

TURBO_S1 = np.array([
    -1, 1, 1, -1, -1, 1, -1, 1, -1, -1, 1, 1, 1, 1, 1, 1, 1, -1, 1, -1, 1, -1, -1, 1, 1, 1, -1, 1, 1, -1, -1, -1,
    -1, 1, 1, -1, 1, 1, -1, 1, -1, 1, 1, -1, -1, 1, -1, 1, 1, 1, 1, -1, -1, -1, -1, -1, 1, -1, 1, 1, 1, 1, -1, 1,
    -1, -1, 1, -1, -1, -1, 1, -1, -1, -1, 1, -1, -1, -1, 1, 1, 1, -1, -1, 1, 1, 1, -1, -1, 1, 1, -1, 1, 1, -1, 1, -1,
    -1, 1, 1, -1, 1, -1, 1, -1, 1, 1, 1, 1, -1, 1, -1, 1, 1, -1, 1, 1, -1, -1, -1, -1, -1, 1, 1, -1, 1, 1, -1, 1,
], dtype=np.float32)
TURBO_S2 = np.array([
    1, 1, 1, 1, -1, 1, 1, -1, 1, -1, -1, -1, 1, -1, -1, -1, 1, 1, -1, -1, 1, -1, 1, -1, 1, -1, -1, 1, -1, 1, 1, 1,
    1, 1, -1, -1, -1, 1, -1, -1, -1, -1, -1, -1, 1, 1, 1, -1, 1, -1, 1, 1, 1, -1, -1, 1, -1, -1, -1, -1, -1, -1, 1, 1,
    1, -1, 1, -1, -1, -1, -1, 1, -1, 1, -1, 1, -1, -1, 1, 1, -1, 1, -1, 1, 1, -1, 1, -1, -1, -1, -1, 1, -1, -1, 1, -1,
    1, -1, 1, 1, 1, -1, -1, 1, -1, 1, -1, 1, 1, -1, -1, 1, -1, 1, -1, 1, 1, -1, 1, -1, 1, -1, -1, -1, -1, -1, 1, -1,
], dtype=np.float32)
assert TURBO_S1.shape == (128,) and TURBO_S2.shape == (128,)
TURBO_INV_SQRT = np.float32(0.08838834764831845)  # the fork's f32 literal for 1/sqrt(128)

TURBO_CENTROIDS = {
    2: np.array([-0.133462, -0.039994, 0.039994, 0.133462], dtype=np.float32),
    3: np.array([-0.190207, -0.118786, -0.066822, -0.021663,
                 0.021663, 0.066822, 0.118786, 0.190207], dtype=np.float32),
    4: np.array([-0.241529, -0.182877, -0.143016, -0.111036, -0.083292, -0.058050, -0.034299, -0.011349,
                 0.011349, 0.034299, 0.058050, 0.083292, 0.111036, 0.143016, 0.182877, 0.241529],
                dtype=np.float32),
}
TURBO_THRESHOLDS = {
    2: np.array([-0.086728, 0.0, 0.086728], dtype=np.float32),
    3: np.array([-0.154496, -0.092804, -0.044243, 0.0, 0.044243, 0.092804, 0.154496], dtype=np.float32),
    4: np.array([-0.212203, -0.162947, -0.127026, -0.097164, -0.070671, -0.046174, -0.022824, 0.0,
                 0.022824, 0.046174, 0.070671, 0.097164, 0.127026, 0.162947, 0.212203], dtype=np.float32),
}
F32_EPS_NORM = np.float32(1e-10)


def turbo_fwht(x):
    """Forward rotation of one 128-group in f32: signs s1, butterflies h = 1..64, x (1/sqrt128 * s2)."""
    z = (x.astype(np.float32) * TURBO_S1).astype(np.float32)
    h = 1
    while h < 128:
        z = z.reshape(-1, 2 * h)
        a, b = z[:, :h], z[:, h:]
        z = np.concatenate([a + b, a - b], axis=1).reshape(128)  # element-wise f32, exact order-free
        h *= 2
    return z * (TURBO_INV_SQRT * TURBO_S2)  # C: x[i] *= inv_sqrt * s2[i]


def seq_sum_sq(v):
    """`float s = 0; for (i) s += v[i]*v[i];` with f32 rounding at every step (no FMA)."""
    s = np.float32(0.0)
    for e in v:
        s = np.float32(s + np.float32(e * e))
    return s


def turbo_quantize_group(x, bits):
    x = np.asarray(x, dtype=np.float32)
    norm = np.sqrt(seq_sum_sq(x))
    inv = np.float32(1.0) / norm if norm > F32_EPS_NORM else np.float32(0.0)
    z = turbo_fwht((x * inv).astype(np.float32))
    thr = TURBO_THRESHOLDS[bits]
    # idx = number of ascending thresholds t with z >= t (strict `<` test: ties go up)
    idx = (z[:, None] >= thr[None, :]).sum(axis=1).astype(np.uint8)
    recon = np.sqrt(seq_sum_sq(TURBO_CENTROIDS[bits][idx]))
    stored = norm / recon if recon > F32_EPS_NORM else norm
    with np.errstate(over="ignore"):  # norms above 65504 become inf, as GGML_FP32_TO_FP16 does
        return idx, np.float32(stored).astype(np.float16)


def turbo_pack(idx, norm16, bits):
    out = bytearray(norm16.tobytes())
    if bits == 2:
        qs = np.zeros(32, np.uint8)
        for j in range(128):
            qs[j // 4] |= np.uint8(idx[j] << (2 * (j % 4)))
        out += qs.tobytes()
    elif bits == 3:
        qs = np.zeros(32, np.uint8)
        signs = np.zeros(16, np.uint8)
        for j in range(128):
            qs[j // 4] |= np.uint8((idx[j] & 3) << (2 * (j % 4)))
            signs[j // 8] |= np.uint8(((idx[j] >> 2) & 1) << (j % 8))
        out += qs.tobytes() + signs.tobytes()
    else:
        qs = (idx[0::2] | (idx[1::2] << 4)).astype(np.uint8)
        out += qs.tobytes()
    return bytes(out)


def turbo_unpack(block, bits):
    norm = np.frombuffer(block[:2], dtype=np.float16)[0].astype(np.float32)
    b = np.frombuffer(block[2:], dtype=np.uint8)
    j = np.arange(128)
    if bits == 2:
        idx = (b[j // 4] >> (2 * (j % 4))) & 3
    elif bits == 3:
        idx = ((b[j // 4] >> (2 * (j % 4))) & 3) | (((b[32 + j // 8] >> (j % 8)) & 1) << 2)
    else:
        idx = (b[j // 2] >> (4 * (j % 2))) & 15
    return (TURBO_CENTROIDS[bits][idx] * norm).astype(np.float32)


def turbo_quantize_rows(x, bits):
    out = bytearray()
    for row in x:
        for g in range(0, row.size, 128):
            idx, n16 = turbo_quantize_group(row[g:g + 128], bits)
            out += turbo_pack(idx, n16, bits)
    return bytes(out)


def check_turbo_worked_example():
    """quant.md section 8: x_j = (j - 127.5)/32 * (1 + 0.5 sin j), first 128 values, C bytes."""
    j = np.arange(256, dtype=np.float64)
    x = ((j - 127.5) / 32.0 * (1.0 + 0.5 * np.sin(j))).astype(np.float32)[:128]
    expect = {
        2: ("cb4fa9256a290d2fa5ae", 31.171875),
        3: ("244f521b95160b471a49", 28.5625),
        4: ("114f95aa571abb49b51a", 28.265625),
    }
    for bits, (hexs, norm) in expect.items():
        idx, n16 = turbo_quantize_group(x, bits)
        blk = turbo_pack(idx, n16, bits)
        got = blk[:10].hex()
        assert got == hexs, f"turbo{bits} worked example: {got} != {hexs}"
        assert float(n16) == norm, f"turbo{bits} worked example norm {float(n16)} != {norm}"
        # the fork's C sign tables and this butterfly order must be an orthogonal rotation
    r = turbo_fwht(np.eye(128, dtype=np.float32)[5])
    assert abs(float(np.dot(r.astype(np.float64), r.astype(np.float64))) - 1.0) < 1e-6


# ---------------------------------------------------------------------------------------------
# The common input


def f32_denormals(rng, n):
    mant = rng.integers(1, 1 << 23, size=n, dtype=np.uint32)
    sign = rng.integers(0, 2, size=n, dtype=np.uint32) << np.uint32(31)
    return (mant | sign).view(np.float32)


def make_input(rng):
    """32 rows of 512 values; returns (array, list of row descriptions)."""
    n = N_PER_ROW
    rows, what = [], []

    def add(v, desc):
        v = np.asarray(v, dtype=np.float32)
        assert v.shape == (n,), desc
        assert np.all(np.isfinite(v)), desc
        rows.append(v)
        what.append(desc)

    add(rng.standard_normal(n), "N(0,1)")
    add(rng.standard_normal(n), "N(0,1)")
    add(rng.standard_normal(n) * 1e-3, "N(0,1) x 1e-3")
    add(rng.standard_normal(n) * 1e3, "N(0,1) x 1e3")
    add(rng.uniform(-1.0, 1.0, n), "uniform(-1,1)")
    add(rng.uniform(0.0, 1.0, n), "uniform(0,1), non-negative")
    add(rng.uniform(-3.0, -1.0, n), "uniform(-3,-1), all negative")
    add(rng.standard_t(3.0, n), "Student-t, 3 degrees of freedom")
    add(np.clip(rng.standard_t(1.5, n), -3e4, 3e4), "Student-t, 1.5 degrees of freedom (clipped to +-3e4)")
    add(np.zeros(n), "all zero")
    add(np.full(n, 0.3712890625), "constant 0.3712890625")

    # Exact rounding ties, block by block (32-value blocks; the kinds cycle).
    def tie_block(kind):
        b = np.zeros(32)
        if kind == "q8_0":  # amax 127 -> d = 1 exactly (q8_0, q8_1); x = k + 0.5 ties away from 0
            b[:] = rng.integers(-127, 127, 32) + 0.5
            b[rng.integers(0, 32)] = 127.0 * rng.choice([-1.0, 1.0])
        elif kind == "q4_0-":  # signed max -8 -> d = 1; x + 8.5 integral
            b[:] = rng.integers(-8, 7, 32) + 0.5
            b[rng.integers(0, 32)] = -8.0
        elif kind == "q4_0+":  # signed max +8 -> d = -1
            b[:] = rng.integers(-7, 7, 32) + 0.5
            b[rng.integers(0, 32)] = 8.0
        elif kind == "q5_0":  # signed max -16 -> d = 1; x + 16.5 integral
            b[:] = rng.integers(-16, 15, 32) + 0.5
            b[rng.integers(0, 32)] = -16.0
        elif kind == "q4_1":  # min 0, max 15 -> d = 1; (x - min) + 0.5 integral
            b[:] = rng.integers(0, 15, 32) + 0.5
            b[0], b[31] = 0.0, 15.0
        elif kind == "q5_1":  # min -3, max 28 -> d = 1
            b[:] = rng.integers(-3, 28, 32) + 0.5
            b[3], b[17] = -3.0, 28.0
        elif kind == "fp4":  # amax 6 in every 16 -> MXFP4 e = 127, NVFP4 ue4m3(1) : d = 0.5; midpoints
            mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
            b[:] = rng.choice(mids, 32) * rng.choice([-1.0, 1.0], 32)
            b[0] = 6.0 * rng.choice([-1.0, 1.0])
            b[16] = 6.0 * rng.choice([-1.0, 1.0])
        elif kind == "iq4_nl":  # signed max -127 -> d0 = +-1; midpoints of kvalues_iq4nl
            kv = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], float)
            mids = (kv[1:] + kv[:-1]) / 2
            mids = np.concatenate([mids, -mids])
            mids = mids[np.abs(mids) < 127]
            b[:] = rng.choice(mids, 32)
            b[rng.integers(0, 32)] = -127.0
        return b

    add(np.concatenate([tie_block(k) for k in ["q8_0", "q4_0-", "q4_0+", "q5_0"] * 4]),
        "exact ties: blocks with amax 127 (q8_0, q8_1: d = 1, x = k + 0.5), signed max -8 / +8 (q4_0: d = +-1), "
        "signed max -16 (q5_0: d = 1)")
    add(np.concatenate([tie_block(k) for k in ["q4_1", "q5_1", "fp4", "iq4_nl"] * 4]),
        "exact ties: min 0 / max 15 (q4_1: d = 1), min -3 / max 28 (q5_1: d = 1), amax 6 per 16 with E2M1 "
        "midpoints (mxfp4, nvfp4: d = 0.5), signed max -127 with kvalues_iq4nl midpoints (iq4_nl)")

    # +-0 mixes
    blocks = []
    for k in range(16):
        kind = k % 4
        if kind == 0:
            b = np.full(32, -0.0 if k % 8 == 0 else 0.0)
        elif kind == 1:
            b = np.where(rng.integers(0, 2, 32) == 1, -0.0, 0.0)
        elif kind == 2:
            b = np.where(rng.integers(0, 2, 32) == 1, -0.0, 0.0)
            pos = rng.integers(0, 32, 3)
            b[pos] = rng.standard_normal(3) * 1e-3
        else:
            b = rng.standard_normal(32)
            b[rng.integers(0, 2, 32) == 1] = -0.0
        blocks.append(b)
    add(np.concatenate(blocks), "+0 / -0 mixes: all -0 blocks, all +0 blocks, random signed zeros, with a few small "
        "values, half zeros")

    # f32 denormals mixed with normals (every block and every 16-value group has normals)
    v = f32_denormals(rng, n).astype(np.float32)
    normal = rng.standard_normal(n)
    tiny_blocks = np.repeat(rng.permutation(16) < 4, 32)  # 4 blocks whose normals are ~1e-30
    normal = np.where(tiny_blocks, normal * 1e-30, normal)
    keep = (np.arange(n) % 4) == 0
    v = np.where(keep, normal.astype(np.float32), v)
    add(v, "f32 denormals, every 4th value normal (N(0,1), or N(0,1) x 1e-30 in 4 blocks)")

    # Blocks whose largest-magnitude element is negative
    v = rng.standard_normal(n)
    for b in range(16):
        blk = v[32 * b:32 * b + 32]
        p = rng.integers(0, 32)
        blk[p] = -(np.abs(blk).max() + rng.uniform(0.1, 2.0))
    add(v, "N(0,1), in every 32-block the largest-magnitude element negative")

    v = rng.standard_normal(n)
    v[137] = 1e4
    add(v, "N(0,1) with a single outlier 1e4 at index 137")

    # Values near the fp16 maximum (65504; 65519.996 rounds down to it, 65520 rounds to inf)
    v = rng.uniform(3e4, 65504.0, n) * rng.choice([-1.0, 1.0], n)
    v[::7] = rng.standard_normal(v[::7].size)
    v[[5, 100, 201, 333, 480]] = [65504.0, -65504.0, 65519.996, 65520.0, -65519.0]
    add(v, "near the fp16 maximum: +-U(3e4, 65504), every 7th N(0,1), 65504, -65504, 65519.996, 65520 "
        "(f16 overflows to inf), -65519")

    # Values near the fp16 minimum normal 2^-14 and in its subnormal range, with exact f16 ties
    mag = 2.0 ** rng.uniform(-26.0, -13.0, n)
    v = mag * rng.choice([-1.0, 1.0], n)
    specials = [2.0 ** -14, -(2.0 ** -14), 2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -25, -(5 * 2.0 ** -25),
                2.0 ** -14 * (1 - 2.0 ** -11), 2.0 ** -14 * (1 + 2.0 ** -11), 2.0 ** -14 * (1 - 2.0 ** -12)]
    v[40:40 + len(specials)] = specials
    add(v, "near the fp16 minimum normal 2^-14: +-2^U(-26,-13), plus 2^-14, 2^-24, 2^-25 (f16 tie), 3*2^-25, "
        "neighbours of 2^-14")

    add(rng.standard_normal(n) * np.repeat(10.0 ** rng.uniform(-4, 4, 16), 32),
        "N(0,1), each 32-block scaled by 10^U(-4,4)")
    v = np.zeros(n)
    pos = rng.choice(n, 24, replace=False)
    v[pos] = rng.standard_normal(24) * 3
    add(v, "sparse: 24 N(0,3^2) values, the rest 0")
    add(rng.standard_normal(n) + 5.0, "N(5,1), all positive offset")
    add(rng.laplace(0.0, 1.0, n), "Laplace(0,1)")
    add(rng.integers(-8, 9, n).astype(np.float64), "integers in [-8, 8]")

    # Equal magnitudes of opposite sign: the first occurrence decides the signed maximum
    v = rng.uniform(-1.0, 1.0, n)
    for b in range(16):
        i, k = sorted(rng.choice(32, 2, replace=False))
        s = 1.0 if b % 2 == 0 else -1.0
        v[32 * b + i], v[32 * b + k] = 5.0 * s, -5.0 * s
    add(v, "uniform(-1,1), each block with +5 and -5 (alternating which comes first)")

    v = rng.standard_normal(n)
    v[7::128] *= 10.0
    v[77::128] *= 10.0
    add(v, "N(0,1), channels 7 and 77 of every 128-group x10 (KV-cache-like outlier channels)")
    add((2.0 ** rng.uniform(-24.0, 14.0, n)) * rng.choice([-1.0, 1.0], n), "+-2^U(-24,14), log-uniform magnitudes")
    add(rng.standard_t(2.0, n) * 0.01, "Student-t, 2 degrees of freedom, x 0.01")
    add(rng.uniform(-1.0, 1.0, n) * 1e3, "uniform(-1,1) x 1e3")
    add(np.round(rng.standard_normal(n) * 8.0) / 8.0, "N(0,1) rounded to multiples of 1/8")
    add((np.arange(n) - 255.5) / 64.0, "linear ramp (j - 255.5) / 64")
    add(rng.standard_normal(n), "N(0,1)")
    assert len(rows) == ROWS, len(rows)
    return np.stack(rows).astype(np.float32), what


# ---------------------------------------------------------------------------------------------
# ggml through ctypes


class Ggml:
    def __init__(self, path):
        self.path = path
        lib = ctypes.CDLL(str(path))
        self.lib = lib
        lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                            ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        lib.ggml_quantize_chunk.restype = ctypes.c_size_t
        lib.ggml_type_name.argtypes = [ctypes.c_int]
        lib.ggml_type_name.restype = ctypes.c_char_p
        lib.ggml_type_size.argtypes = [ctypes.c_int]
        lib.ggml_type_size.restype = ctypes.c_size_t
        lib.ggml_blck_size.argtypes = [ctypes.c_int]
        lib.ggml_blck_size.restype = ctypes.c_int64
        for name, (gid, blk, size) in TYPES.items():
            if gid is None:
                continue
            got = (lib.ggml_type_name(gid).decode().lower(), lib.ggml_blck_size(gid), lib.ggml_type_size(gid))
            assert got == (name, blk, size), f"ggml type {gid}: {got} != {(name, blk, size)}"
        for sym in ["quantize_row_iq4_nl_ref", "quantize_row_q8_1_ref", "quantize_row_q8_K_ref",
                    "quantize_row_q4_0_ref",
                    "quantize_row_q4_1_ref", "quantize_row_q5_0_ref", "quantize_row_q5_1_ref", "quantize_row_q8_0_ref",
                    "quantize_row_mxfp4_ref", "ggml_fp32_to_fp16_row", "ggml_fp32_to_bf16_row_ref",
                    *GGML_DEQ.values()]:
            f = getattr(lib, sym)
            f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
            f.restype = None

    def quantize_chunk(self, name, x):
        gid, _, _ = TYPES[name]
        x = np.ascontiguousarray(x, dtype=np.float32)
        nrows, n = x.shape
        row_bytes = n // TYPES[name][1] * TYPES[name][2]
        out = np.zeros(nrows * row_bytes, dtype=np.uint8)
        got = self.lib.ggml_quantize_chunk(gid, x.ctypes.data, out.ctypes.data, 0, nrows, n, None)
        assert got == out.size, (name, got, out.size)
        return out.tobytes()

    def row_fn(self, sym, x, out_bytes):
        x = np.ascontiguousarray(x, dtype=np.float32).ravel()
        out = np.zeros(out_bytes, dtype=np.uint8)
        getattr(self.lib, sym)(x.ctypes.data, out.ctypes.data, x.size)
        return out.tobytes()

    def dequantize(self, name, data, n_values):
        src = np.frombuffer(data, dtype=np.uint8).copy()
        out = np.zeros(n_values, dtype=np.float32)
        getattr(self.lib, GGML_DEQ[name])(src.ctypes.data, out.ctypes.data, n_values)
        return out


# ---------------------------------------------------------------------------------------------
# Dequantizer inputs


def moderate_f16(rng, k):
    """Random f16 values of moderate magnitude: +-2^U(-16, 4) (includes some f16 subnormals)."""
    v = (2.0 ** rng.uniform(-16.0, 4.0, k)) * rng.choice([-1.0, 1.0], k)
    return v.astype(np.float16)


def random_blocks(rng, name):
    gid, blk, size = TYPES[name]
    if name in ("f16", "bf16"):
        bits = rng.integers(0, 1 << 16, DEQ_FLOAT_VALUES, dtype=np.uint16)
        if name == "f16":
            bad = (bits & 0x7C00) == 0x7C00
            bits[bad] &= np.uint16(0xBFFF)  # clear the top exponent bit: finite
            specials = [0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x0400, 0x7BFF, 0xFBFF, 0x7C00, 0xFC00, 0x3C00]
        else:
            bad = (bits & 0x7F80) == 0x7F80
            bits[bad] &= np.uint16(0xBFFF)
            specials = [0x0000, 0x8000, 0x0001, 0x8001, 0x007F, 0x0080, 0x7F7F, 0xFF7F, 0x7F80, 0xFF80, 0x3F80]
        bits[:len(specials)] = specials  # signed zeros, subnormals, min normal, max, +-inf, 1.0
        return bits.tobytes()
    raw = rng.integers(0, 256, (DEQ_BLOCKS, size), dtype=np.uint8)
    for off in F16_FIELDS.get(name, []):
        raw[:, off:off + 2] = moderate_f16(rng, DEQ_BLOCKS).view(np.uint8).reshape(DEQ_BLOCKS, 2)
    if name == "q8_k":
        d = ((2.0 ** rng.uniform(-20.0, 4.0, DEQ_BLOCKS)) * rng.choice([-1.0, 1.0], DEQ_BLOCKS)).astype(np.float32)
        raw[:, 0:4] = d.view(np.uint8).reshape(DEQ_BLOCKS, 4)
    if name == "mxfp4":
        raw[:, 0] = rng.integers(100, 155, DEQ_BLOCKS)
    if name == "nvfp4":
        # UE4M3 scales 0x00..0x7E: converters strip the sign bit; 0x7F (NaN in E4M3) excluded
        raw[:, 0:4] = rng.integers(0, 0x7F, (DEQ_BLOCKS, 4))
    if name in ("turbo2", "turbo3", "turbo4"):
        raw[:, 0:2] = (np.abs(moderate_f16(rng, DEQ_BLOCKS).astype(np.float32)) * 64).astype(np.float16) \
            .view(np.uint8).reshape(DEQ_BLOCKS, 2)
    return raw.tobytes()


def gguf_dequantize(name, data):
    return gguf.quants.dequantize(np.frombuffer(data, dtype=np.uint8).copy(), GQ[name]).astype(np.float32).ravel()


def q8_1_as_q8_0(data):
    """A q8_1 block {d, s, qs[32]} dequantizes as the q8_0 block {d, qs[32]} (s is a cached sum)."""
    b = np.frombuffer(data, dtype=np.uint8).reshape(-1, 36)
    return np.concatenate([b[:, 0:2], b[:, 4:36]], axis=1).tobytes()


# ---------------------------------------------------------------------------------------------


def first_diff(a, b, size):
    for i in range(0, min(len(a), len(b)), size):
        if a[i:i + size] != b[i:i + size]:
            return i // size, a[i:i + size].hex(), b[i:i + size].hex()
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="golden/ directory")
    ap.add_argument("--ggml-lib", type=Path, help="libggml-base.so built by reference/build_llama_cpp.sh")
    ap.add_argument("--models-dir", type=Path, help="ignored (passed by `cargo xtask golden`)")
    ap.add_argument("--date", default=datetime.date.today().isoformat(), help="date recorded in MANIFEST.md")
    args = ap.parse_args()

    out = args.out / "quant"
    (out / "quantize").mkdir(parents=True, exist_ok=True)
    (out / "dequantize").mkdir(parents=True, exist_ok=True)
    ggml = Ggml(args.ggml_lib) if args.ggml_lib else None

    check_turbo_worked_example()
    print("turbo: numpy reimplementation reproduces the worked example of quant.md section 8")

    rng = np.random.default_rng(SEED)
    x, row_desc = make_input(rng)
    input_bytes = x.astype("<f4").tobytes()
    if ggml is None:
        old = out / "input.f32"
        if not old.exists() or old.read_bytes() != input_bytes:
            print("error: input.f32 would change; regenerate with --ggml-lib so the ggml goldens follow",
                  file=sys.stderr)
            return 1
        print("no --ggml-lib: keeping the ggml-produced files; rewriting gguf-py and numpy files")
    (out / "input.f32").write_bytes(input_bytes)

    index_path = out / "index.json"
    old_index = json.loads(index_path.read_text()) if index_path.exists() else {}
    files = {} if ggml else dict(old_index.get("files", {}))
    notes = [] if ggml else list(old_index.get("notes", []))
    files["input.f32"] = {"producer": f"numpy {np.__version__} Generator(PCG64), seed {SEED}",
                          "rows": ROWS, "n_per_row": N_PER_ROW, "seed": SEED, "dtype": "f32le", "row_kinds": row_desc}

    old_files = old_index.get("files", {})
    old_bytes = {} if ggml else {p: (out / p).read_bytes() for p in old_files if (out / p).exists()}

    def record(path, producer, rows, n_per_row, ty, seed=SEED, **extra):
        if path in old_bytes and old_bytes[path] == (out / path).read_bytes():
            files[path] = old_files[path]  # unchanged: keep what the full (ggml) run recorded
            return
        files[path] = {"producer": producer, "type": ty, "rows": rows, "n_per_row": n_per_row, "seed": seed, **extra}

    # --- quantizers: gguf-py, cross-checked against ggml
    for name in GGUF_PY_QUANT:
        with np.errstate(over="ignore"):  # 65520 overflows to inf in f16, as in ggml
            py = gguf.quants.quantize(x, GQ[name]).tobytes()
        producer, extra = GGUF_PY, {}
        if ggml is None and files.get(f"quantize/{name}.bin", {}).get("producer", "").startswith("ggml"):
            print(f"quantize {name}: keeping ggml's golden (gguf-py disagreed when it was made)")
            continue
        if ggml:
            c = ggml.quantize_chunk(name, x)
            size = TYPES[name][2]
            d = first_diff(py, c, size)
            ref_sym = {"f16": "ggml_fp32_to_fp16_row", "bf16": "ggml_fp32_to_bf16_row_ref"}.get(
                name, f"quantize_row_{name}_ref")
            c_ref = ggml.row_fn(ref_sym, x, len(c))
            assert c_ref == c, f"{name}: ggml_quantize_chunk != {ref_sym}"
            if d is None:
                extra["cross_check"] = f"identical to ggml_quantize_chunk and {ref_sym}"
                print(f"quantize {name}: gguf-py == ggml")
            else:
                bad = [i // size for i in range(0, len(c), size) if py[i:i + size] != c[i:i + size]]
                nd = len(bad)
                blk = TYPES[name][1]
                flat = x.ravel()
                zero_blocks = all(np.all(flat[b * blk:(b + 1) * blk] == 0) for b in bad)
                only_sign = all(bytes(p ^ q for p, q in zip(py[b * size:(b + 1) * size], c[b * size:(b + 1) * size]))
                                .strip(b"\x00") in (b"\x80",) for b in bad)
                why = ""
                if zero_blocks and only_sign:
                    why = (" - all of them are all-zero input blocks (mixes of +0 and -0) and the only difference is "
                           "the sign bit of an f16 zero scale field: ggml starts its running max/min from +0.0f / "
                           "FLT_MAX and keeps the first value on equality, numpy's argmax/min pick another signed "
                           "zero; both decode to zeros")
                msg = (f"{name}: gguf-py and ggml quantizers disagree on {nd} of {len(c) // size} blocks "
                       f"(blocks {bad}; first: gguf-py {d[1]}, ggml {d[2]}){why}; golden is ggml's")
                print("DISAGREEMENT " + msg)
                notes.append(msg)
                py = c
                producer = f"{GGML}: ggml_quantize_chunk ({ref_sym}), gguf-py disagrees (see notes)"
                extra["gguf_py_disagrees_blocks"] = nd
        (out / "quantize" / f"{name}.bin").write_bytes(py)
        record(f"quantize/{name}.bin", producer, ROWS, N_PER_ROW, name, input="input.f32", **extra)

    # --- quantizers only ggml has
    if ggml:
        for name in GGML_CHUNK_QUANT:
            c = ggml.quantize_chunk(name, x)
            extra = {}
            if name != "iq4_nl":  # ggml_quantize_chunk without imatrix = quantize_row_*_ref
                sym = {"q2_k": "quantize_row_q2_K_ref", "q3_k": "quantize_row_q3_K_ref",
                       "q4_k": "quantize_row_q4_K_ref", "q5_k": "quantize_row_q5_K_ref",
                       "q6_k": "quantize_row_q6_K_ref", "iq4_xs": "quantize_row_iq4_xs_ref",
                       "nvfp4": "quantize_row_nvfp4_ref"}[name]
                f = getattr(ggml.lib, sym)
                f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
                f.restype = None
                assert ggml.row_fn(sym, x, len(c)) == c, f"{name}: chunk != {sym}"
                extra["cross_check"] = f"identical to {sym}"
            else:
                extra["variant"] = "quantize_iq4_nl (ntry = 7, llama-quantize)"
            (out / "quantize" / f"{name}.bin").write_bytes(c)
            record(f"quantize/{name}.bin", f"{GGML}: ggml_quantize_chunk(imatrix = NULL)", ROWS, N_PER_ROW, name,
                   input="input.f32", **extra)
            print(f"quantize {name}: ggml_quantize_chunk")
        for gname, (sym, ty) in GGML_REF_QUANT.items():
            nbytes = ROWS * (N_PER_ROW // TYPES[ty][1]) * TYPES[ty][2]
            c = ggml.row_fn(sym, x, nbytes)
            (out / "quantize" / f"{gname}.bin").write_bytes(c)
            extra = {}
            if gname == "iq4_nl_ref":
                extra["variant"] = "ntry = -1 (CPU from_float, KV-cache writes)"
                # With ntry = -1 a block whose max |x| < GROUP_MAX_EPS (1e-15f) never writes its codes:
                # quantize_row_iq4_nl_impl `continue`s before filling L and only recomputes L when
                # ntry > 0, so the block packs whatever L held (the previous block's codes, or
                # uninitialised stack for the first block of a call). Only its zero d is specified.
                amax = np.abs(x.reshape(-1, 32)).max(axis=1)
                stale = [int(b) for b in np.nonzero(amax < np.float32(1e-15))[0]]
                blocks = np.frombuffer(c, dtype=np.uint8).reshape(-1, 18)
                assert all(blocks[b, 0] == 0 and blocks[b, 1] in (0x00, 0x80) for b in stale)
                per_row = b"".join(ggml.row_fn(sym, row, len(c) // ROWS) for row in x)
                live = np.ones(len(blocks), bool)
                live[stale] = False
                assert np.array_equal(np.frombuffer(per_row, np.uint8).reshape(-1, 18)[live], blocks[live])
                extra["codes_unspecified_blocks"] = stale
                extra["codes_unspecified_reason"] = (
                    "blocks (row * 16 + block) whose max |x| < GROUP_MAX_EPS = 1e-15: ggml leaves their codes as "
                    "whatever its L buffer held (the previous block's codes, or uninitialised stack), so only d = 0 "
                    "is specified; tests compare d only")
            record(f"quantize/{gname}.bin", f"{GGML}: {sym}", ROWS, N_PER_ROW, ty, input="input.f32", **extra)
            print(f"quantize {gname}: {sym}")

    # --- turbo quantizers
    for bits in (2, 3, 4):
        name = f"turbo{bits}"
        data = turbo_quantize_rows(x, bits)
        assert len(data) == ROWS * (N_PER_ROW // 128) * TYPES[name][2]
        (out / "quantize" / f"{name}.bin").write_bytes(data)
        record(f"quantize/{name}.bin", NUMPY_TURBO, ROWS, N_PER_ROW, name, input="input.f32",
               check="reproduces the C bytes of quant.md section 8")
        print(f"quantize {name}: numpy")

    # --- the rotation on its own (what the turbo codes depend on bit for bit)
    (out / "wht").mkdir(parents=True, exist_ok=True)
    rot = np.concatenate([turbo_fwht(g) for g in x.reshape(-1, 128)]).astype("<f4")
    (out / "wht" / "forward.f32").write_bytes(rot.tobytes())
    record("wht/forward.f32", f"{NUMPY_TURBO}: turbo_cpu_fwht (forward, group 128) in f32", ROWS, N_PER_ROW,
           "wht", input="input.f32", check="the rotation behind the turbo goldens")
    print("wht forward: numpy")

    # --- dequantizers
    drng = np.random.default_rng(SEED + 1)
    for name in TYPES:
        gid, blk, size = TYPES[name]
        data = random_blocks(drng, name)  # drawn for every type so the stream does not depend on --ggml-lib
        n_values = DEQ_FLOAT_VALUES if blk == 1 else DEQ_BLOCKS * blk
        extra = {}
        if name in ("q8_k",):
            if ggml is None:
                continue
            y = ggml.dequantize(name, data, n_values)
            producer = f"{GGML}: dequantize_row_q8_K (gguf-py has no Q8_K codec)"
        elif name == "q8_1":
            as_q80 = q8_1_as_q8_0(data)
            y = gguf_dequantize("q8_0", as_q80)
            producer = (f"{GGUF_PY} Q8_0 dequantize of the blocks with the s field removed "
                        "(neither gguf-py nor ggml has a Q8_1 dequantizer; y = d * qs)")
            if ggml:
                assert ggml.dequantize("q8_0", as_q80, n_values).tobytes() == y.tobytes()
                extra["cross_check"] = "identical to ggml dequantize_row_q8_0 on the same q8_0 blocks"
        elif name.startswith("turbo"):
            bits = int(name[-1])
            y = np.concatenate([turbo_unpack(data[i:i + size], bits) for i in range(0, len(data), size)])
            producer = f"{NUMPY_TURBO} (dequantize: centroid[idx] * f32(norm), rotated domain)"
        else:
            y = gguf_dequantize(name, data)
            producer = GGUF_PY
            if ggml:
                c = ggml.dequantize(name, data, n_values)
                if c.view(np.uint32).tobytes() != y.view(np.uint32).tobytes():
                    bad = int(np.sum(c.view(np.uint32) != y.view(np.uint32)))
                    msg = f"dequantize {name}: gguf-py and ggml differ in {bad} values; golden is ggml's"
                    print("DISAGREEMENT " + msg)
                    notes.append(msg)
                    y, producer = c, f"{GGML}: {GGML_DEQ[name]} (gguf-py disagrees, see notes)"
                else:
                    extra["cross_check"] = f"bit-identical to ggml {GGML_DEQ[name]}"
        y = np.asarray(y, dtype=np.float32)
        assert y.size == n_values, (name, y.size)
        assert not np.any(np.isnan(y)), name
        (out / "dequantize" / f"{name}.in").write_bytes(data)
        (out / "dequantize" / f"{name}.out").write_bytes(y.astype("<f4").tobytes())
        nblocks = len(data) // size
        record(f"dequantize/{name}.in", f"numpy random bytes, seed {SEED + 1} (scale fields forced finite)", 1,
               n_values, name, seed=SEED + 1, blocks=nblocks)
        record(f"dequantize/{name}.out", producer, 1, n_values, name, seed=SEED + 1, blocks=nblocks,
               input=f"dequantize/{name}.in",
               **extra)
        print(f"dequantize {name}: {producer.split(':')[0]}")

    versions = {"python": platform.python_version(), "numpy": np.__version__, "gguf": GGUF_PY,
                "ggml": GGML if ggml else old_index.get("versions", {}).get("ggml", GGML)}
    index = {"generator": "reference/quant_golden.py", "seed": SEED, "dequantize_seed": SEED + 1,
             "date": args.date, "versions": versions, "notes": notes,
             "files": dict(sorted(files.items()))}
    index_path.write_text(json.dumps(index, indent=1) + "\n")
    write_manifest(out, index, row_desc)
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"wrote {len(files)} files under {out} ({total} bytes)")
    return 0


def write_manifest(out, index, row_desc):
    v = index["versions"]
    lines = [
        "# golden/quant/",
        "",
        "Golden vectors of `specula-quant`, read by `crates/quant/tests/golden.rs`. Never edit by hand:",
        "regenerate with `reference/quant_golden.py --out golden --ggml-lib <libggml-base.so>` after",
        "building the oracle with `reference/build_llama_cpp.sh <dir>` (see `index.json` for the",
        "machine-readable version of this file).",
        "",
        "| | |",
        "|---|---|",
        "| script | `reference/quant_golden.py` |",
        f"| gguf-py | {v['gguf']} (`gguf.quants.quantize` / `dequantize`) |",
        f"| ggml | {v['ggml']}, built by `reference/build_llama_cpp.sh` (Release, shared, GGML_NATIVE=ON; "
        "`libggml-base.so`, through ctypes) |",
        "| turbo | numpy reimplementation of the TurboQuant fork's `quantize_row_turbo{2,3,4}_0_ref` "
        "(quant.md section 5.5; fork sign tables `turbo_cpu_s1/s2`; post-PR #197 centroids and "
        "thresholds); checked against the C bytes of quant.md section 8 |",
        f"| numpy | {v['numpy']} |",
        f"| Python | {v['python']} |",
        f"| seed | {index['seed']} (input.f32), {index['dequantize_seed']} (dequantizer inputs) |",
        f"| date | {index['date']} |",
        "",
        "## input.f32",
        "",
        f"{ROWS} rows x {N_PER_ROW} little-endian f32 (`numpy.random.default_rng({index['seed']})`), no inf/NaN:",
        "",
        "| row | values |",
        "|---|---|",
    ]
    lines += [f"| {i} | {d} |" for i, d in enumerate(row_desc)]
    lines += [
        "",
        "## Files",
        "",
        "`quantize/<type>.bin` holds every row of input.f32 quantized, row after row (512 values per",
        "row: 16 blocks of 32, 8 NVFP4 blocks, 4 turbo groups, 2 super-blocks of 256).",
        "`dequantize/<type>.in` holds 64 random blocks (2048 values for f16/bf16) with every f16 scale",
        "field forced to +-2^U(-16,4) (turbo norms positive), q8_K's f32 d to +-2^U(-20,4), MXFP4 `e` in",
        "100..154 and NVFP4 scale bytes in 0x00..0x7E; `dequantize/<type>.out` the f32 values they decode to",
        "(one row of all blocks). f16/bf16 inputs are random finite bit patterns plus signed zeros,",
        "subnormals, extremes and +-inf. `wht/forward.f32` is the forward rotation of every 128-value",
        "group of input.f32 (raw values, not normalised), as the fork's `turbo_cpu_fwht` computes it in f32.",
        "",
        "| File | Type | Producer | Notes |",
        "|---|---|---|---|",
    ]
    for path, f in index["files"].items():
        if path == "input.f32":
            continue
        size = (out / path).stat().st_size
        note = "; ".join(str(f[k]) for k in ("variant", "cross_check", "check") if k in f)
        if "codes_unspecified_blocks" in f:
            note += (f"; codes of {len(f['codes_unspecified_blocks'])} blocks unspecified: "
                     f"{f['codes_unspecified_reason']} (listed in index.json)")
        lines.append(f"| `{path}` ({size} B) | {f['type']} | {f['producer']} | {note} |")
    lines += ["", "## Disagreements between gguf-py and ggml", ""]
    lines += [f"- {n}" for n in index["notes"]] or ["None: every gguf-py codec that exists matched ggml bit for bit."]
    lines.append("")
    (out / "MANIFEST.md").write_text("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
