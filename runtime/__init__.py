"""edgelin.runtime: drive an edgelin export with ONNX Runtime. Imports only numpy, onnxruntime and the standard library.

    from edgelin.runtime import load, Generator
    session = load("out/", provider="auto")
    for tok in Generator(session, "Hello", max_new_tokens=32, temperature=0.8, seed=0):
        print(tok.text, end="", flush=True)

Session (load): new_state / prefill / prefill_batch (prompts of different lengths) / decode / load_state; State: fork / save / rows / stack;
Generator: streaming tokens for one prompt or a batch; generate_text: the function behind `edgelin generate`.
"""

from edgelin.runtime.chat import Chat, ChatTemplate
from edgelin.runtime.generate import DEFAULT_PREFILL_CHUNK, MAX_NEW_TOKENS, Generator, Result, Stats, Token, generate_text
from edgelin.runtime.manifest import FORMAT, MANIFEST_FILE, Manifest, StateSpec
from edgelin.runtime.sampling import Sampler, top_k_mask, top_p_mask
from edgelin.runtime.providers import PROVIDERS, ProviderWarning
from edgelin.runtime.session import Session, load
from edgelin.runtime.state import State
from edgelin.runtime.tokenizer import ByteTokenizer, make_tokenizer

__all__ = [
    "Chat", "ChatTemplate",
    "DEFAULT_PREFILL_CHUNK", "FORMAT", "MANIFEST_FILE", "MAX_NEW_TOKENS", "PROVIDERS",
    "ByteTokenizer", "Generator", "Manifest", "ProviderWarning", "Result", "Sampler", "Session", "State",
    "StateSpec", "Stats", "Token", "generate_text", "load", "make_tokenizer", "top_k_mask", "top_p_mask",
]
