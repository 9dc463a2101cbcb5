"""The manifest format's names and fixed values: the format strings, the file and metadata key, the symbolic dims,
the fields of each version, the dtypes, the logits layout and the tokenizer fields. Standard library + numpy only."""

from __future__ import annotations

import numpy as np

FORMAT = "edgelin/2"
FORMAT_V1 = "edgelin/1"  # still read, upgraded in memory
MANIFEST_FILE = "edgelin.json"
METADATA_KEY = "edgelin"  # key of the manifest in each graph's metadata_props
BATCH = "batch"
PAST = "past"  # a growing state's (a KV cache's) positions: 0 for a fresh sequence
PRESENT = "present"  # a growing state's positions after a call: past + the call's tokens, at most its window
STATE_PREFIX, PRESENT_PREFIX = "state.", "present."  # graph input / output name of the state with key K
DTYPES = {"float32": np.float32, "float16": np.float16, "int64": np.int64}
GRAPHS = ("prefill", "decode")
MAX_DIM = 1 << 31  # a fixed dim or vocabulary size beyond this is a corrupt manifest
MAX_MANIFEST_BYTES = 16 << 20
REQUIRED_V1 = (
    "format", "graphs", "input_ids", "logits", "states", "vocab_size", "tokenizer",
    "model", "opset", "precision", "edgelin_version", "source",
)
DROPPED_V1 = ("weights_file",)  # named a file that is not in the export
FIELDS = REQUIRED_V1 + ("sha256", "symbols", "io", "logits_layout", "min_sequence", "prefill_piece", "max_sequence", "lengths", "logits_at", "max_positions", "weights")
WEIGHTS = "weights"  # the key of the weights file's hash in ``sha256``
SEQUENCE = "sequence"
POSITIONS = "positions"  # the prefill graph's logits_at: how many positions' logits one call returns
LOGITS_AT = "logits_at"  # the name edgelin's exports give that input (a manifest may name it otherwise)
SYMBOLS = {
    BATCH: "sequences run together (>= 1); the same for every input and output of one call",
    SEQUENCE: "tokens in one prefill call (>= min_sequence); decode takes exactly 1",
}
GROWING_SYMBOLS = {  # in "symbols" only when a state grows
    PAST: "positions a growing state (a KV cache) holds before a call: 0 for a fresh sequence; the same for "
          "every growing state and row of one call (rows of different lengths are left-padded, see docs/manifest.md)",
    PRESENT: "positions a growing state holds after a call: past + the call's tokens, at most the state's window",
}
POSITIONS_SYMBOL = {  # in "symbols" only when the prefill graph takes logits_at
    POSITIONS: "positions of a prefill call whose logits it returns (logits_at; 1 for a prompt's next token)",
}
SEQUENCE_DIM = {"prefill": SEQUENCE, "decode": 1}  # the token dim of input_ids and logits, per graph
LOGITS_LAYOUT = {"axes": (BATCH, SEQUENCE, "vocab"), "positions": "every", "next_token": "last"}
LOGITS_AT_POSITIONS = "logits_at"  # logits_layout.positions of an export whose prefill graph takes logits_at
LOGITS_DTYPES = ("float32", "float16")
TOKEN_INTS = ("offset", "bos_id", "eos_id", "pad_id")
# tokenizer fields beyond the six every manifest has; a 'huggingface' tokenizer has them all
TOKENIZER_OPTIONAL = ("eos_ids", "add_bos", "skip_special_tokens", "files")
HUGGINGFACE = "huggingface"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
PREFILL_PIECE = 1024  # the runtime's default longest prefill call (tokens); bounds memory for any prompt length
