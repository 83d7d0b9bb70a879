#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Writes the hostile-file set of tests/data/hostile/: crafted bad .npy and safetensors files and
expected.json, which lists each file with the exact status the reader must return and a substring
of its message. Read by tests/test_hostile.c (the C readers) and tests/test_hostile_cli.py
(`mha run`). Deterministic, standard library only; rerun after editing:
    python3 tests/data/hostile/make_hostile.py
Every safetensors case is loaded with --heads 2; valid_weights.safetensors and valid_input.npy
are the good partners the CLI test pairs each bad file with.
"""
import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
CASES = []


def write(name, data):
    with open(os.path.join(HERE, name), "wb") as f:
        f.write(data)


def case(name, data, status, message, note):
    write(name, data)
    CASES.append({"file": name, "kind": "npy" if name.endswith(".npy") else "safetensors",
                  "status": status, "message": message, "note": note})


# ---------------------------------------------------------------------------------------------
# .npy
# ---------------------------------------------------------------------------------------------
def npy_raw(header, data=b"", major=1, length=None):
    """Magic, version, header length (actual unless `length`), header bytes, data."""
    h = header if isinstance(header, bytes) else header.encode("latin1")
    n = len(h) if length is None else length
    ln = struct.pack("<H", n) if major == 1 else struct.pack("<I", n)
    return b"\x93NUMPY" + bytes([major, 0]) + ln + h + data


def npy(dict_text, data=b"", major=1):
    pre = 10 if major == 1 else 12
    total = (pre + len(dict_text) + 1 + 63) // 64 * 64
    return npy_raw(dict_text + " " * (total - pre - len(dict_text) - 1) + "\n", data, major)


def d(descr="'<f4'", order="False", shape="(4, 4)"):
    return "{'descr': %s, 'fortran_order': %s, 'shape': %s, }" % (descr, order, shape)


F16 = struct.pack("<16f", *range(16))  # 64 bytes: a [4, 4] float32 array

case("npy_empty.npy", b"", "BAD_FILE", "truncated header: the file is 0 bytes", "empty file")
case("npy_bad_magic.npy", b"PK\x03\x04" + b"\0" * 60, "BAD_FILE",
     "not a .npy file (bad magic bytes)", "a zip file, not .npy")
case("npy_truncated_preamble.npy", b"\x93NUMPY\x01", "BAD_FILE", "truncated header",
     "cut inside the preamble")
case("npy_truncated_dict.npy", npy(d(), F16)[:40], "BAD_FILE",
     "truncated header: the header dict is 118 bytes", "cut inside the header dict")
case("npy_truncated_data.npy", npy(d(), F16[:8]), "BAD_FILE",
     "data is 8 bytes, shape (4, 4) of <f4 needs 64", "data shorter than the shape")
case("npy_trailing_data.npy", npy(d(), F16 + b"\0\0\0\0"), "BAD_FILE",
     "data is 68 bytes, shape (4, 4) of <f4 needs 64", "junk after the data")
case("npy_declares_1tb.npy", npy(d(shape="(268435456000,)"), F16), "BAD_FILE",
     "shape (268435456000,) of <f4 needs 1073741824000", "declares a 1 TB array, refused before allocating")
case("npy_shape_overflow.npy", npy(d(shape="(4611686018427387904, 8)"), F16), "BAD_FILE",
     "is too large (its byte size overflows)", "byte size overflows 64 bits")
case("npy_dim_too_big.npy", npy(d(shape="(99999999999999999999,)"), F16), "BAD_FILE",
     "does not fit in 64 bits", "a dimension beyond int64")
case("npy_negative_dim.npy", npy(d(shape="(4, -4)"), F16), "BAD_FILE", "negative dimension",
     "negative dimension")
case("npy_nine_dims.npy", npy(d(shape="(1, 1, 1, 1, 1, 1, 1, 1, 1)"), F16[:4]), "BAD_FILE",
     "more than 8 dimensions", "too many dimensions")
case("npy_nested_shape.npy", npy(d(shape="(" * 200 + "4" + ")" * 200), F16), "BAD_FILE",
     "malformed", "deeply nested shape tuple")
case("npy_shape_string.npy", npy(d(shape="'4'"), F16), "BAD_FILE", "'shape' must be a tuple",
     "shape is a string")
case("npy_fortran_order.npy", npy(d(order="True"), F16), "BAD_FILE",
     "fortran_order True is not supported", "Fortran order")
case("npy_big_endian.npy", npy(d(descr="'>f4'"), F16), "BAD_FILE",
     "big-endian dtype '>f4' is not supported", "big-endian floats")
case("npy_complex.npy", npy(d(descr="'<c8'", shape="(4, 2)"), F16), "BAD_FILE",
     "unsupported dtype '<c8'", "complex dtype")
case("npy_object.npy", npy(d(descr="'|O'", shape="(8,)"), F16), "BAD_FILE",
     "unsupported dtype '|O'", "object (pickled) dtype")
case("npy_structured.npy", npy(d(descr="[('a', '<f4')]", shape="(16,)"), F16), "BAD_FILE",
     "structured dtypes", "structured dtype")
case("npy_dtype_non_utf8.npy", npy_raw(d(descr="'<f\xff'") + " " * 9 + "\n", F16), "BAD_FILE",
     "unsupported dtype", "non-UTF-8 byte in the dtype string")
case("npy_version_4.npy", npy(d(), F16, major=1).replace(b"NUMPY\x01", b"NUMPY\x04", 1),
     "BAD_FILE", "unsupported .npy format version 4.0", "unknown format version")
case("npy_header_len_4gib.npy", npy_raw(d(), F16, major=2, length=0xFFFFFFFF), "BAD_FILE",
     "truncated header", "version 2.0 header length of 4 GiB")
case("npy_duplicate_key.npy",
     npy("{'descr': '<f4', 'descr': '<f8', 'fortran_order': False, 'shape': (4, 4), }", F16),
     "BAD_FILE", "duplicate key 'descr'", "duplicate key")
case("npy_unknown_key.npy",
     npy("{'descr': '<f4', 'fortran_order': False, 'shape': (4, 4), 'pickle': 1, }", F16),
     "BAD_FILE", "unknown key 'pickle'", "unknown key")
case("npy_missing_shape.npy", npy("{'descr': '<f4', 'fortran_order': False, }", F16),
     "BAD_FILE", "no 'shape'", "no shape key")
case("npy_nul_in_header.npy", npy_raw(d() + "\0" * 9 + "\n", F16), "BAD_FILE",
     "unexpected text after the dict", "NUL bytes padding the header")
nan_inf = struct.pack("<16f", *([1.0] * 5 + [float("nan")] + [1.0] * 4 + [float("inf")] + [1.0] * 5))
case("npy_nan_inf_values.npy", npy(d(), nan_inf), "OK", "",
     "NaN and Inf values: read as they are (policy: they propagate per row)")

# ---------------------------------------------------------------------------------------------
# safetensors (loaded with --heads 2)
# ---------------------------------------------------------------------------------------------
def st_raw(header_bytes, data=b"", length=None):
    n = len(header_bytes) if length is None else length
    return struct.pack("<Q", n) + header_bytes + data


def ent(dtype="F32", shape=(4, 4), offsets=(0, 64)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


def layer(overrides=None, extra=None, data=None):
    """A valid 4-feature, 2-head HF layer; `overrides` replaces entries, `extra` adds some."""
    h = {"q_proj.weight": ent(offsets=(0, 64)), "k_proj.weight": ent(offsets=(64, 128)),
         "v_proj.weight": ent(offsets=(128, 192)), "o_proj.weight": ent(offsets=(192, 256))}
    h.update(overrides or {})
    h.update(extra or {})
    blob = data if data is not None else struct.pack("<64f", *[0.01 * (i % 17) for i in range(64)])
    return h, blob


def st(header, blob):
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return st_raw(text, blob)


write("valid_weights.safetensors", st(*layer()))
write("valid_input.npy", npy(d(shape="(3, 4)"), struct.pack("<12f", *[0.1 * i for i in range(12)])))

case("st_empty.safetensors", b"", "BAD_FILE", "too short for a safetensors header", "empty file")
case("st_header_len_2_63.safetensors", st_raw(b"{}", b"", length=1 << 63), "BAD_FILE",
     "header length 9223372036854775808 exceeds the file size", "header length 2^63")
case("st_header_len_max.safetensors", st_raw(b"{}", b"", length=(1 << 64) - 1), "BAD_FILE",
     "header length 18446744073709551615 exceeds the file size", "header length 2^64-1")
case("st_header_past_eof.safetensors", st_raw(b"{}", b"", length=100000), "BAD_FILE",
     "header length 100000 exceeds the file size", "header longer than the file")
case("st_truncated_json.safetensors", st(*layer())[:60], "BAD_FILE", "exceeds the file size",
     "file cut inside the header")
case("st_json_cut.safetensors", st_raw(b'{"q_proj.weight": {"dtype": "F32", "sha'), "BAD_FILE",
     "the safetensors header is not valid JSON", "JSON cut short")
case("st_not_object.safetensors", st_raw(b"[1, 2]  "), "BAD_FILE",
     "the safetensors header is not a JSON object", "top level is an array")
case("st_trailing_junk.safetensors", st_raw(b'{}  xyz '), "BAD_FILE",
     "unexpected bytes after the JSON header", "junk after the JSON")
case("st_nul_padding.safetensors", st_raw(b'{}\0\0\0\0\0\0'), "BAD_FILE",
     "unexpected bytes after the JSON header", "NUL padding instead of spaces")
case("st_deep_nesting.safetensors", st_raw(b'{"__metadata__": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
     "BAD_FILE", "the safetensors header is not valid JSON",
     "5000-deep JSON nesting (cJSON's limit is 1000)")
case("st_metadata_not_object.safetensors", st(*layer(extra={"__metadata__": [1]})), "BAD_FILE",
     "\"__metadata__\" is not a JSON object", "metadata is an array")
case("st_entry_not_object.safetensors", st(*layer(extra={"junk": 1})), "BAD_FILE",
     "tensor 'junk': header entry is not a JSON object", "entry is a number")
case("st_missing_dtype.safetensors",
     st(*layer({"q_proj.weight": {"shape": [4, 4], "data_offsets": [0, 64]}})), "BAD_FILE",
     "tensor 'q_proj.weight': missing or non-string \"dtype\"", "no dtype")
case("st_declares_1tb.safetensors",
     st(*layer(extra={"huge": ent(shape=(262144, 1048576), offsets=(256, 256 + (1 << 40)))})),
     "BAD_FILE", "data_offsets [256, 1099511628032] are outside the 256-byte data buffer",
     "declares a 1 TB tensor: refused before any allocation")
case("st_offsets_out_of_range.safetensors", st(*layer({"o_proj.weight": ent(offsets=(192, 320))})),
     "BAD_FILE", "data_offsets [192, 320] are outside the 256-byte data buffer",
     "end past the data buffer")
case("st_offsets_reversed.safetensors", st(*layer({"o_proj.weight": ent(offsets=(256, 192))})),
     "BAD_FILE", "data_offsets [256, 192] are outside", "begin > end")
case("st_offsets_overlap.safetensors", st(*layer({"k_proj.weight": ent(offsets=(32, 96)),
                                                  "v_proj.weight": ent(offsets=(96, 160)),
                                                  "o_proj.weight": ent(offsets=(160, 224))})),
     "BAD_FILE", "overlap in the data buffer", "overlapping byte ranges")
case("st_offsets_float.safetensors", st(*layer({"q_proj.weight": ent(offsets=(0, 64.5))})),
     "BAD_FILE", "data_offsets are not non-negative integers", "fractional offset")
case("st_offsets_string.safetensors", st(*layer({"q_proj.weight": ent(offsets=("0", 64))})),
     "BAD_FILE", "data_offsets are not non-negative integers", "offset is a string")
case("st_offsets_negative.safetensors", st(*layer({"q_proj.weight": ent(offsets=(-64, 0))})),
     "BAD_FILE", "data_offsets are not non-negative integers", "negative offset")
case("st_offsets_2_64.safetensors",
     st(*layer({"q_proj.weight": ent(offsets=(0, 18446744073709551616))})), "BAD_FILE",
     "data_offsets are not non-negative integers", "offset 2^64 (beyond exact JSON integers)")
case("st_offsets_three.safetensors", st(*layer({"q_proj.weight": ent(offsets=(0, 32, 64))})),
     "BAD_FILE", "\"data_offsets\" must be an array [begin, end]", "three offsets")
case("st_size_mismatch.safetensors", st(*layer({"q_proj.weight": ent(offsets=(0, 60))})),
     "BAD_FILE", "data_offsets [0, 60] hold 60 bytes, but shape [4, 4] of F32 needs 64",
     "byte range does not match the shape")
case("st_negative_dim.safetensors", st(*layer({"q_proj.weight": ent(shape=(-4, -4))})),
     "BAD_FILE", "tensor 'q_proj.weight': shape[0] is not a non-negative integer",
     "negative dimension")
case("st_dim_inf.safetensors", st_raw(json.dumps(layer()[0]).encode().replace(b"[4, 4]", b"[1e999, 4]", 1),
                                      layer()[1]),
     "BAD_FILE", "shape[0] is not a non-negative integer", "dimension 1e999 (infinite double)")
case("st_shape_overflow.safetensors",
     st(*layer({"q_proj.weight": ent(shape=(4294967296, 4294967296, 4294967296))})), "BAD_FILE",
     "the element count of its shape overflows", "element count overflows int64")
case("st_bad_dtype.safetensors", st(*layer({"q_proj.weight": ent(dtype="F33")})), "BAD_FILE",
     "tensor 'q_proj.weight' (query) has dtype F33; supported: F32, F64, F16, BF16",
     "unknown dtype string")
case("st_int_dtype.safetensors",
     st(*layer({"q_proj.weight": ent(dtype="I8", offsets=(0, 16))}, data=struct.pack("<64f", *[0.01] * 64))),
     "BAD_FILE", "has dtype I8", "integer weights")
case("st_wrong_rank.safetensors", st(*layer({"q_proj.weight": ent(shape=(16,))})), "BAD_FILE",
     "tensor 'q_proj.weight' (query) has shape [16], expected 2-d", "1-d weight")
case("st_empty_weight.safetensors",
     st(*layer({"q_proj.weight": ent(shape=(0, 4), offsets=(0, 0))})), "BAD_FILE", "(empty)",
     "zero-sized weight")
case("st_heads_mismatch.safetensors",
     st(*layer({"q_proj.weight": ent(shape=(3, 4), offsets=(0, 48))})), "BAD_FILE",
     "3 rows are not divisible by num_heads 2", "rows not divisible by the heads")
case("st_missing_output.safetensors", st(*layer({}, None))[:0] + st(
    {k: v for k, v in layer()[0].items() if k != "o_proj.weight"}, layer()[1][:192]),
     "NOT_FOUND", "no output weight: tried 'o_proj.weight'", "o_proj.weight missing")
case("st_no_tensors.safetensors", st({}, b""), "NOT_FOUND",
     "no query weight: tried 'q_proj.weight', 'in_proj_weight', 'q_proj_weight'", "empty header")
case("st_duplicate_names.safetensors",
     st_raw(json.dumps(layer()[0]).encode()[:-1] + b', "q_proj.weight": ' +
            json.dumps(ent(offsets=(0, 64))).encode() + b"}", layer()[1]),
     "BAD_FILE", "duplicate tensor name 'q_proj.weight'", "the same name twice")
case("st_name_non_utf8.safetensors",
     st_raw(json.dumps(layer()[0]).encode()[:-1] + b', "bad\xff\xfe\\nname": ' +
            json.dumps(ent(offsets=(0, 999))).encode() + b"}", layer()[1]),
     "BAD_FILE", "are outside the 256-byte data buffer",
     "non-UTF-8 bytes and a newline in a tensor name (one message line in the CLI)")
nan_blob = bytearray(layer()[1])
nan_blob[64 + 4 * 6: 64 + 4 * 7] = struct.pack("<f", float("nan"))
case("st_nan_weight.safetensors", st(layer()[0], bytes(nan_blob)), "BAD_FILE",
     "tensor 'k_proj.weight' element [1, 2] is NaN in float32: weights must be finite",
     "NaN weight")
inf_blob = bytearray(layer()[1])
inf_blob[192 + 4 * 15: 192 + 4 * 16] = struct.pack("<f", float("-inf"))
case("st_inf_weight.safetensors", st(layer()[0], bytes(inf_blob)), "BAD_FILE",
     "tensor 'o_proj.weight' element [3, 3] is infinite", "Inf weight")
h64 = layer()[0]
h64["v_proj.weight"] = ent(dtype="F64", offsets=(128, 256))
h64["o_proj.weight"] = ent(offsets=(256, 320))
blob64 = layer()[1][:128] + struct.pack("<16d", *([0.5] * 7 + [1e300] + [0.5] * 8)) + layer()[1][192:]
case("st_f64_overflow.safetensors", st(h64, blob64), "BAD_FILE",
     "tensor 'v_proj.weight' element [1, 3] is infinite in float32",
     "F64 weight beyond float32 range")

with open(os.path.join(HERE, "expected.json"), "w") as f:
    json.dump({"comment": "Generated by make_hostile.py. Each file: the status the reader returns "
                          "(mha__npy_read for .npy, mha_layer_load_safetensors with num_heads 2 "
                          "for .safetensors) and a substring of its message.",
               "cases": CASES}, f, indent=1)
    f.write("\n")
print("%d cases" % len(CASES))
