"""transformers' Falcon-Mamba (FalconMambaForCausalLM) for testkit.hf_oracle: the classes (the default perturbation
and cache reading apply)."""

CLASSES = ("FalconMambaConfig", "FalconMambaForCausalLM")
