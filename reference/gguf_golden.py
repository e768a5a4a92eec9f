#!/usr/bin/env python3
"""Golden files for specula-gguf, produced by gguf-py (the independent GGUF implementation).

Writes, under OUT/gguf/:
  synthetic.gguf, synthetic-align64.gguf  small files written by gguf-py's GGUFWriter with every
                                          metadata value type (nested arrays included) and
                                          tensors of many ggml types filled with seeded bytes;
  <name>.json                             what gguf-py's GGUFReader reads from each file, and from
                                          every real model found in --models-dir.

The JSON describes each metadata entry (key, type, scalar value or array element type, length
and a sha256 of the array's elements) and each tensor (name, ggml type, dims in ggml order,
offset relative to the data section, byte size, and for synthetic files a sha256 of its data).
Array hashes are computed from gguf-py's *decoded* values with this canonical encoding, which
the Rust test recomputes from specula's decoded values:
  numbers  little-endian bytes of the declared element type;  bools  one byte 0/1;
  strings  u64 little-endian UTF-8 byte length, then the bytes;
  arrays of arrays (gguf-py flattens their contents)  the raw element bytes gguf-py delimited.
"""

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import gguf
from gguf import GGUFReader, GGUFWriter, GGMLQuantizationType as Q, GGUFValueType as VT

SEED = 20261129

NUMPY_OF = {
    VT.UINT8: "<u1", VT.INT8: "<i1", VT.UINT16: "<u2", VT.INT16: "<i2", VT.UINT32: "<u4",
    VT.INT32: "<i4", VT.FLOAT32: "<f4", VT.UINT64: "<u8", VT.INT64: "<i8", VT.FLOAT64: "<f8",
}

# Real models: cache file name -> golden name (the files `cargo xtask fetch-models` writes).
REAL_MODELS = {
    "SmolLM2-135M-Instruct.Q4_1.gguf": "smollm2-135m",
    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf": "qwen2.5-coder-0.5b",
    "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf": "qwen2.5-coder-1.5b",
    "gemma-3-270m-q4_k_m.gguf": "gemma3-270m",
}


def canonical(field, elem_type, values):
    if elem_type == VT.STRING:
        out = bytearray()
        for s in values:
            b = s.encode("utf-8")
            out += len(b).to_bytes(8, "little") + b
        return bytes(out)
    if elem_type == VT.BOOL:
        return bytes(1 if v else 0 for v in values)
    if elem_type == VT.ARRAY:
        return b"".join(bytes(p) for p in field.parts[5:])
    return np.asarray(values, dtype=NUMPY_OF[elem_type]).tobytes()


def jsonable_scalar(vtype, v):
    if vtype in (VT.FLOAT32, VT.FLOAT64):
        return float(v)
    if vtype == VT.BOOL:
        return bool(v)
    if vtype == VT.STRING:
        return str(v)
    return int(v)


def dump(path: Path, with_data_hash: bool) -> dict:
    r = GGUFReader(path)
    meta = []
    for key, f in r.fields.items():
        if key.startswith("GGUF."):
            continue
        vtype = f.types[0]
        entry = {"key": key, "type": vtype.name}
        if vtype == VT.ARRAY:
            elem = f.types[1]
            # The element count is the array header's u64, which gguf-py keeps as parts[4].
            count = int(f.parts[4][0])
            values = f.contents()
            entry.update(
                elem_type=elem.name,
                len=count,
                sha256=hashlib.sha256(canonical(f, elem, values)).hexdigest(),
            )
            if elem != VT.ARRAY:
                entry["head"] = [jsonable_scalar(elem, v) for v in values[:3]]
        else:
            entry["value"] = jsonable_scalar(vtype, f.contents())
        meta.append(entry)
    tensors = []
    for t in r.tensors:
        entry = {
            "name": t.name,
            "type": Q(t.tensor_type).name,
            "dims": [int(d) for d in t.shape],
            "offset": int(t.data_offset - r.data_offset),
            "n_bytes": int(t.n_bytes),
        }
        if with_data_hash:
            raw = np.asarray(r.data[t.data_offset : t.data_offset + t.n_bytes])
            entry["sha256"] = hashlib.sha256(raw.tobytes()).hexdigest()
        tensors.append(entry)
    return {
        "producer": f"gguf-py {gguf.__version__ if hasattr(gguf, '__version__') else '0.19.0'} GGUFReader",
        "file": path.name,
        "file_size": path.stat().st_size,
        "version": int(r.fields["GGUF.version"].contents()),
        "alignment": int(r.alignment),
        "data_offset": int(r.data_offset),
        "metadata": meta,
        "tensors": tensors,
    }


def write_synthetic(path: Path, alignment: int | None) -> None:
    rng = np.random.default_rng(SEED + (alignment or 0))
    w = GGUFWriter(path, "llama")
    if alignment is not None:
        # add_custom_alignment both writes the key and lays the data out with it
        # (add_key_value alone would write a file whose offsets break its own alignment).
        w.add_custom_alignment(alignment)
    w.add_string("general.name", "specula synthetic — ünïcødé ✓")
    w.add_key_value("test.u8", 255, VT.UINT8)
    w.add_key_value("test.i8", -128, VT.INT8)
    w.add_key_value("test.u16", 65535, VT.UINT16)
    w.add_key_value("test.i16", -32768, VT.INT16)
    w.add_key_value("test.u32", 4294967295, VT.UINT32)
    w.add_key_value("test.i32", -2147483648, VT.INT32)
    w.add_key_value("test.u64", 18446744073709551615, VT.UINT64)
    w.add_key_value("test.i64", -9223372036854775808, VT.INT64)
    w.add_key_value("test.f32", -0.0, VT.FLOAT32)
    w.add_key_value("test.f32_denormal", 1e-40, VT.FLOAT32)
    w.add_key_value("test.f64", 1.0000000000000002, VT.FLOAT64)
    w.add_key_value("test.bool_true", True, VT.BOOL)
    w.add_key_value("test.bool_false", False, VT.BOOL)
    w.add_key_value("test.empty_string", "", VT.STRING)
    w.add_array("test.arr_u8", [0, 1, 255])
    w.add_key_value("test.arr_i8", [-1, 0, 127], VT.ARRAY, sub_type=VT.INT8)
    w.add_key_value("test.arr_u16", [1, 65535], VT.ARRAY, sub_type=VT.UINT16)
    w.add_key_value("test.arr_i16", [-5, 5], VT.ARRAY, sub_type=VT.INT16)
    w.add_key_value("test.arr_u32", [7, 8, 9], VT.ARRAY, sub_type=VT.UINT32)
    w.add_key_value("test.arr_i32", [-7, 8], VT.ARRAY, sub_type=VT.INT32)
    w.add_key_value("test.arr_f32", [0.5, -1.25, 3.0e38], VT.ARRAY, sub_type=VT.FLOAT32)
    w.add_key_value("test.arr_u64", [2**64 - 1, 0], VT.ARRAY, sub_type=VT.UINT64)
    w.add_key_value("test.arr_i64", [-(2**63), 1], VT.ARRAY, sub_type=VT.INT64)
    w.add_key_value("test.arr_f64", [1e300, -2.5], VT.ARRAY, sub_type=VT.FLOAT64)
    w.add_key_value("test.arr_bool", [True, False, True], VT.ARRAY, sub_type=VT.BOOL)
    w.add_array("test.arr_str", ["", "a", "Ġthe", "<|im_end|>", "日本語"])
    w.add_array("test.arr_nested", [[1, 2], [3, 4, 5]])
    w.add_array("test.arr_nested_str", [["x", "yz"], ["w"]])
    w.add_uint32("llama.block_count", 2)
    w.add_uint32("llama.embedding_length", 64)

    def raw(name, qtype, ne0, rows):
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        data = rng.integers(0, 256, size=(rows, ne0 // block * size), dtype=np.uint8)
        w.add_tensor(name, data, raw_dtype=qtype)

    w.add_tensor("t.f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("t.f16", rng.standard_normal((2, 8)).astype(np.float16))
    w.add_tensor("t.i32", rng.integers(-1000, 1000, size=(7,), dtype=np.int32))
    raw("t.bf16", Q.BF16, 16, 2)
    raw("t.q8_0", Q.Q8_0, 64, 3)
    raw("t.q4_0", Q.Q4_0, 32, 2)
    raw("t.q4_1", Q.Q4_1, 32, 1)
    raw("t.q5_k", Q.Q5_K, 256, 1)
    raw("t.q4_k", Q.Q4_K, 512, 2)
    raw("t.q6_k", Q.Q6_K, 256, 1)
    raw("t.iq4_nl", Q.IQ4_NL, 32, 4)
    raw("t.mxfp4", Q.MXFP4, 64, 2)
    raw("t.nvfp4", Q.NVFP4, 128, 2)
    w.add_tensor("t.nvfp4.scale", np.array([0.75], dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="golden/ directory")
    ap.add_argument("--models-dir", type=Path, help="model cache of `cargo xtask fetch-models`")
    args = ap.parse_args()
    out = args.out / "gguf"
    out.mkdir(parents=True, exist_ok=True)
    for name, align in (("synthetic", None), ("synthetic-align64", 64)):
        path = out / f"{name}.gguf"
        write_synthetic(path, align)
        (out / f"{name}.json").write_text(json.dumps(dump(path, True), indent=1) + "\n")
        print(f"wrote {path} ({path.stat().st_size} bytes) and {name}.json")
    types = {t.name: {"id": int(t), "block": b, "bytes": s} for t, (b, s) in gguf.GGML_QUANT_SIZES.items()}
    (out / "ggml_types.json").write_text(json.dumps(types, indent=1) + "\n")
    if args.models_dir:
        for fname, name in REAL_MODELS.items():
            path = args.models_dir / fname
            if not path.exists():
                print(f"skip {name}: {path} not fetched", file=sys.stderr)
                continue
            (out / f"{name}.json").write_text(json.dumps(dump(path, False), indent=1) + "\n")
            print(f"wrote {name}.json from {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
