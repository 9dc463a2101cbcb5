"""edgelin.exporters: a LinearLM -> prefill.onnx + decode.onnx + edgelin.json."""
