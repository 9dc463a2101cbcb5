"""ONNX Runtime sessions for an export's graphs: the execution providers by short name (with the package whose build
has each), "auto", plugin providers, session options, and opening the graphs on a provider that is really active
(ONNX Runtime may quietly fall back to CPU: what it activated is checked, never assumed).
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import onnxruntime as ort

from edgelin.errors import ManifestError, ProviderError, RuntimeInputError
from edgelin.runtime.options import check_int


CUDA_EP, CPU_EP = "CUDAExecutionProvider", "CPUExecutionProvider"


# short name -> (ONNX Runtime's execution provider, the package whose build has it). One onnxruntime package per
# environment: onnxruntime, onnxruntime-gpu and onnxruntime-openvino all write the same onnxruntime/ folder
EXECUTION_PROVIDERS = {
    "cpu": (CPU_EP, "onnxruntime"),
    "cuda": (CUDA_EP, "onnxruntime-gpu"),
    "openvino": ("OpenVINOExecutionProvider", "onnxruntime-openvino (in its own environment)"),
    "dml": ("DmlExecutionProvider", "onnxruntime-directml (Windows)"),
    "coreml": ("CoreMLExecutionProvider", "onnxruntime (its macOS build)"),
}


# plugin execution providers: a package beside onnxruntime (>= 1.23's plugin EP interface) holds the library;
# short name -> (its module, the package to install)
PLUGIN_PROVIDERS = {
    "webgpu": ("onnxruntime_ep_webgpu", "onnxruntime-ep-webgpu (beside onnxruntime >= 1.24.4)"),
}


EXECUTION_PROVIDERS["webgpu"] = ("WebGpuExecutionProvider", PLUGIN_PROVIDERS["webgpu"][1])


PROVIDERS = ("auto", *EXECUTION_PROVIDERS)
FUSED_NODES = ("LinearAttention", "CausalConvWithState")  # the com.microsoft nodes of a fused export (edgelin.ops.fused)


_REGISTERED: set[str] = set()


OPTIMIZATION = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


ORT_DEFAULT_SEVERITY = 2  # warnings; onnxruntime's own default


class ProviderWarning(UserWarning):
    """provider="auto" asked for CUDA, which is not active: running on CPU."""


# ---- opening and checking the graphs -------------------------------------------------------------
def gpu_visible() -> bool | None:
    """Whether this machine shows an NVIDIA GPU to its programs: on Linux, the driver's /proc entry, a /dev/nvidiaN
    node, WSL2's /dev/dxg or a Jetson's /dev/nvhost-* and /dev/nvmap; None where it cannot tell (other systems),
    and "auto" then tries CUDA."""
    if not sys.platform.startswith("linux"):
        return None
    dev = Path("/dev")
    return (Path("/proc/driver/nvidia/version").exists() or (dev / "dxg").exists() or (dev / "nvmap").exists()
            or any(dev.glob("nvidia[0-9]*")) or any(dev.glob("nvhost-*")))


def open_graphs(paths, provider, options, cuda_device, log_severity) -> tuple[str, dict[str, ort.InferenceSession]]:
    """Create both sessions; returns ("cuda" | "cpu", sessions). CUDA counts only if ORT reports it active."""

    def on_cpu() -> dict[str, ort.InferenceSession]:
        return {g: _session(p, options(g), [CPU_EP]) for g, p in paths.items()}

    if provider == "cpu":
        return "cpu", on_cpu()
    if provider not in ("auto", "cuda"):
        return provider, _open_other(paths, provider, options)
    if provider == "auto" and gpu_visible() is False:  # a machine without an NVIDIA GPU: the CPU, nothing to warn about
        return "cpu", on_cpu()
    if CUDA_EP in ort.get_available_providers():
        cuda = [(CUDA_EP, {"device_id": cuda_device}), CPU_EP]
        sessions = {}
        for graph, path in paths.items():
            # ORT logs a multi-line C++ error when the CUDA libraries are missing; we check and say it in one line
            if log_severity >= 3:
                ort.set_default_logger_severity(4)
            try:
                sessions[graph] = _session(path, options(graph), cuda)
            finally:
                if log_severity >= 3:
                    ort.set_default_logger_severity(ORT_DEFAULT_SEVERITY)
            if sessions[graph].get_providers()[0] != CUDA_EP:
                break
        else:
            return "cuda", sessions
        why = "ONNX Runtime could not activate CUDAExecutionProvider (no usable GPU, or CUDA/cuDNN libraries missing)"
    else:
        why = "this onnxruntime build has no CUDA provider (install onnxruntime-gpu)"
    if provider == "cuda":
        raise ProviderError(f"CUDA was requested but {why}; use --provider cpu")
    if CUDA_EP in ort.get_available_providers():  # a GPU build that cannot use the GPU: say so
        warnings.warn(f"CUDA is not active: {why}; running on CPU", ProviderWarning, stacklevel=4)
    return "cpu", on_cpu()


def _open_other(paths, provider: str, options) -> dict[str, ort.InferenceSession]:
    """Both sessions on another execution provider (CPU taking the nodes it does not); ProviderError unless
    this build has it and ONNX Runtime activates it."""
    ep, package = EXECUTION_PROVIDERS[provider]
    if provider in PLUGIN_PROVIDERS:
        device = _plugin_device(provider)
    else:
        available = ort.get_available_providers()
        if ep not in available:
            raise ProviderError(f"{provider} was requested but this onnxruntime build has no {ep} (it has {', '.join(available)}); "
                                f"install {package}")
    sessions = {}
    for g, p in paths.items():
        so = options(g)
        if provider in PLUGIN_PROVIDERS:
            so.add_provider_for_devices([device], {})
        try:  # the graph loaded on CPU (and its sha256 held): a failure here is the provider's
            sessions[g] = ort.InferenceSession(str(p), so) if provider in PLUGIN_PROVIDERS else ort.InferenceSession(str(p), so, providers=[ep, CPU_EP])
        except Exception as exc:  # e.g. WebGPU: "Failed to get a WebGPU adapter: No supported adapters"
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ProviderError(f"{provider} was requested but {ep} cannot load the {g} graph here: {first[:300]}; use --provider cpu") from None
    for graph, sess in sessions.items():
        if sess.get_providers()[0] != ep:
            raise ProviderError(f"{provider} was requested but ONNX Runtime could not activate {ep} for the {graph} graph "
                                f"(it runs on {', '.join(sess.get_providers())}); use --provider cpu")
    return sessions


def _plugin_device(provider: str):
    """The ONNX Runtime device of a plugin execution provider, its library registered once per process."""
    module_name, package = PLUGIN_PROVIDERS[provider]
    ep = EXECUTION_PROVIDERS[provider][0]
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        raise ProviderError(f"{provider} was requested but the {module_name} package is not installed; install {package}") from None
    if not hasattr(ort, "register_execution_provider_library"):
        raise ProviderError(f"{provider} was requested but onnxruntime {ort.__version__} cannot load plugin execution providers; "
                            f"upgrade onnxruntime ({package})")
    if provider not in _REGISTERED:
        try:
            ort.register_execution_provider_library(provider, module.get_library_path())
        except Exception as exc:  # an incompatible onnxruntime, a library that does not load
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ProviderError(f"{provider} was requested but ONNX Runtime cannot register {ep}: {first[:200]}") from None
        _REGISTERED.add(provider)
    device = next((d for d in ort.get_ep_devices() if d.ep_name == ep), None)
    if device is None:
        raise ProviderError(f"{provider} was requested but {ep} found no device (it needs a GPU with a Vulkan, Metal or D3D12 driver; "
                            "a software Vulkan driver such as lavapipe also needs ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER=1); use --provider cpu")
    return device


def make_session_options(
    threads: int | None = None,
    *,
    optimization: str = "all",
    log_severity: int = 3,
    extra: dict[str, Any] | None = None,
    optimized_path: str | os.PathLike | None = None,
    prepack: bool = True,
) -> ort.SessionOptions:
    """The one place ONNX Runtime session options are made (the Session, the exporter's check, the bench)."""
    if threads is not None:
        check_int("threads", threads, low=1, high=1024, hint="or None for ONNX Runtime's default")
    if optimization not in OPTIMIZATION:
        raise RuntimeInputError(f"optimization must be one of {', '.join(OPTIMIZATION)}, got {optimization!r}")
    so = ort.SessionOptions()
    so.log_severity_level = log_severity
    so.graph_optimization_level = OPTIMIZATION[optimization]
    if threads is not None:
        so.intra_op_num_threads = threads
    if optimized_path is not None:
        so.optimized_model_filepath = str(optimized_path)
    if not prepack:
        so.add_session_config_entry("session.disable_prepacking", "1")
    for key, value in (extra or {}).items():
        if key.startswith("_") or not hasattr(so, key):
            raise RuntimeInputError(f"session_options: onnxruntime.SessionOptions has no attribute {key!r}")
        try:
            setattr(so, key, value)
        except TypeError:
            raise RuntimeInputError(f"session_options: {key}={value!r} has the wrong type for onnxruntime.SessionOptions") from None
    return so


def open_session(
    path: str | os.PathLike, provider: str = "cpu", *, options: ort.SessionOptions | None = None, cuda_device: int = 0, **option_kwargs: Any
) -> ort.InferenceSession:
    """One ONNX file on "cpu" or "cuda" (ProviderError unless CUDA is really active). ``option_kwargs`` go to
    ``make_session_options`` when ``options`` is not given."""
    if provider not in ("cpu", "cuda"):
        raise RuntimeInputError(f"provider must be cpu or cuda, got {provider!r}")
    so = options if options is not None else make_session_options(**option_kwargs)
    if provider == "cpu":
        return _session(Path(path), so, [CPU_EP])
    kind, sessions = open_graphs({"graph": Path(path)}, "cuda", lambda _g: so, cuda_device, so.log_severity_level)
    return sessions["graph"]


def _session(path: Path, so: ort.SessionOptions, providers: list) -> ort.InferenceSession:
    try:
        return ort.InferenceSession(str(path), so, providers=providers)
    except Exception as exc:  # ORT raises several exception types (Fail, InvalidGraph, InvalidProtobuf, ...)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
        node = next((n for n in FUSED_NODES if n in first), None)
        if node:  # a fused export (edgelin export --ops fused) on an ONNX Runtime without the node
            raise ManifestError(f"ONNX Runtime {ort.__version__} cannot load {path}: {first[:300]}; the graph holds the "
                                f"com.microsoft.{node} node of a fused export: install onnxruntime >= 1.30, or "
                                "re-export with --ops portable") from None
        raise ManifestError(f"ONNX Runtime cannot load {path}: {first[:300]}; re-export the model") from None


__all__ = ["CPU_EP", "CUDA_EP", "EXECUTION_PROVIDERS", "OPTIMIZATION", "ORT_DEFAULT_SEVERITY", "PLUGIN_PROVIDERS", "PROVIDERS", "ProviderWarning", "gpu_visible", "make_session_options", "open_graphs", "open_session"]
