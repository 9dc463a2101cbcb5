"""Hugging Face transformers checkpoints, imported onto edgelin's one model skeleton (edgelin.skeleton).

One module per ``model_type``; each reads its config with the shared field framework (edgelin.importers.fields),
builds ``edgelin.skeleton.CausalLM`` from the registered mixer kinds, and loads the weights with the shared
matching (edgelin.importers.weights). Families: ``qwen3_5`` (Qwen3.5's text model, also from the vision-language
checkpoint) in ``edgelin.importers.hf.qwen3_5``. docs/importers.md lists every config field each reads.
"""
