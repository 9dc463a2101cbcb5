"""transformers' Jamba (JambaForCausalLM) for testkit.hf_oracle: the classes (the default perturbation, its
dt/B/C norm weights around 1 among the others, and cache reading apply)."""

CLASSES = ("JambaConfig", "JambaForCausalLM")
