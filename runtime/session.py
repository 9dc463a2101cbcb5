"""Load an export and run its two graphs: ``Session`` with ``new_state``, ``prefill`` and ``decode``.

    session = load("out/", provider="auto", threads=2)
    state = session.new_state(batch=1)
    logits = session.prefill(ids, state)        # ids int64 [B, T] -> logits [B, T, V]; state advanced
                                                # (in pieces of the manifest's prefill_piece tokens)
    logits = session.decode(next_ids, state)    # next_ids int64 [B, 1] -> logits [B, 1, V]
    last, state = session.prefill_batch([ids_a, ids_b])   # prompts of different lengths -> [B, V], their state

Every name, shape and dtype comes from the manifest. At load, each graph's inputs and outputs are
checked against it, and the provider that ONNX Runtime really activated is checked against the one
asked for: onnxruntime-gpu accepts a CUDA request on a machine without CUDA and quietly runs on CPU.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from edgelin.errors import ManifestError, ProviderError, RuntimeInputError
from edgelin.runtime.check import check_graph, graph_io
from edgelin.runtime.files import check_output_folder, check_replace, make_parents
from edgelin.runtime.manifest import GRAPHS, METADATA_KEY, Manifest, absent, join_problems, positions_feed
from edgelin.runtime.state import CPU, Device, State, check_state_for, require_state, to_ortvalue
from edgelin.runtime.tokenizer import Tokenizer, make_tokenizer
from edgelin.runtime.options import check_int, check_number, token_array
from edgelin.runtime.providers import PROVIDERS, make_session_options, open_graphs




HOST_MEMORY = ("cpu", "openvino")  # providers whose kernels read and write the host buffers bound to them


LOGITS_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


_SERIALS = itertools.count()


def load(export_dir: str | os.PathLike, provider: str = "auto", threads: int | None = None, **options: Any) -> "Session":
    """Read and check an export folder and open its two graphs. See ``Session`` for the options."""
    return Session(export_dir, provider, threads, **options)


class Session:
    """The two graphs of one export, on one provider.

    provider: "auto" (CUDA if really active, else CPU: with a ProviderWarning where the machine shows an NVIDIA
        GPU that CUDA could not use, quietly on a machine without one), "cpu", "cuda"
        (ProviderError unless CUDA is really active), or another of ``EXECUTION_PROVIDERS`` ("openvino",
        "dml", "coreml": ProviderError unless this onnxruntime build has it and it activates; "webgpu": the
        plugin package onnxruntime-ep-webgpu beside onnxruntime; nodes a provider does not take run on the CPU
        provider).
    threads: ONNX Runtime intra-op threads (None: its default, one per core).
    optimization: graph optimisation level, one of "disable", "basic", "extended", "all".
    save_optimized: a folder to write the optimised graphs to (``prefill.optimized.onnx``, ...).
    session_options: extra ``onnxruntime.SessionOptions`` attributes, e.g. {"enable_profiling": True}.
    io_binding: True runs through IO binding (state stays on the device, no copy per step on CPU);
        False runs ``InferenceSession.run`` with numpy feeds. Can be changed between runs.
    cuda_device: the CUDA device id.
    log_severity: ONNX Runtime's log level for the sessions (0 verbose ... 4 fatal).
    check_hashes: True (default) reads both graph files and the weights file once at load and refuses any
        whose sha256 differs from the manifest's (a graph from another export copied in runs otherwise, and
        gives other text);
        that costs one read of the files: about 1 s per GiB on a loaded 2-core AMD EPYC (sha256 itself
        0.6-0.9 s per GiB there), so about 3 s for a 3 GB export.
        False skips it (the structure and embedded-manifest checks still run, and the weights file must
        have the size the manifest gives).
    prepack: True (ONNX Runtime's default) lets each session copy its MatMul weights into a packed layout (faster
        on CPU; each of the two sessions holds its own copy). False keeps them in the weights file's mapped pages,
        shared by both sessions: less resident memory, some speed (measured in the README, Weights stored once).
    """

    def __init__(
        self,
        export_dir: str | os.PathLike,
        provider: str = "auto",
        threads: int | None = None,
        *,
        optimization: str = "all",
        save_optimized: str | os.PathLike | None = None,
        session_options: dict[str, Any] | None = None,
        io_binding: bool = True,
        cuda_device: int = 0,
        log_severity: int = 3,
        check_hashes: bool = True,
        prepack: bool = True,
    ) -> None:
        if provider not in PROVIDERS:
            raise RuntimeInputError(f"provider must be one of {', '.join(PROVIDERS)}, got {provider!r}")
        self.manifest = Manifest.load(export_dir)  # a path that cannot be one (None, a NUL in it): one ManifestError
        self.export_dir = Path(export_dir)
        self.io_binding = io_binding
        self._tokenizer: Tokenizer | None = None
        self._serial = next(_SERIALS)  # tells apart the IO bindings that states cache for each session
        paths = {g: self.manifest.graph_path(self.export_dir, g) for g in GRAPHS}
        for graph, path in paths.items():
            if not path.is_file():
                raise ManifestError(f"{absent(path, path.name, str(self.export_dir))}, the {graph} graph named in edgelin.json; re-export the model")
        # the graphs (and their weights) are the files the manifest names, not others of the same name; without
        # the hashes, at least the weights file's size (a truncated copy would load and compute garbage)
        problems = self.manifest.file_problems(self.export_dir) if check_hashes else self.manifest.weights_problems(self.export_dir, hashes=False)
        if problems:
            raise ManifestError(f"{self.export_dir}: {join_problems(problems)}")
        if save_optimized is not None:  # ONNX Runtime writes these files itself: check them as edgelin's own writes
            folder = check_output_folder(save_optimized, "folder for the optimised graphs")
            for g in GRAPHS:
                check_replace(folder / f"{g}.optimized.onnx", "optimised graph", ours=is_optimized_graph)
            make_parents(folder)

        def options(graph: str) -> ort.SessionOptions:
            optimized = None if save_optimized is None else Path(save_optimized) / f"{graph}.optimized.onnx"
            return make_session_options(threads, optimization=optimization, log_severity=log_severity, extra=session_options, optimized_path=optimized,
                                        prepack=prepack)

        self.provider, self._sessions = open_graphs(paths, provider, options, cuda_device, log_severity)
        self.device: Device = ("cuda", cuda_device) if self.provider == "cuda" else CPU
        problems = [p for g in GRAPHS for p in check_graph(g, paths[g].name, self._sessions[g], self.manifest)]
        if problems:
            raise ManifestError(f"{self.export_dir}: the graphs do not match edgelin.json: {'; '.join(problems)}; re-export the model")
        self._logits_dtype = {g: LOGITS_DTYPES[graph_io(s, outputs=True)[self.manifest.logits].type] for g, s in self._sessions.items()}

    # ---- facts ---------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.manifest.vocab_size

    @property
    def providers(self) -> dict[str, list[str]]:
        """What ONNX Runtime reports as active, per graph."""
        return {g: s.get_providers() for g, s in self._sessions.items()}

    @property
    def io_binding(self) -> bool:
        """Whether decode runs through IO binding. Set True, it holds only where the state keeps its shape: a growing
        state (a KV cache) changes shape every call, so ONNX Runtime allocates it and no buffers are bound."""
        return self._io_binding

    @io_binding.setter
    def io_binding(self, value: bool) -> None:
        self._io_binding = bool(value) and not self.manifest.grows

    @property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer the manifest names; ManifestError if the runtime does not know its kind."""
        if self._tokenizer is None:
            self._tokenizer = make_tokenizer(self.manifest.tokenizer, self.export_dir, self.manifest.vocab_size)
        return self._tokenizer

    def __repr__(self) -> str:
        return f"Session({str(self.export_dir)!r}, provider={self.provider!r}, io_binding={self.io_binding})"

    def end_profiling(self) -> dict[str, str]:
        """Stop ONNX Runtime's profiling of both graphs and write their profiles: graph -> the JSON file written (a session
        made with ``session_options={"enable_profiling": True, "profile_file_prefix": PREFIX}``); {} where profiling was off."""
        return {g: path for g, s in self._sessions.items() if (path := s.end_profiling())}

    # ---- state ---------------------------------------------------------------------------------
    def new_state(self, batch: int = 1) -> State:
        """The state of ``batch`` fresh sequences, on this session's device."""
        return State.fresh(self.manifest, batch, self.device)

    def load_state(self, path: str | os.PathLike, batch: int | None = None) -> State:
        """A state saved with ``State.save``; refused if it comes from another model (or batch size)."""
        return State.load(path, self.manifest, self.device, batch=batch)

    @property
    def ragged_fallback(self) -> str | None:
        """Why ``prefill_batch`` prefills prompts one by one, or None when the prefill graph takes per-row
        lengths (one call for the whole batch)."""
        if self.manifest.lengths is not None:
            return None
        return (
            "the prefill graph of this export takes no per-row lengths (exported without --ragged, or from a "
            "model that does not declare accepts_lengths): prompts of different lengths are prefilled one by one"
        )

    # ---- running -------------------------------------------------------------------------------
    def prefill(self, input_ids: Any, state: State, *, chunk: int | None = None, last_only: bool = False) -> np.ndarray:
        """Feed ``input_ids`` [B, T] through the prefill graph, advancing ``state`` in place.

        Returns logits [B, T, V], or only the last position's [B, V] with ``last_only``. The prompt goes in
        pieces of at most ``chunk`` tokens (default: the manifest's ``prefill_piece``, 1,024 in edgelin's
        exports), the state carried between them, so memory stays bounded for any T and long prompts run
        at the speed of short ones (then ask for ``last_only``: all logits are T * V floats). ``chunk=T``
        runs the whole prompt in one call, unless the export bounds a call (the manifest's ``max_sequence``,
        4,096 in a portable delta-rule export): pieces never exceed it.
        """
        ids = self._check_ids(input_ids, state)
        pieces = []
        for start, end in self._pieces(ids.shape[1], chunk):
            logits = self._run("prefill", ids[:, start:end], state, last=last_only)  # [B, t, V], or [B, 1, V]
            pieces.append(logits[:, -1].copy() if last_only else logits)  # keep [B, V], not the whole piece
        return pieces[-1] if last_only else np.concatenate(pieces, axis=1)  # [B, V] or [B, T, V]

    def prefill_batch(
        self, prompts: Any, state: State | None = None, *, chunk: int | None = None, max_padding: float | None = None
    ) -> tuple[np.ndarray, State]:
        """Prefill prompts of different lengths together: ``prompts`` is a list of B token-id sequences.

        Returns (each prompt's last logits [B, V], the state of all B sequences) -- the state of row b is that
        of prompt b prefilled alone, ready for ``decode`` of the whole batch. ``state`` continues B sequences
        (it is consumed: use the returned state) instead of fresh ones. With a ragged export (the manifest's
        ``lengths``) the prompts are right-padded and run in one prefill call per piece of ``chunk`` tokens (default:
        the manifest's prefill_piece);
        otherwise one by one (``ragged_fallback`` says why), with the same results.

        Padding is computed like real tokens: ``max_padding`` (>= 1) groups the prompts by length so that no
        call computes more than ``max_padding`` times its real tokens (longest first, each group one ragged
        call, the rows put back in prompt order). None: all prompts in one call.
        """
        rows = self._check_prompts(prompts)
        B = len(rows)
        if max_padding is not None:
            max_padding = check_number("max_padding", max_padding, low=1.0)
        if state is None:
            state = self.new_state(B)
        else:
            check_state_for(state, B)
        if self.manifest.lengths is None:
            singles = [state] if B == 1 else state.split()
            last = [self.prefill(r[None], st, chunk=chunk, last_only=True) for r, st in zip(rows, singles)]  # B x [1, V]
            return np.concatenate(last), (singles[0] if B == 1 else State.stack(singles))
        lengths = np.array([len(r) for r in rows], dtype=np.int64)  # [B]
        groups = [list(range(B))] if max_padding is None else length_groups(lengths, max_padding)
        if len(groups) == 1:
            return self._prefill_ragged(rows, state, chunk), state
        parts = [state.rows(g) for g in groups]
        last = np.concatenate([self._prefill_ragged([rows[i] for i in g], part, chunk) for g, part in zip(groups, parts)])  # [B, V], grouped order
        order = np.argsort(np.concatenate(groups))  # row b of the result is row order[b] of the groups
        return last[order], State.stack(parts).rows(order.tolist())

    def _prefill_ragged(self, rows: list[np.ndarray], state: State, chunk: int | None) -> np.ndarray:
        """Right-padded rows through the ragged prefill graph, one call per piece: each row's last logits [B, V]."""
        B = len(rows)
        lengths = np.array([len(r) for r in rows], dtype=np.int64)  # [B]
        T = int(lengths.max())
        pad = self.manifest.tokenizer.get("pad_id") or 0
        ids = np.full((B, T), pad, dtype=np.int64)  # [B, T], right-padded
        for b, r in enumerate(rows):
            ids[b, : len(r)] = r
        ids = self._check_ids(ids, state)
        last = np.empty((B, self.vocab_size), dtype=self._logits_dtype["prefill"])  # [B, V]
        for start, end in self._pieces(T, chunk):
            here = np.clip(lengths - start, 0, end - start)  # [B] real tokens of each row in this piece
            logits = self._run("prefill", ids[:, start:end], state, here, last=True)  # [B, 1, V]: each row's last real token
            ends = np.flatnonzero((lengths > start) & (lengths <= end))  # rows whose last token is in this piece
            last[ends] = logits[ends, 0]
        return last

    def _check_prompts(self, prompts: Any) -> list[np.ndarray]:
        """One int64 [T_b] array per prompt, each non-empty (ids are checked with the padded batch)."""
        if isinstance(prompts, np.ndarray) and prompts.ndim == 2:
            prompts = list(prompts)
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise RuntimeInputError("prefill_batch takes a non-empty list of prompts (token-id sequences)")
        rows = []
        for i, p in enumerate(prompts):
            r = token_array(p, f"prompt {i}", self.vocab_size)
            if r.ndim != 1 or r.size == 0:
                raise RuntimeInputError(f"prompt {i} must be a non-empty flat sequence of token ids, got shape {list(r.shape)}")
            if not np.issubdtype(r.dtype, np.integer):
                raise RuntimeInputError(f"prompt {i} must hold integer token ids, got {r.dtype}")
            bad = np.flatnonzero((r < 0) | (r >= self.vocab_size))
            if bad.size:
                raise RuntimeInputError(f"token id {int(r[bad[0]])} at position {int(bad[0])} of prompt {i} is outside the vocabulary [0, {self.vocab_size})")
            rows.append(r.astype(np.int64))
        return rows

    def _pieces(self, T: int, chunk: int | None) -> list[tuple[int, int]]:
        """(start, end) of each prefill call over T tokens: pieces of at most ``chunk`` (None: the manifest's
        prefill_piece), never more than the manifest's max_sequence, none shorter than min_sequence."""
        chunk = self.manifest.prefill_piece if chunk is None else check_int("prefill chunk", chunk, low=1)
        if self.manifest.max_sequence is not None:  # the graph is exact up to max_sequence tokens per call
            chunk = min(chunk, self.manifest.max_sequence)
        least = self.manifest.min_sequence
        if T < least:
            raise RuntimeInputError(f"prefill takes at least {least} token(s) (the manifest's min_sequence), got {T}")
        starts = list(range(0, T, max(chunk, least)))
        if len(starts) > 1 and T - starts[-1] < least:  # never a last piece shorter than the graph accepts
            starts.pop()
        return list(zip(starts, starts[1:] + [T]))

    def decode(self, input_ids: Any, state: State) -> np.ndarray:
        """One token per sequence through the decode graph: ids [B, 1] (or [B]) -> logits [B, 1, V]."""
        ids = token_array(input_ids, "input_ids", self.vocab_size, ragged="decode takes one token id per sequence: [batch, 1] or [batch]")
        if ids.ndim == 1:
            ids = ids[:, None]  # [B, 1]
        ids = self._check_ids(ids, state)
        if ids.shape[1] != 1:
            raise RuntimeInputError(f"decode takes one token per sequence, got input_ids of shape {list(ids.shape)}; use prefill for more")
        return self._run("decode", ids, state)

    def _check_ids(self, input_ids: Any, state: State) -> np.ndarray:
        """Token ids as int64 [B, T], every id inside the vocabulary: ORT's Gather does not check."""
        require_state(state)
        if not state.same_model(self.manifest):
            raise RuntimeInputError("this state belongs to another model; create it with this session's new_state()")
        if state.device != self.device:
            raise RuntimeInputError(f"this state lives on {state.device[0]}, the session runs on {self.device[0]}")
        ids = token_array(input_ids, "input_ids", self.vocab_size, ragged="input_ids must be a rectangular [batch, tokens] array; "
                          "for prompts of different lengths use prefill_batch")
        if ids.ndim == 1:
            ids = ids[None]  # [1, T]
        if ids.ndim != 2 or ids.shape[0] != state.batch:
            raise RuntimeInputError(f"input_ids must be [batch={state.batch}, tokens], got shape {list(ids.shape)}")
        if ids.shape[1] == 0:
            raise RuntimeInputError("input_ids is empty: give at least one token")
        limit = self.manifest.max_positions
        if limit is not None and state.seen + ids.shape[1] > limit:
            raise RuntimeInputError(
                f"this model declares a context of {limit:,} positions (max_positions); the sequence would reach "
                f"{state.seen + ids.shape[1]:,} -- start a new sequence or shorten the prompt"
            )
        if not np.issubdtype(ids.dtype, np.integer):
            raise RuntimeInputError(f"input_ids must be integers, got {ids.dtype}")
        bad = (ids < 0) | (ids >= self.vocab_size)
        if bad.any():
            b, t = map(int, np.argwhere(bad)[0])
            raise RuntimeInputError(
                f"token id {int(ids[b, t])} at position {t} (sequence {b}) is outside the vocabulary [0, {self.vocab_size})"
            )
        return np.ascontiguousarray(ids, dtype=np.int64)

    def _run(self, graph: str, ids: np.ndarray, state: State, lengths: np.ndarray | None = None, *, last: bool = False) -> np.ndarray:
        """One graph run: ids int64 [B, t] -> logits [B, t, V]; the state moves on. A ragged prefill graph
        also takes each row's real tokens, ``lengths`` [B] (default: all t). ``last``: only each row's last
        (real) position's logits, [B, 1, V] -- the only ones a prefill graph with ``logits_at`` then computes."""
        m, sess = self.manifest, self._sessions[graph]
        B, t = ids.shape
        ragged = graph == "prefill" and m.lengths is not None
        if ragged and lengths is None:
            lengths = np.full(B, t, dtype=np.int64)  # [B]: no padding
        ends = None if lengths is None else np.maximum(np.asarray(lengths, dtype=np.int64) - 1, 0)[:, None]  # [B, 1]
        at = None
        if graph == "prefill" and m.logits_at is not None:  # the positions whose logits the graph returns, [B, P]
            at = (positions_feed(B, t, last=True) if ends is None else ends) if last else positions_feed(B, t)
        if not self.io_binding:
            feeds = {m.input_ids: ids, **{s.input: v.numpy() for s, v in zip(m.states, state.values)}}
            if ragged:
                feeds[m.lengths] = np.ascontiguousarray(lengths, dtype=np.int64)
            if at is not None:
                feeds[m.logits_at] = at
            logits, *states = self._ort(graph, sess.run, [m.logits] + [s.output for s in m.states], feeds)
            state._advance([to_ortvalue(a, self.device) for a in states])
            state.seen += t
            return _last(logits, ends) if last and at is None else logits
        key = (self._serial, graph, ids.shape, state._parity)
        bound = state._bindings.get(key)
        if bound is None:
            bound = self._bind(graph, ids, state, t if at is None else at.shape[1])
            # decode has the same shapes every step: bind once per buffer set, then only run. Only where the
            # provider computes in host memory (CPU, OpenVINO's CPU device): ORT copies an input to a device at bind
            # time, so a kept binding would go stale -- and feed the first step's ids again (measured on WebGPU)
            if graph == "decode" and self.provider in HOST_MEMORY:
                state._bindings[key] = bound
        io, ids_buffer, logits = bound
        ids_buffer[...] = ids
        if ragged:  # bound per call (prefill bindings are never kept); the array lives until the run is done
            lengths = np.ascontiguousarray(lengths, dtype=np.int64)  # [B]
            io.bind_ortvalue_input(m.lengths, to_ortvalue(lengths, CPU))
        if at is not None:  # bound per call, as lengths
            io.bind_ortvalue_input(m.logits_at, to_ortvalue(at, CPU))
        self._ort(graph, sess.run_with_iobinding, io)
        if self.provider not in HOST_MEMORY:  # a device copies outputs to host buffers asynchronously (CUDA, WebGPU)
            io.synchronize_outputs()
        state._advance()
        state.seen += t
        if last and at is None:
            return _last(logits, ends)
        return logits.copy() if graph == "decode" else logits  # the decode buffer is reused next step

    def _ort(self, graph: str, call, *args):
        """``call(*args)``, ONNX Runtime running ``graph``: its errors (Fail, RuntimeException, ... with the failing
        node in their first line) become one ProviderError that says which graph, which provider, and what to try.
        The state has not moved on when it is raised."""
        try:
            return call(*args)
        except Exception as exc:  # noqa: BLE001 -- ONNX Runtime raises several types, all of them Exception
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ProviderError(
                f"ONNX Runtime failed while running the {graph} graph on {self.provider} ({first[:300]}); if memory ran out, "
                "feed shorter pieces (Session.prefill(..., chunk=N)); otherwise try the cpu provider or re-export"
            ) from None

    def _bind(self, graph: str, ids: np.ndarray, state: State, positions: int) -> tuple[Any, np.ndarray, np.ndarray]:
        """An IO binding reading the state's current buffers and writing the other set, never the same one. The
        ids are in their buffer before it is bound: a provider on a device copies an input at bind time.
        ``positions``: how many positions' logits the graph returns per row (t, or logits_at's)."""
        m, sess = self.manifest, self._sessions[graph]
        ids_buffer = np.array(ids, dtype=np.int64)  # [B, t]
        logits = np.empty((ids.shape[0], positions, m.vocab_size), dtype=self._logits_dtype[graph])  # [B, P, V]
        io = sess.io_binding()
        io.bind_ortvalue_input(m.input_ids, to_ortvalue(ids_buffer, CPU))  # shares memory with ids_buffer
        io.bind_ortvalue_output(m.logits, to_ortvalue(logits, CPU))  # ORT writes straight into `logits`
        for spec, current, out in zip(m.states, state.values, state._outputs()):
            io.bind_ortvalue_input(spec.input, current)
            io.bind_ortvalue_output(spec.output, out)
        return io, ids_buffer, logits


def _last(logits: np.ndarray, ends: np.ndarray | None) -> np.ndarray:
    """Each row's last position of ``logits`` [B, t, V] (``ends`` [B, 1]: its last real one), [B, 1, V]: for an export
    whose prefill graph returns every position's logits (made before logits_at)."""
    return logits[:, -1:] if ends is None else np.take_along_axis(logits, ends[:, :, None], axis=1)


def is_optimized_graph(path: Path) -> bool:
    """True if ``path`` is a graph ``save_optimized`` wrote earlier: an ONNX file whose model metadata (serialised
    after the graph, so at the end of the file) holds edgelin's manifest key."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(max(0, size - (16 << 20)))
            tail = f.read()
    except OSError:
        return False
    return path.name.endswith(".optimized.onnx") and b"\x0a\x07" + METADATA_KEY.encode() + b"\x12" in tail


is_optimized_graph.kind = "an optimised graph an edgelin Session saved"  # type: ignore[attr-defined]


def length_groups(lengths: np.ndarray, max_padding: float) -> list[list[int]]:
    """Prompt indices grouped for ragged prefill calls: longest first, a group grows while its padded work
    (size x its longest) stays within ``max_padding`` x its real tokens. One group when the lengths are close."""
    groups: list[list[int]] = []
    for i in np.argsort(-lengths, kind="stable").tolist():
        g = groups[-1] if groups else None
        if g is not None and (len(g) + 1) * lengths[g[0]] <= max_padding * (lengths[g].sum() + lengths[i]):
            g.append(i)
        else:
            groups.append([i])
    return groups


__all__ = ["HOST_MEMORY", "Session", "length_groups", "load"]
