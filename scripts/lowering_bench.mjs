// The JavaScript half of scripts/lowering_bench.py: the portable and the fused export of one model through
// runtime/web/edgelin.mjs, interleaved, in one process, batch 1 (the JS runtime's batch):
//   node scripts/lowering_bench.mjs PACKAGE PORTABLE_DIR FUSED_DIR THREADS ROUNDS LENGTHS...  -> JSON on stdout
// PACKAGE: onnxruntime-node (native CPU) or onnxruntime-web (its WASM backend, as a browser runs it).
import { readFile } from "node:fs/promises";
import { join } from "node:path";

import * as edgelin from "../runtime/web/edgelin.mjs";

const [pkg, portable, fusedDir, threads, rounds, ...lengths] = process.argv.slice(2);
const ort = await import(pkg);
const sessionOptions = pkg === "onnxruntime-web"
  ? { executionProviders: ["wasm"] }
  : { executionProviders: ["cpu"], intraOpNumThreads: Number(threads), interOpNumThreads: 1 };
if (pkg === "onnxruntime-web") ort.env.wasm.numThreads = Number(threads);
const folder = (dir) => (name) => readFile(join(dir, name)).then((b) => new Uint8Array(b));
const models = {
  portable: await edgelin.loadExport(ort, folder(portable), { sessionOptions }),
  fused: await edgelin.loadExport(ort, folder(fusedDir), { sessionOptions }),
};
const median = (xs) => xs.slice().sort((a, b) => a - b)[xs.length >> 1];
const times = {};
const record = (key, value) => (times[key] ??= []).push(value);
const STEPS = 100;
for (let r = 0; r < Number(rounds); r++) {
  const order = r % 2 === 0 ? ["portable", "fused"] : ["fused", "portable"];
  for (const name of order) {
    const model = models[name];
    let state = model.newState();
    await model.decode(1, state); // warm
    let start = performance.now();
    for (let i = 0; i < STEPS; i++) await model.decode(i % model.vocabSize, state);
    record(`${name}/decode_ms`, (performance.now() - start) / STEPS);
    for (const T of lengths.map(Number)) {
      const ids = Array.from({ length: T }, (_, i) => (i * 7919 + 13) % model.vocabSize);
      state = model.newState();
      start = performance.now();
      await model.prefill(ids, state);
      record(`${name}/prefill_${T}_tok_s`, T / ((performance.now() - start) / 1000));
    }
  }
}
const out = {};
for (const [key, xs] of Object.entries(times)) out[key] = median(xs);
console.log(JSON.stringify({ package: pkg, threads: Number(threads), rounds: Number(rounds), medians: out }));
