// The JavaScript runtimes' half of the bench's llamacpp section (edgelin/bench/llamacpp.py): one edgelin
// measurement of one export through runtime/web/edgelin.mjs, as the Python runtime's edgelin_round makes it:
//   node scripts/llamacpp_round.mjs PACKAGE DIR THREADS N_DECODE LENGTHS...  -> JSON on stdout
// PACKAGE: onnxruntime-node (native CPU) or onnxruntime-web (its WASM backend, as a browser runs it).
// {"tgN": N decode calls from an empty state, N / their total seconds, "ppL": one prefill of L tokens in the
// runtime's default pieces (the manifest's prefill_piece), L / its seconds}; ids below 512 (the section's models
// have at least that many); "failed": {key: the error's first line} for a measurement that threw (the others
// still run; a failure while loading or warming up fails the round).
import { readFile } from "node:fs/promises";
import { join } from "node:path";

import * as edgelin from "../runtime/web/edgelin.mjs";

const [pkg, dir, threads, nDecode, ...lengths] = process.argv.slice(2);
const ort = await import(pkg);
const sessionOptions = pkg === "onnxruntime-web"
  ? { executionProviders: ["wasm"] }
  : { executionProviders: ["cpu"], intraOpNumThreads: Number(threads), interOpNumThreads: 1 };
if (pkg === "onnxruntime-web") ort.env.wasm.numThreads = Number(threads);
const model = await edgelin.loadExport(ort, (name) => readFile(join(dir, name)).then((b) => new Uint8Array(b)), { sessionOptions });
const id = (i) => (i * 7919 + 13) % Math.min(512, model.vocabSize);
const ids = (T) => Array.from({ length: T }, (_, i) => id(i));

let state = model.newState(); // warm-up: a few decode calls and a short prefill (llama-bench warms up itself)
for (let i = 0; i < 4; i++) await model.decode(id(i), state);
await model.prefill(ids(64), model.newState(), { piece: 64 });

const out = {};
const failed = {}; // a measurement that throws (e.g. WASM's heap exhausted by a long prefill) loses only its own figure
const measure = async (key, run) => {
  try {
    out[key] = await run();
  } catch (e) {
    failed[key] = String(e?.message ?? e).split("\n")[0].slice(0, 300);
  }
};
const n = Number(nDecode);
await measure(`tg${n}`, async () => {
  state = model.newState();
  let total = 0;
  for (let i = 0; i < n; i++) {
    const start = performance.now();
    await model.decode(id(i), state);
    total += performance.now() - start;
  }
  return n / (total / 1000);
});
for (const T of lengths.map(Number)) {
  await measure(`pp${T}`, async () => {
    const prompt = ids(T);
    state = model.newState();
    const start = performance.now();
    await model.prefill(prompt, state);
    return T / ((performance.now() - start) / 1000);
  });
}
if (Object.keys(failed).length) out.failed = failed;
console.log(JSON.stringify(out));
