"""transformers' Lfm3ForCausalLM as the oracle (testkit.hf_oracle): its config and model classes; the default
perturbation (norm weights around 1, the sandwich norms included), DynamicCache and cache reading fit it (a sliding
layer's cache holds its last sliding_window - 1 keys and values)."""

CLASSES = ("Lfm3Config", "Lfm3ForCausalLM")
