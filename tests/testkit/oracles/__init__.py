"""Per-family hooks of the transformers oracle (testkit.hf_oracle): one module per model_type."""
