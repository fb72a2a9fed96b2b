// Greedy and beam search over the exported graphs, a port of captionkit/inference/decoding.py for one
// photo: the same allowed words (<pad>, <start>, <unk> never generated; only <end> at the last
// step), the same float32 scores, the same ranking logprob / (words + 1) ^ length_penalty and
// the same stopping rule, so captions equal Python's. Generic over the model family: the
// manifest names the step's state and memory tensors, all batch-first.

export class Graphs {
  constructor(ort, manifest, sessions) {
    this.ort = ort;
    this.m = manifest;
    this.encoder = sessions.encoder;
    this.init = sessions.init;
    this.step = sessions.step;
  }

  static async load(ort, baseUrl, manifest, variant = "float32", options = {}) {
    const files = manifest.graphs[variant];
    const sessions = {};
    for (const g of ["encoder", "init", "step"]) {
      sessions[g] = await ort.InferenceSession.create(new URL(files[g], baseUrl).href, options);
    }
    return new Graphs(ort, manifest, sessions);
  }

  async encode(imageData) {
    const S = this.m.preprocess.size;
    const out = await this.encoder.run({ image: new this.ort.Tensor("float32", imageData, [1, 3, S, S]) });
    return out.feats;
  }
}

const NEG_INF = -Infinity;

function allowed(logp, V, lastStep, special) {
  // in place on one row of V log-probabilities (a Float32Array view)
  if (lastStep) {
    const e = logp[special.end];
    logp.fill(NEG_INF);
    logp[special.end] = e;
  } else {
    logp[special.pad] = NEG_INF;
    logp[special.start] = NEG_INF;
    logp[special.unk] = NEG_INF;
  }
}

function repeatRows(ort, t, rows) {
  // tensor (B, ...) -> (rows.length, ...) with row i = t[rows[i]]
  const per = t.data.length / t.dims[0];
  const Ctor = t.data.constructor;
  const out = new Ctor(per * rows.length);
  rows.forEach((r, i) => out.set(t.data.subarray(r * per, (r + 1) * per), i * per));
  return new ort.Tensor(t.type, out, [rows.length, ...t.dims.slice(1)]);
}

// The k largest of values (descending), as torch.topk would list them; ties keep index order.
function topk(values, k) {
  const idx = [];
  for (let i = 0; i < values.length; i++) {
    const v = values[i];
    if (idx.length < k) {
      idx.push(i);
      idx.sort((a, b) => values[b] - values[a] || a - b);
    } else if (v > values[idx[k - 1]]) {
      idx[k - 1] = i;
      idx.sort((a, b) => values[b] - values[a] || a - b);
    }
  }
  return idx;
}

async function initMemory(g, feats) {
  const m = g.m;
  const outs = await g.init.run({ feats });
  const tensors = { feats };
  for (const name of m.memory) if (name !== "feats") tensors[name] = outs[name];
  const state = m.state.map((n) => outs[n]);
  return { tensors, state };
}

async function runStep(g, tokens, state, memory) {
  const m = g.m;
  const feed = { tokens: new g.ort.Tensor("int64", BigInt64Array.from(tokens.map(BigInt)), [tokens.length]) };
  m.state.forEach((n, i) => { feed[n] = state[i]; });
  for (const n of m.memory) feed[n] = memory[n];
  const out = await g.step.run(feed);
  return {
    logp: out.logprobs.data, // (rows, V)
    state: m.state.map((n) => out[`${n}_next`]),
    attention: out.attention.data, // (rows, L)
    V: out.logprobs.dims[1], L: out.attention.dims[1],
  };
}

export async function greedy(g, feats, maxLen) {
  const sp = g.m.special;
  const { tensors, state: s0 } = await initMemory(g, feats);
  let state = s0, token = sp.start;
  const ids = [], attention = [];
  for (let t = 0; t <= maxLen; t++) {
    const r = await runStep(g, [token], state, tensors);
    const logp = Float32Array.from(r.logp);
    allowed(logp, r.V, t === maxLen, sp);
    let best = 0;
    for (let w = 1; w < r.V; w++) if (logp[w] > logp[best]) best = w;
    state = r.state;
    if (best === sp.end) break;
    ids.push(best);
    attention.push(Array.from(r.attention.subarray(0, r.L)));
    token = best;
  }
  return { ids, attention };
}

export async function beamSearch(g, feats, K, maxLen, lengthPenalty) {
  const sp = g.m.special;
  const { tensors, state: s0 } = await initMemory(g, feats);
  const rows = Array(K).fill(0);
  const memory = {};
  for (const [n, t] of Object.entries(tensors)) memory[n] = repeatRows(g.ort, t, rows);
  let state = s0.map((t) => repeatRows(g.ort, t, rows));
  let tokens = Array(K).fill(sp.start);
  let scores = new Float32Array(K).fill(NEG_INF);
  scores[0] = 0;
  let seqs = Array.from({ length: K }, () => []);
  let hist = Array.from({ length: K }, () => []);
  const finished = [];
  const norm = (lp, n) => (lengthPenalty ? lp / Math.pow(n + 1, lengthPenalty) : lp);
  for (let t = 0; t <= maxLen; t++) {
    const r = await runStep(g, tokens, state, memory);
    const { V, L } = r;
    for (let k = 0; k < K; k++) hist[k] = hist[k].concat([r.attention.subarray(k * L, (k + 1) * L)]);
    const cand = new Float32Array(K * V);
    for (let k = 0; k < K; k++) {
      const row = Float32Array.from(r.logp.subarray(k * V, (k + 1) * V));
      allowed(row, V, t === maxLen, sp);
      for (let w = 0; w < V; w++) cand[k * V + w] = scores[k] + row[w]; // float32 sums, as torch
    }
    const top = topk(cand, 2 * K);
    const topS = top.map((i) => cand[i]);
    const src = top.map((i) => Math.floor(i / V));
    const word = top.map((i) => i % V);
    for (let j = 0; j < K; j++) {
      if (word[j] !== sp.end || !Number.isFinite(topS[j])) continue;
      const ids = seqs[src[j]];
      finished.push({ score: norm(topS[j], ids.length), ids, attention: hist[src[j]].slice(0, ids.length), logprob: topS[j] });
    }
    const live = Float32Array.from(topS.map((s, j) => (word[j] === sp.end ? NEG_INF : s)));
    const pick = topk(live, K);
    scores = Float32Array.from(pick.map((j) => live[j]));
    const parent = pick.map((j) => src[j]);
    tokens = pick.map((j) => word[j]);
    seqs = pick.map((j, i) => seqs[parent[i]].concat([tokens[i]]));
    hist = parent.map((p) => hist[p]);
    state = r.state.map((s) => repeatRows(g.ort, s, parent));
    if (finished.length) {
      const bestDone = Math.max(...finished.map((f) => f.score));
      if (finished.length >= K || (lengthPenalty === 0 && bestDone >= scores[0])) break;
    }
  }
  let best = finished[0];
  for (const f of finished) if (f.score > best.score) best = f;
  return { ids: best.ids, attention: best.attention.map((a) => Array.from(a)) };
}

// decoding.decode: beam 1 without length normalisation is plain greedy search.
export async function caption(g, imageData, beam) {
  const d = g.m.decoding;
  const feats = await g.encode(imageData);
  const res = beam === 1 && !d.length_penalty
    ? await greedy(g, feats, d.max_len)
    : await beamSearch(g, feats, beam, d.max_len, d.length_penalty);
  let attention = res.attention;
  if (g.m.attention_view === "onehot-argmax") {
    attention = attention.map((a) => { const m = a.indexOf(Math.max(...a)); return a.map((_, i) => (i === m ? 1 : 0)); });
  }
  return { words: res.ids.map((i) => g.m.vocab[i]), attention, grid: g.m.grid };
}
