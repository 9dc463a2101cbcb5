"""What every precision conversion shares: the choices (precision, state dtype, int8 scheme, embedding storage)
and their checks, the constants of the block-quantised com.microsoft operators, the notes a conversion returns
(``Conversion``) and the quieting of ONNX Runtime's converters."""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable

import onnx

from edgelin.errors import ExportError
from edgelin.runtime.manifest import StateSpec

PRECISIONS = ("fp32", "fp16", "int8", "int4")
STATE_DTYPES = ("float32", "float16")
INT4_BLOCK = 32
TABLE_BLOCK = 32  # the embedding table's quantisation block (along d_model), int8 and int4
EMBEDDING_BITS = {"int8": 8, "int4": 4}
EMBEDDINGS = ("int8", "int4", "fp32")  # how an int8/int4 export stores the token embedding and a tied head
# int8 for both quantised precisions: on the bundled model (int4 export, validate seed 0, --long 1000) a 4-bit
# table moved the held-out bits/byte delta +0.0053 -> +0.0061, greedy agreement 52.5 -> 37.7 % and the long
# stream's rel L2 0.42 -> 1.2 (out of the int4 budget), while an 8-bit one matched the fp32 table (+0.0050,
# 52.5 %, 0.42); "int4" stays a choice for the smallest files
DEFAULT_EMBEDDING = "int8"
# int8's weight schemes. channel: MatMulInteger on per-channel weights, each activation tensor quantised with one scale
# (DynamicQuantizeLinear). block: MatMulNBits, 8 bits, block INT8_BLOCK. Measured (AVX2, ONNX Runtime 1.31; README,
# "Edge precision"): the bundled model's held-out prefill logits against fp32 rel L2 0.0040 (block) vs 0.0256
# (channel), decode level, prefill 4,096 tokens 0.59x; a random-init LFM2-350M (docs/bench/llamacpp-lfm2-350m-int8-
# block.json, 2 threads): forced top-1 vs transformers 81 % vs 56 %, decode 56 vs 46 tokens/s, prefill 4,096 209 vs
# 257 tokens/s, 399 vs 366 MB. channel stays the default for edgelin's own and fla checkpoints (the faster prefill;
# their exports keep their numbers). A transformers checkpoint defaults to block (DEFAULT_INT8_SCHEMES): trained
# hybrids carry activations one scale per tensor cannot resolve. Measured on three checkpoints trained for minutes
# (scripts/train_hf_tiny.py, docs/importers.md): per-channel int8 failed validate in LFM2, Qwen3.5 and Mamba2 (6-9
# checks each: logits, states, greedy), block passed in all three.
INT8_SCHEMES = ("channel", "block")
DEFAULT_INT8_SCHEME = "channel"
DEFAULT_INT8_SCHEMES = {"transformers": "block"}  # framework of the checkpoint (edgelin.upstream.framework_of) -> scheme
INT8_BLOCK = 32
# MatMulNBits' accuracy_level for the quantised table's head and every int4 MatMul: 4, activations quantised to
# int8 per block, integer products. ONNX Runtime 1.31's CPU kernel for 8-bit weights with fp32 activations (levels
# 0, 1) is a slow path: a 65,536 x 1,024 head took 551 ms per decode step against 5.0 ms at level 4 (2 threads, AVX2;
# 4-bit: 14.0 ms at level 0, 2.8 ms at level 4). On the bundled model's int4 export (1 thread, median of 200 decode
# steps, 3 interleaved rounds): 0.64-0.76 ms per token against 1.20-1.91 ms at level 0; validate seed 0 --long 1000:
# held-out delta +0.0052 (+0.0050), greedy 53.3 % (52.5 %), the long stream's rel L2 0.42 (0.42); prefill and
# decode then differ by rel L2 1.4e-2 (the activations are quantised per call), within the int4 budget.
ACCURACY_LEVEL = 4
MS_DOMAIN = "com.microsoft"
FLOAT = onnx.TensorProto.FLOAT


@dataclass
class Conversion:
    precision: str
    kept: list[str] = field(default_factory=list)  # "what (why)": tensors/nodes left in higher precision
    fp32_nodes: int = 0  # fp16: nodes kept in fp32 (the accumulator region)
    eight_bit: int = 0  # int4: MatMuls stored in 8-bit blocks (a layer's eight_bit_linears)
    fp32_routers: int = 0  # int8 / int4: mixture-of-experts routers' MatMuls left in fp32 (``router_matmuls``)
    # initializer -> converter of its bytes, for initializers the conversion retyped but left in their data file
    # (fp16's): ``weights.save_graph`` converts them piece by piece on the way to the new one
    recast: dict[str, Callable[[bytes], bytes]] = field(default_factory=dict)
    spilled: Path | None = None  # a file of tensors the conversion wrote as it went (int8's, int4's): copied on by save_graph, then removed


def check_precision(precision: str, state_dtype: str = "float32") -> None:
    if precision not in PRECISIONS:
        raise ExportError(f"precision {precision!r} is not supported; choose one of {', '.join(PRECISIONS)}")
    if state_dtype not in STATE_DTYPES:
        raise ExportError(f"state dtype {state_dtype!r} is not supported; choose one of {', '.join(STATE_DTYPES)}")
    if state_dtype != "float32" and precision != "fp16":
        raise ExportError(f"a {state_dtype} state needs --precision fp16 (got {precision}); drop --state-dtype")


def state_dtypes(specs: Iterable[StateSpec], precision: str, state_dtype: str = "float32") -> tuple[StateSpec, ...]:
    """The manifest's states for this precision: float states take ``state_dtype`` (fp16 exports only)."""
    check_precision(precision, state_dtype)
    return tuple(replace(s, dtype=state_dtype) if s.dtype == "float32" else s for s in specs)


@contextlib.contextmanager
def quiet():
    """ORT's quantisers log per-node progress and warn about pre-processing; keep the terminal ours."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        root.setLevel(level)


def int8_scheme_choice(precision: str, scheme: str | None, framework: str | None = None) -> str | None:
    """The int8 weight scheme for ``precision`` (None: the default for a checkpoint of ``framework``, None for
    edgelin's own: DEFAULT_INT8_SCHEMES, else DEFAULT_INT8_SCHEME; None for other precisions); ExportError for a
    scheme that is not known or does not apply."""
    if precision != "int8":
        if scheme is not None:
            raise ExportError(f"--int8-scheme applies to int8 exports only (this one is {precision}); drop it or pass --precision int8")
        return None
    if scheme is None:
        return DEFAULT_INT8_SCHEMES.get(framework or "", DEFAULT_INT8_SCHEME)
    if scheme not in INT8_SCHEMES:
        raise ExportError(f"int8 scheme {scheme!r} is not known; choose one of {', '.join(INT8_SCHEMES)}")
    return scheme


def embedding_choice(precision: str, embedding: str | None) -> str:
    """The embedding storage for ``precision`` (None: the default); ExportError for one that does not apply."""
    if precision not in ("int8", "int4"):
        if embedding is not None:
            raise ExportError(f"--embedding applies to int8 and int4 exports; a {precision} export stores the embedding in {precision}")
        return precision
    if embedding is None:
        return DEFAULT_EMBEDDING
    if embedding not in EMBEDDING_BITS and embedding != "fp32":
        raise ExportError(f"embedding storage {embedding!r} is not known; choose one of {', '.join(EMBEDDINGS)}")
    return embedding


SLAB_BYTES = 16 << 20  # float32 bytes of a weight quantised at a time (int8's and int4's converters)


def slab_columns(rows: int) -> int:
    """How many columns of a weight with ``rows`` rows make a slab of SLAB_BYTES in float32 (at least one)."""
    return max(1, SLAB_BYTES // (4 * rows))
