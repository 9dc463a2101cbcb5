// Tests of runtime/web/edgelin.mjs in node, against expectations the Python runtime wrote.
// Run by tests/web/test_node.py, which sets EDGELIN_WEB_CASES to a JSON file of cases and
// EDGELIN_ORT_NODE to the folder of onnxruntime-node; without them every test is skipped, saying why.
import { test } from "node:test";
import assert from "node:assert/strict";
import { readFile } from "node:fs/promises";
import { createRequire } from "node:module";
import { join } from "node:path";

import * as edgelin from "../../runtime/web/edgelin.mjs";

const casesPath = process.env.EDGELIN_WEB_CASES;
const ortDir = process.env.EDGELIN_ORT_NODE;
const why = !casesPath ? "EDGELIN_WEB_CASES is not set (run through tests/web/test_node.py)" : !ortDir ? "EDGELIN_ORT_NODE is not set" : null;
const cases = why ? null : JSON.parse(await readFile(casesPath, "utf8"));
const ort = why ? null : createRequire(join(ortDir, "package.json"))(ortDir);
const LOGITS_TOL = 1e-4;

function maxAbs(a, b) {
  assert.equal(a.length, b.length, "logits lengths differ");
  let worst = 0;
  for (let i = 0; i < a.length; i++) worst = Math.max(worst, Math.abs(a[i] - b[i]));
  return worst;
}

async function open(dir) {
  return edgelin.loadExport(ort, (name) => readFile(join(dir, name)).then((b) => new Uint8Array(b)), {
    sessionOptions: { executionProviders: ["cpu"], intraOpNumThreads: 1, interOpNumThreads: 1 },
  });
}

test("greedy ids and logits equal the Python runtime's", { skip: why ?? false }, async (t) => {
  for (const c of cases.exports) {
    const model = await open(c.dir);
    for (const p of c.prompts) {
      await t.test(`${c.name} / ${p.name}`, async () => {
        const state = model.newState();
        const all = await model.prefill(p.ids, state, { piece: p.piece, all: true });
        const err = maxAbs(all, p.prefill_logits.flat());
        assert.ok(err <= LOGITS_TOL, `prefill logits differ by ${err}`);
        // greedy continuation, decode logits step by step
        let logits = all.slice(all.length - model.vocabSize);
        const ids = [];
        let worst = 0;
        for (let i = 0; i < p.greedy_ids.length; i++) {
          const id = edgelin.argmax(logits);
          ids.push(id);
          if (i + 1 < p.greedy_ids.length) {
            logits = await model.decode(id, state);
            worst = Math.max(worst, maxAbs(logits, p.decode_logits[i]));
          }
        }
        assert.deepEqual(ids, p.greedy_ids);
        assert.ok(worst <= LOGITS_TOL, `decode logits differ by ${worst}`);
        // the streaming API gives the same ids and the Python runtime's text
        const conv = model.conversation();
        const toks = await conv.generate(p.ids, { maxNewTokens: p.greedy_ids.length, piece: p.piece }).toArray();
        assert.deepEqual(toks.map((x) => x.id), p.greedy_ids);
        if (p.text !== null) assert.equal(conv.text, p.text);
        assert.equal(conv.stopReason, "length");
      });
    }
    await t.test(`${c.name} / state kept between calls`, async () => {
      const k = c.continuation;
      const conv = model.conversation();
      await conv.generate(k.first_ids, { maxNewTokens: k.first_n }).toArray();
      assert.deepEqual(conv.ids, k.first_out);
      await conv.generate(k.second_ids, { maxNewTokens: k.second_n }).toArray();
      assert.deepEqual(conv.ids, k.second_out);
    });
    await t.test(`${c.name} / state size`, () => {
      assert.equal(model.stateBytes(1), c.state_bytes);
    });
  }
});

test("text streams as the Python byte tokenizer decodes it", { skip: why ?? false }, () => {
  const tok = new edgelin.ByteTokenizer({ kind: "bytes", encoding: "utf-8", offset: 0, eos_id: null }, 256);
  for (const d of cases.decoding) {
    const dec = tok.decoder();
    const pieces = d.ids.map((i) => dec.feed(i));
    pieces.push(dec.flush());
    assert.equal(pieces.join(""), d.pieces.join(""), `bytes ${JSON.stringify(d.ids)}`);
    // valid UTF-8 is released at the same tokens; invalid bytes give the same U+FFFD, sometimes a token earlier
    if (!d.pieces.join("").includes("\ufffd")) assert.deepEqual(pieces, d.pieces, `bytes ${JSON.stringify(d.ids)}`);
  }
  for (const e of cases.encoding) assert.deepEqual(tok.encode(e.text), e.ids);
});

test("sampling follows the Python sampler's distribution", { skip: why ?? false }, () => {
  for (const s of cases.sampling) {
    const logits = Float32Array.from(s.logits, (v) => (v === null ? -Infinity : v)); // null: a banned token
    const p = edgelin.probabilities(logits, edgelin.samplingOptions(s.options));
    let worst = 0;
    for (let i = 0; i < p.length; i++) worst = Math.max(worst, Math.abs(p[i] - s.probs[i]));
    assert.ok(worst <= 1e-9, `${JSON.stringify(s.options)}: probabilities differ by ${worst}`);
  }
});

test("a seed gives the same sampled stream; another seed another one", { skip: why ?? false }, async () => {
  const c = cases.exports[0];
  const model = await open(c.dir);
  const run = (seed) => model.generate(c.prompts[0].ids, { maxNewTokens: 40, temperature: 1.0, topK: 50, topP: 0.95, seed }).toArray();
  const a = (await run(1)).map((x) => x.id);
  assert.deepEqual((await run(1)).map((x) => x.id), a);
  assert.notDeepEqual((await run(2)).map((x) => x.id), a);
});

test("bad input is refused with an EdgelinError", { skip: why ?? false }, async () => {
  const c = cases.exports[0];
  const model = await open(c.dir);
  await assert.rejects(model.generate("", {}).toArray(), edgelin.EdgelinError);
  await assert.rejects(model.generate([model.vocabSize], {}).toArray(), /outside the vocabulary/);
  await assert.rejects(model.generate("a", { topP: 0 }).toArray(), /topP/);
  await assert.rejects(model.generate("a", { temperature: -1 }).toArray(), /temperature/);
  assert.throws(() => edgelin.checkManifest({ format: "edgelin/1" }), /this runtime reads edgelin\/2/);
  // a graph file that is not the one the manifest describes
  const tampered = (name) => readFile(join(c.dir, name)).then((b) => {
    const bytes = new Uint8Array(b);
    if (name === "decode.onnx") bytes[bytes.length - 1] ^= 1;
    return bytes;
  });
  await assert.rejects(edgelin.loadExport(ort, tampered), /sha256 differs/);
  // the weights file: truncated (refused by its size, hash check or not), or changed (refused by its hash)
  const weights = (change) => (name) => readFile(join(c.dir, name)).then((b) => {
    const bytes = new Uint8Array(b);
    return name === "weights.data" ? change(bytes) : bytes;
  });
  const truncated = weights((b) => b.subarray(0, b.length - 1));
  await assert.rejects(edgelin.loadExport(ort, truncated), /weights\.data is \d+ bytes but edgelin\.json says/);
  await assert.rejects(edgelin.loadExport(ort, truncated, { verify: false }), /weights\.data is \d+ bytes but edgelin\.json says/);
  await assert.rejects(edgelin.loadExport(ort, weights((b) => { b[0] ^= 1; return b; })), /weights\.data is not the file edgelin\.json describes/);
});

// ---- the golden check ----------------------------------------------------------------------------
// JS and Python compute the same lower bounds from the same stored rows, but of logits from two ONNX Runtime
// builds (onnxruntime-node, the Python wheel) at batch 1 here and 2 there. At fp32 the errors are rounding
// noise (~1e-6), which another kernel can change by a small factor, so the two measures of each group must
// agree within a factor GOLDEN_AGREE, plus GOLDEN_FLOOR (the rounding of one fp32 logit of a few units, on the
// max(|logit|, 1) scale). Measured: equal to 4 digits (onnxruntime-node 1.30.0, onnxruntime 1.31.1, x86-64).
const GOLDEN_AGREE = 4, GOLDEN_FLOOR = 2e-7;

test("the golden check passes and measures what the Python check measures", { skip: why ?? false }, async (t) => {
  for (const c of cases.exports) {
    await t.test(c.name, async () => {
      const model = await open(c.dir);
      const r = await model.check();
      const python = c.golden_check.results.filter((x) => x.group === "golden");
      assert.equal(r.golden, true);
      assert.ok(r.passed && c.golden_check.passed, JSON.stringify(r.results));
      assert.deepEqual(r.results.map((x) => x.name), python.map((x) => x.name)); // "prefill vs golden (pieces ...)", "decode vs golden (8 steps)"
      assert.ok(r.results[0].name.startsWith("prefill vs golden") && r.results[1].name.startsWith("decode vs golden"));
      assert.ok(r.seconds >= 0);
      for (let i = 0; i < r.results.length; i++) {
        const x = r.results[i], py = python[i];
        assert.ok(x.passed && x.where === "" && x.nonfinite === 0, JSON.stringify(x));
        assert.deepEqual(x.budget, py.budget);
        assert.ok(Object.keys(x.budget).length > 0);
        for (const k of ["max_abs", "max_rel", "rel_l2"]) {
          assert.ok(Number.isFinite(x[k]) && x[k] >= 0, `${x.name}: ${k} ${x[k]}`);
          if (x.budget[k] !== undefined) assert.ok(x[k] <= x.budget[k], `${x.name}: ${k} ${x[k]} over its budget ${x.budget[k]}`);
        }
        for (const k of ["max_rel", "rel_l2"]) {
          const [js, p] = [x[k], py[k]];
          t.diagnostic(`${c.name} ${x.name} ${k}: js ${js.toExponential(3)} python ${p.toExponential(3)}`);
          assert.ok(js <= GOLDEN_AGREE * p + GOLDEN_FLOOR && p <= GOLDEN_AGREE * js + GOLDEN_FLOOR, `${x.name}: ${k} ${js} in JavaScript, ${p} in Python`);
        }
      }
    });
  }
});

/** A reader of the export in `dir` whose files pass through `change(name, bytes)`. */
const changed = (dir, change) => (name) => readFile(join(dir, name)).then((b) => change(name, new Uint8Array(b)));

test("the golden check fails on wrong golden values and refuses a golden.json that is not the manifest's", { skip: why ?? false }, async () => {
  const g = cases.golden;
  // one stored value of one decode row moved by 1.0 (the manifest's golden entry updated): out of budget there
  const bad = await (await open(g.perturbed.dir)).check();
  assert.equal(bad.passed, false);
  const [prefill, decode] = bad.results;
  assert.ok(prefill.passed && prefill.where === "", JSON.stringify(prefill));
  assert.equal(decode.passed, false);
  assert.ok(decode.where.startsWith(g.perturbed.where), decode.where);
  assert.ok(decode.max_abs >= 0.99 && decode.max_abs <= 1.01, `max abs ${decode.max_abs}`);
  const python = g.perturbed.python.results.find((x) => x.name === decode.name);
  assert.ok(!python.passed && python.where.startsWith(g.perturbed.where), python.where);
  assert.ok(Math.abs(decode.max_rel - python.max_rel) <= 1e-3 * python.max_rel, `max rel ${decode.max_rel} in JavaScript, ${python.max_rel} in Python`);
  // golden.json changed behind the manifest's back: refused by its sha256 (the same size)
  await assert.rejects((await open(g.tampered.dir)).check(), /golden\.json is not the file edgelin\.json records \(its sha256 differs/);
  // a golden.json of another size: refused by its size
  const dir = cases.exports[0].dir;
  const longer = changed(dir, (name, b) => (name === "golden.json" ? Uint8Array.from([...b, 10]) : b));
  await assert.rejects((await edgelin.loadExport(ort, longer)).check(), /golden\.json is \d+ bytes but edgelin\.json says/);
  // an export without golden outputs (made by an earlier edgelin)
  const none = changed(dir, (name, b) => {
    if (name !== "edgelin.json") return b;
    const m = JSON.parse(new TextDecoder().decode(b));
    delete m.golden;
    return new TextEncoder().encode(JSON.stringify(m));
  });
  const old = await edgelin.loadExport(ort, none);
  await assert.rejects(old.check(), (err) => err instanceof edgelin.EdgelinError && /this export has no golden outputs \(golden\.json\); re-export it/.test(err.message));
  // a golden.json of another format, its hash and size made to match
  const other = new TextEncoder().encode(JSON.stringify({ format: "edgelin-golden/0" }));
  const digest = Array.from(new Uint8Array(await crypto.subtle.digest("SHA-256", other)), (x) => x.toString(16).padStart(2, "0")).join("");
  const swapped = changed(dir, (name, b) => {
    if (name === "golden.json") return other;
    if (name !== "edgelin.json") return b;
    const m = JSON.parse(new TextDecoder().decode(b));
    m.golden = { ...m.golden, sha256: digest, bytes: other.length };
    return new TextEncoder().encode(JSON.stringify(m));
  });
  await assert.rejects((await edgelin.loadExport(ort, swapped)).check(), /not a golden outputs file edgelin can read \(format "edgelin-golden\/0"/);
});

test("rowErrors gives the errors themselves for a whole stored row, and lower bounds for a part", { skip: false }, () => {
  const ref = [3, -1, 0.5, 2];
  const norm = (x) => Math.sqrt(x.reduce((a, v) => a + v * v, 0));
  const whole = { ids: [0, 3, 2, 1], values: [3, 2, 0.5, -1], absmax: 3, l2: norm(ref) };
  const got = Float32Array.of(3.5, -1, 0.5, 2);
  const e = edgelin.rowErrors(got, whole);
  assert.equal(e.max_abs, 0.5);
  assert.equal(e.max_rel, 0.5 / 3);
  assert.ok(Math.abs(e.rel_l2 - 0.5 / norm(ref)) < 1e-15);
  // only the top two stored: the difference at id 2 is unseen, but the row's norm still bounds it
  const part = { ids: [0, 3], values: [3, 2], absmax: 3, l2: norm(ref) };
  const far = Float32Array.of(3, -1, 10, 2);
  const p = edgelin.rowErrors(far, part);
  assert.equal(p.max_abs, 7); // | max|got| - absmax | = 10 - 3
  assert.ok(p.rel_l2 > 0 && p.rel_l2 * norm(ref) <= 9.5 + 1e-12);
  assert.equal(edgelin.rowErrors(Float32Array.of(NaN, 0, 0, 0), whole).nonfinite, 1);
  assert.equal(edgelin.withinBudget(edgelin.rowErrors(Float32Array.of(NaN, 0, 0, 0), whole), {}), false);
  assert.equal(edgelin.withinBudget(e, { max_rel: 0.2, rel_l2: 0.2 }), true);
  assert.equal(edgelin.withinBudget(e, { max_rel: 0.1 }), false);
  assert.equal(edgelin.withinBudget(e, { max_abs: 0.4 }), false);
});

test("float16 bits round-trip", { skip: false }, () => {
  for (const x of [0, 1, -2.5, 65504, 6.1e-5, 5.96e-8, 0.1]) {
    const back = edgelin.fromHalf(edgelin.toHalf(x));
    assert.ok(Math.abs(back - x) <= Math.abs(x) * 1e-3 + 6e-8, `${x} -> ${back}`);
  }
  assert.equal(edgelin.toHalf(1), 0x3c00);
  assert.equal(edgelin.toHalf(-2), 0xc000);
  assert.equal(edgelin.toHalf(Infinity), 0x7c00);
});

// ---- sampling without a full sort, against the full sort it replaced (no cases needed) ----------
function referenceProbabilities(logits, { temperature, topK, topP }) {
  const V = logits.length;
  const x = Float64Array.from(logits, (v) => v / temperature);
  const keep = new Uint8Array(V).fill(1);
  if (topK > 0 && topK < V) {
    const kth = Float64Array.from(x).sort()[V - topK];
    for (let i = 0; i < V; i++) if (x[i] < kth) keep[i] = 0;
  }
  const softmax = (y) => {
    let max = -Infinity;
    for (const v of y) if (v > max) max = v;
    const e = Float64Array.from(y, (v) => Math.exp(v - max));
    let sum = 0;
    for (const v of e) sum += v;
    return e.map((v) => v / sum);
  };
  if (topP < 1) {
    const p = softmax(x);
    const order = Array.from(p.keys()).sort((i, j) => p[j] - p[i] || i - j);
    let before = 0;
    const inNucleus = new Uint8Array(V);
    for (const i of order) {
      if (before < topP) inNucleus[i] = 1;
      before += p[i];
    }
    for (let i = 0; i < V; i++) keep[i] &= inNucleus[i];
  }
  for (let i = 0; i < V; i++) if (!keep[i]) x[i] = -Infinity;
  return softmax(x);
}

function normals(n, seed, scale = 1, shift = 0) {
  const random = edgelin.rng(seed);
  return Float32Array.from({ length: n }, () => shift + scale * Math.sqrt(-2 * Math.log(1 - random())) * Math.cos(2 * Math.PI * random()));
}

function awkwardLogits() {
  const V = 250000;
  const tied = normals(32000, 3, 1, -20);
  tied.fill(1, 100, 3100);
  tied[7] = 6; tied[18000] = 5; tied[31999] = 5; tied[5] = 4;
  const banned = new Float32Array(V).fill(-Infinity);
  banned[3] = 0.5; banned[99999] = 2; banned[200001] = 2;
  const spotted = normals(65536, 4, 2);
  const random = edgelin.rng(5);
  for (let n = 0; n < 20000; n++) spotted[Math.floor(random() * 65536)] = -Infinity;
  return {
    "V=1": Float32Array.of(0.3), "V=2 tie": Float32Array.of(1, 1), "normal V=5000": normals(5000, 1, 3),
    "V=250k normal x3": normals(V, 2, 3), "V=250k peaked": normals(V, 6, 40), "V=250k flat": normals(V, 7, 1e-3),
    "V=250k all equal": new Float32Array(V), "ties at the cutoff V=32k": tied, "-inf V=250k": banned, "-inf spotted V=65536": spotted,
  };
}

test("sampling without a full sort gives the full sort's probabilities bit for bit", { skip: false }, () => {
  const options = [[1, 0, 1], [1, 1, 1], [0.7, 50, 1], [1, 1e9, 1], [1, 0, 0.9], [1, 0, 0.5], [1.3, 0, 0.99], [1, 0, 1e-9],
    [1, 0, 0.999999], [1, 0, 1 - 1e-13], [0.5, 40, 0.8], [1, 1, 0.5], [1, 5000, 0.9], [1, 3002, 0.95], [1e-4, 0, 0.9],
    [100, 0, 0.3], [2, 4, 0.999999]];
  const large = [[1, 0, 0.9], [1, 0, 0.5], [1, 0, 1e-9], [1, 0, 1 - 1e-13], [0.5, 40, 0.8], [1, 5000, 0.9], [0.7, 50, 1]];
  for (const [name, logits] of Object.entries(awkwardLogits())) {
    for (const [temperature, topK, topP] of logits.length > 70000 ? large : options) { // the full sort is slow at 250k
      const o = edgelin.samplingOptions({ temperature, topK, topP });
      const got = edgelin.probabilities(logits, o), want = referenceProbabilities(logits, o);
      assert.equal(got.length, want.length);
      let differ = 0;
      for (let i = 0; i < got.length; i++) if (!Object.is(got[i], want[i])) differ++;
      assert.equal(differ, 0, `${name}, ${JSON.stringify(o)}: ${differ} probabilities differ`);
    }
  }
});

test("non-finite logits give what the full sort gave", { skip: false }, () => {
  const cases = [Float32Array.of(1, NaN, 2), Float32Array.of(1, Infinity, 2), Float32Array.of(-Infinity, -Infinity)];
  for (const logits of cases) {
    for (const o of [{ temperature: 1, topK: 0, topP: 0.9 }, { temperature: 1, topK: 1, topP: 0.5 }]) {
      assert.deepEqual(Array.from(edgelin.probabilities(logits, edgelin.samplingOptions(o))), Array.from(referenceProbabilities(logits, o)));
    }
  }
});

test("selectInPlace finds the k-th smallest value, ties and -inf included", { skip: false }, () => {
  const random = edgelin.rng(9);
  for (const n of [1, 2, 3, 10, 1000, 20000]) {
    for (const kind of ["distinct", "few values", "sorted", "reversed", "-inf"]) {
      const a = Float64Array.from({ length: n }, (_, i) =>
        kind === "distinct" ? random() : kind === "few values" ? Math.floor(random() * 3) : kind === "sorted" ? i : kind === "reversed" ? -i : random() < 0.7 ? -Infinity : random());
      const sorted = Float64Array.from(a).sort();
      for (const k of [0, n - 1, n >> 1, Math.floor(random() * n)]) {
        assert.equal(edgelin.selectInPlace(Float64Array.from(a), k), sorted[k], `${kind}, n ${n}, k ${k}`);
      }
    }
  }
});

test("at V = 250k no sampling step sorts the vocabulary", { skip: false }, () => {
  const logits = normals(250000, 12, 3);
  const sort = Float64Array.prototype.sort;
  const lengths = [];
  Float64Array.prototype.sort = function (...args) { lengths.push(this.length); return sort.apply(this, args); };
  try {
    for (const o of [{ temperature: 0.8, topK: 0, topP: 0.9 }, { temperature: 0.8, topK: 40, topP: 0.95 }, { temperature: 1, topK: 50, topP: 1 }]) {
      edgelin.sample(logits, edgelin.samplingOptions(o), edgelin.rng(0));
    }
  } finally {
    Float64Array.prototype.sort = sort;
  }
  assert.ok(Math.max(0, ...lengths) <= 20000, `sorted ${JSON.stringify(lengths)}`);
});

test("prefill pieces never exceed the manifest's max_sequence", { skip: false }, async () => {
  // the graph of a bounded export (a portable delta rule's scan) is exact only up to max_sequence tokens per call
  const calls = [];
  const model = Object.create(edgelin.Model.prototype);
  const V = 3;
  model.vocabSize = V;
  model._run = async (graph, ids) => { calls.push([graph, ids.length]); return new Float32Array(ids.length * V); };
  for (const [manifest, piece, expected] of [
    [{ min_sequence: 1, prefill_piece: 1024, max_sequence: 256 }, undefined, [256, 256, 37]],
    [{ min_sequence: 1, prefill_piece: 1024, max_sequence: 256 }, 549, [256, 256, 37]],
    [{ min_sequence: 1, prefill_piece: 1024, max_sequence: 256 }, 100, [100, 100, 100, 100, 100, 49]],
    [{ min_sequence: 1, prefill_piece: 1024 }, 549, [549]],
    [{ min_sequence: 1, prefill_piece: 1024 }, undefined, [549]],
  ]) {
    model.manifest = manifest;
    calls.length = 0;
    await model.prefill(Array.from({ length: 549 }, (_, i) => i % V), {}, piece === undefined ? {} : { piece });
    assert.deepEqual(calls.map((c) => c[1]), expected, JSON.stringify([manifest, piece]));
  }
});
