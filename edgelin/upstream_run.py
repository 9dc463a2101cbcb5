"""Run a checkpoint's own framework on CPU: ``python upstream_run.py SPEC_JSON`` (a process of its own).

edgelin's validate starts this file by its path, never as ``edgelin.*``: nothing of edgelin is imported here, and
what this process hides or patches to make the framework run on a CPU (below) never reaches edgelin's process.

  transformers  triton and fla are hidden before transformers is imported: with them importable, transformers
                picks GPU kernels for its linear-attention layers (Gated DeltaNet, Mamba2), which fail on a CPU
                ("0 active drivers"); hidden, it runs its own PyTorch paths. The model runs in float64 with its
                modelling code's float32 casts lifted (``float64_throughout``): the exact reference.
  fla           fla's Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1, set by the caller), the
                autotuner kept to the config with the largest blocks (its benchmark step needs a GPU driver),
                device functions not re-patching the language inside a kernel (``interpret_on_cpu``); models load with
                attn_mode="fused_recurrent" (fla's chunk kernels do not run in the interpreter) and, where the
                config has them, fuse_norm / fuse_swiglu off (the same math in PyTorch: far fewer kernel launches).
                RWKV-7's layer calls its chunk kernel for 64 tokens or more whatever attn_mode says: it is pointed
                at fla's fused_recurrent DPLR kernel instead (``rwkv7_recurrent``).

SPEC (JSON): {"framework", "checkpoint", "prompt": [[ids]] (B x T), "steps": [[ids]] (B x N), "greedy": k,
"threads", "out"[, "dtype"]}; ``dtype`` (transformers only; default "float64"): "float16" runs the model as a user
would at half precision (its own float32 islands kept): the precision floor of edgelin.upstream. Writes ``out``
(safetensors, float64 / int64): "prefill" [B, T, V] logits of one forward over the prompt (cache kept); "decode"
[N, B, V], each column of ``steps`` fed one token at a time through the framework's cache; "greedy" [B, k] greedy ids continuing each row after the prompt and the steps, through the same cache;
"hidden.{i}" [B, T, d] the output of decoder layer i over the prompt (a forward hook on the framework's own layer
module). Beside it, ``out`` + ".json": {"model_class", "how", "layers", "seconds": {"load", "prefill", "decode",
"greedy"}}.
Exit 0 on success; on failure the last line on stderr says why.
"""

from __future__ import annotations

import inspect
import json
import math
import sys
import time


def _load_transformers(folder: str, dtype: str = "float64"):
    sys.modules["triton"] = None  # type: ignore[assignment]  # transformers then takes its PyTorch paths
    sys.modules["fla"] = None  # type: ignore[assignment]
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder)
    auto = transformers.AutoModelForCausalLM
    if getattr(config, "vision_config", None) is not None:  # a vision-language checkpoint (qwen3_5): its own class
        auto = transformers.AutoModelForImageTextToText
    # mixture-of-experts MLPs: transformers' own loop over the experts (its grouped matmul takes no float64)
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)  # (Granite's, Nemotron-H's)
    options = {"experts_implementation": "eager"} if experts else {}
    model = _loaded(auto, folder, options, dtype=getattr(torch, dtype))
    if dtype != "float64":  # as a user runs it at that precision: its float32 islands kept
        return model, config, f"transformers' own PyTorch paths in {dtype} (triton and fla hidden in its process)"
    lifted = float64_throughout(model)
    how = ("transformers' own PyTorch paths in float64 (triton and fla hidden in its process; the float32 casts of "
           + ", ".join(lifted) + " lifted to float64)")
    return model, config, how


class _Float64Torch:
    """``torch`` as a modelling module sees it, with its float32 dtype names meaning float64."""

    def __init__(self, torch) -> None:
        self._torch = torch

    def __getattr__(self, name: str):
        if name in ("float32", "float"):
            return self._torch.float64
        return getattr(self._torch, name)


def float64_throughout(model) -> list[str]:
    """Make a transformers model compute in float64 where its code casts to float32 on purpose (RMSNorm statistics,
    the gated delta rule, the SSM scan, softmax, rotary angles: float32 islands for bf16/fp16 weights, which in a
    float64 model would round its reference to float32): each modelling module of the model's classes sees
    ``torch.float32`` as float64, and ``Tensor.float()`` gives float64 in this process. The same code, the same
    math, in float64: the reference edgelin's float32 import and graphs are then held to is the exact one, not
    transformers' own float32 rounding (2.3e-5 of the logits' scale for a Qwen3-Next model whose import agrees
    with it to 3.9e-8 when both run in float64). Returns the names of the modules patched."""
    import torch

    names = sorted({type(m).__module__ for m in model.modules() if type(m).__module__.startswith("transformers.models.")})
    names += [n for n in ("transformers.modeling_rope_utils", "transformers.integrations.sdpa_attention") if n in sys.modules]
    proxy = _Float64Torch(torch)
    for name in names:
        module = sys.modules[name]
        if getattr(module, "torch", None) is torch:
            module.torch = proxy
    torch.Tensor.float = lambda self, *args, **kwargs: self.double()  # type: ignore[method-assign]
    return [n.rsplit(".", 1)[-1] for n in names]


class MissingWeights(RuntimeError):
    pass


def _loaded(auto, folder: str, options: dict, dtype=None):
    """The model with every weight from the checkpoint: one left at its random init would make a wrong reference."""
    import torch

    model, info = auto.from_pretrained(folder, dtype=dtype or torch.float32, output_loading_info=True, **options)
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise MissingWeights(f"{type(model).__name__} found no weights in the checkpoint for {len(missing)} of its tensors "
                             f"(e.g. {missing[0]}); it would run them at random init")
    return model.eval()


def fewest_programs(autotuner, kwargs) -> list:
    """Triton's ``Autotuner.prune_configs`` on a CPU: [the config whose integer meta-parameters (BD, BT, BK, ...)
    have the largest product], the first of equals (num_warps and num_stages mean nothing to the interpreter)."""
    def blocks(config) -> int:
        return math.prod(v for v in config.kwargs.values() if isinstance(v, int) and not isinstance(v, bool) and v > 0)

    return [max(autotuner.configs, key=blocks)]


def interpret_on_cpu() -> None:
    """Make Triton's interpreter (TRITON_INTERPRET=1) run fla's kernels on a CPU, and faster; idempotent.

    - The autotuner keeps one config, the one with the largest blocks (``fewest_programs``): benchmarking the
      candidates needs a GPU driver, and the interpreter runs a kernel's program instances one after another in
      Python, so fewer, larger programs take less time. A config only splits the same work differently: fla's
      logits were bit for bit those of the first config in the tiny Gated DeltaNet, DeltaNet, GLA
      and linear_attn models of the tests (150-token prefill and 20 cached steps, batch 2), which ran 1.5x, 1.9x,
      1.1x and 1.05x faster (fla's short-conv update: 8-channel blocks before, 256-channel ones now).
    - A device function (a ``@triton.jit`` helper called from a kernel) re-patches ``triton.language`` on every
      call (``inspect.getmembers`` over the whole module; that patch is never undone), though the running kernel
      or an earlier call has patched the same modules already: such a call is skipped until the kernel's own
      patch is restored. Nothing a kernel computes changes (fla's logits compared bit for bit with and without
      it; tests/importers/test_interpreter.py); a 150-token Gated DeltaNet prefill runs about 10 % faster.
    """
    import importlib

    importlib.import_module("triton.runtime.autotuner").Autotuner.prune_configs = fewest_programs
    interpreter = importlib.import_module("triton.runtime.interpreter")
    tl = importlib.import_module("triton.language")
    patch_lang = interpreter._patch_lang
    if getattr(patch_lang, "once_per_kernel", False):
        return
    active: set[int] = set()  # the language modules the running kernel's patch covers
    modules: dict = {}  # fn -> the language modules its globals see (as Triton's _patch_lang finds them)

    def langs(fn) -> frozenset[int]:
        if fn not in modules:
            modules[fn] = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
        return modules[fn]

    def once_per_kernel(fn):
        mine = langs(fn)
        if active and mine <= active:  # a device function inside a kernel: its modules are patched already
            return interpreter._LangPatchScope()
        scope = patch_lang(fn)
        kernel = not active
        active.update(mine)  # a device function's own patch is never undone (as Triton ships it): skip it from now on
        if kernel:  # the kernel's own patch (GridExecutor): the record is cleared when it is restored
            restore = scope.restore

            def restore_and_forget():
                try:
                    restore()
                finally:
                    active.clear()

            scope.restore = restore_and_forget
        return scope

    once_per_kernel.once_per_kernel = True  # type: ignore[attr-defined]
    once_per_kernel.shipped = patch_lang  # type: ignore[attr-defined]
    interpreter._patch_lang = once_per_kernel


def rwkv7_recurrent() -> None:
    """Make fla's RWKV7Attention run its recurrence on fla's ``fused_recurrent_rwkv7`` kernel (the DPLR recurrence
    token by token, which the interpreter runs) where it would call ``chunk_rwkv7`` (64 tokens or more, whatever
    attn_mode says; that kernel fails in the interpreter). The chunk kernel's own options (safe_gate, lower_bound,
    chunk_size) choose how it computes, not what: they are dropped. Idempotent."""
    import importlib

    layer = importlib.import_module("fla.layers.rwkv7")
    if getattr(layer.chunk_rwkv7, "recurrent", False):
        return
    fused_recurrent_rwkv7 = importlib.import_module("fla.ops.rwkv7").fused_recurrent_rwkv7

    def recurrent(r, w, k, v, a, b, scale=1.0, initial_state=None, output_final_state=True, cu_seqlens=None, **_how):
        return fused_recurrent_rwkv7(r, w, k, v, a, b, scale=scale, initial_state=initial_state,
                                     output_final_state=output_final_state, cu_seqlens=cu_seqlens)

    recurrent.recurrent = True  # type: ignore[attr-defined]
    layer.chunk_rwkv7 = recurrent


def _load_fla(folder: str):
    import transformers

    import fla  # noqa: F401 -- registers fla's models with transformers' Auto classes

    interpret_on_cpu()
    config = transformers.AutoConfig.from_pretrained(folder)
    rwkv7 = getattr(config, "model_type", "") == "rwkv7"
    if rwkv7:
        rwkv7_recurrent()
    options = {"attn_mode": "fused_recurrent"} if hasattr(config, "attn_mode") else {}
    faster = {name: False for name in ("fuse_norm", "fuse_swiglu") if getattr(config, name, False)}
    try:
        model = _loaded(transformers.AutoModelForCausalLM, folder, {**options, **faster})
    except MissingWeights:
        # fuse_norm also chooses some layers' output-norm module (and so its weight names): keep it as configured
        faster.pop("fuse_norm", None)
        model = _loaded(transformers.AutoModelForCausalLM, folder, {**options, **faster})
    options.update(faster)
    off = [name for name in ("fuse_norm", "fuse_swiglu") if options.get(name) is False]
    how = "fla's kernels in Triton's interpreter (fused_recurrent" + "".join(f", {name} off" for name in off) + ")"
    if rwkv7:
        how += "; RWKV-7's chunk kernel replaced by fla's fused_recurrent_rwkv7"
    return model, config, how


def _layers(model, n_layers: int):
    """The framework's decoder layers: the ModuleList named ``layers`` with one module per hidden layer."""
    import torch

    for name, module in model.named_modules():
        if name.split(".")[-1] == "layers" and isinstance(module, torch.nn.ModuleList) and len(module) == n_layers:
            return module
    raise RuntimeError(f"found no module list 'layers' of {n_layers} layers in {type(model).__name__}")


def main(spec_file: str) -> None:
    spec = json.loads(open(spec_file, encoding="utf-8").read())
    t0 = time.perf_counter()
    if spec["framework"] == "transformers":
        model, config, how = _load_transformers(spec["checkpoint"], spec.get("dtype", "float64"))
    else:
        model, config, how = _load_fla(spec["checkpoint"])
    import torch
    from safetensors.torch import save_file

    torch.set_num_threads(int(spec.get("threads", 1)))
    text = getattr(config, "text_config", None) or config
    n_layers = int(getattr(text, "num_hidden_layers"))
    seconds = {"load": time.perf_counter() - t0}
    prompt, steps = torch.tensor(spec["prompt"], dtype=torch.long), torch.tensor(spec["steps"], dtype=torch.long)
    hidden: dict[int, torch.Tensor] = {}

    def keep(i):
        def hook(_module, _inputs, output):
            hidden[i] = (output[0] if isinstance(output, (tuple, list)) else output).detach().to(torch.float64).clone()
        return hook

    handles = [layer.register_forward_hook(keep(i)) for i, layer in enumerate(_layers(model, n_layers))]
    with_cache = spec["framework"] == "transformers"  # transformers: a DynamicCache object, updated in place
    model_type = getattr(text, "model_type", "")
    import transformers

    # transformers 5 names the cache argument ``cache``; earlier versions and fla ``past_key_values``
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def new_cache() -> dict:
        return {cache_arg: transformers.DynamicCache(config=text)} if with_cache else {}

    def run(ids: torch.Tensor, cache: dict, at: int | None = None) -> torch.Tensor:
        """Logits of ``ids`` through ``cache``; ``at``: the position of a single token (Bamba-like models count
        positions from 0 on every call unless given them, as transformers' generate does)."""
        extra = {}
        if at is not None and with_cache and model_type in ("bamba", "granitemoehybrid"):
            extra["position_ids"] = torch.full((ids.shape[0], 1), at, dtype=torch.long)
        out = model(ids, use_cache=True, **cache, **extra)
        if not with_cache:
            cache[cache_arg] = out.past_key_values
        return out.logits.to(torch.float64)

    out: dict[str, torch.Tensor] = {}
    B, T = prompt.shape
    with torch.no_grad():
        t = time.perf_counter()
        cache = new_cache()
        out["prefill"] = run(prompt, cache)
        seconds["prefill"] = time.perf_counter() - t
        for h in handles:
            h.remove()
        for i in range(n_layers):
            out[f"hidden.{i}"] = hidden[i]
        t = time.perf_counter()
        decoded = [run(steps[:, s : s + 1], cache, T + s)[:, -1] for s in range(steps.shape[1])]
        out["decode"] = torch.stack(decoded) if decoded else torch.zeros(0, B, out["prefill"].shape[-1])
        seconds["decode"] = time.perf_counter() - t
        t = time.perf_counter()
        logits, at = (decoded[-1] if decoded else out["prefill"][:, -1]), T + steps.shape[1]
        greedy = []
        for s in range(int(spec["greedy"])):
            greedy.append(logits.argmax(-1))
            if s + 1 < int(spec["greedy"]):
                logits = run(greedy[-1][:, None], cache, at + s)[:, -1]
        out["greedy"] = torch.stack(greedy, 1) if greedy else torch.zeros(B, 0, dtype=torch.long)
        seconds["greedy"] = time.perf_counter() - t
    save_file({k: v.contiguous() for k, v in out.items()}, spec["out"])
    info = {"model_class": type(model).__name__, "how": how, "layers": n_layers, "seconds": seconds}
    with open(spec["out"] + ".json", "w", encoding="utf-8") as f:
        json.dump(info, f)


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    except Exception as exc:  # noqa: BLE001 -- the caller reports the last line
        import traceback

        traceback.print_exc()
        print(f"{type(exc).__name__}: {exc}".replace("\n", " ")[:2000], file=sys.stderr)
        sys.exit(1)
