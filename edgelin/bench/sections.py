"""The six sections of a bench run, each a method of ``Bench`` returning its part of the JSON.

    decode      latency per token, batch 1 and 8: ORT decode graph (plain ``run`` and IO binding, through
                the runtime's Session) vs PyTorch eager ``model.step`` of the same model
    throughput  the ORT decode graph (IO binding) at batch 1 .. 64, batches interleaved: ms per step and
                tokens/s = batch / step time
    position    decode latency at positions 128 .. 64k (state carried: prefill to the position, then time
                decode steps) vs two softmax-twin decode graphs: KV cache concatenated per step, and ORT's
                GroupQueryAttention on a preallocated buffer updated in place (``gqa``); the strongest
                (fastest) baseline per position; memory per sequence; a baseline whose cache would pass the
                memory cap is skipped, with why
    prefill     throughput and peak memory vs prompt length: the chunked prefill graph, the quadratic
                masked form, the softmax twin, and the chunked graph fed in state-carried pieces; cases
                predicted to exceed a memory or time cap are skipped and say why
    sweep       prefill throughput vs the chunk size of the prefill graph (one export per chunk size)
    floor       memory bandwidth (numpy copy) and the decode graph's weight bytes: the lower bound per
                token, and measured / bound

The linear export's rows need only the model protocol (state through ``state_specs``); the twin and
the quadratic form need a LinearLM (``baselines``), and are left out, with the reason, otherwise.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import torch

from edgelin.protocol import chunk_size
from edgelin.runtime.providers import open_session
from edgelin.runtime.session import Session
from edgelin.state import fresh_state

from . import baselines, gqa
from .harness import cache_bytes, caches, interleaved, ratio, stats
from .measure import copy_bandwidth, extrapolate, graph_weight_bytes, node_counts, prefill_worker, session_options
from .plan import DATA_SEED, Plan, Progress, Subject
from .report import mb


# position section: baseline -> (its ms key, its ms / linear ms key) in a row
POSITION_KEYS = {"softmax_kv": ("softmax_kv_ms", "softmax_over_linear"), "softmax_gqa": ("softmax_gqa_ms", "softmax_gqa_over_linear")}


class Bench:
    """One bench run's shared set-up: the exports, the runtime Session of the linear export, the checks."""

    def __init__(self, subject: Subject, provider: str, threads: int, plan: Plan, work: Path, memory_cap: int, say: Progress) -> None:
        self.subject, self.provider, self.threads, self.plan, self.work, self.say = subject, provider, threads, plan, work, say
        self.model = subject.model
        self.specs = self.model.state_specs()
        self.vocab = self.model.vocab_size
        self.chunk = chunk_size(self.model)
        self.memory_cap = memory_cap
        self.rng = np.random.default_rng(DATA_SEED)
        self.paths: dict[str, Path] = {}
        self.exports: dict[str, dict] = {}
        self.checks: baselines.Checks = {}
        self.twin, self.twin_skipped = baselines.softmax_twin(subject)
        self.session: Session | None = None  # the runtime Session of the linear export
        self.active_provider: str | None = None
        self._gqa_session: ort.InferenceSession | None = None  # the KV-buffer baseline's, opened on first use

    # ---- set-up --------------------------------------------------------------------------------
    def prepare(self, sections: tuple[str, ...]) -> None:
        kv_capacity = max(self.plan.positions) + self.position_steps() if "position" in sections else 0
        jobs = baselines.plan_exports(self.subject, sections, self.sweep_chunks(), self.work, kv_capacity)
        self.exports = baselines.run_exports(jobs, self.subject, self.twin, self.work, self.say)
        self.paths = {job["name"]: Path(job["path"]) for job in jobs}
        if self.subject.export_dir is not None:
            self.paths["linear"] = self.subject.export_dir
        self.open_session()
        self.checks = baselines.verify(self.paths, self.subject, self.twin, self.threads, self.say)

    def sweep_chunks(self) -> list[int]:
        """The model's chunk and the plan's, if the model can change its chunk (``with_chunk_size``)."""
        if not hasattr(self.model, "with_chunk_size"):
            return [self.chunk]
        return sorted(set(self.plan.sweep_chunks) | {self.chunk})

    def open_session(self) -> None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.session = Session(self.paths["linear"], self.provider, self.threads, session_options={"inter_op_num_threads": 1})
        for w in caught:
            self.say(f"note: {w.message}")
        self.active_provider = self.session.provider

    def graph(self, role: str) -> Path:
        return self.paths["linear"] / self.session.manifest.graphs[role]

    # ---- 1. decode latency -----------------------------------------------------------------------
    def decode(self) -> dict[str, Any]:
        p, sess = self.plan, self.session
        out: dict[str, Any] = {"what": "ms per decode call (one token per sequence); tokens/s = batch / median",
                               "contenders": {"torch_eager": f"{type(self.model).__name__}.step, PyTorch eager (CPU), inference_mode",
                                              "ort_run": "runtime Session.decode, io_binding=False (InferenceSession.run, numpy feeds)",
                                              "ort_iobinding": "runtime Session.decode, io_binding=True (state buffers reused)"
                                              if not sess.manifest.grows else "runtime Session.decode asked for IO binding: not "
                                              "used, the state grows (KV caches), so this is ort_run again"},
                               "batches": {}}
        dtype = next(self.model.parameters()).dtype
        for B in p.decode_batches:
            self.say(f"decode: batch {B} (torch eager vs ORT run vs ORT IO binding) ...")
            ids_np = self.rng.integers(0, self.vocab, (B, 1), dtype=np.int64)  # [B, 1]
            ids_t = torch.from_numpy(ids_np)
            holder = {"torch": fresh_state(self.specs, B, dtype=dtype), "run": sess.new_state(B), "bind": sess.new_state(B)}

            def eager():
                holder["torch"] = self.model.step(ids_t, holder["torch"])[1]

            def ort_run():
                sess.io_binding = False
                sess.decode(ids_np, holder["run"])

            def ort_bind():
                sess.io_binding = True
                sess.decode(ids_np, holder["bind"])

            with torch.inference_mode():
                samples = interleaved({"torch_eager": eager, "ort_run": ort_run, "ort_iobinding": ort_bind},
                                      warmup=p.decode_warmup, rounds=p.decode_rounds, per_round=p.decode_per_round)
            sess.io_binding = True
            row = {name: stats(s) for name, s in samples.items()}
            for name in samples:
                row[name]["tokens_per_s"] = B / (row[name]["median"] / 1e3)
            row["ratios"] = {
                "torch_eager_over_ort_run": ratio(row["torch_eager"], row["ort_run"]),
                "torch_eager_over_ort_iobinding": ratio(row["torch_eager"], row["ort_iobinding"]),
                "ort_run_over_ort_iobinding": ratio(row["ort_run"], row["ort_iobinding"]),
            }
            out["batches"][str(B)] = row
        out["graph_nodes"] = {g: node_counts(self.graph(g), self.work) for g in ("decode", "prefill")}
        return out

    # ---- 1b. decode throughput vs batch ----------------------------------------------------------
    def throughput(self) -> dict[str, Any]:
        p, sess = self.plan, self.session
        self.say(f"throughput: decode at batch {', '.join(map(str, p.throughput_batches))} (ORT IO binding, batches interleaved) ...")
        sess.io_binding = True
        cases = {}
        for B in p.throughput_batches:
            ids, state = self.rng.integers(0, self.vocab, (B, 1), dtype=np.int64), sess.new_state(B)  # [B, 1]
            cases[str(B)] = functools.partial(sess.decode, ids, state)
        samples = interleaved(cases, warmup=p.decode_warmup, rounds=p.decode_rounds, per_round=p.decode_per_round)
        rows = {}
        for B, s in samples.items():
            step = stats(s)
            rows[B] = {"ms_per_step": step, "ms_per_token": step["median"] / int(B), "tokens_per_s": int(B) / (step["median"] / 1e3)}
        for row in rows.values():
            row["tokens_per_s_over_batch_1"] = row["tokens_per_s"] / rows["1"]["tokens_per_s"] if "1" in rows else None
        best = max(rows, key=lambda B: rows[B]["tokens_per_s"])
        return {"what": "ms per decode step (one token for each of B sequences) and tokens/s = B / median step time; "
                        "the batch sizes' calls interleaved in rotating rounds",
                "contender": "runtime Session.decode, io_binding=True (state buffers reused)",
                "batches": rows, "best_batch": int(best), "best_tokens_per_s": rows[best]["tokens_per_s"]}

    # ---- 2. decode vs position -------------------------------------------------------------------
    def position_steps(self) -> int:
        """Decode steps each contender takes at one position (warm-up and timed): how far a cache grows."""
        p = self.plan
        return p.position_warmup + p.position_rounds * p.position_per_round

    def _softmax_step(self, P: int, tok: np.ndarray):
        """A callable running one softmax-twin decode step whose KV cache starts at length P and grows."""
        cfg = self.twin.cfg
        soft = open_session(self.paths["softmax_decode"], self.active_provider, options=session_options(self.threads))
        device = ("cuda", 0) if self.active_provider == "cuda" else ("cpu", 0)
        keys = baselines.kv_keys(cfg.n_layers)
        # the cache's values do not change its speed, its length does: random values of length P
        kv = {"past": [ort.OrtValue.ortvalue_from_numpy(self.rng.standard_normal((1, cfg.n_heads, P, cfg.head_dim), dtype=np.float32), *device)
                       for _ in keys]}

        def step():
            io = soft.io_binding()
            io.bind_cpu_input("input_ids", tok)
            for k, v in zip(keys, kv["past"]):
                io.bind_ortvalue_input(f"past.{k}", v)
            io.bind_output("logits", *device)
            for k in keys:
                io.bind_output(f"present.{k}", *device)
            soft.run_with_iobinding(io)
            kv["past"] = io.get_outputs()[1:]  # the cache grows by one position: fed back as the next past

        return step

    def _gqa_step(self, P: int, tok: np.ndarray):
        """A callable running one KV-buffer decode step (GroupQueryAttention, in place) whose cache starts at length P."""
        cfg = self.twin.cfg
        if self._gqa_session is None:
            self._gqa_session = open_session(self.paths["softmax_gqa"], "cpu", options=session_options(self.threads))
        decoder = gqa.KVBufferDecoder(self._gqa_session, n_layers=cfg.n_layers, n_heads=cfg.n_heads, head_dim=cfg.head_dim, batch=1,
                                      capacity=P + self.position_steps())
        for buffer in decoder.buffers.values():  # random values of length P, as the concatenating baseline's
            buffer[:, :, :P] = self.rng.standard_normal((1, cfg.n_heads, P, cfg.head_dim), dtype=np.float32)
        decoder.lengths[:] = P
        return functools.partial(decoder.step, tok)

    def _position_baselines(self, P: int) -> list[tuple[str, int, Any, str | None]]:
        """(name, bytes it needs, step maker, why it is not measured here or None) of each softmax baseline at position P."""
        kv = self.twin.cfg.kv_cache_bytes(P + self.position_steps())
        on_cuda = "the float32 KV-buffer graph runs on CPU only (ORT's CUDA GroupQueryAttention takes float16/bfloat16)"
        gqa_why = gqa.unsupported(self.twin.cfg) or (on_cuda if self.active_provider == "cuda" else None)
        found = []
        for name, need, make, why in (("softmax_kv", 2 * kv, self._softmax_step, None),  # past in + present out, alive together
                                      ("softmax_gqa", kv, self._gqa_step, gqa_why)):
            if why is None and need > self.memory_cap:
                why = f"its cache needs ~{mb(need)} > memory cap {mb(self.memory_cap)}"
            found.append((name, need, make, why))
        return found

    def position(self) -> dict[str, Any]:
        p, sess = self.plan, self.session
        state_bytes = sess.manifest.state_bytes(1)
        steps = self.position_steps()
        rows = []
        for P in p.positions:
            what = "linear state vs softmax KV cache (concatenated; in-place buffer)" if self.twin else "linear state"
            self.say(f"position {P:,}: prefill, then decode steps ({what}) ...")
            state = sess.new_state(1)
            sess.io_binding = True
            sess.prefill(self.rng.integers(0, self.vocab, (1, P), dtype=np.int64), state, chunk=p.piece, last_only=True)
            tok = self.rng.integers(0, self.vocab, (1, 1), dtype=np.int64)  # [1, 1]
            cases = {"linear": lambda: sess.decode(tok, state)}
            skipped = {}
            for name, _, make, why in self._position_baselines(P) if self.twin is not None else []:
                if why:
                    skipped[name] = why
                else:
                    cases[name] = make(P, tok)
            samples = interleaved(cases, warmup=p.position_warmup, rounds=p.position_rounds, per_round=p.position_per_round)
            cases.clear()  # the caches go now, not at the next position
            row = {"position": P, "linear_ms": stats(samples["linear"]), "linear_state_bytes": state_bytes}
            for name, (ms_key, over_key) in POSITION_KEYS.items():
                if name in samples:
                    row[ms_key] = stats(samples[name])
                    row[over_key] = ratio(row[ms_key], row["linear_ms"])
            if self.twin is not None:
                kv_bytes = self.twin.cfg.kv_cache_bytes(P)
                row.update({"kv_cache_bytes": kv_bytes, "kv_over_state": kv_bytes / state_bytes, "skipped": skipped})
                measured = [n for n in POSITION_KEYS if n in samples]
                if measured:
                    strongest = min(measured, key=lambda n: row[POSITION_KEYS[n][0]]["median"])
                    row.update({"strongest_baseline": strongest, "strongest_over_linear": row[POSITION_KEYS[strongest][1]]})
            rows.append(row)
        out = {
            "what": f"ms per decode step at batch 1 after P tokens; every contender carries its state/cache over its {steps} steps "
                    f"({self.plan.position_warmup} warm-up, {steps - self.plan.position_warmup} timed); "
                    "x_over_linear = baseline ms / linear ms (above 1: linear is faster); strongest = the fastest baseline measured at P",
            "softmax_baseline": "SoftmaxLM (same widths, RoPE, random weights) decode step exported here with past k/v of dynamic length; "
                                "present k/v (a new, one-longer copy each step) fed back through IO binding; its cache starts from random values of length P",
            "softmax_gqa_baseline": "the same SoftmaxLM's decode step around ORT's com.microsoft.GroupQueryAttention (RoPE inside the op), built "
                                    "here with onnx.helper and checked against PyTorch; one preallocated BNSH buffer per layer for k and v "
                                    "bound as both past and present, written in place (no copy per step); its cache starts from random values of length P",
            "memory_per_sequence": "linear state bytes (constant) vs fp32 KV-cache bytes 2 * layers * heads * P * head_dim * 4",
            "rows": rows,
        }
        if self.twin is None:
            out["softmax_baseline"] = out["softmax_gqa_baseline"] = f"skipped: {self.twin_skipped}"
            out["memory_per_sequence"] = "linear state bytes (constant)"
        return out

    # ---- 3. prefill and 3b. chunk sweep (each case in a torch-free subprocess) -------------------
    def _case(self, form: str, graph: Path, T: int, piece: int | None, history: dict, quadratic: bool, stateful: bool = True) -> dict[str, Any]:
        """One prefill case, unless it is predicted to exceed the memory or time cap (then skipped, with why)."""
        p = self.plan
        row: dict[str, Any] = {"form": form, "T": T}
        if piece:
            row["piece"] = piece
        if history.get("skipped_at"):
            return {**row, "status": "skipped", "reason": f"a shorter length ({history['skipped_at']:,}) was already skipped"}
        power = 2 if quadratic else 1
        heads = self.twin.cfg.n_heads if self.twin is not None else 0
        analytic = 2 * heads * T * T * 4 if quadratic else 0  # two live [B, H, T, T] fp32 tensors
        seen = history.setdefault("seen", [])  # (T, peak increment, median seconds) of the cases measured so far
        pred_mem = max(analytic, extrapolate([(t, m) for t, m, _ in seen], T, power))
        pred_s = extrapolate([(t, sec) for t, _, sec in seen], T, power)
        reason = None
        if pred_mem > self.memory_cap:
            reason = f"predicted peak {mb(pred_mem)} > memory cap {mb(self.memory_cap)}"
        elif pred_s > p.case_time_cap_s:
            reason = f"predicted {pred_s:.0f} s per run > time cap {p.case_time_cap_s:.0f} s"
        if reason:
            history["skipped_at"] = T
            return {**row, "status": "skipped", "reason": reason}
        self.say(f"  {form:13s} T={T:>6,}{f' in pieces of {piece:,}' if piece else ''} ...")
        res = prefill_worker(graph, self.specs if stateful else [], provider=self.active_provider, threads=self.threads, vocab=self.vocab,
                             T=T, seed=DATA_SEED, plan=p, piece=piece)
        if res["status"] != "ok":
            history["skipped_at"] = T
            return {**row, **res}
        sec = stats(res["times_s"], unit="s")
        seen.append((T, res["peak_increment_bytes"], sec["median"]))
        return {**row, "status": "ok", "seconds": sec, "tokens_per_s": T / sec["median"], "first_run_s": res["first_s"],
                "peak_rss_bytes": res["peak_rss_bytes"], "peak_increment_bytes": res["peak_increment_bytes"],
                "rss_before_bytes": res["rss_before_bytes"], "memory_method": res["memory_method"], "providers": res["providers"]}

    def prefill(self) -> dict[str, Any]:
        p = self.plan
        linear = self.graph("prefill")
        # (form, graph, piece, quadratic, carries the linear state)
        forms = [("chunk", linear, None, False, True)]
        if self.twin is not None:
            forms += [("parallel", self.paths["parallel"], None, True, True), ("softmax", self.paths["softmax_prefill"], None, True, False)]
        forms.append(("chunk_pieces", linear, p.piece, False, True))
        rows = []
        histories: dict[str, dict] = {form: {} for form, *_ in forms}
        for T in p.prefill_lengths:  # length-major: the forms compared at one length run back to back
            self.say(f"prefill: T={T:,} ...")
            for form, graph, piece, quadratic, stateful in forms:
                if form == "chunk_pieces" and T < p.piece_from:
                    continue
                rows.append(self._case(form, graph, T, piece, histories[form], quadratic, stateful))
        ratios = prefill_ratios(rows, p.prefill_lengths, p.piece)
        described = {"chunk": "the export's prefill graph (chunked parallel form, O(T) memory)",
                     "parallel": "the same LinearLM exported with form='parallel' (quadratic masked form, O(T^2) memory)",
                     "softmax": "SoftmaxLM of the same size (random weights) exported here, causal softmax over all T",
                     "chunk_pieces": f"the export's prefill graph fed {p.piece:,}-token pieces, state carried between runs"}
        out = {
            "what": "seconds per prefill of T tokens at batch 1 (the whole prompt in one graph run, unless in pieces); "
                    "tokens/s = T / median; ratios are of tokens/s",
            "forms": {form: described[form] for form, *_ in forms},
            "lengths": list(p.prefill_lengths), "memory_cap_bytes": self.memory_cap, "time_cap_s": p.case_time_cap_s,
            "rows": rows, "ratios": ratios, "piece": p.piece,
            "skipped": [f"{r['form']} T={r['T']}: {r['reason']}" for r in rows if r["status"] != "ok"],
        }
        if self.twin is None:
            out["forms_not_run"] = {"parallel": self.twin_skipped, "softmax": self.twin_skipped}
        return out

    def sweep(self) -> dict[str, Any]:
        T = self.plan.sweep_length
        self.say(f"chunk sweep at T={T:,} ...")
        rows = []
        for c in self.sweep_chunks():
            graph = self.graph("prefill") if c == self.chunk else self.paths[f"chunk{c}"]
            row = self._case("chunk", graph, T, None, {}, False)
            rows.append({"chunk": c, "export_seconds": self.exports.get(f"chunk{c}", {}).get("seconds"), **row})
        ok = [r for r in rows if r["status"] == "ok"]
        best = max(ok, key=lambda r: r["tokens_per_s"]) if ok else None
        for r in ok:
            r["over_best"] = r["tokens_per_s"] / best["tokens_per_s"]
        out = {"what": f"prefill of T={T:,} tokens, batch 1, one graph per chunk size (re-exported)", "length": T,
               "model_chunk": self.chunk, "best_chunk": best["chunk"] if best else None, "rows": rows}
        if not hasattr(self.model, "with_chunk_size"):
            out["note"] = f"{type(self.model).__name__} has no with_chunk_size: only its own chunk is measured"
        return out

    # ---- 4. the floor ----------------------------------------------------------------------------
    def floor(self) -> dict[str, Any]:
        p, sess = self.plan, self.session
        self.say("floor: memory bandwidth (numpy copy) and decode weight bytes ...")
        bandwidth = copy_bandwidth(p.bandwidth_bytes, p.bandwidth_repeats, self.rng)
        weight_bytes = graph_weight_bytes(self.graph("decode"))
        state_bytes = sess.manifest.state_bytes(1)
        measured = {}
        for B in (1, 8):
            state = sess.new_state(B)
            ids = self.rng.integers(0, self.vocab, (B, 1), dtype=np.int64)  # [B, 1]
            sess.io_binding = True
            samples = interleaved({"ort_iobinding": lambda: sess.decode(ids, state)}, warmup=10, rounds=1, per_round=p.floor_calls)
            measured[B] = stats(samples["ort_iobinding"])
        GBps = bandwidth["max"] * 1e9  # the best copy seen: the lowest floor
        rows = {}
        for B, m in measured.items():
            moved = weight_bytes + 2 * B * state_bytes  # weights read once per call; the state read and written
            floor_ms = moved / GBps * 1e3
            rows[str(B)] = {"bytes_per_call": moved, "floor_ms_per_call": floor_ms, "floor_ms_per_token": floor_ms / B,
                            "weights_only_floor_ms_per_token": weight_bytes / GBps * 1e3 / B,
                            "measured_ms_per_call": m, "measured_ms_per_token": m["median"] / B,
                            "measured_over_floor": m["median"] / floor_ms}
        llc = max((cache_bytes(v) or 0 for k, v in caches().items() if k[1:].isdigit()), default=0)
        return {
            "what": "lower bound per decode call = (decode-graph weight bytes + 2 x batch x state bytes) / memory bandwidth "
                    "(weights_only_floor: weight bytes alone); bandwidth = best single-thread numpy copy of copy_bytes, "
                    "counting bytes read + bytes written; measured = ORT decode with IO binding, timed here",
            "bandwidth_GBps": bandwidth, "copy_bytes": int(p.bandwidth_bytes), "weight_bytes": int(weight_bytes),
            "state_bytes_per_sequence": int(state_bytes), "last_level_cache_bytes": int(llc) or None,
            "weights_fit_in_cache": bool(llc and weight_bytes + 2 * state_bytes < llc),
            "batches": rows,
        }


def prefill_ratios(rows: list[dict[str, Any]], lengths: tuple[int, ...], piece: int) -> list[dict[str, Any]]:
    """Per length, the ratios of tokens/s between the prefill forms that ran ("status" ok): chunk over
    parallel and softmax, pieces over chunk, and pieces over one call of one piece. A length whose one-call
    run was skipped keeps its pieces-over-one-piece ratio: the pieces are what the runtime does."""
    ok = {(r["form"], r["T"]): r["tokens_per_s"] for r in rows if r["status"] == "ok"}
    ratios = []
    for T in lengths:
        chunk, pieces, one_piece = ok.get(("chunk", T)), ok.get(("chunk_pieces", T)), ok.get(("chunk", piece))
        entry: dict[str, Any] = {"T": T}
        for other, key in (("parallel", "chunk_over_parallel"), ("softmax", "chunk_over_softmax")):
            if chunk is not None and (other, T) in ok:
                entry[key] = chunk / ok[(other, T)]
        if pieces is not None and chunk is not None:
            entry["pieces_over_chunk"] = pieces / chunk
        if pieces is not None and one_piece is not None:
            entry["pieces_over_one_piece"] = pieces / one_piece
        if len(entry) > 1:
            ratios.append(entry)
    return ratios


__all__ = ["Bench", "POSITION_KEYS", "prefill_ratios"]
