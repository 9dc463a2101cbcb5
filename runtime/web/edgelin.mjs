// edgelin.mjs: run an edgelin export (edgelin.json + prefill.onnx + decode.onnx + weights.data) in JavaScript.
//
// One ES module: the caller passes in the ONNX Runtime object -- onnxruntime-web in a browser, onnxruntime-node
// in node -- and, for an export with a Hugging Face tokenizer.json, the @huggingface/tokenizers module (node finds
// it in node_modules by itself). Everything (names, dtypes, shapes, state layout, tokenizer, the
// prefill piece size) comes from the manifest, format edgelin/2 (docs/manifest.md).
//
//   import * as ort from "./ort/ort.min.mjs";              // or: import ort from "onnxruntime-node"
//   import { loadExport } from "./edgelin.mjs";
//   const model = await loadExport(ort, "export/");          // a URL (fetched) or async name => Uint8Array
//   const chat = model.conversation();                       // holds the recurrent state between calls
//   for await (const tok of chat.generate("Hello", { maxNewTokens: 32 })) out.textContent += tok.text;
//   await chat.generate(" and then", { temperature: 0.8, topP: 0.9, seed: 1 }).toArray();   // continues
//   const { passed, results } = await model.check();       // this runtime against the export's golden.json
//
// The contract is the Python runtime's (edgelin.runtime): a prompt is prefilled in pieces of at most
// manifest.prefill_piece tokens with the state carried between them; the first new token comes from
// the prompt's last logits, each next one from a decode step; the state after a call continues the
// text exactly where it ends (the last token is fed at the start of the next call). Greedy decoding
// reproduces the Python runtime's tokens. Sampling (temperature, top-k, top-p) follows the same
// rules but draws from a small seeded generator of its own (sfc32): a seed gives the same stream
// every time in JavaScript, but not the stream numpy gives for that seed in Python.
// Batch 1 only. A ragged export (the manifest names `lengths`, the prefill graph's per-row token counts)
// is fed lengths = [tokens in the call]: no padding, the same results as an export without the input. A prefill
// graph with `logits_at` (the manifest names it) is asked for the last position's logits only, unless every
// position's are wanted (prefill(..., {all: true})).

export const FORMAT = "edgelin/2";
export const VERSION = "0.1.0";
export const GOLDEN_FILE = "golden.json"; // the export's golden outputs (Model.check)
export const GOLDEN_FORMAT = "edgelin-golden/1";
const GRAPHS = ["prefill", "decode"];
const TYPED = {
  float32: (n) => new Float32Array(n),
  float16: (n) => new Uint16Array(n),
  int64: (n) => new BigInt64Array(n),
};

export class EdgelinError extends Error {
  constructor(message) {
    super(message);
    this.name = "EdgelinError";
  }
}

// ---- the manifest ---------------------------------------------------------------------------------
const plainName = (f) => typeof f === "string" && f !== "" && f !== "." && f !== ".." && !/[\/\\\0]/.test(f);

/** Check what this runtime relies on in an edgelin/2 manifest; throws EdgelinError with one line. */
export function checkManifest(m) {
  const fail = (what) => { throw new EdgelinError(`edgelin.json: ${what}; re-export the model with edgelin`); };
  if (m === null || typeof m !== "object" || Array.isArray(m)) fail("not a JSON object");
  if (m.format !== FORMAT) {
    throw new EdgelinError(`edgelin.json has format ${JSON.stringify(m.format)}; this runtime reads ${FORMAT} (re-export, or read it with the Python runtime)`);
  }
  for (const key of ["graphs", "io", "states", "tokenizer", "logits_layout"]) {
    if (m[key] === null || typeof m[key] !== "object") fail(`'${key}' is missing`);
  }
  for (const g of GRAPHS) {
    const f = m.graphs[g];
    if (!plainName(f)) fail(`graphs.${g} must be a plain file name`);
    if (!m.io[g] || !Array.isArray(m.io[g].inputs) || !Array.isArray(m.io[g].outputs)) fail(`io.${g} must list inputs and outputs`);
  }
  if (m.weights !== undefined) {
    const w = m.weights;
    if (w === null || typeof w !== "object" || !plainName(w.file)) fail("weights.file must be a plain file name");
    if (!Number.isInteger(w.bytes) || w.bytes < 0) fail("weights.bytes must be a non-negative integer");
  }
  if (!Number.isInteger(m.vocab_size) || m.vocab_size < 1) fail("'vocab_size' must be a positive integer");
  if (!Number.isInteger(m.prefill_piece) || m.prefill_piece < 1) fail("'prefill_piece' must be a positive integer");
  if (!Number.isInteger(m.min_sequence) || m.min_sequence < 1) fail("'min_sequence' must be a positive integer");
  if (m.max_sequence !== undefined && (!Number.isInteger(m.max_sequence) || m.max_sequence < m.min_sequence)) fail("'max_sequence' must be an integer >= min_sequence");
  // positions "logits_at": the prefill graph returns the positions its logits_at input asks for (the last one, here)
  const positions = m.logits_at === undefined ? "every" : "logits_at";
  if (m.logits_layout.next_token !== "last" || m.logits_layout.positions !== positions) fail("unknown logits_layout");
  for (const s of m.states) {
    if (!TYPED[s.dtype]) fail(`state ${s.input} has dtype ${s.dtype}`);
    // a growing state (a KV cache) has "past" where its positions go: 0 for a fresh sequence
    if (s.shape[0] !== "batch" || !s.shape.slice(1).every((d) => (Number.isInteger(d) && d > 0) || d === "past")) fail(`state ${s.input} has shape ${JSON.stringify(s.shape)}`);
  }
  if (m.lengths !== undefined && (typeof m.lengths !== "string" || !m.lengths)) fail("'lengths' must be a name");
  if (m.logits_at !== undefined && (typeof m.logits_at !== "string" || !m.logits_at)) fail("'logits_at' must be a name");
  for (const g of GRAPHS) {
    const names = (list) => list.map((t) => t.name).sort().join(",");
    const extra = g === "prefill" ? [m.lengths, m.logits_at].filter((n) => n !== undefined) : [];
    const wantIn = [m.input_ids, ...extra, ...m.states.map((s) => s.input)].sort().join(",");
    const wantOut = [m.logits, ...m.states.map((s) => s.output)].sort().join(",");
    if (names(m.io[g].inputs) !== wantIn || names(m.io[g].outputs) !== wantOut) fail(`io.${g} does not match input_ids, lengths, logits_at, logits and states`);
  }
  const logits = m.io.prefill.outputs.find((t) => t.name === m.logits);
  if (logits.dtype !== "float32" && logits.dtype !== "float16") fail(`logits dtype ${logits.dtype}`);
  return m;
}

// ---- the manifest a graph carries -------------------------------------------------------------------
// Each graph holds the manifest it was exported with in its metadata (ModelProto field 14, entries of key 1 and
// value 2, under "edgelin"). What this runtime reads from edgelin.json must be what the graphs say: an edgelin.json
// edited under a site (states paired otherwise, another eos id) would run and give garbage. Not compared: sha256 (a
// file cannot hold its own hash) and the entries naming files by their sha256, checked against the files themselves
// (golden, the tokenizer's files) -- as the Python runtime (runtime/check.py: runtime_differences).
export const METADATA_KEY = "edgelin";
const UNCOMPARED = ["sha256", "golden"];
const V1_COMPARED = ["input_ids", "logits", "vocab_size", "precision", "source"];

function varint(bytes, at) {
  let value = 0;
  for (let shift = 0; shift < 64; shift += 7) {
    if (at.i >= bytes.length) throw new EdgelinError("the file ends inside a field");
    const b = bytes[at.i++];
    value += (b & 0x7f) * 2 ** shift;
    if (b < 0x80) return value;
  }
  throw new EdgelinError("a varint longer than 10 bytes");
}

/** The manifest text an ONNX file's bytes carry under "edgelin", or null where it has none. */
export function graphManifest(bytes) {
  const at = { i: 0 };
  while (at.i < bytes.length) {
    const tag = varint(bytes, at);
    const [field, wire] = [Math.floor(tag / 8), tag % 8];
    if (wire === 0) varint(bytes, at);
    else if (wire === 1 || wire === 5) at.i += wire === 1 ? 8 : 4;
    else if (wire === 2) {
      const n = varint(bytes, at);
      const end = at.i + n;
      if (end > bytes.length) throw new EdgelinError("a field runs past the end of the file");
      if (field === 14) {
        const entry = {};
        const e = { i: at.i };
        while (e.i < end) {
          const t = varint(bytes, e);
          const len = varint(bytes, e);
          entry[Math.floor(t / 8)] = bytes.subarray(e.i, e.i + len);
          e.i += len;
        }
        if (entry[1] && new TextDecoder().decode(entry[1]) === METADATA_KEY) return new TextDecoder().decode(entry[2] ?? new Uint8Array());
      }
      at.i = end;
    } else throw new EdgelinError(`protobuf wire type ${wire}`);
  }
  return null;
}

function canonical(x) {
  if (Array.isArray(x)) return `[${x.map(canonical).join(",")}]`;
  if (x !== null && typeof x === "object") return `{${Object.keys(x).sort().map((k) => `${JSON.stringify(k)}:${canonical(x[k])}`).join(",")}}`;
  return JSON.stringify(x);
}

/** The fields a runtime reads in which edgelin.json (`m`) differs from the manifest a graph carries (`own`). */
export function manifestDifferences(own, m) {
  const tokenizer = (t) => { const { files, ...rest } = t ?? {}; return rest; };
  if (own.format !== FORMAT) { // an edgelin/1 export's graphs, in a site whose edgelin.json edgelin web upgraded
    const state = (s) => ({ input: s.input, output: s.output, shape: s.shape, dtype: s.dtype, init: s.init });
    const differ = V1_COMPARED.filter((k) => canonical(own[k]) !== canonical(m[k]));
    if (canonical((own.states ?? []).map(state)) !== canonical(m.states.map(state))) differ.unshift("states");
    if ((own.tokenizer?.eos_id ?? null) !== (m.tokenizer?.eos_id ?? null)) differ.push("tokenizer");
    return differ;
  }
  const keys = [...new Set([...Object.keys(m), ...Object.keys(own)])].filter((k) => !UNCOMPARED.includes(k));
  const value = (d, k) => canonical(k === "tokenizer" ? tokenizer(d[k]) : d[k]);
  const differ = keys.filter((k) => value(own, k) !== value(m, k));
  const derived = differ.filter((k) => k === "io" || k === "symbols");
  return [...differ.filter((k) => k === "states"), ...differ.filter((k) => k !== "states" && !derived.includes(k)), ...derived];
}

/** Throws EdgelinError where graph `file` (its bytes) carries a manifest that differs from edgelin.json in what a
 * runtime reads. */
export function checkGraphManifest(file, bytes, m) {
  let own;
  try {
    const text = graphManifest(bytes);
    if (text === null) return;
    own = JSON.parse(text);
  } catch (err) {
    throw new EdgelinError(`${file}: its '${METADATA_KEY}' metadata cannot be read (${err.message}); re-export the model`);
  }
  if (own.source !== m.source || canonical(own.model) !== canonical(m.model)) {
    throw new EdgelinError(`${file} was exported from another model than edgelin.json describes (files from two exports?); re-export the model`);
  }
  const differ = manifestDifferences(own, m);
  if (differ.length) {
    throw new EdgelinError(`${file}: edgelin.json differs from the manifest the graph carries in ${differ.join(", ")}; `
      + "edgelin.json was edited or comes from another export -- re-export the model");
  }
}

// ---- float16 <-> float32 ----------------------------------------------------------------------
const f32 = new Float32Array(1);
const u32 = new Uint32Array(f32.buffer);

/** float -> IEEE half bits, round to nearest even. */
export function toHalf(x) {
  f32[0] = x;
  const b = u32[0];
  const sign = (b >>> 16) & 0x8000;
  const exp = (b >>> 23) & 0xff;
  let mant = b & 0x7fffff;
  if (exp === 0xff) return sign | 0x7c00 | (mant ? 0x200 : 0);
  let e = exp - 127 + 15;
  if (e >= 0x1f) return sign | 0x7c00;
  if (e <= 0) {
    if (e < -10) return sign;
    mant |= 0x800000;
    const shift = 14 - e;
    let half = mant >>> shift;
    const rest = mant & ((1 << shift) - 1);
    const mid = 1 << (shift - 1);
    if (rest > mid || (rest === mid && (half & 1))) half += 1;
    return sign | half;
  }
  let half = (e << 10) | (mant >>> 13);
  const rest = mant & 0x1fff;
  if (rest > 0x1000 || (rest === 0x1000 && (half & 1))) half += 1;
  return sign | half;
}

/** IEEE half bits -> float. */
export function fromHalf(h) {
  const sign = h & 0x8000 ? -1 : 1;
  const exp = (h >>> 10) & 0x1f;
  const mant = h & 0x3ff;
  if (exp === 0) return sign * mant * 2 ** -24;
  if (exp === 0x1f) return mant ? NaN : sign * Infinity;
  return sign * (1 + mant / 1024) * 2 ** (exp - 15);
}

// ---- tokenizer --------------------------------------------------------------------------------
/** The byte tokenizer: id = UTF-8 byte + offset. Text decodes incrementally: a character split across
 * tokens is held back until complete; bytes that are not UTF-8, and ids that are no byte, give U+FFFD. */
export class ByteTokenizer {
  constructor(spec, vocabSize) {
    if (spec.kind !== "bytes" || spec.encoding !== "utf-8") {
      throw new EdgelinError(`tokenizer kind ${JSON.stringify(spec.kind)} is not known to this runtime (known: bytes, huggingface); pass token ids instead of text`);
    }
    this.offset = spec.offset ?? 0;
    this.eosId = spec.eos_id ?? null;
    this.eosIds = eosIdsOf(spec);
    this.vocabSize = vocabSize;
  }

  encode(text) {
    if (typeof text !== "string") throw new EdgelinError(`the prompt must be text, got ${typeof text}`);
    return Array.from(new TextEncoder().encode(text), (b) => b + this.offset);
  }

  decoder() {
    const utf8 = new TextDecoder("utf-8", { fatal: false });
    const offset = this.offset;
    return {
      feed(id) {
        const b = id - offset;
        if (!(b >= 0 && b < 256)) return utf8.decode() + "\ufffd";
        return utf8.decode(Uint8Array.of(b), { stream: true });
      },
      flush() {
        return utf8.decode();
      },
    };
  }

  decode(ids) {
    const d = this.decoder();
    return ids.map((i) => d.feed(i)).join("") + d.flush();
  }
}

/** Every id that ends a sequence: the manifest's `eos_ids` (a chat model may stop at several), else `eos_id`. */
function eosIdsOf(spec) {
  const ids = Array.isArray(spec.eos_ids) ? spec.eos_ids : spec.eos_id !== null && spec.eos_id !== undefined ? [spec.eos_id] : [];
  return new Set(ids);
}

export const HUGGINGFACE = "huggingface";
export const TOKENIZER_FILE = "tokenizer.json";
export const TOKENIZERS_PACKAGE = "@huggingface/tokenizers";
const REPLACEMENT = "\ufffd";
const BYTE_PIECE = /^<0x[0-9A-Fa-f]{2}>$/;

/**
 * A Hugging Face tokenizer.json (manifest kind "huggingface") run by the `@huggingface/tokenizers` package, as the
 * Python runtime runs it with `tokenizers`: encode = the tokenizer's ids without its post-processor's special
 * tokens, `bos_id` first when `add_bos`; decode = its decoding (`skip_special_tokens` as the manifest says, and
 * no clean-up of spaces: the Rust library's `decode` does none). The streamed text is the decoding of the ids so
 * far, released as it becomes final (HuggingFaceStreamDecoder in runtime/tokenizer.py, the same rules).
 */
export class HuggingFaceTokenizer {
  constructor(tokenizer, spec, vocabSize, json) {
    this.tok = tokenizer;
    this.vocabSize = vocabSize;
    this.bosId = spec.bos_id ?? null;
    this.eosId = spec.eos_id ?? null;
    this.eosIds = eosIdsOf(spec);
    this.addBos = Boolean(spec.add_bos);
    this.skipSpecialTokens = spec.skip_special_tokens ?? true;
    if (this.addBos && this.bosId === null) throw new EdgelinError("the tokenizer says add_bos but names no bos_id; re-export the model");
    // ids whose text may still change with the ids after them, held back while they end the sequence: byte-fallback
    // pieces (<0xNN>: a run decodes as one group) and skipped special tokens (they decode to nothing)
    this.held = new Set();
    let top = -1;
    for (const [token, id] of tokenizer.get_vocab(true)) {
      top = Math.max(top, id);
      if (json.includes('"ByteFallback"') && BYTE_PIECE.test(token)) this.held.add(id);
    }
    for (const [id, added] of tokenizer.get_added_tokens_decoder()) {
      top = Math.max(top, id);
      if (this.skipSpecialTokens && added.special) this.held.add(id);
    }
    if (top >= vocabSize) throw new EdgelinError(`${TOKENIZER_FILE}: a token has id ${top}, outside the model's vocabulary [0, ${vocabSize}); re-export the model`);
  }

  encode(text) {
    if (typeof text !== "string") throw new EdgelinError(`the prompt must be text, got ${typeof text}`);
    if (/[\ud800-\udbff](?![\udc00-\udfff])|(?<![\ud800-\udbff])[\udc00-\udfff]/.test(text)) {
      throw new EdgelinError("the prompt holds a lone UTF-16 surrogate, which is no character; pass valid text");
    }
    const ids = text ? this.tok.encode(text, { add_special_tokens: false }).ids : [];
    return this.addBos ? [this.bosId, ...ids] : ids;
  }

  decode(ids) {
    return ids.length ? this.tok.decode(ids, { skip_special_tokens: this.skipSpecialTokens, clean_up_tokenization_spaces: false }) : "";
  }

  decoder() {
    const tok = this;
    const ids = [];
    let start = 0; // the window decoded each time begins here (a point with text before it)
    let read = 0; // ids[0, read) have been released
    const release = (k, final) => {
      const before = tok.decode(ids.slice(start, read));
      const text = tok.decode(ids.slice(start, k));
      if (!text.startsWith(before) || (!final && text.endsWith(REPLACEMENT))) return "";
      const out = text.slice(before.length);
      if (out && tok.decode(ids.slice(read, k))) start = read;
      read = k;
      return out;
    };
    return {
      feed(id) {
        ids.push(id);
        let k = ids.length;
        while (k > read && tok.held.has(ids[k - 1])) k -= 1;
        return k === read ? "" : release(k, false);
      },
      flush() {
        return ids.length === read ? "" : release(ids.length, true);
      },
    };
  }
}

/** The tokenizer of a manifest: bytes, or a Hugging Face tokenizer.json read with `read` (its sha256 checked when
 * `verify`), run by the `tokenizers` module given (else imported by its package name, where the platform can). */
async function loadTokenizer(manifest, read, verify, tokenizers) {
  const spec = manifest.tokenizer;
  if (spec.kind !== HUGGINGFACE) return null; // bytes: made on first use; ids: no text
  const want = spec.files && spec.files[TOKENIZER_FILE];
  if (!want) throw new EdgelinError(`edgelin.json: the tokenizer names no ${TOKENIZER_FILE}; re-export the model`);
  let bytes;
  try {
    bytes = await read(TOKENIZER_FILE);
  } catch (err) {
    throw new EdgelinError(`cannot read ${TOKENIZER_FILE}, the tokenizer named in edgelin.json (${err.message}); copy the whole export folder`);
  }
  if (verify) {
    const got = await sha256Hex(bytes);
    if (got !== null && got !== want) throw new EdgelinError(`${TOKENIZER_FILE} is not the file edgelin.json describes (its sha256 differs); re-export the model`);
  }
  let lib = tokenizers;
  if (!lib) {
    try {
      lib = await import(TOKENIZERS_PACKAGE);
    } catch {
      return new EdgelinError(`this export's tokenizer (${TOKENIZER_FILE}) needs the ${TOKENIZERS_PACKAGE} package: npm install ${TOKENIZERS_PACKAGE}@0.2.0, or pass its module as loadExport(..., {tokenizers}); or pass token ids instead of text`);
    }
  }
  const json = new TextDecoder().decode(bytes);
  let tok;
  try {
    tok = new lib.Tokenizer(JSON.parse(json), { clean_up_tokenization_spaces: false });
  } catch (err) {
    throw new EdgelinError(`${TOKENIZER_FILE} cannot be read by ${TOKENIZERS_PACKAGE} (${err.message}); re-export the model`);
  }
  rustByteFallback(tok.decoder);
  return new HuggingFaceTokenizer(tok, spec, manifest.vocab_size, json);
}

export const CHAT_CONFIG = "tokenizer_config.json";
export const JINJA_PACKAGE = "@huggingface/jinja";

/** The chat template of an export's tokenizer (tokenizer_config.json's chat_template, its sha256 checked), rendered
 * by `@huggingface/jinja` (`jinja`, else imported by its package name); null where there is none, an EdgelinError
 * (thrown where a chat is asked for) where the package cannot be had. */
async function loadChatTemplate(manifest, read, verify, jinja) {
  const want = manifest.tokenizer.kind === HUGGINGFACE && manifest.tokenizer.files && manifest.tokenizer.files[CHAT_CONFIG];
  if (!want) return null;
  const bytes = await read(CHAT_CONFIG);
  if (verify) {
    const got = await sha256Hex(bytes);
    if (got !== null && got !== want) throw new EdgelinError(`${CHAT_CONFIG} is not the file edgelin.json describes (its sha256 differs); re-export the model`);
  }
  let config;
  try {
    config = JSON.parse(new TextDecoder().decode(bytes));
  } catch (err) {
    throw new EdgelinError(`${CHAT_CONFIG} is not JSON (${err.message}); re-export the model`);
  }
  let source = config && config.chat_template;
  if (Array.isArray(source)) source = (source.find((t) => t && t.name === "default") || {}).template;
  if (typeof source !== "string" || !source) return null;
  let lib = jinja;
  if (!lib) {
    try {
      lib = await import(JINJA_PACKAGE);
    } catch {
      return new EdgelinError(`this export's chat template needs the ${JINJA_PACKAGE} package: npm install ${JINJA_PACKAGE}@0.5.11, or pass its module as loadExport(..., {jinja})`);
    }
  }
  return new ChatTemplate(lib, source, config);
}

/** A chat template rendered as the Python runtime (edgelin.runtime.chat) and transformers' apply_chat_template
 * render it: the conversation's messages, add_generation_prompt, the tokenizer's special tokens as variables. */
export class ChatTemplate {
  constructor(jinja, source, config = {}) {
    try {
      this.template = new jinja.Template(source);
    } catch (err) {
      throw new EdgelinError(`${CHAT_CONFIG}: the chat template does not parse (${err.message}); re-export with a fixed ${CHAT_CONFIG}`);
    }
    this.special = {};
    for (const [k, v] of Object.entries(config)) {
      if (!k.endsWith("_token")) continue;
      const text = typeof v === "string" ? v : v && typeof v.content === "string" ? v.content : null;
      if (text !== null) this.special[k] = text;
    }
  }

  render(messages, { addGenerationPrompt = true } = {}) {
    checkMessages(messages);
    try {
      return this.template.render({ ...this.special, messages, add_generation_prompt: addGenerationPrompt });
    } catch (err) {
      throw new EdgelinError(`the chat template refused the conversation: ${err.message}`);
    }
  }
}

const ROLES = ["system", "user", "assistant", "tool"];
function checkMessages(messages) {
  if (!Array.isArray(messages) || messages.length === 0) throw new EdgelinError("a conversation is a non-empty list of {role, content} messages");
  messages.forEach((m, i) => {
    if (!m || !ROLES.includes(m.role) || typeof m.content !== "string") throw new EdgelinError(`message ${i} must be {role: one of ${ROLES.join(", ")}, content: text}`);
  });
}

/** Byte-fallback decoding as the Rust library does it: a run of <0xNN> pieces that is not valid UTF-8 becomes one
 * U+FFFD per byte (@huggingface/tokenizers 0.2.0 decodes the run with a lenient TextDecoder, which keeps the valid
 * bytes of an invalid run and replaces per sequence). Patches each ByteFallback step of the decoder (its
 * `text_decoder`, as that version names it; the ByteLevel step's lenient decoding is the Rust library's too); the
 * tests compare the result with the Python runtime's. */
function rustByteFallback(decoder) {
  if (!decoder) return;
  for (const d of decoder.decoders ?? []) rustByteFallback(d);
  if (decoder.config?.type === "ByteFallback" && decoder.text_decoder) {
    const strict = new TextDecoder("utf-8", { fatal: true });
    decoder.text_decoder = {
      decode(bytes) {
        try {
          return strict.decode(bytes);
        } catch {
          return REPLACEMENT.repeat(bytes.length);
        }
      },
    };
  }
}

// ---- Hugging Face generate's logits processors ------------------------------------------------
/** Before sampling, as the Python runtime (runtime/controls.py: process_logits) and Hugging Face's generate do:
 * the repetition penalty (CTRL: the logit of every id in `seen` divided by the penalty where positive, multiplied
 * where negative, in float32), the n-gram ban (every id of `banned`, from NGrams.banned(), is -Infinity) and
 * min_new_tokens (every eos id masked while fewer tokens were generated). Returns `logits` itself where none
 * applies, else a processed copy. */
export function processLogits(logits, seen, newTokens, { repetitionPenalty = 1, minNewTokens = 0, eosIds = new Set(), banned = [] } = {}) {
  const penalise = seen && repetitionPenalty !== 1;
  const mask = newTokens < minNewTokens && eosIds.size > 0;
  if (!penalise && !mask && banned.length === 0) return logits;
  const out = Float32Array.from(logits);
  if (penalise) {
    const p = Math.fround(repetitionPenalty);
    for (const id of seen) {
      if (id >= 0 && id < out.length) out[id] = out[id] < 0 ? out[id] * p : out[id] / p;
    }
  }
  if (mask) for (const id of eosIds) if (id >= 0 && id < out.length) out[id] = -Infinity;
  for (const id of banned) if (id >= 0 && id < out.length) out[id] = -Infinity;
  return out;
}

/** Stop strings found in text that arrives piece by piece, in time linear in the text and the strings, as the Python
 * runtime finds them (runtime/controls.py: StopStrings): each string gets Knuth-Morris-Pratt's table once; a matcher
 * advances one state per string and character (how many of the string's first characters the text ends with),
 * which is also how much text must be held back while it may still become that string. */
export class StopStrings {
  constructor(stops) {
    this.stops = stops;
    this.prefix = stops.map((s) => {
      const table = new Int32Array(s.length);
      for (let i = 1, k = 0; i < s.length; i++) {
        while (k && s[i] !== s[k]) k = table[k - 1];
        if (s[i] === s[k]) k += 1;
        table[i] = k;
      }
      return table;
    });
  }

  matcher() {
    const { stops, prefix } = this;
    const state = new Array(stops.length).fill(0);
    return {
      /** Advance over `text`: [the string's index, where it ends in `text`] for the first string of the list that is
       * complete in it (its first occurrence), or null. */
      feed(text) {
        for (let j = 0; j < stops.length; j++) {
          const s = stops[j], table = prefix[j];
          let k = state[j];
          for (let i = 0; i < text.length; i++) {
            while (k && text[i] !== s[k]) k = table[k - 1];
            if (text[i] === s[k]) k += 1;
            if (k === s.length) { state[j] = table[k - 1]; return [j, i + 1]; }
          }
          state[j] = k;
        }
        return null;
      },
      /** How many characters at the end of the text so far may still start a stop string. */
      partial() { return state.reduce((a, b) => Math.max(a, b), 0); },
    };
  }
}

/** The n-grams of a growing sequence, for Hugging Face's no_repeat_ngram_size (as the Python runtime's NGrams):
 * banned() is the ids that would complete an n-gram the sequence already holds; one step costs O(n). */
export class NGrams {
  constructor(n, ids = []) {
    this.n = n;
    this.ids = [];
    this.next = new Map(); // the (n - 1)-gram's ids joined by "," -> the ids seen after it, in order
    for (const id of ids) this.add(id);
  }

  add(id) {
    this.ids.push(id);
    const n = this.n, len = this.ids.length;
    if (len < n) return;
    const key = this.ids.slice(len - n, len - 1).join(",");
    let after = this.next.get(key);
    if (!after) this.next.set(key, (after = new Set()));
    after.add(id);
  }

  banned() {
    const n = this.n, len = this.ids.length;
    if (len + 1 < n) return [];
    return Array.from(this.next.get(this.ids.slice(len - n + 1).join(",")) ?? []);
  }
}

// ---- sampling ---------------------------------------------------------------------------------
/** A small seeded generator (sfc32, state from splitmix32 of the seed): uniform floats in [0, 1). */
export function rng(seed) {
  let s = (seed ?? Math.floor(Math.random() * 2 ** 32)) >>> 0;
  const splitmix = () => {
    s = (s + 0x9e3779b9) >>> 0;
    let z = s;
    z = Math.imul(z ^ (z >>> 16), 0x85ebca6b) >>> 0;
    z = Math.imul(z ^ (z >>> 13), 0xc2b2ae35) >>> 0;
    return (z ^ (z >>> 16)) >>> 0;
  };
  let a = splitmix(), b = splitmix(), c = splitmix(), d = splitmix();
  const next = () => {
    const t = (((a + b) >>> 0) + d) >>> 0;
    d = (d + 1) >>> 0;
    a = b ^ (b >>> 9);
    b = (c + (c << 3)) >>> 0;
    c = ((c << 21) | (c >>> 11)) >>> 0;
    c = (c + t) >>> 0;
    return t;
  };
  for (let i = 0; i < 12; i++) next();
  return () => (next() * 2 ** 21 + (next() >>> 11)) / 2 ** 53; // 53 random bits
}

/** Check sampling options as the Python Sampler does; returns them filled in. */
export function samplingOptions({ temperature = 0, topK = 0, topP = 1, seed = undefined } = {}) {
  if (!(Number.isFinite(temperature) && temperature >= 0 && temperature <= 100)) throw new EdgelinError(`temperature must be in [0, 100] (0 = greedy), got ${temperature}`);
  if (!(Number.isInteger(topK) && topK >= 0)) throw new EdgelinError(`topK must be an integer >= 0 (0 = off), got ${topK}`);
  if (!(Number.isFinite(topP) && topP > 0 && topP <= 1)) throw new EdgelinError(`topP must be in (0, 1] (1 = off), got ${topP}`);
  if (seed !== undefined && seed !== null && !(Number.isInteger(seed) && seed >= 0)) throw new EdgelinError(`seed must be an integer >= 0, got ${seed}`);
  return { temperature, topK, topP, seed: seed ?? undefined };
}

/** Index of the largest logit (the first one on ties, as numpy's argmax). */
export function argmax(logits) {
  let best = 0;
  for (let i = 1; i < logits.length; i++) if (logits[i] > logits[best]) best = i;
  return best;
}

/** The distribution sampled from (float64, zeros where masked): temperature, then top-k (ties with the
 * k-th value kept), then top-p (the smallest set of most likely tokens reaching p, ranked by probability
 * with ties in vocabulary order; the top one always). Nothing sorts the whole vocabulary: top-k is a
 * selection (the k-th largest value, O(V)); top-p sorts only the probabilities of the most likely m
 * tokens (and all tied with the m-th), m growing 4x from 1024 until their mass reaches p, or, with top-k,
 * of the tokens at least as likely as the least likely of the top k. Same result as a full sort, bit for
 * bit (tested against it in tests/web/edgelin.test.mjs). */
export function probabilities(logits, { temperature, topK, topP }) {
  const V = logits.length;
  const x = new Float64Array(V);
  let max = -Infinity, nan = false;
  for (let i = 0; i < V; i++) {
    const v = (x[i] = logits[i] / temperature);
    if (v > max) max = v;
    else if (v !== v) nan = true;
  }
  // NaN has no place in a selection; +inf or a row all -inf makes NaN probabilities: as they always did
  if (nan || !Number.isFinite(max)) return probabilitiesBySort(x, topK, topP);
  const keep = new Uint8Array(V).fill(1);
  let members = V;
  if (topK > 0 && topK < V) {
    const kth = selectInPlace(x.slice(), V - topK);
    members = 0;
    for (let i = 0; i < V; i++) if (x[i] < kth) keep[i] = 0; else members++;
  }
  // The kept tokens always include the largest logit, so the masked softmax has the same maximum and
  // the same exp for each kept token: one exp serves both softmaxes (a masked token adds 0 to the sum).
  const e = new Float64Array(V);
  let sum = 0;
  for (let i = 0; i < V; i++) sum += (e[i] = Math.exp(x[i] - max));
  if (topP < 1) {
    const p = new Float64Array(V);
    for (let i = 0; i < V; i++) p[i] = e[i] / sum;
    const inNucleus = nucleus(p, topP, members < V ? keep : null, members);
    for (let i = 0; i < V; i++) keep[i] &= inNucleus[i];
  }
  let kept = 0;
  for (let i = 0; i < V; i++) if (keep[i]) kept += e[i];
  for (let i = 0; i < V; i++) e[i] = keep[i] ? e[i] / kept : 0;
  return e;
}

/** 1 for the tokens of the nucleus of p (probabilities); given `inside` (1 for `members` tokens), right
 * at least where inside is 1. The running sum in rank order only grows, so the nucleus is a prefix of the
 * rank order: the n most likely tokens, those tied at the n-th probability taken in vocabulary order. */
function nucleus(p, topP, inside, members) {
  const V = p.length;
  // Of the tokens with probability >= t (a prefix of the rank order, ties included): how many the
  // nucleus keeps, and whether that is all of it (the mass ranked above reached topP within the set).
  const count = (t) => {
    let n = 0;
    for (let i = 0; i < V; i++) if (p[i] >= t) n++;
    const values = new Float64Array(n);
    for (let i = 0, j = 0; i < V; i++) if (p[i] >= t) values[j++] = p[i];
    values.sort(); // ascending: the rank order is from the end; ties are equal values, any order
    let before = 0, kept = 0;
    for (let j = n - 1; j >= 0 && before < topP; j--, kept++) before += values[j];
    return { kept, nth: values[n - kept], whole: before >= topP };
  };
  const mark = ({ kept, nth }) => {
    const out = new Uint8Array(V);
    let above = 0;
    for (let i = 0; i < V; i++) if (p[i] > nth) { out[i] = 1; above++; }
    for (let i = 0, tied = kept - above; i < V && tied > 0; i++) if (p[i] === nth) { out[i] = 1; tied--; }
    return out;
  };
  let scratch = null;
  for (let m = NUCLEUS_FIRST; 2 * m <= V; m *= NUCLEUS_GROWTH) {
    if (inside && members <= m) { // all of `inside` is at least as likely as its least likely token
      let least = Infinity;
      for (let i = 0; i < V; i++) if (inside[i] && p[i] < least) least = p[i];
      return mark(count(least));
    }
    scratch = scratch ?? new Float64Array(V);
    scratch.set(p);
    const found = count(selectInPlace(scratch, V - m)); // the m-th largest probability, and all ties
    if (found.whole) return mark(found);
  }
  return mark(count(-Infinity)); // the nucleus is a large share of V: sort all of it
}

const NUCLEUS_FIRST = 1024;
const NUCLEUS_GROWTH = 4;

/** The k-th smallest value of a (0-based; no NaN), reordering a in place: quickselect with a median of
 * three, Hoare partitioning (ties split evenly), a sort of what is left after too many rounds. */
export function selectInPlace(a, k) {
  let lo = 0, hi = a.length - 1;
  let rounds = 2 * Math.ceil(Math.log2(a.length + 1)) + 8;
  while (hi > lo) {
    if (rounds-- === 0) {
      a.subarray(lo, hi + 1).sort();
      return a[k];
    }
    const mid = lo + ((hi - lo) >> 1);
    const u = a[lo], v = a[mid], w = a[hi];
    const pivot = u < v ? (v < w ? v : u < w ? w : u) : u < w ? u : v < w ? w : v;
    let i = lo, j = hi;
    while (i <= j) {
      while (a[i] < pivot) i++;
      while (a[j] > pivot) j--;
      if (i <= j) {
        const t = a[i]; a[i] = a[j]; a[j] = t;
        i++; j--;
      }
    }
    if (k <= j) hi = j;
    else if (k >= i) lo = i;
    else return a[k]; // between j and i: equal to the pivot
  }
  return a[k];
}

/** What probabilities did before it selected: a sort of the whole vocabulary (kept for NaN logits; the baseline
 * scripts/sampling_cost.mjs measures). `x`: the logits over the temperature, Float64Array, changed in place. */
export function probabilitiesBySort(x, topK, topP) {
  const V = x.length;
  const keep = new Uint8Array(V).fill(1);
  if (topK > 0 && topK < V) {
    const kth = Float64Array.from(x).sort()[V - topK];
    for (let i = 0; i < V; i++) if (x[i] < kth) keep[i] = 0;
  }
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

function softmax(x) {
  const V = x.length;
  let max = -Infinity;
  for (let i = 0; i < V; i++) if (x[i] > max) max = x[i];
  const e = new Float64Array(V);
  let sum = 0;
  for (let i = 0; i < V; i++) sum += (e[i] = Math.exp(x[i] - max));
  for (let i = 0; i < V; i++) e[i] /= sum;
  return e;
}

/** Next token id from one position's logits. */
export function sample(logits, options, random) {
  if (options.temperature === 0) return argmax(logits);
  const p = probabilities(logits, options);
  let total = 0;
  for (let i = 0; i < p.length; i++) total += p[i];
  const u = random() * total;
  let id = 0, cdf = 0; // the first id whose cumulative probability exceeds u
  while (id < p.length && (cdf += p[id]) <= u) id++;
  return Math.min(id, p.length - 1);
}

// ---- loading ----------------------------------------------------------------------------------
async function sha256Hex(bytes) {
  const subtle = globalThis.crypto && globalThis.crypto.subtle;
  if (!subtle) return null;
  const digest = new Uint8Array(await subtle.digest("SHA-256", bytes));
  return Array.from(digest, (b) => b.toString(16).padStart(2, "0")).join("");
}

function reader(source) {
  if (typeof source === "function") return source;
  const base = new URL(String(source).endsWith("/") ? String(source) : `${source}/`, globalThis.location ? globalThis.location.href : undefined);
  return async (name) => {
    const url = new URL(name, base);
    const response = await fetch(url);
    if (!response.ok) throw new EdgelinError(`cannot fetch ${url}: HTTP ${response.status}`);
    return new Uint8Array(await response.arrayBuffer());
  };
}

/**
 * Load an export. `source`: the folder's URL (files are fetched), or an async function name -> Uint8Array.
 * options: `sessionOptions` (passed to ort.InferenceSession.create, e.g. {executionProviders: ["wasm"],
 * intraOpNumThreads: 1}), `verify` (default true: check each graph file's sha256 against the manifest
 * where crypto.subtle exists), `tokenizers` (the `@huggingface/tokenizers` module, for an export with a Hugging Face
 * tokenizer.json; default: imported by its package name, which node resolves from node_modules; a page passes the
 * copy its site ships). Without it such a model still runs on token ids; asking it for text says what to install.
 * An export whose manifest names a `weights` file (ONNX external data shared by both graphs) has it read
 * once and handed to both sessions (ONNX Runtime's `externalData` option); its size is always checked.
 */
export async function loadExport(ort, source, { sessionOptions = {}, verify = true, tokenizers = null, jinja = null } = {}) {
  const read = reader(source);
  let manifest;
  try {
    manifest = JSON.parse(new TextDecoder().decode(await read("edgelin.json")));
  } catch (err) {
    if (err instanceof EdgelinError) throw err;
    throw new EdgelinError(`cannot read edgelin.json: ${err.message}`);
  }
  checkManifest(manifest);
  const checkHash = async (name, bytes, want) => {
    if (!verify || !want) return;
    const got = await sha256Hex(bytes);
    if (got !== null && got !== want) {
      throw new EdgelinError(`${name} is not the file edgelin.json describes (its sha256 differs); re-export the model`);
    }
  };
  let externalData = [];
  if (manifest.weights) {
    const { file, bytes: size } = manifest.weights;
    const weights = await read(file);
    if (weights.byteLength !== size) {
      throw new EdgelinError(`${file} is ${weights.byteLength} bytes but edgelin.json says ${size} (truncated, or the weights of another export); copy the whole export folder again`);
    }
    await checkHash(file, weights, manifest.sha256 && manifest.sha256.weights);
    externalData = [{ path: file, data: weights }];
  }
  const sessions = {};
  for (const g of GRAPHS) {
    const bytes = await read(manifest.graphs[g]);
    await checkHash(manifest.graphs[g], bytes, manifest.sha256 && manifest.sha256[g]);
    checkGraphManifest(manifest.graphs[g], bytes, manifest);
    const files = externalData.length ? { externalData } : {};
    sessions[g] = await ort.InferenceSession.create(bytes, { graphOptimizationLevel: "all", ...sessionOptions, ...files });
    const missing = [
      ...manifest.io[g].inputs.filter((t) => !sessions[g].inputNames.includes(t.name)),
      ...manifest.io[g].outputs.filter((t) => !sessions[g].outputNames.includes(t.name)),
    ];
    const extra = sessions[g].inputNames.filter((n) => !manifest.io[g].inputs.some((t) => t.name === n));
    if (missing.length || extra.length) {
      throw new EdgelinError(`${manifest.graphs[g]} does not match edgelin.json (missing ${missing.map((t) => t.name).join(", ") || "none"}, unexpected ${extra.join(", ") || "none"})`);
    }
  }
  const model = new Model(ort, manifest, sessions, read, verify);
  const tokenizer = await loadTokenizer(manifest, read, verify, tokenizers);
  if (tokenizer !== null) model._tokenizer = tokenizer; // an EdgelinError: thrown where text is asked for
  model._chatTemplate = await loadChatTemplate(manifest, read, verify, jinja);
  return model;
}

// ---- running ----------------------------------------------------------------------------------
/** The recurrent state of one sequence: one ort.Tensor per manifest state, keyed by its input name. */
export class State {
  constructor(tensors) {
    this.tensors = tensors;
    this.pending = null; // a generated token not yet fed to the model (fed at the start of the next call)
    this.seen = 0; // tokens fed so far (checked against the manifest's max_positions)
  }
}

export class Model {
  /** `read`: the export's files, name -> Uint8Array (what loadExport read the manifest and graphs with; check()
   * reads golden.json through it); `verify`: check sha256 where crypto.subtle exists. */
  constructor(ort, manifest, sessions, read = null, verify = true) {
    this.ort = ort;
    this.manifest = manifest;
    this.sessions = sessions;
    this._read = read;
    this._verify = verify;
    this.vocabSize = manifest.vocab_size;
    this.logitsHalf = manifest.io.prefill.outputs.find((t) => t.name === manifest.logits).dtype === "float16";
    this._tokenizer = null;
  }

  get tokenizer() {
    if (this._tokenizer === null) this._tokenizer = new ByteTokenizer(this.manifest.tokenizer, this.vocabSize);
    if (this._tokenizer instanceof Error) throw this._tokenizer;
    return this._tokenizer;
  }

  /** Bytes of the state of `batch` sequences holding `past` positions in its growing states (a KV cache, at
   * most its window); without a growing state the same at any length. */
  stateBytes(batch = 1, past = 0) {
    const size = { float32: 4, float16: 2, int64: 8 };
    const held = (s) => (s.window === undefined ? past : Math.min(past, s.window));
    return this.manifest.states.reduce((n, s) => n + batch * s.shape.slice(1).reduce((a, d) => a * (d === "past" ? held(s) : d), 1) * size[s.dtype], 0);
  }

  /** A fresh state: every element at its spec's init. */
  newState() {
    const tensors = {};
    for (const s of this.manifest.states) {
      const dims = [1, ...s.shape.slice(1).map((d) => (d === "past" ? 0 : d))]; // a fresh KV cache holds nothing
      const data = TYPED[s.dtype](dims.reduce((a, b) => a * b, 1));
      data.fill(s.dtype === "int64" ? BigInt(s.init) : s.dtype === "float16" ? toHalf(s.init) : s.init);
      tensors[s.input] = new this.ort.Tensor(s.dtype, data, dims);
    }
    return new State(tensors);
  }

  _checkIds(ids) {
    for (let t = 0; t < ids.length; t++) {
      const id = ids[t];
      if (!Number.isInteger(id) || id < 0 || id >= this.vocabSize) {
        throw new EdgelinError(`token id ${id} at position ${t} is outside the vocabulary [0, ${this.vocabSize})`);
      }
    }
  }

  /** One graph run; returns the logits [1, t, V] flat, or with `last` (prefill) the last position's [1, 1, V]. */
  async _run(graph, ids, state, last = false) {
    const m = this.manifest;
    if (m.max_positions !== undefined && state.seen + ids.length > m.max_positions) {
      throw new EdgelinError(`this model declares a context of ${m.max_positions} positions (max_positions); the sequence would reach ${state.seen + ids.length} -- start a new conversation or shorten the prompt`);
    }
    const feeds = { ...state.tensors };
    feeds[m.input_ids] = new this.ort.Tensor("int64", BigInt64Array.from(ids, (i) => BigInt(i)), [1, ids.length]);
    if (graph === "prefill" && m.lengths !== undefined) {
      feeds[m.lengths] = new this.ort.Tensor("int64", BigInt64Array.of(BigInt(ids.length)), [1]); // one row, unpadded
    }
    const picked = graph === "prefill" && m.logits_at !== undefined; // the graph computes the logits it is asked for only
    if (picked) {
      const at = last ? BigInt64Array.of(BigInt(ids.length - 1)) : BigInt64Array.from(ids, (_, t) => BigInt(t));
      feeds[m.logits_at] = new this.ort.Tensor("int64", at, [1, at.length]);
    }
    const out = await this.sessions[graph].run(feeds);
    for (const s of m.states) state.tensors[s.input] = out[s.output];
    state.seen += ids.length;
    let data = out[m.logits].data;
    if (last && !picked) data = data.subarray(data.length - this.vocabSize); // an export made before logits_at
    return this.logitsHalf ? Float32Array.from(data, fromHalf) : data; // [1, t, V] (or [1, 1, V]) flat
  }

  /**
   * Feed `ids` through the prefill graph in pieces of at most `piece` tokens (default: the manifest's
   * prefill_piece; never more than its max_sequence, up to which the graph is exact), advancing `state`. Returns the last position's logits (Float32Array [V]), or with
   * `all: true` every position's (Float32Array [T * V]).
   */
  async prefill(ids, state, { piece = this.manifest.prefill_piece, all = false } = {}) {
    const least = this.manifest.min_sequence;
    if (ids.length < least) throw new EdgelinError(`prefill takes at least ${least} token(s), got ${ids.length}`);
    this._checkIds(ids);
    const step = Math.max(Math.min(piece, this.manifest.max_sequence ?? Infinity), least);
    const starts = [];
    for (let s = 0; s < ids.length; s += step) starts.push(s);
    if (starts.length > 1 && ids.length - starts[starts.length - 1] < least) starts.pop();
    const V = this.vocabSize;
    const kept = [];
    let last = null;
    for (let i = 0; i < starts.length; i++) {
      const end = i + 1 < starts.length ? starts[i + 1] : ids.length;
      const logits = await this._run("prefill", ids.slice(starts[i], end), state, !all);
      last = logits.slice(logits.length - V);
      if (all) kept.push(logits);
    }
    if (!all) return last;
    const out = new Float32Array(ids.length * V);
    let at = 0;
    for (const k of kept) { out.set(k, at); at += k.length; }
    return out;
  }

  /** One token through the decode graph; returns its logits (Float32Array [V]). */
  async decode(id, state) {
    this._checkIds([id]);
    return this._run("decode", [id], state);
  }

  /** A conversation: generate() calls that continue one another through the kept state. */
  conversation(state = this.newState()) {
    return new Conversation(this, state);
  }

  /** The tokenizer's chat template (ChatTemplate), or null where it has none. */
  get chatTemplate() {
    if (this._chatTemplate instanceof Error) throw this._chatTemplate;
    return this._chatTemplate ?? null;
  }

  /** A chat rendered with the tokenizer's chat template that keeps its state between turns (Chat). */
  chat({ system = null } = {}) {
    if (this.chatTemplate === null) throw new EdgelinError("this export's tokenizer has no chat template (tokenizer_config.json's chat_template); prompt it with plain text");
    return new Chat(this, system);
  }

  /** Generate from a fresh state (see Conversation.generate). */
  generate(prompt, options = {}) {
    return this.conversation().generate(prompt, options);
  }

  /**
   * Check this runtime (its ONNX Runtime, its provider) against the export's golden outputs (golden.json: what
   * the PyTorch model computed at export time), as the Python runtime's `edgelin check` does: each stored
   * prompt from a fresh state, prefilled in the stored pieces with the state carried, then the stored decode
   * ids fed one by one with the state fed back; every stored logits row compared by the lower bounds of its
   * errors that the stored part determines (see rowErrors) and held to the export's logits budget.
   * Returns {golden: true, precision, passed, results: [{group, name, max_abs, max_rel, rel_l2, nonfinite,
   * budget, passed, where}], seconds}: one result for the prefill rows, one for the decode rows, each with its
   * worst errors and `where`, the first row out of budget ("" when none is). The JavaScript State holds one
   * sequence, so the prompts run one after the other (Python runs them as one batch of 2).
   * EdgelinError for an export without golden outputs, or a golden.json that is not the manifest's.
   */
  async check() {
    const start = now();
    const golden = await this._golden();
    const budget = golden.budgets.logits;
    const V = this.vocabSize;
    const got = new Map(); // "graph b at" -> Float32Array [V]
    for (let b = 0; b < golden.prompt.length; b++) {
      const state = this.newState();
      const prompt = golden.prompt[b];
      const logits = new Float32Array(prompt.length * V);
      let at = 0;
      for (const n of golden.pieces) { // one prefill call per stored piece, as the Python check makes
        logits.set(await this.prefill(prompt.slice(at, at + n), state, { piece: n, all: true }), at * V);
        at += n;
      }
      for (const p of golden.positions) got.set(`prefill ${b} ${p}`, logits.subarray(p * V, (p + 1) * V));
      for (let t = 0; t < golden.decode[b].length; t++) got.set(`decode ${b} ${t}`, await this.decode(golden.decode[b][t], state));
    }
    const steps = golden.decode[0].length;
    const results = [];
    for (const graph of ["prefill", "decode"]) {
      let worst = { max_abs: 0, max_rel: 0, rel_l2: 0, nonfinite: 0 };
      let where = "";
      for (const row of golden.rows.filter((r) => r.graph === graph)) {
        const e = rowErrors(got.get(`${graph} ${row.batch} ${row.at}`), row);
        worst = {
          max_abs: Math.max(worst.max_abs, e.max_abs), max_rel: Math.max(worst.max_rel, e.max_rel),
          rel_l2: Math.max(worst.rel_l2, e.rel_l2), nonfinite: worst.nonfinite + e.nonfinite,
        };
        if (!where && !withinBudget(e, budget)) {
          where = `${graph} ${graph === "prefill" ? "position" : "step"} ${row.at} of prompt ${row.batch}: max abs ${exp2(e.max_abs)}, ` +
            `max rel ${exp2(e.max_rel)}, rel L2 ${exp2(e.rel_l2)}`;
        }
      }
      const name = `${graph} vs golden` + (graph === "decode" ? ` (${steps} steps)` : ` (pieces ${golden.pieces.join("+")})`);
      results.push({ group: "golden", name, ...worst, budget: { ...budget }, passed: withinBudget(worst, budget), where });
    }
    return { golden: true, precision: golden.precision, passed: results.every((r) => r.passed), results, seconds: (now() - start) / 1000 };
  }

  /** golden.json, read through the export's reader and checked against the manifest (size, sha256, format, plan). */
  async _golden() {
    const m = this.manifest;
    const entry = m.golden;
    if (entry === undefined || entry === null) {
      throw new EdgelinError(`this export has no golden outputs (${GOLDEN_FILE}); re-export it with this edgelin`);
    }
    if (typeof entry !== "object" || entry.file !== GOLDEN_FILE || typeof entry.sha256 !== "string") {
      throw new EdgelinError(`edgelin.json's 'golden' entry is not {"file": "${GOLDEN_FILE}", "sha256": ...}; re-export the model`);
    }
    if (this._read === null) throw new EdgelinError("this Model was made without a reader of its export's files; load it with loadExport");
    const bytes = await this._read(GOLDEN_FILE);
    if (Number.isInteger(entry.bytes) && bytes.byteLength !== entry.bytes) {
      throw new EdgelinError(`${GOLDEN_FILE} is ${bytes.byteLength} bytes but edgelin.json says ${entry.bytes} (truncated, or another export's); copy the whole export folder again, or re-export the model`);
    }
    if (this._verify) {
      const got = await sha256Hex(bytes);
      if (got !== null && got !== entry.sha256) {
        throw new EdgelinError(`${GOLDEN_FILE} is not the file edgelin.json records (its sha256 differs: changed since the export); re-export the model`);
      }
    }
    const fail = (what) => { throw new EdgelinError(`${GOLDEN_FILE} is not a golden outputs file edgelin can read (${what}); re-export the model`); };
    let d;
    try {
      d = JSON.parse(new TextDecoder().decode(bytes));
    } catch (err) {
      fail(err.message);
    }
    if (d === null || typeof d !== "object") fail("not a JSON object");
    if (d.format !== GOLDEN_FORMAT) fail(`format ${JSON.stringify(d.format)}, not ${JSON.stringify(GOLDEN_FORMAT)}`);
    if (d.precision !== this.manifest.precision) { // another export's golden outputs would hold the graphs to its budget
      throw new EdgelinError(`${GOLDEN_FILE} was made for a ${JSON.stringify(d.precision)} export but edgelin.json says `
        + `${JSON.stringify(this.manifest.precision)} (another export's golden outputs?); re-export the model`);
    }
    const isId = (i) => Number.isInteger(i) && i >= 0 && i < this.vocabSize;
    const idRows = (x) => Array.isArray(x) && x.every((r) => Array.isArray(r) && r.every(isId));
    if (!idRows(d.prompt) || !idRows(d.decode)) fail("prompt and decode must be rows of token ids inside the vocabulary");
    const { prompt, decode, pieces, positions } = d;
    const length = prompt.length ? prompt[0].length : 0;
    if (!prompt.length || prompt.length !== decode.length || !Array.isArray(pieces) || !pieces.every((n) => Number.isInteger(n) && n > 0) ||
        !prompt.every((r) => r.length === pieces.reduce((a, n) => a + n, 0)) || !decode.every((r) => r.length === decode[0].length)) {
      fail("prompt, decode and pieces do not fit together");
    }
    if (!Array.isArray(positions) || !positions.every((p) => Number.isInteger(p) && p >= 0 && p < length)) fail("positions outside the prompt");
    const plan = [];
    for (let b = 0; b < prompt.length; b++) for (const p of positions) plan.push(`prefill ${b} ${p}`);
    for (let b = 0; b < prompt.length; b++) for (let t = 0; t < decode[b].length; t++) plan.push(`decode ${b} ${t}`);
    const rows = d.rows;
    if (!Array.isArray(rows) || rows.length !== plan.length || rows.some((r, i) => r === null || `${r.graph} ${r.batch} ${r.at}` !== plan[i])) {
      fail("its rows are not the ones its plan compares");
    }
    const finite = (x) => typeof x === "number" && Number.isFinite(x);
    for (const r of rows) {
      if (!Array.isArray(r.ids) || !Array.isArray(r.values) || r.ids.length !== r.values.length || !r.ids.every(isId) ||
          !r.values.every(finite) || !finite(r.absmax) || !finite(r.l2)) {
        fail(`row ${r.graph} ${r.batch} ${r.at} is not ids, values, absmax and l2`);
      }
    }
    const logits = d.budgets && d.budgets.logits;
    if (logits === null || typeof logits !== "object" || !Object.values(logits).every((v) => typeof v === "number")) fail("no logits budget");
    return { ...d, budgets: { ...d.budgets, logits: { ...logits } } };
  }
}

// ---- golden outputs ---------------------------------------------------------------------------
/**
 * Lower bounds of a whole logits row's errors from its stored part (`row`: ids, values -- the reference's
 * largest logits --, absmax and l2 of the whole reference row), in float64, exactly as the Python runtime's
 * golden.row_errors: max abs >= max(max |got - ref| over the stored ids, | max|got| - absmax |), L2 >=
 * max(||got - ref|| over the stored ids, | ||got|| - l2 |); rel_l2 = L2 / l2, max_rel = max abs / max(absmax, 1).
 * With the whole row stored the bounds are the errors themselves. Non-finite logits: infinite errors.
 */
export function rowErrors(got, row) {
  let nonfinite = 0;
  for (let i = 0; i < got.length; i++) if (!Number.isFinite(got[i])) nonfinite++;
  if (nonfinite) return { max_abs: Infinity, max_rel: Infinity, rel_l2: Infinity, nonfinite };
  let diffMax = 0, diffSq = 0;
  for (let k = 0; k < row.ids.length; k++) {
    const d = got[row.ids[k]] - row.values[k];
    diffMax = Math.max(diffMax, Math.abs(d));
    diffSq += d * d;
  }
  let gotMax = 0, gotSq = 0;
  for (let i = 0; i < got.length; i++) {
    gotMax = Math.max(gotMax, Math.abs(got[i]));
    gotSq += got[i] * got[i];
  }
  const maxAbs = Math.max(diffMax, Math.abs(gotMax - row.absmax));
  const l2 = Math.max(Math.sqrt(diffSq), Math.abs(Math.sqrt(gotSq) - row.l2));
  return { max_abs: maxAbs, max_rel: maxAbs / Math.max(row.absmax, 1), rel_l2: l2 / Math.max(row.l2, 1e-30), nonfinite: 0 };
}

/** Every error bound in `budget` ("max_abs", "max_rel", "rel_l2"; others are ignored) holds and nothing is
 * non-finite (edgelin.parity.within). */
export function withinBudget(errors, budget) {
  if (errors.nonfinite) return false;
  return ["max_abs", "max_rel", "rel_l2"].every((k) => budget[k] === undefined || errors[k] <= budget[k]);
}

/** x as Python's f"{x:.2e}" writes it (two-digit exponent). */
function exp2(x) {
  if (!Number.isFinite(x)) return Number.isNaN(x) ? "nan" : x > 0 ? "inf" : "-inf";
  return x.toExponential(2).replace(/e([+-])(\d)$/, (_, sign, digit) => `e${sign}0${digit}`);
}

function now() {
  return globalThis.performance ? globalThis.performance.now() : Date.now();
}

/**
 * A chat (the Python runtime's Chat): each send() renders the whole conversation with the chat template and feeds
 * the model only the ids after those its state has seen, where the rendering starts with them; otherwise the
 * conversation is prefilled again from a fresh state (same result; `refills` counts). The rendered text holds its
 * own special tokens: it is encoded without a bos.
 */
export class Chat {
  constructor(model, system = null) {
    this.model = model;
    this.messages = system ? [{ role: "system", content: system }] : [];
    this.conv = null;
    this.fed = [];
    this.refills = 0;
    this.lastPrefill = 0;
  }

  promptIds(messages = this.messages) {
    const text = this.model.chatTemplate.render(messages, { addGenerationPrompt: true });
    return text ? this.model.tokenizer.tok.encode(text, { add_special_tokens: false }).ids : [];
  }

  async send(content, options = {}) {
    this.messages.push({ role: "user", content });
    const ids = this.promptIds();
    const prefix = this.fed.length < ids.length && this.fed.every((id, i) => ids[i] === id);
    if (this.conv === null || !prefix) {
      if (this.conv !== null) this.refills += 1;
      this.conv = this.model.conversation();
      this.fed = [];
    }
    const fresh = ids.slice(this.fed.length);
    this.lastPrefill = fresh.length;
    const reply = await this.conv.generate(fresh, options).done();
    this.fed = [...ids, ...this.conv.ids, ...(this.conv.eosId !== null ? [this.conv.eosId] : [])];
    this.messages.push({ role: "assistant", content: reply });
    return reply;
  }
}

export class Conversation {
  constructor(model, state) {
    this.model = model;
    this.state = state;
    this.stats = null;
    this.text = "";
    this.ids = [];
    this.stopReason = null;
    this.eosId = null; // the eos id that ended the last call (the state takes it in first on the next)
  }

  /**
   * Stream the continuation of `prompt` (text, or an array of token ids): an async iterable of
   * {id, text} (text is "" while a character is incomplete). options: maxNewTokens (default 256),
   * temperature (0 = greedy), topK (0 = off), topP (1 = off), seed, eosId (default: every eos id of the tokenizer),
   * repetitionPenalty (1 = off), noRepeatNgramSize (0 = off: no n ids in a row occur twice), minNewTokens (0), stop (strings: the text ends before the first; stopReason "stop"),
   * piece (prefill piece). Afterwards: this.text, this.ids, this.stopReason ("eos" | "length" | "stop"),
   * this.stats ({promptTokens, prefillMs, firstTokenMs, newTokens, decodeTokens, decodeMs, decodeTokensPerS}).
   * The returned object also has toArray() (all tokens) and done() (the text).
   */
  generate(prompt, options = {}) {
    const conv = this;
    const iterable = {
      [Symbol.asyncIterator]: () => conv._stream(prompt, options),
      async toArray() {
        const out = [];
        for await (const t of iterable) out.push(t);
        return out;
      },
      async done() {
        await iterable.toArray();
        return conv.text;
      },
    };
    return iterable;
  }

  async *_stream(prompt, { maxNewTokens = 256, eosId, piece, repetitionPenalty = 1, noRepeatNgramSize = 0, minNewTokens = 0, stop = [], ...sampling } = {}) {
    const model = this.model;
    const opts = samplingOptions(sampling);
    if (!(Number.isInteger(maxNewTokens) && maxNewTokens >= 0)) throw new EdgelinError(`maxNewTokens must be an integer >= 0, got ${maxNewTokens}`);
    if (!(Number.isFinite(repetitionPenalty) && repetitionPenalty > 0 && repetitionPenalty <= 100)) throw new EdgelinError(`repetitionPenalty must be in (0, 100] (1 = off; 1.1-1.3 discourages repeats), got ${repetitionPenalty}`);
    if (!(Number.isInteger(noRepeatNgramSize) && noRepeatNgramSize >= 0 && noRepeatNgramSize <= 4096)) throw new EdgelinError(`noRepeatNgramSize must be an integer in [0, 4096] (0 = off; n bans any id that would repeat an n-gram), got ${noRepeatNgramSize}`);
    if (!(Number.isInteger(minNewTokens) && minNewTokens >= 0)) throw new EdgelinError(`minNewTokens must be an integer >= 0 (eos is masked until this many tokens were generated), got ${minNewTokens}`);
    const stops = typeof stop === "string" ? [stop] : Array.from(stop);
    if (stops.some((x) => typeof x !== "string" || x === "")) throw new EdgelinError("stop must be a list of non-empty strings");
    const textPrompt = typeof prompt === "string";
    const ids = textPrompt ? model.tokenizer.encode(prompt) : Array.from(prompt ?? []);
    if (ids.length === 0) throw new EdgelinError("the prompt is empty: give at least one token");
    model._checkIds(ids);
    let tokenizer = null;
    try { tokenizer = model.tokenizer; } catch (err) { if (textPrompt) throw err; }
    const eos = eosId !== undefined && eosId !== null ? new Set([eosId]) : tokenizer ? tokenizer.eosIds : new Set();
    const decoder = tokenizer ? tokenizer.decoder() : null;
    if (stops.length && !decoder) throw new EdgelinError("stop strings need text: this export has no tokenizer");
    const random = rng(opts.seed);
    const seen = repetitionPenalty !== 1 ? new Set(ids) : null; // the ids of this prompt and of what it generates
    const grams = noRepeatNgramSize > 0 ? new NGrams(noRepeatNgramSize, ids) : null; // the same sequence's n-grams
    let held = ""; // decoded text not yet released (it may still be the start of a stop string)
    const matcher = stops.length ? new StopStrings(stops).matcher() : null;
    this.text = "";
    this.ids = [];
    this.stopReason = null;
    this.eosId = null;
    const stats = (this.stats = { promptTokens: ids.length, prefillMs: 0, firstTokenMs: NaN, newTokens: 0, decodeTokens: 0, decodeMs: 0, decodeTokensPerS: NaN });
    const start = now();
    if (this.state.pending !== null) { // the last token of the previous call, not yet through the model
      const pending = this.state.pending;
      this.state.pending = null;
      await model.decode(pending, this.state);
    }
    let logits = await model.prefill(ids, this.state, { piece: piece ?? model.manifest.prefill_piece });
    stats.prefillMs = now() - start;
    if (maxNewTokens === 0) { this.stopReason = "length"; return; }
    let first = null;
    for (;;) {
      if (!logits.every(Number.isFinite)) throw new EdgelinError("the logits became NaN/infinite; the model or its state has overflowed -- start from a fresh state");
      const id = sample(processLogits(logits, seen, stats.newTokens, { repetitionPenalty, minNewTokens, eosIds: eos, banned: grams ? grams.banned() : [] }), opts, random);
      const t = now();
      if (first === null) { first = t; stats.firstTokenMs = t - start; }
      stats.decodeMs = t - first;
      stats.newTokens += 1;
      stats.decodeTokens = stats.newTokens - 1;
      stats.decodeTokensPerS = stats.decodeMs > 0 ? (stats.decodeTokens * 1000) / stats.decodeMs : NaN;
      this.state.pending = id;
      if (seen) seen.add(id);
      if (grams) grams.add(id);
      if (eos.has(id)) {
        this.stopReason = "eos";
        this.eosId = id;
        const rest = held + (decoder ? decoder.flush() : "");
        this.text += rest;
        if (rest) yield { id: null, text: rest };
        return;
      }
      this.ids.push(id);
      const piece = decoder ? decoder.feed(id) : "";
      held += piece;
      if (this.ids.length >= maxNewTokens) this.stopReason = "length";
      let text;
      const hit = matcher && piece ? matcher.feed(piece) : null;
      if (hit !== null) { // the text ends before the stop string (the first of the list found, as in Python)
        this.stopReason = "stop";
        text = held.slice(0, held.length - piece.length + hit[1] - stops[hit[0]].length);
        held = "";
      } else if (this.stopReason !== null) { // length: everything goes out, a partial character too
        text = held + (decoder ? decoder.flush() : "");
        held = "";
      } else { // keep back what may be the start of a stop string
        const keep = matcher ? matcher.partial() : 0;
        text = held.slice(0, held.length - keep);
        held = held.slice(held.length - keep);
      }
      this.text += text;
      yield { id, text };
      if (this.stopReason !== null) return;
      this.state.pending = null;
      logits = await model.decode(id, this.state);
    }
  }
}
