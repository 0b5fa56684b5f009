"""Compile every kernel for an H100 (sm_90) without a GPU and report its global memory accesses.

Run as ``TRITON_INTERPRET=0 python -m tests.kernels.compile_for_gpu``: prints one JSON object
mapping ``kernel[variant]`` to the count of each ``ld.global`` / ``st.global`` PTX instruction.
The Triton wheel ships the NVIDIA backend and ptxas, so this checks on a CPU-only machine that the
kernels build for a real GPU and that their hot paths use 16-byte vector accesses (``.v4.b32``).
"""

import collections
import importlib
import json
import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

# import_module returns the op modules themselves (the package attributes of the same names are
# the public functions).
flatten = importlib.import_module("flashfsdp.kernels.flatten")
unflatten = importlib.import_module("flashfsdp.kernels.unflatten")
accumulate_grad_shard = importlib.import_module("flashfsdp.kernels.accumulate_grad_shard")
quantize = importlib.import_module("flashfsdp.kernels.quantize")

TARGET = GPUTarget("cuda", 90, 32)
DIVISIBLE_16 = [["tt.divisibility", 16]]


def compile_kernel(fn, signature, constexprs, divisible, num_warps):
    """How many PTX global loads and stores of each kind ``fn`` compiled for :data:`TARGET` has."""
    names = list(signature)
    attrs = {(names.index(name),): DIVISIBLE_16 for name in divisible}
    source = ASTSource(fn=fn, signature={**signature, **{k: "constexpr" for k in constexprs}},
                       constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(source, target=TARGET, options={"num_warps": num_warps, "enable_fp_fusion": False})
    ptx = compiled.asm["ptx"]
    return dict(collections.Counter(re.findall(r"(?:ld|st)\.global[.\w]*", ptx)))


def main():
    report = {}
    for dtype in ("fp32", "bf16", "fp16"):
        report[f"flatten[out={dtype}]"] = compile_kernel(
            flatten.flatten_kernel,
            {"table_ptr": "*i64", "n_segments": "i32", "out_ptr": f"*{dtype}", "scale": "fp32"},
            {"BLOCK": flatten.BLOCK, "APPLY_SCALE": True}, ["table_ptr", "out_ptr"], flatten.NUM_WARPS)
        report[f"unflatten[flat={dtype}]"] = compile_kernel(
            unflatten.unflatten_kernel,
            {"table_ptr": "*i64", "n_segments": "i32", "flat_ptr": f"*{dtype}"},
            {"BLOCK": unflatten.BLOCK}, ["table_ptr", "flat_ptr"], unflatten.NUM_WARPS)
    for src, dst, n_type in (("fp32", "fp32", "i32"), ("bf16", "fp32", "i64"), ("fp32", "bf16", "i32")):
        report[f"accumulate[{src}->{dst},n={n_type}]"] = compile_kernel(
            accumulate_grad_shard.accumulate_kernel,
            {"src_ptr": f"*{src}", "dst_ptr": f"*{dst}", "partial_sum_ptr": "*fp32", "partial_flag_ptr": "*i32",
             "n": n_type, "scale": "fp32"},
            {"BLOCK": accumulate_grad_shard.BLOCK, "ACCUMULATE": True, "APPLY_SCALE": True},
            ["src_ptr", "dst_ptr", "partial_sum_ptr", "partial_flag_ptr", "n"], accumulate_grad_shard.NUM_WARPS)
    report["finalize"] = compile_kernel(
        accumulate_grad_shard.finalize_kernel,
        {"partial_sum_ptr": "*fp32", "partial_flag_ptr": "*i32", "n_partials": "i32", "norm_sq_ptr": "*fp32",
         "flag_ptr": "*u8"},
        {"BLOCK": accumulate_grad_shard.FINALIZE_BLOCK}, ["partial_sum_ptr", "partial_flag_ptr"],
        accumulate_grad_shard.FINALIZE_WARPS)
    # quantize_int8 / quantize_grad, dequantize_int8 / dequantize_reduce: int8 and int4 payloads
    # (int4 packs nibble pairs with tl.split / tl.join), float and requantised outputs
    rows = quantize.rows_per_program(quantize.BLOCK_SIZE)
    for bits in (8, 4):
        report[f"quantize[bits={bits}]"] = compile_kernel(
            quantize.quantize_kernel,
            {"src_ptr": "*fp32", "packed_ptr": "*i8", "scales_ptr": "*fp32", "n": "i32", "n_blocks": "i32",
             "chunk_bytes": "i64", "scales_start": "i64", "nodes": "i32", "local_size": "i32"},
            {"BLOCK": quantize.BLOCK_SIZE, "ROWS": rows, "BITS": bits, "QMAX": float(quantize.QMAX_BY_BITS[bits])},
            ["src_ptr", "packed_ptr", "scales_ptr"], quantize.NUM_WARPS)
    for bits, out, out_bits in ((8, "fp32", 0), (4, "bf16", 0), (4, "i8", 4), (8, "i8", 4)):
        report[f"dequantize_reduce[bits={bits}->{out_bits or out}]"] = compile_kernel(
            quantize.dequantize_reduce_kernel,
            {"packed_ptr": "*i8", "scales_ptr": "*fp32", "out_ptr": f"*{out}", "out_scales_ptr": "*fp32",
             "n": "i32", "n_blocks": "i32", "senders": "i32", "chunks": "i32", "chunk_bytes": "i64",
             "scales_start": "i64", "out_chunk_bytes": "i64", "out_scales_start": "i64"},
            {"BLOCK": quantize.BLOCK_SIZE, "ROWS": rows, "BITS": bits, "OUT_BITS": out_bits,
             "OUT_QMAX": float(quantize.QMAX_BY_BITS[out_bits or 8])},
            ["packed_ptr", "scales_ptr", "out_ptr", "out_scales_ptr"], quantize.NUM_WARPS)
    json.dump(report, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
