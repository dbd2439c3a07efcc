// piper_strategy: write a Piper parallelism strategy in JavaScript.
//
// The JavaScript twin of the Rust `piper-sdk`: typed filters, options and
// plugin info over the `piper:strategy` imports, plus the pipeline layout
// every pipeline strategy starts with. `piper plugin build` puts this module
// beside the strategy's `app.js`, which ends with
//
//     export const { info, apply } = exportStrategy(new MyStrategy());
//
// An exception thrown by `apply` (a directive's DagError, an OptionError, or
// any bug) reaches the user as the plugin's error: its name, message and
// stack, with the plugin's name added by the host.

import { log as hostLog } from 'piper:strategy/log@0.4.0';

export const Pass = Object.freeze({
  F: 'F', B: 'B', BI: 'BI', BW: 'BW', UPDATE: 'update', SEND: 'send', RECV: 'recv',
  ALL_REDUCE: 'all-reduce', REDUCE_SCATTER: 'reduce-scatter', ALL_GATHER: 'all-gather',
  ALL_TO_ALL: 'all-to-all', R: 'R', MARKER: 'marker',
});

/** Selects nodes by tags (AND) and optionally one pass:
 *  Filter.all(), Filter.tag('PP', 3).and('MB', 0).pass(Pass.F), Filter.all().any('EP').
 *  Kept in the WIT record's own shape, so handing it to the host converts nothing
 *  (the interpreter's instructions count against the sandbox's fuel). */
export class Filter {
  constructor(tags = [], pass = undefined) {
    this.tags = tags; // [{ key, value: { tag: 'any' } | { tag: 'index', val } }], never mutated
    this.passName = pass;
  }
  static all() { return new Filter(); }
  static tag(key, index) { return new Filter([{ key, value: { tag: 'index', val: index } }]); }
  with(key, value) {
    const tags = this.tags.slice();
    const i = tags.findIndex((t) => t.key === key);
    if (i < 0) tags.push({ key, value }); else tags[i] = { key, value };
    return new Filter(tags, this.passName);
  }
  and(key, index) { return this.with(key, { tag: 'index', val: index }); }
  any(key) { return this.with(key, { tag: 'any' }); }
  pass(name) { return new Filter(this.tags, name); }
  toWit() { return { tags: this.tags, pass: this.passName }; }
  toString() {
    const parts = this.tags.map((t) => `${t.key}=${t.value.tag === 'any' ? '*' : t.value.val}`);
    if (this.passName !== undefined) parts.push(`PASS=${this.passName}`);
    return `{${parts.join(', ')}}`;
  }
}

/** A directive or primitive failed; `kind` is the WIT case (`no-match`, ...). */
export class DagError extends Error {
  constructor(kind, message) { super(message); this.name = 'DagError'; this.kind = kind; }
}

export class OptionError extends Error {
  constructor(message) { super(message); this.name = 'OptionError'; }
}

function call(f) {
  try {
    return f();
  } catch (e) {
    const p = e && e.payload;
    if (p && typeof p.tag === 'string') throw new DagError(p.tag, String(p.val));
    throw e;
  }
}

/** Options of Dag.replicate: data parallelism and ZeRO stages. */
export class ReplicateOptions {
  constructor({ zeroStage = 0, bucketBytes = 0, reduceStream = 'dp', gatherStream = 'dp',
    reshardAfterForward = true } = {}) {
    Object.assign(this, { zeroStage, bucketBytes, reduceStream, gatherStream, reshardAfterForward });
  }
  toWit() {
    const z = this.zeroStage;
    return {
      shardOptimizer: z >= 1, shardGrads: z >= 2, shardParams: z >= 3,
      bucketBytes: BigInt(this.bucketBytes), reduceStream: this.reduceStream,
      gatherStream: this.gatherStream, reshardAfterForward: this.reshardAfterForward,
    };
  }
}

/** The host's training DAG. A failing call leaves the DAG unchanged and
 *  throws DagError naming the call and the offending nodes. */
export class Dag {
  constructor(handle) { this.d = handle; }
  split(filter, dim, n) { call(() => this.d.split(filter.toWit(), dim, n)); }
  place(filter, devices, stream = 'pp') { call(() => this.d.place(filter.toWit(), [...devices], stream)); }
  replicate(filter, devices, options = new ReplicateOptions()) {
    call(() => this.d.replicate(filter.toWit(), [...devices], options.toWit()));
  }
  shard(filter, devices, stream = 'ep') { call(() => this.d.shard(filter.toWit(), [...devices], stream)); }
  shardTensor(filter, devices, stream = 'tp') {
    call(() => this.d.shardTensor(filter.toWit(), [...devices], stream));
  }
  /**
   * Sequence parallelism (Megatron-SP, WIT 0.3.0) inside the segments of the matched
   * tensor-parallel nodes; apply it after shardTensor. Returns how many segments it covers.
   */
  sequenceParallel(filter) { return call(() => this.d.sequenceParallel(filter.toWit())); }
  /**
   * Context parallelism (WIT 0.4.0): each replica of the matched nodes becomes `degree`
   * replicas that split its sequences into 2·degree chunks (two each), attention meeting
   * the group's keys and values around a ring ('ring') or all-gathered ('all-gather') on
   * `stream`. Apply after shardTensor, before shard and recompute. Returns how many nodes
   * it changed.
   */
  contextParallel(filter, degree, exchange = 'ring', stream = 'cp') {
    return call(() => this.d.contextParallel(filter.toWit(), degree, exchange, stream));
  }
  /** Run group i before group i+1 on one device; each group is an array of filters. */
  order(groups) { call(() => this.d.order(groups.map((g) => g.map((f) => f.toWit())))); }
  query(filter) { return call(() => this.d.query(filter.toWit())); }
  queryIds(filter) { return call(() => this.d.queryIds(filter.toWit())); }
  node(id) { return call(() => this.d.node(id)); }
  neighbours(id) { return call(() => this.d.neighbours(id)); }
  /** { tag key: how many indices it spans } */
  tagExtents() { return Object.fromEntries(this.d.tagExtents().map((t) => [t.key, t.index])); }
  cluster() { return this.d.cluster(); }
  addTemporalEdge(from, to) { call(() => this.d.addTemporalEdge(from, to)); }
  setStream(filter, stream) { return call(() => this.d.setStream(filter.toWit(), stream)); }
  setPriority(filter, priority) { return call(() => this.d.setPriority(filter.toWit(), priority)); }
  /**
   * Activation recomputation: the matched forwards keep only what `policy` ('full' or
   * 'selective') says; a recompute node (Pass.R) rebuilds the rest before the backward.
   * Apply it after every split/place/replicate. Returns how many forwards got one.
   */
  recompute(filter, policy = 'full') { return call(() => this.d.recompute(filter.toWit(), policy)); }
}

/** The options the host passed (declared ones, given or defaulted, type-checked). */
export class Options {
  constructor(entries) { this.entries = new Map(entries.map((e) => [e.name, e.value])); }
  get(name, tags, what) {
    const v = this.entries.get(name);
    if (v === undefined) return undefined;
    if (!tags.includes(v.tag)) throw new OptionError(`option \`${name}\`: expected ${what}, got ${v.tag} ${v.val}`);
    return v.val;
  }
  int(name) {
    const v = this.get(name, ['int'], 'an integer');
    if (v === undefined) return undefined;
    const n = Number(v);
    if (!Number.isSafeInteger(n)) throw new OptionError(`option \`${name}\`: ${v} is too large`);
    return n;
  }
  u32(name) {
    const v = this.int(name);
    if (v !== undefined && (v < 0 || v > 0xffffffff)) {
      throw new OptionError(`option \`${name}\`: must be between 0 and 4294967295, got ${v}`);
    }
    return v;
  }
  float(name) { const v = this.get(name, ['float', 'int'], 'a number'); return v === undefined ? v : Number(v); }
  bool(name) { return this.get(name, ['bool'], 'a bool'); }
  str(name) { return this.get(name, ['str'], 'a string'); }
}

/** An option the strategy takes; `default` is text, undefined = no default. */
export const OptionSpec = {
  int: (name, dflt, help) => ({ name, type: 'int', default: dflt ?? undefined, help }),
  float: (name, dflt, help) => ({ name, type: 'float', default: dflt ?? undefined, help }),
  bool: (name, dflt, help) => ({ name, type: 'bool', default: dflt ?? undefined, help }),
  str: (name, dflt, help) => ({ name, type: 'str', default: dflt ?? undefined, help }),
};

export class PluginInfo {
  constructor(name, version, description, options = []) {
    Object.assign(this, { name, version, description, options: [...options] });
  }
  option(spec) { this.options.push(spec); return this; }
}

/** A line in the host's log, shown with the plugin's name. */
export function log(message, level = 'info') { hostLog(level, String(message)); }

/** `Name: message`, then the strategy's frames of the stack (the SDK's and the
 *  bindings' own frames left out, paths shown by file name). */
function describe(e) {
  if (e instanceof Error) {
    const frames = (e.stack || '').split('\n')
      .filter((l) => l && !l.includes('piper_strategy.js') && !l.includes('initializer.js'))
      .map((l) => l.replace(/@.*\//, '@'));
    return `${e.name}: ${e.message}${frames.length ? `\nstack:\n${frames.join('\n')}` : ''}`;
  }
  return `uncaught ${typeof e}: ${String(e)}`;
}

/** The component's `info` and `apply` exports for a strategy object with
 *  `info()` and `apply(dag, options)`. */
export function exportStrategy(strategy) {
  return {
    info() {
      const i = strategy.info();
      return { name: i.name, version: i.version, description: i.description, options: i.options };
    },
    apply(dag, options) {
      try {
        strategy.apply(new Dag(dag), new Options(options));
      } catch (e) {
        throw describe(e); // the `err` of apply's result
      }
    },
  };
}

// ---- pipeline layout (the Rust SDK's `pipeline` module) ----

/** Stages, their device groups and their PP regions (one stage per pipeline
 *  position), and the microbatches. Composes with a data-parallel group
 *  applied before: if every forward sits on group G, position q runs on
 *  G + q. */
export class Pipeline {
  constructor(groups, regions, microbatches = 1) {
    this.groups = groups; this.regions = regions; this.microbatches = microbatches;
  }

  /** The layout from the options: `stages` (default: devices / data-parallel
   *  degree), regions cut evenly or at `boundaries`, `microbatches` (default
   *  2 x stages). Changes nothing in the DAG; `splitPlace` does. */
  static new(dag, options, who) {
    const pipe = Pipeline.layOut(dag, options.u32('stages'), who);
    const text = options.str('boundaries');
    if (text !== undefined) pipe.cutAt(parseBoundaries(text, who), who);
    pipe.microbatches = options.u32('microbatches') ?? 2 * pipe.stages();
    if (pipe.microbatches === 0) throw new Error(`${who} needs at least 1 microbatch, got 0`);
    return pipe;
  }

  static layOut(dag, stages, who) {
    const devices = dag.cluster().devices;
    const nRegions = dag.tagExtents().PP ?? 0;
    if (nRegions === 0) throw new Error(`${who} needs a model annotated with PP regions`);
    const forwards = dag.query(Filter.all().pass(Pass.F));
    const first = [...forwards[0].devices];
    for (const n of forwards) {
      if (n.devices.length !== first.length || n.devices.some((d, i) => d !== first[i])) {
        throw new Error(`${who} needs the whole model on one device group before it runs: found forwards on [${first}] and [${n.devices}]`);
      }
    }
    const base = first.length ? first : [0];
    const dp = base.length;
    const positions = stages === undefined ? Math.floor(devices / dp) : stages;
    if (positions === 0) throw new Error(`${who} needs at least 1 pipeline position, got 0`);
    if (positions > nRegions) throw new Error(`${who} needs stages <= PP regions: got ${positions} stages for ${nRegions} regions`);
    if (positions * dp > devices) throw new Error(`${who} needs pipeline devices x data-parallel degree <= devices: ${positions} x ${dp} > ${devices}`);
    const groups = [];
    for (let q = 0; q < positions; q++) groups.push(base.map((g) => g + q));
    const flat = groups.flat();
    if (flat.some((g) => g >= devices) || new Set(flat).size !== flat.length) {
      throw new Error(`${who}: the data-parallel group [${base}] leaves no room for ${positions} pipeline positions on ${devices} devices`);
    }
    const per = Math.floor(nRegions / positions);
    const extra = nRegions % positions;
    const regions = [];
    let next = 0;
    for (let s = 0; s < positions; s++) {
      const take = per + (s < extra ? 1 : 0);
      regions.push(Array.from({ length: take }, (_, i) => next + i));
      next += take;
    }
    return new Pipeline(groups, regions);
  }

  /** Stage s starts at region firsts[s] and runs to the next stage's first
   *  (the last stage to the last region): one first region per stage, the
   *  first 0, strictly increasing. */
  cutAt(firsts, who) {
    const stages = this.regions.length;
    const n = 1 + this.regions.flat().reduce((m, r) => Math.max(m, r), -1);
    const shown = `[${firsts.join(', ')}]`;
    if (firsts.length !== stages) throw new Error(`${who}: boundaries name ${firsts.length} stages' first regions, the pipeline has ${stages} stages`);
    if (firsts[0] !== 0) throw new Error(`${who}: boundaries must start at region 0 (the first stage's first region), got ${shown}`);
    for (let i = 1; i < firsts.length; i++) {
      if (firsts[i] <= firsts[i - 1]) throw new Error(`${who}: boundaries must increase (every stage holds at least one region): ${firsts[i]} follows ${firsts[i - 1]} in ${shown}`);
    }
    const last = firsts[firsts.length - 1];
    if (last >= n) throw new Error(`${who}: boundary ${last} is past the model's last PP region (${n} regions, 0 to ${Math.max(n - 1, 0)})`);
    this.regions = firsts.map((a, s) => {
      const end = s + 1 < firsts.length ? firsts[s + 1] : n;
      return Array.from({ length: end - a }, (_, i) => a + i);
    });
  }

  /** Split the batch into the microbatches and place each stage on its
   *  group, transfers on the `stream` option (default `pp`). */
  splitPlace(dag, options) {
    dag.split(Filter.all(), 'MB', this.microbatches);
    const stream = options.str('stream') ?? 'pp';
    this.groups.forEach((group, s) => {
      for (const r of this.regions[s]) dag.place(Filter.tag('PP', r), group, stream);
    });
  }

  stages() { return this.groups.length; }

  /** One order group: `pass` of microbatch `mb` over stage s's regions. */
  step(s, mb, pass) { return this.regions[s].map((r) => Filter.tag('PP', r).and('MB', mb).pass(pass)); }
}

const MAX_BOUNDARIES = 4096;

/** A `boundaries` option's text: each stage's first PP region, separated by
 *  `/` (`0/4/8/11`) or commas inside brackets (`[0, 4, 8, 11]`). */
export function parseBoundaries(text, who) {
  const t = text.trim();
  const inner = t.startsWith('[') && t.endsWith(']') ? t.slice(1, -1) : t;
  const out = [];
  for (const raw of inner.split(/[/,]/)) {
    const item = raw.trim();
    if (out.length === MAX_BOUNDARIES) throw new Error(`${who}: boundaries name more than ${MAX_BOUNDARIES} stages`);
    if (!/^[0-9]+$/.test(item) || Number(item) > 0xffffffff) {
      throw new Error(`${who}: boundaries \`${t.slice(0, 80)}\`: \`${item.slice(0, 40)}\` is not a region index (give each stage's first PP region, e.g. \`0/4/8/11\`)`);
    }
    out.push(Number(item));
  }
  return out;
}

/** The options every pipeline plugin takes: stages, microbatches,
 *  boundaries (default: an even cut), stream. */
export function pipelineOptions(info, stagesHelp, microbatchesHelp) {
  return info.option(OptionSpec.int('stages', undefined, stagesHelp))
    .option(OptionSpec.int('microbatches', undefined, microbatchesHelp))
    .option(OptionSpec.str('boundaries', undefined, 'first PP region of each stage, e.g. 0/4/8/11 (default: regions cut evenly, earlier stages taking the remainder)'))
    .option(OptionSpec.str('stream', 'pp', 'stream of the activation/gradient transfers'));
}

/** A pipeline plugin's `recompute` option: none (default), full or selective. */
export function recomputeOption() {
  return OptionSpec.str('recompute', 'none', "activation recomputation after the schedule: none, full (keep each segment's input, rerun its forward before the backward) or selective");
}

/** Apply the `recompute` option last (after `order`) to every PP region's
 *  forwards; under `full`, regions of split expert phases only are skipped.
 *  Returns how many forwards got a recompute node. */
export function applyRecomputeOption(dag, options, who) {
  const policy = (options.str('recompute') ?? 'none').trim();
  if (policy === 'none') return 0;
  if (policy !== 'full' && policy !== 'selective') {
    throw new OptionError(`${who}: recompute \`${policy.slice(0, 40)}\` is not none, full or selective`);
  }
  let made = 0;
  const regions = dag.tagExtents().PP ?? 0;
  for (let r = 0; r < regions; r++) {
    try {
      made += dag.recompute(Filter.tag('PP', r).pass(Pass.F), policy);
    } catch (e) {
      if (!(e instanceof DagError) || e.kind !== 'unsupported' || policy !== 'full') throw e;
    }
  }
  return made;
}
