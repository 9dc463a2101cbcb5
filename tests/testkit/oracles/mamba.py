"""transformers' Mamba (MambaForCausalLM) for testkit.hf_oracle: the classes (the default perturbation and cache
reading apply: its cache holds a recurrent state [B, I, N] and a conv window [B, I, K] per layer)."""

CLASSES = ("MambaConfig", "MambaForCausalLM")
