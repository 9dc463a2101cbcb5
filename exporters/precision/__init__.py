"""fp32 graphs -> fp16, int8 or int4 graphs: the post-processing behind ``edgelin export --precision``.

The exporter traces the model in fp32 and checks the graphs; this module then rewrites each graph with
ONNX Runtime's own tooling and writes by hand only the choice of what stays in fp32:

    fp32   the traced graphs, unchanged
    fp16   weights and activations in fp16 (``onnxruntime.transformers.float16``). The recurrent state
           S, the denominator z and everything computed from them up to the normalising division stay
           in fp32 (they are running sums: |z| grows linearly with the tokens read and passes fp16's
           65504 after some tens of thousands of tokens), as do the prefill's cumulative sums over
           chunks and each decay's path into them from its Softplus (``decay_region``). Graph state IO is fp32; ``state_dtype="float16"`` stores the float states as fp16
           between steps (the sums are still formed in fp32, then rounded for storage).
    int8   (scheme "channel", the default) per-channel int8 weights for every MatMul with a constant weight (the numbers and graph pattern of
           ``onnxruntime.quantization.quantize_dynamic``, computed here one weight at a time read from the graph's
           data file: ``int8_file``); activations are quantised at run time, one
           scale per tensor. Weights use 7 of the 8 bits (``reduce_range``, values in [-64, 64]): ONNX
           Runtime's u8 x s8 kernel on x86 CPUs without VNNI (AVX2 only) adds pairs of products in int16
           and saturates for full-range weights. Measured on an AVX2-only AMD EPYC, the tiny test model's
           prefill logits against fp32: rel L2 0.68 with full-range weights, 0.063 with reduce_range
           (0.049 with u8 weights, a kernel fewer runtimes have); with VNNI or on ARM the two agree. An
           export is made once and run on many CPUs, so it takes the range that is right on all of them.
           Scheme "block" (``int8_scheme``): the same weights block-quantised along K, 8 bits, block 32, one scale
           per block (llama.cpp's Q8_0), as MatMulNBits with int8 activations per block (accuracy_level 4): the
           activations get a scale per 32 values instead of one per tensor, so an outlier no longer costs a whole
           tensor its resolution (INT8_SCHEMES says what it costs).
    int4   4-bit symmetric block-quantised weights, block 32 (``MatMulNBitsQuantizer``: MatMulNBits, the
           op onnxruntime-genai runs on CPU), computing with int8 activations per block (accuracy_level 4,
           ACCURACY_LEVEL); every other op in fp32.

Embedding and tied head (int8, int4): a vocabulary of 250k at d_model 1024 is a quarter of a billion weights,
read by the token embedding's Gather (rows) and, in a tied model, transposed by the head's MatMul. Both are
block-quantised from one table (``quantise_table``: symmetric, block 32 along d_model, stored unsigned with
zero point 2^(bits-1), the layout ONNX Runtime's com.microsoft MatMulNBits and GatherBlockQuantized read):
the Gather becomes GatherBlockQuantized and a tied head's Transpose + MatMul becomes MatMulNBits on the same
bytes, which the weights file stores once. The table is 8-bit by default in both precisions (``embedding``:
"int8"; "int4" for the smallest files, "fp32" to keep it exact; see DEFAULT_EMBEDDING for why 8). An untied
head is a MatMul with a constant weight like any other in int8; in int4 it is stored as the table is (8-bit by
default: ``int4._quantise_untied_head`` says why). A d_model that is not a multiple of the block keeps the table in
fp32, said in the notes. The logits output stays fp32 in every precision.

``convert(proto, precision, state_dtype=...)`` returns the new graph and ``Conversion`` notes (what was
kept in higher precision and why); ``state_dtypes`` gives the manifest's state dtypes.

The package: ``common`` (the choices, their checks, ``Conversion``), ``fp16`` (and its fp32 regions), ``int8``,
``int4`` and ``tables`` (the embedding table and the tied head, for both). Import from this package.
"""

from __future__ import annotations

from typing import Callable

import onnx

from edgelin.exporters.precision.common import (
    DEFAULT_EMBEDDING, DEFAULT_INT8_SCHEME, DEFAULT_INT8_SCHEMES, EMBEDDING_BITS, EMBEDDINGS, INT4_BLOCK, INT8_BLOCK, INT8_SCHEMES,
    PRECISIONS, STATE_DTYPES, TABLE_BLOCK, Conversion, check_precision, embedding_choice, int8_scheme_choice, state_dtypes,
)
from edgelin.exporters.precision.fp16 import ACCUMULATORS, accumulator_region, angle_region, convert_fp16, decay_region, fp16_file, norm_region
from edgelin.exporters.precision.int4 import convert_int4, int4_file, untied_head
from edgelin.exporters.precision.int8 import convert_int8, int8_file, quantise_int8_blocks, quantise_int8_columns
from edgelin.exporters.precision.tables import dequantise_table, quantise_table


def convert_fp32(proto: onnx.ModelProto, state_dtype: str, embedding: str = "fp32") -> tuple[onnx.ModelProto, Conversion]:
    return proto, Conversion("fp32")


CONVERTERS: dict[str, Callable[..., tuple[onnx.ModelProto, Conversion]]] = {
    "fp32": convert_fp32, "fp16": convert_fp16, "int8": convert_int8, "int4": convert_int4,
}


def convert(proto: onnx.ModelProto, precision: str, *, state_dtype: str = "float32", embedding: str | None = None,
            int8_scheme: str | None = None, eight_bit: frozenset[str] = frozenset()) -> tuple[onnx.ModelProto, Conversion]:
    """One fp32 graph (prefill or decode, as the exporter writes it) in ``precision``. ``embedding``: how an
    int8 or int4 export stores the token embedding and a tied head ("int8" by default, "int4", "fp32";
    ``embedding_choice``). ``int8_scheme``: int8's weights, "channel" (the default) or "block" (INT8_SCHEMES).
    ``eight_bit``: int4 only, the digests of weights kept in 8-bit blocks (``convert_int4``)."""
    check_precision(precision, state_dtype)
    scheme = int8_scheme_choice(precision, int8_scheme)
    extra: dict = {"scheme": scheme} if scheme else {}
    if precision == "int4" and eight_bit:
        extra["eight_bit"] = eight_bit
    return CONVERTERS[precision](proto, state_dtype, embedding_choice(precision, embedding), **extra)


__all__ = ["ACCUMULATORS", "CONVERTERS", "Conversion", "DEFAULT_INT8_SCHEME", "DEFAULT_INT8_SCHEMES", "INT4_BLOCK", "INT8_BLOCK", "INT8_SCHEMES", "PRECISIONS", "STATE_DTYPES", "DEFAULT_EMBEDDING", "EMBEDDINGS", "EMBEDDING_BITS", "TABLE_BLOCK", "accumulator_region", "angle_region",
           "check_precision", "convert", "decay_region", "fp16_file", "int4_file", "dequantise_table", "embedding_choice", "int8_file", "int8_scheme_choice", "norm_region", "quantise_int8_blocks", "quantise_int8_columns", "quantise_table", "state_dtypes", "untied_head"]
