// The JavaScript runtime's Hugging Face tokenizer against the Python runtime's. Run by
// tests/tokenizers/test_js_tokenizer.py, which sets EDGELIN_TOKENIZER_CASES (cases written by Python),
// EDGELIN_ORT_NODE (onnxruntime-node) and EDGELIN_NODE_MODULES; without them every test is skipped, saying why.
import { test } from "node:test";
import assert from "node:assert/strict";
import { cp, readFile, rm, writeFile } from "node:fs/promises";
import { createRequire } from "node:module";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

import * as edgelin from "../../runtime/web/edgelin.mjs";

const casesPath = process.env.EDGELIN_TOKENIZER_CASES;
const ortDir = process.env.EDGELIN_ORT_NODE;
const why = !casesPath ? "EDGELIN_TOKENIZER_CASES is not set (run through tests/tokenizers/test_js_tokenizer.py)" : !ortDir ? "EDGELIN_ORT_NODE is not set" : null;
const cases = why ? null : JSON.parse(await readFile(casesPath, "utf8"));
const ort = why ? null : createRequire(join(ortDir, "package.json"))(ortDir);
const tokenizers = why ? null : await import(pathToFileURL(join(process.env.EDGELIN_NODE_MODULES, "@huggingface/tokenizers/dist/tokenizers.mjs")).href);
const jinja = why ? null : await import(pathToFileURL(join(process.env.EDGELIN_NODE_MODULES, "@huggingface/jinja/dist/index.js")).href);

function open(dir, options = {}) {
  return edgelin.loadExport(ort, (name) => readFile(join(dir, name)).then((b) => new Uint8Array(b)), {
    sessionOptions: { executionProviders: ["cpu"], intraOpNumThreads: 1, interOpNumThreads: 1 },
    tokenizers,
    jinja,
    ...options,
  });
}

test("encoding gives the Python runtime's ids, bos as the manifest says", { skip: why ?? false }, async () => {
  for (const c of cases.exports) {
    const model = await open(c.dir);
    assert.ok(model.tokenizer instanceof edgelin.HuggingFaceTokenizer, c.kind);
    for (const e of c.encode) assert.deepEqual(model.tokenizer.encode(e.text), e.ids, `${c.kind}: ${JSON.stringify(e.text)}`);
  }
});

test("streamed text is released token for token as the Python runtime releases it", { skip: why ?? false }, async () => {
  for (const c of cases.exports) {
    const model = await open(c.dir);
    for (const s of c.streams) {
      const dec = model.tokenizer.decoder();
      const pieces = s.ids.map((i) => dec.feed(i));
      pieces.push(dec.flush());
      assert.deepEqual(pieces, s.pieces, `${c.kind}: ids ${JSON.stringify(s.ids)}`);
      assert.equal(model.tokenizer.decode(s.ids), s.text, `${c.kind}: ids ${JSON.stringify(s.ids)}`);
    }
  }
});

test("generation from a text prompt gives the Python runtime's ids and text, with generate's controls", { skip: why ?? false }, async () => {
  let penalised = 0, banned = 0;
  for (const c of cases.exports) {
    const model = await open(c.dir);
    for (const run of c.generate) {
      const chat = model.conversation();
      const what = `${c.kind} ${JSON.stringify(run.options)}`;
      const text = await chat.generate(c.prompt, { maxNewTokens: c.n, ...run.options }).done();
      assert.deepEqual(chat.ids, run.ids, what);
      assert.equal(text, run.text, what);
      assert.equal(chat.stopReason, run.stop, what);
      const changed = JSON.stringify(run.ids) !== JSON.stringify(c.generate[0].ids);
      if (run.options.repetitionPenalty && changed) penalised += 1;
      if (run.options.noRepeatNgramSize && changed) banned += 1;
    }
  }
  assert.ok(penalised > 0, "no repetition penalty changed a generation: the cases test nothing");
  assert.ok(banned > 0, "no n-gram ban changed a generation: the cases test nothing");
});

test("processLogits is Hugging Face's repetition penalty and min_new_tokens", { skip: false }, () => {
  const logits = Float32Array.from([2, -2, 0.5, -0.5, 3]);
  const out = edgelin.processLogits(logits, new Set([0, 1, 4]), 0, { repetitionPenalty: 2, minNewTokens: 1, eosIds: new Set([4]) });
  assert.deepEqual(Array.from(out), [1, -4, 0.5, -0.5, -Infinity]);
  assert.equal(edgelin.processLogits(logits, null, 5, { minNewTokens: 1, eosIds: new Set([4]) }), logits); // nothing to do: the same array
});

test("NGrams bans what would repeat an n-gram, as a scan of the sequence does (Python: NGrams)", { skip: false }, () => {
  let x = 7;
  const seq = Array.from({ length: 60 }, () => ((x = (x * 1103515245 + 12345) % 2147483648) >> 16) % 4);
  for (const n of [1, 2, 3, 4]) {
    const grams = new edgelin.NGrams(n, seq.slice(0, 3));
    for (let t = 3; t < seq.length; t += 1) {
      const tail = seq.slice(t - n + 1, t).join(",");
      const want = new Set();
      if (t + 1 >= n) for (let i = 0; i + n - 1 < t; i += 1) if (seq.slice(i, i + n - 1).join(",") === tail) want.add(seq[i + n - 1]);
      assert.deepEqual(grams.banned().sort(), Array.from(want).sort(), `n ${n} at ${t}`);
      grams.add(seq[t]);
    }
  }
  const out = edgelin.processLogits(Float32Array.from([1, 2, 3]), null, 0, { banned: [0, 2] });
  assert.deepEqual(Array.from(out), [-Infinity, 2, -Infinity]);
});

test("the package is imported by name where node can resolve it", { skip: why ?? false }, async () => {
  const c = cases.exports[0];
  const model = await open(c.dir, { tokenizers: null }); // resolved from node_modules by its package name
  assert.deepEqual(model.tokenizer.encode(c.encode[0].text), c.encode[0].ids);
});

test("a tokenizer.json that is not the manifest's is refused", { skip: why ?? false }, async () => {
  const c = cases.exports[0];
  const copy = join(tmpdir(), `edgelin-tok-${process.pid}`);
  await cp(c.dir, copy, { recursive: true });
  const file = join(copy, "tokenizer.json");
  try {
    await writeFile(file, (await readFile(file, "utf8")).replace("<|endoftext|>", "<|endoftexT|>"));
    await assert.rejects(open(copy), (err) => err instanceof edgelin.EdgelinError && /tokenizer\.json is not the file edgelin\.json describes/.test(err.message));
  } finally {
    await rm(copy, { recursive: true, force: true });
  }
});

test("chat templates render as the Python runtime (and transformers) render them", { skip: why ?? false }, () => {
  for (const t of cases.chat.templates) {
    const template = new edgelin.ChatTemplate(jinja, typeof t.config.chat_template === "string" ? t.config.chat_template : t.config.chat_template[0].template, t.config);
    cases.chat.conversations.forEach((c, i) => assert.equal(template.render(c), t.renders[i], `${t.name} conversation ${i}`));
  }
  const llama = cases.chat.templates.find((t) => t.name === "llama2");
  const template = new edgelin.ChatTemplate(jinja, llama.config.chat_template, llama.config);
  assert.throws(() => template.render([{ role: "assistant", content: "hi" }]), (err) => err instanceof edgelin.EdgelinError && /refused the conversation/.test(err.message));
  assert.throws(() => template.render([{ role: "robot", content: "hi" }]), /message 0 must be/);
});

test("a chat keeps its state between turns as the Python runtime's Chat does", { skip: why ?? false }, async () => {
  const model = await open(cases.chat.export);
  const chat = model.chat({ system: cases.chat.system });
  for (const t of cases.chat.turns) {
    const reply = await chat.send(t.content, { maxNewTokens: t.n });
    assert.equal(reply, t.reply, t.content);
    assert.equal(chat.refills, t.refills, t.content);
    assert.equal(chat.lastPrefill, t.prefill, t.content);
  }
});
