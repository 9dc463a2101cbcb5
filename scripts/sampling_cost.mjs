// The node half of scripts/sampling_cost.py: one sampling step (runtime/web/edgelin.mjs's `sample`)
// against the full sort it replaced, on one row of float32 logits, interleaved, median of REPS rounds.
//   node scripts/sampling_cost.mjs LOGITS.f32 V REPS     -> JSON {setting: {"full sort": ms, "selection": ms}}
import { readFileSync } from "node:fs";

import * as edgelin from "../runtime/web/edgelin.mjs";

const SETTINGS = [["top-p 0.9", 1, 0, 0.9], ["top-k 50, top-p 0.95", 1, 50, 0.95], ["top-k 50", 1, 50, 1]];

// ---- the implementation before (a sort of the whole row for top-k and for top-p): the runtime keeps it ----
function fullSortProbabilities(logits, { temperature, topK, topP }) {
  return edgelin.probabilitiesBySort(Float64Array.from(logits, (v) => v / temperature), topK, topP);
}

function fullSortSample(logits, options, random) {
  const p = fullSortProbabilities(logits, options);
  let total = 0;
  const cdf = p.map((v) => (total += v));
  const u = random() * total;
  let id = 0;
  while (id < cdf.length && cdf[id] <= u) id++;
  return Math.min(id, cdf.length - 1);
}

const [path, V, reps] = [process.argv[2], Number(process.argv[3]), Number(process.argv[4] ?? 41)];
const bytes = readFileSync(path);
const logits = new Float32Array(bytes.buffer, bytes.byteOffset, bytes.byteLength / 4);
if (logits.length !== V) throw new Error(`${path} holds ${logits.length} logits, not ${V}`);
const median = (xs) => xs.slice().sort((a, b) => a - b)[xs.length >> 1];
const out = {};
for (const [name, temperature, topK, topP] of SETTINGS) {
  const options = edgelin.samplingOptions({ temperature, topK, topP });
  const times = { "full sort": [], selection: [] };
  for (let r = 0; r < reps; r++) {
    const runs = [["full sort", () => fullSortSample(logits, options, edgelin.rng(r))], ["selection", () => edgelin.sample(logits, options, edgelin.rng(r))]];
    const ids = {};
    for (const [which, f] of r % 2 === 0 ? runs : runs.reverse()) {
      const start = performance.now();
      ids[which] = f();
      times[which].push(performance.now() - start);
    }
    if (ids["full sort"] !== ids.selection) throw new Error(`${name}: the selection chose ${ids.selection}, the full sort ${ids["full sort"]}`);
  }
  out[name] = { "full sort": median(times["full sort"]), selection: median(times.selection) };
}
console.log(JSON.stringify(out));
