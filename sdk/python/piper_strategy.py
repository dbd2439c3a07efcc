"""piper_strategy: write a Piper parallelism strategy in Python.

The Python twin of the Rust `piper-sdk`: typed filters, options and plugin
info over the generated `piper:strategy` bindings, plus the pipeline layout
every pipeline strategy starts with. `piper plugin build` puts this module on
the component's Python path; a strategy's `app.py` ends with

    WitWorld = piper_strategy.export(MyStrategy)

An exception raised by `apply` (a directive's `DagError`, an `OptionError`,
or any bug) reaches the user as the plugin's error: its type, message and
traceback, with the plugin's name added by the host.
"""

import traceback

from componentize_py_types import Err
from wit_world import OptionSpec as _OptionSpec
from wit_world import OptionType as _OptionType
from wit_world import PluginInfo as _PluginInfo
from wit_world import OptionValue_Bool, OptionValue_Float, OptionValue_Int, OptionValue_Str
from wit_world.imports import dag as _dag
from wit_world.imports import log as _log
from wit_world.imports import types as _t


class Pass:
    """The PASS values a filter can select."""
    F = "F"
    B = "B"
    BI = "BI"
    BW = "BW"
    UPDATE = "update"
    SEND = "send"
    RECV = "recv"
    ALL_REDUCE = "all-reduce"
    REDUCE_SCATTER = "reduce-scatter"
    ALL_GATHER = "all-gather"
    ALL_TO_ALL = "all-to-all"
    R = "R"
    MARKER = "marker"


class Filter:
    """Selects nodes by tags (AND) and optionally one pass.

    Filter.all(), Filter.tag("PP", 3).and_("MB", 0).pass_(Pass.F),
    Filter.all().any("EP").
    """

    __slots__ = ("tags", "pass_name")

    def __init__(self, tags=None, pass_name=None):
        # key -> index, or None for "carries the tag, any index"
        self.tags = dict(tags or {})
        self.pass_name = pass_name

    @staticmethod
    def all():
        return Filter()

    @staticmethod
    def tag(key, index):
        return Filter({key: index})

    def and_(self, key, index):
        f = Filter(self.tags, self.pass_name)
        f.tags[key] = index
        return f

    def any(self, key):
        f = Filter(self.tags, self.pass_name)
        f.tags[key] = None
        return f

    def pass_(self, name):
        return Filter(self.tags, name)

    def to_wit(self):
        tags = [
            _t.TagFilter(k, _t.TagMatch_Any() if v is None else _t.TagMatch_Index(v))
            for k, v in self.tags.items()
        ]
        return _t.Filter(tags, self.pass_name)

    def __repr__(self):
        parts = ["%s=%s" % (k, "*" if v is None else v) for k, v in self.tags.items()]
        if self.pass_name is not None:
            parts.append("PASS=%s" % self.pass_name)
        return "{" + ", ".join(parts) + "}"


class DagError(Exception):
    """A directive or primitive failed; `kind` is the WIT case (`no-match`, ...)."""

    __module__ = "builtins"  # shown as `DagError: ...`, like the other languages

    def __init__(self, kind, message):
        super().__init__(message)
        self.kind = kind
        self.message = message


class OptionError(Exception):
    pass


def _dag_error(e):
    v = e.value
    kind = type(v).__name__.replace("DagError_", "")
    kind = "".join("-" + c.lower() if c.isupper() else c for c in kind).lstrip("-")
    return DagError(kind, v.value)


def _call(f, *args):
    try:
        return f(*args)
    except Err as e:
        raise _dag_error(e) from None


class ReplicateOptions:
    """Options of `Dag.replicate`: data parallelism and ZeRO stages."""

    def __init__(self, zero_stage=0, bucket_bytes=0, reduce_stream="dp",
                 gather_stream="dp", reshard_after_forward=True):
        self.zero_stage = zero_stage
        self.bucket_bytes = bucket_bytes
        self.reduce_stream = reduce_stream
        self.gather_stream = gather_stream
        self.reshard_after_forward = reshard_after_forward

    def to_wit(self):
        z = self.zero_stage
        return _t.ReplicateOptions(z >= 1, z >= 2, z >= 3, self.bucket_bytes,
                                   self.reduce_stream, self.gather_stream,
                                   self.reshard_after_forward)


class Dag:
    """The host's training DAG. Every call checks its arguments; a failing
    call leaves the DAG unchanged and raises DagError naming the call and the
    offending nodes."""

    def __init__(self, handle):
        self._d = handle

    def split(self, filter, dim, n):
        _call(self._d.split, filter.to_wit(), dim, n)

    def place(self, filter, devices, stream="pp"):
        _call(self._d.place, filter.to_wit(), list(devices), stream)

    def replicate(self, filter, devices, options=None):
        _call(self._d.replicate, filter.to_wit(), list(devices),
              (options or ReplicateOptions()).to_wit())

    def shard(self, filter, devices, stream="ep"):
        _call(self._d.shard, filter.to_wit(), list(devices), stream)

    def shard_tensor(self, filter, devices, stream="tp"):
        _call(self._d.shard_tensor, filter.to_wit(), list(devices), stream)

    def sequence_parallel(self, filter):
        """Sequence parallelism (Megatron-SP, WIT 0.3.0) inside the segments of
        the matched tensor-parallel nodes; apply it after shard_tensor. Returns
        how many segments it covers."""
        return _call(self._d.sequence_parallel, filter.to_wit())

    def context_parallel(self, filter, degree, exchange="ring", stream="cp"):
        """Context parallelism (WIT 0.4.0): each replica of the matched nodes
        becomes `degree` replicas that split its sequences into 2*degree
        chunks (two each), attention meeting the group's keys and values
        around a ring ("ring") or all-gathered ("all-gather") on `stream`.
        Apply it after shard_tensor, before shard and recompute. Returns how
        many nodes it changed."""
        ways = {"ring": _dag.KvExchange.RING, "all-gather": _dag.KvExchange.ALL_GATHER}
        if exchange not in ways:
            raise DagError("invalid-argument", "exchange %r is not ring or all-gather" % (exchange,))
        return _call(self._d.context_parallel, filter.to_wit(), degree, ways[exchange], stream)

    def order(self, groups):
        """Run group i before group i+1 on one device; each group is a list of filters."""
        _call(self._d.order, [[f.to_wit() for f in g] for g in groups])

    def query(self, filter):
        return _call(self._d.query, filter.to_wit())

    def query_ids(self, filter):
        return _call(self._d.query_ids, filter.to_wit())

    def node(self, id):
        return _call(self._d.node, id)

    def neighbours(self, id):
        return _call(self._d.neighbours, id)

    def tag_extents(self):
        """{tag key: how many indices it spans}."""
        return {t.key: t.index for t in self._d.tag_extents()}

    def cluster(self):
        return self._d.cluster()

    def add_temporal_edge(self, src, dst):
        _call(self._d.add_temporal_edge, src, dst)

    def set_stream(self, filter, stream):
        return _call(self._d.set_stream, filter.to_wit(), stream)

    def set_priority(self, filter, priority):
        return _call(self._d.set_priority, filter.to_wit(), priority)

    def recompute(self, filter, policy="full"):
        """Activation recomputation: the matched forwards keep only what `policy`
        ("full" or "selective") says; a recompute node (Pass.R) rebuilds the rest
        before the backward. Apply it after every split/place/replicate. Returns
        how many forwards got one."""
        policies = {"full": _dag.RecomputePolicy.FULL, "selective": _dag.RecomputePolicy.SELECTIVE}
        if policy not in policies:
            raise DagError("invalid-argument", "recompute policy %r is not full or selective" % (policy,))
        return _call(self._d.recompute, filter.to_wit(), policies[policy])


class Options:
    """The options the host passed (declared ones, given or defaulted, type-checked)."""

    def __init__(self, entries):
        self.values = {e.name: e.value.value for e in entries}
        self._kinds = {e.name: type(e.value) for e in entries}

    def _get(self, name, kinds, what):
        if name not in self.values:
            return None
        if self._kinds[name] not in kinds:
            raise OptionError("option `%s`: expected %s, got %r" % (name, what, self.values[name]))
        return self.values[name]

    def int(self, name):
        return self._get(name, (OptionValue_Int,), "an integer")

    def u32(self, name):
        v = self.int(name)
        if v is not None and not 0 <= v <= 0xFFFFFFFF:
            raise OptionError("option `%s`: must be between 0 and 4294967295, got %d" % (name, v))
        return v

    def float(self, name):
        v = self._get(name, (OptionValue_Float, OptionValue_Int), "a number")
        return None if v is None else float(v)

    def bool(self, name):
        return self._get(name, (OptionValue_Bool,), "a bool")

    def str(self, name):
        return self._get(name, (OptionValue_Str,), "a string")


class OptionSpec:
    """An option the strategy takes; `default` is text, None = no default."""

    def __init__(self, name, type, default, help):
        self.name, self.type, self.default, self.help = name, type, default, help

    @staticmethod
    def int(name, default, help):
        return OptionSpec(name, "int", default, help)

    @staticmethod
    def float(name, default, help):
        return OptionSpec(name, "float", default, help)

    @staticmethod
    def bool(name, default, help):
        return OptionSpec(name, "bool", default, help)

    @staticmethod
    def str(name, default, help):
        return OptionSpec(name, "str", default, help)

    def to_wit(self):
        ty = {"int": _OptionType.INT, "float": _OptionType.FLOAT,
              "bool": _OptionType.BOOL, "str": _OptionType.STR}[self.type]
        return _OptionSpec(self.name, ty, self.default, self.help)


class PluginInfo:
    def __init__(self, name, version, description, options=()):
        self.name, self.version, self.description = name, version, description
        self.options = list(options)

    def option(self, spec):
        self.options.append(spec)
        return self

    def to_wit(self):
        return _PluginInfo(self.name, self.version, self.description,
                           [o.to_wit() for o in self.options])


def log(message, level="info"):
    """A line in the host's log, shown with the plugin's name."""
    lv = {"debug": _log.Level.DEBUG, "info": _log.Level.INFO, "warn": _log.Level.WARN}[level]
    _log.log(lv, message)


class Strategy:
    """Subclass and implement `info()` and `apply(dag, options)`."""

    def info(self):
        raise NotImplementedError

    def apply(self, dag, options):
        raise NotImplementedError


def _describe(exc):
    """`Type: message`, then the strategy's frames of the traceback (innermost
    last; the SDK's own frames left out, paths shown by file name)."""
    head = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.endswith("piper_strategy.py")]
    lines = ['  File "%s", line %d, in %s' % (f.filename.rsplit("/", 1)[-1], f.lineno, f.name)
             for f in frames]
    return "%s\nTraceback (most recent call last):\n%s" % (head, "\n".join(lines))


def export(strategy_class):
    """The component's `WitWorld` for a Strategy subclass."""
    strategy = strategy_class()

    class WitWorld:
        def info(self):
            return strategy.info().to_wit()

        def apply(self, dag, options):
            try:
                strategy.apply(Dag(dag), Options(options))
            except Exception as e:  # every failure becomes the plugin's error
                raise Err(_describe(e)) from None

    return WitWorld


# ---- pipeline layout (the Rust SDK's `pipeline` module) ----

class Pipeline:
    """Stages, their device groups and their PP regions (one stage per
    pipeline position), and the microbatches. Composes with a data-parallel
    group applied before: if every forward sits on group G, position q runs
    on G + q."""

    def __init__(self, groups, regions, microbatches=1):
        self.groups = groups
        self.regions = regions
        self.microbatches = microbatches

    @staticmethod
    def new(dag, options, who):
        """The layout from the options: `stages` (default: devices /
        data-parallel degree), regions cut evenly or at `boundaries`,
        `microbatches` (default 2 x stages). Changes nothing in the DAG;
        `split_place` does."""
        pipe = Pipeline._lay_out(dag, options.u32("stages"), who)
        text = options.str("boundaries")
        if text is not None:
            pipe.cut_at(parse_boundaries(text, who), who)
        mbs = options.u32("microbatches")
        pipe.microbatches = 2 * pipe.stages() if mbs is None else mbs
        if pipe.microbatches == 0:
            raise ValueError("%s needs at least 1 microbatch, got 0" % who)
        return pipe

    @staticmethod
    def _lay_out(dag, stages, who):
        devices = dag.cluster().devices
        n_regions = dag.tag_extents().get("PP", 0)
        if n_regions == 0:
            raise ValueError("%s needs a model annotated with PP regions" % who)
        forwards = dag.query(Filter.all().pass_(Pass.F))
        first = list(forwards[0].devices)
        for n in forwards:
            if list(n.devices) != first:
                raise ValueError(
                    "%s needs the whole model on one device group before it runs: "
                    "found forwards on %s and %s" % (who, first, list(n.devices)))
        base = first or [0]
        dp = len(base)
        positions = devices // dp if stages is None else stages
        if positions == 0:
            raise ValueError("%s needs at least 1 pipeline position, got 0" % who)
        if positions > n_regions:
            raise ValueError("%s needs stages <= PP regions: got %d stages for %d regions"
                             % (who, positions, n_regions))
        if positions * dp > devices:
            raise ValueError("%s needs pipeline devices x data-parallel degree <= devices: "
                             "%d x %d > %d" % (who, positions, dp, devices))
        groups = [[g + q for g in base] for q in range(positions)]
        flat = [g for grp in groups for g in grp]
        if any(g >= devices for g in flat) or len(set(flat)) != len(flat):
            raise ValueError("%s: the data-parallel group %s leaves no room for %d pipeline "
                             "positions on %d devices" % (who, base, positions, devices))
        per, extra = divmod(n_regions, positions)
        regions, nxt = [], 0
        for s in range(positions):
            take = per + (1 if s < extra else 0)
            regions.append(list(range(nxt, nxt + take)))
            nxt += take
        return Pipeline(groups, regions)

    def cut_at(self, firsts, who):
        """Stage s starts at region firsts[s] and runs to the next stage's
        first (the last stage to the last region): one first region per
        stage, the first 0, strictly increasing."""
        stages = len(self.regions)
        n = 1 + max((r for rs in self.regions for r in rs), default=-1)
        if len(firsts) != stages:
            raise ValueError("%s: boundaries name %d stages' first regions, the pipeline has %d stages"
                             % (who, len(firsts), stages))
        if not firsts or firsts[0] != 0:
            raise ValueError("%s: boundaries must start at region 0 (the first stage's first region), got %s"
                             % (who, firsts))
        for a, b in zip(firsts, firsts[1:]):
            if b <= a:
                raise ValueError("%s: boundaries must increase (every stage holds at least one region): "
                                 "%d follows %d in %s" % (who, b, a, firsts))
        if firsts[-1] >= n:
            raise ValueError("%s: boundary %d is past the model's last PP region (%d regions, 0 to %d)"
                             % (who, firsts[-1], n, max(n - 1, 0)))
        ends = firsts[1:] + [n]
        self.regions = [list(range(a, b)) for a, b in zip(firsts, ends)]

    def split_place(self, dag, options):
        """Split the batch into the microbatches and place each stage on its
        group, transfers on the `stream` option (default `pp`)."""
        dag.split(Filter.all(), "MB", self.microbatches)
        stream = options.str("stream") or "pp"
        for group, regions in zip(self.groups, self.regions):
            for r in regions:
                dag.place(Filter.tag("PP", r), group, stream)

    def stages(self):
        return len(self.groups)

    def step(self, s, mb, pass_name):
        """One order group: `pass_name` of microbatch `mb` over stage s's regions."""
        return [Filter.tag("PP", r).and_("MB", mb).pass_(pass_name) for r in self.regions[s]]


_MAX_BOUNDARIES = 4096


def parse_boundaries(text, who):
    """A `boundaries` option's text: each stage's first PP region, separated
    by `/` (`0/4/8/11`) or commas inside brackets (`[0, 4, 8, 11]`)."""
    t = text.strip()
    inner = t[1:-1] if t.startswith("[") and t.endswith("]") else t
    out = []
    for item in inner.replace(",", "/").split("/"):
        item = item.strip()
        if len(out) == _MAX_BOUNDARIES:
            raise ValueError("%s: boundaries name more than %d stages" % (who, _MAX_BOUNDARIES))
        if not item or len(item) > 10 or any(c not in "0123456789" for c in item) \
                or int(item) > 0xFFFFFFFF:
            raise ValueError("%s: boundaries `%s`: `%s` is not a region index "
                             "(give each stage's first PP region, e.g. `0/4/8/11`)"
                             % (who, t[:80], item[:40]))
        out.append(int(item))
    return out


def pipeline_options(info, stages_help, microbatches_help):
    """The options every pipeline plugin takes: stages, microbatches,
    boundaries (default: an even cut), stream."""
    return (info.option(OptionSpec.int("stages", None, stages_help))
                .option(OptionSpec.int("microbatches", None, microbatches_help))
                .option(OptionSpec.str("boundaries", None,
                                       "first PP region of each stage, e.g. 0/4/8/11 "
                                       "(default: regions cut evenly, earlier stages taking the remainder)"))
                .option(OptionSpec.str("stream", "pp", "stream of the activation/gradient transfers")))


def recompute_option():
    """A pipeline plugin's `recompute` option: none (default), full or selective."""
    return OptionSpec.str("recompute", "none",
                          "activation recomputation after the schedule: none, full (keep each "
                          "segment's input, rerun its forward before the backward) or selective")


def apply_recompute_option(dag, options, who):
    """Apply the `recompute` option last (after `order`) to every PP region's
    forwards; under `full`, regions of split expert phases only are skipped.
    Returns how many forwards got a recompute node."""
    policy = (options.str("recompute") or "none").strip()
    if policy == "none":
        return 0
    if policy not in ("full", "selective"):
        raise OptionError("%s: recompute `%s` is not none, full or selective" % (who, policy[:40]))
    made = 0
    for r in range(dag.tag_extents().get("PP", 0)):
        try:
            made += dag.recompute(Filter.tag("PP", r).pass_(Pass.F), policy)
        except DagError as e:
            if e.kind != "unsupported" or policy != "full":
                raise
    return made
