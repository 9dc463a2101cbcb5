"""transformers' OlmoHybridForCausalLM as the oracle (testkit.hf_oracle): its config and model classes; the default
perturbation (norm weights around 1, the Gated DeltaNet's o_norm and the post-norms included), DynamicCache and cache
reading fit it (a linear-attention layer's cache: the recurrent state and one conv window over [q | k | v])."""

CLASSES = ("OlmoHybridConfig", "OlmoHybridForCausalLM")
