"""edgelin.runtime: drive an edgelin export with ONNX Runtime. Imports only numpy, onnxruntime and the standard library."""
