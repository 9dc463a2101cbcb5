"""edgelin: linear-attention language models to ONNX, and a torch-free ONNX Runtime driver.

This module stays light on purpose: ``import edgelin`` and ``import edgelin.runtime`` never import
torch, so the runtime works on a device that has only numpy and onnxruntime.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
