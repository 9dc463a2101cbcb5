"""edgelin.models: bundled checkpoints (config.json + model.safetensors + a model card)."""
