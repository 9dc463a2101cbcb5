"""transformers' NemotronHForCausalLM with "moe" layers as the oracle (testkit.hf_oracle; a name of its own so that
the dense Nemotron-H cases keep the default perturbation): the default perturbation (norms around 1, embeddings and
the head, A_log and dt_bias by 0.3, the rest by 0.05), routers of clear margins (std 0.3 on normed inputs: sigmoid
scores spread over (0, 1)) and a non-zero score-correction bias (a buffer the default perturbation leaves at zero)."""

CLASSES = ("NemotronHConfig", "NemotronHForCausalLM")
ROUTERS = ("mixer.gate.weight",)
BUFFERS = {"e_score_correction_bias": 0.6}
