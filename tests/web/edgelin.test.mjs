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
    const p = edgelin.probabilities(Float32Array.from(s.logits), edgelin.samplingOptions(s.options));
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
