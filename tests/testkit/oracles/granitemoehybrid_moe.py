"""transformers' GraniteMoeHybridForCausalLM with experts as the oracle (testkit.hf_oracle; a name of its own so that
the dense Granite cases keep the default perturbation): the default perturbation (norms around 1, embeddings and the
head, A_log and dt_bias by 0.3, the rest by 0.05) with routers of clear margins (std 0.3 on normed inputs: logits of
std ~1.7, no top-k choice within float32 rounding of a tie)."""

CLASSES = ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM")
ROUTERS = ("block_sparse_moe.router.weight",)
