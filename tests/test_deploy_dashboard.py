"""The Grafana dashboard (deploy/grafana/dashboards/opsd.json) loads and queries only what the roles export.

Every PromQL expression is parsed (a small parser for the PromQL the
dashboard may use, below): each metric name it references must be a sample
name that the services' Prometheus registry exports (or a listed
dcgm-exporter or redis_exporter name), each label it matches on, groups by or names in a
legend must exist where it is used, and every metric of opsd/metrics.py is
shown somewhere. Each sample's value is also followed by its registry TYPE:
counters only through rate/irate/increase (or resets), gauges never through
them, deriv & co. only over gauges, histogram_quantile only over `_bucket`
series. Negative controls prove the checker reports mistakes.
"""

from __future__ import annotations

import importlib
import json
import re
from dataclasses import dataclass, field

import pytest

from tests.deploy_tools import ROOT

DASHBOARD = ROOT / "deploy/grafana/dashboards/opsd.json"
SERVICE_MODULES = ("opsd.metrics", "services.rollout.__main__", "services.teacher.__main__", "services.embedder.app",
                   "services.embedder.__main__", "services.trainer.__main__")
ROWS = ["Throughput", "Engine", "Queues", "Policy & staleness", "Trainer", "Learning signal", "Reliability", "Redis", "GPU"]
DATASOURCE = "${datasource}"
# Metrics of opsd/metrics.py the dashboard deliberately leaves out (name -> why). Keep it empty if possible.
OMITTED: dict[str, str] = {}

# NVIDIA dcgm-exporter (default counters), a non-opsd source the dashboard may query, and its labels: pod,
# namespace and container of the pod holding the GPU come with its Kubernetes pod mapping; scraped with
# honorLabels false (its Helm chart's default) Prometheus renames them exported_* (the target's own win).
DCGM_METRICS = {"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_MEM_COPY_UTIL",
                "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_GPU_TEMP"}
DCGM_LABELS = frozenset({"gpu", "UUID", "device", "modelName", "Hostname", "pci_bus_id", "pod", "namespace", "container",
                         "exported_pod", "exported_namespace", "exported_container"})
# oliver006/redis_exporter (the k8s sidecar v1.88.0, compose's Debian 1.45): the series the Redis row may query,
# as exporter/exporter.go names them (INFO field -> metric) with their type and own labels.
REDIS_METRICS = {"redis_up": ("gauge", ()), "redis_memory_used_bytes": ("gauge", ()),
                 "redis_memory_max_bytes": ("gauge", ()), "redis_connected_clients": ("gauge", ()),
                 "redis_commands_processed_total": ("counter", ()), "redis_errors_total": ("counter", ("err",)),
                 "redis_evicted_keys_total": ("counter", ())}
# Prometheus adds these to every sample it scrapes; through a PodMonitor the Prometheus Operator adds the pod's
# namespace, pod, container and endpoint (absent in compose, where a `=~".*"` matcher still matches).
TARGET_LABELS = frozenset({"job", "instance", "namespace", "pod", "container", "endpoint"})

# ------------------------------------------------------------------ PromQL
# The full PromQL vocabulary (Prometheus 2.x/3.x), so that a misspelt function is reported, not taken for a metric.
AGGREGATIONS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk",
                "quantile", "limitk", "limit_ratio"}
FUNCTIONS = {
    "abs", "absent", "absent_over_time", "ceil", "changes", "clamp", "clamp_max", "clamp_min", "day_of_month",
    "day_of_week", "day_of_year", "days_in_month", "delta", "deriv", "exp", "floor", "histogram_avg",
    "histogram_count", "histogram_fraction", "histogram_quantile", "histogram_stddev", "histogram_stdvar",
    "histogram_sum", "holt_winters", "double_exponential_smoothing", "hour", "idelta", "increase", "irate",
    "label_join", "label_replace", "ln", "log2", "log10", "minute", "month", "predict_linear", "rate", "resets",
    "round", "scalar", "sgn", "sort", "sort_desc", "sort_by_label", "sort_by_label_desc", "sqrt", "time",
    "timestamp", "vector", "year", "avg_over_time", "min_over_time", "max_over_time", "sum_over_time",
    "count_over_time", "quantile_over_time", "stddev_over_time", "stdvar_over_time", "last_over_time",
    "present_over_time", "mad_over_time", "acos", "acosh", "asin", "asinh", "atan", "atanh", "cos", "cosh", "sin",
    "sinh", "tan", "tanh", "deg", "rad", "pi", "info",
}
SCALAR_FUNCTIONS = {"scalar", "time", "pi"}
# How functions treat a sample's value, by its registry type (kinds: "counter" = cumulative, "gauge", "created").
RATE_FUNCTIONS = {"rate", "irate", "increase", "resets"}  # counters only: on a gauge (or a rate) they mean nothing
GAUGE_FUNCTIONS = {"deriv", "delta", "idelta", "predict_linear", "holt_winters", "double_exponential_smoothing"}
# The documented ways a raw counter may be used outside RATE_FUNCTIONS, all of which drop its cumulative value:
# these functions (only whether/when samples exist), count/group, the right side of and/unless (only its label
# sets filter), and a `bool` comparison with a scalar (`opsd_groups_total > bool 0`: "has it ever counted").
VALUE_BLIND = {"absent", "absent_over_time", "present_over_time", "count_over_time", "timestamp"}
PASS_THROUGH = {"label_replace", "label_join", "sort", "sort_desc", "sort_by_label", "sort_by_label_desc", "last_over_time"}
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or", "unless",
            "atan2", "inf", "nan"}
PRECEDENCE = {"or": 1, "and": 2, "unless": 2, "==": 3, "!=": 3, "<=": 3, "<": 3, ">=": 3, ">": 3, "+": 4, "-": 4,
              "*": 5, "/": 5, "%": 5, "atan2": 5, "^": 6}
TOKEN = re.compile(r"""
    (?P<ws>\s+) | (?P<comment>\#[^\n]*)
  | (?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
  | (?P<range>\[[^\]]*\])                          # [5m], [$__rate_interval], [1h:1m]: no names inside
  | (?P<var>\$(?:\{[^}]*\}|\w+))                    # a Grafana variable outside strings/ranges
  | (?P<number>(?:(?:\d+(?:ms|[smhdwy]))+|0x[0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)(?![\w:]))
  | (?P<ident>[a-zA-Z_:][\w:]*)
  | (?P<op>=~|!~|==|!=|<=|>=|[-+*/%^<>=,(){}@])
""", re.X)


def tokenize(expr: str) -> list[tuple[str, str]]:
    """(kind, text) tokens, whitespace and comments dropped; ValueError on a character PromQL does not have."""
    out, pos = [], 0
    while pos < len(expr):
        m = TOKEN.match(expr, pos)
        if not m:
            raise ValueError(f"cannot tokenize {expr[pos:pos + 20]!r} in {expr!r}")
        if m.lastgroup not in ("ws", "comment"):
            out.append((m.lastgroup, m.group()))
        pos = m.end()
    return out


@dataclass
class Value:
    kind: str  # "vector", "scalar" or "string"
    labels: frozenset | None = frozenset()  # labels its series can carry; None: unknown (an error was reported)
    text: str = ""  # a string literal's value
    src: frozenset = frozenset()  # (sample name, "raw" or the last function applied) for each value reaching here


@dataclass
class PromQL:
    """Parses one expression: the metric names it references, and the problems found on the way.

    `catalog` maps each known sample name to its label names, `kinds` to
    its value's type (see the `kinds` fixture). The output label set and the
    value sources of every sub-expression are followed (aggregations keep
    only their `by` labels, etc.), so a label or a type is checked against
    what actually reaches the place it is used, not only the raw metric.
    """

    expr: str
    catalog: dict[str, frozenset]
    kinds: dict[str, str] = field(default_factory=dict)
    metrics: set = field(default_factory=set)
    problems: list = field(default_factory=list)

    def __post_init__(self):
        self.toks, self.i = tokenize(self.expr), 0
        self.result = self.parse(0)
        if self.i < len(self.toks):
            raise ValueError(f"unexpected {self.peek()!r} in {self.expr!r}")
        if raw := self.raw_counters(self.result.src):
            self.problems.append(f"cumulative counter(s) {raw} shown as they are: wrap them in rate/irate/increase")

    # -- token helpers
    def peek(self, k: int = 0) -> str:
        return self.toks[self.i + k][1] if self.i + k < len(self.toks) else ""

    def kind(self) -> str:
        return self.toks[self.i][0] if self.i < len(self.toks) else ""

    def take(self, want: str | None = None) -> str:
        text = self.peek()
        if want is not None and text != want:
            raise ValueError(f"expected {want!r}, got {text!r} in {self.expr!r}")
        self.i += 1
        return text

    def need(self, used, have: frozenset | None, where: str) -> None:
        missing = set(used) - (have or set()) - {"__name__"}
        if have is not None and missing:
            self.problems.append(f"{where}: label(s) {sorted(missing)} not on the series there ({sorted(have)})")

    def raw_counters(self, src: frozenset) -> list[str]:
        return sorted(n for n, how in src if how == "raw" and self.kinds.get(n) == "counter")

    def label_list(self) -> list[str]:
        self.take("(")
        names = []
        while self.peek() != ")":
            names.append(self.take())
            if self.peek() == ",":
                self.take()
        self.take(")")
        return names

    # -- grammar
    def parse(self, min_prec: int) -> Value:
        left = self.unary()
        while (op := self.peek().lower()) in PRECEDENCE and PRECEDENCE[op] >= min_prec and self.kind() in ("op", "ident"):
            self.take()
            if is_bool := self.peek() == "bool":
                self.take()
            on = ignoring = include = None
            if self.peek() in ("on", "ignoring"):
                (on, ignoring) = (self.label_list(), None) if self.take() == "on" else (None, self.label_list())
            if self.peek() in ("group_left", "group_right"):
                side = self.take()
                include = (side, self.label_list() if self.peek() == "(" else [])
            right = self.parse(PRECEDENCE[op] + (op != "^"))
            left_src, left_kind = left.src, left.kind
            left = self.binary(op, left, right, on, ignoring, include)
            # Which values flow on: and/unless keep the left ones; a bool comparison with a scalar yields 0/1.
            left.src = (left_src if op in ("and", "unless") else frozenset()
                        if is_bool and "scalar" in (left_kind, right.kind) else left_src | right.src)
        return left

    def unary(self) -> Value:
        if self.peek() in ("-", "+"):
            self.take()
            return self.parse(PRECEDENCE["^"])
        return self.postfix(self.primary())

    def postfix(self, v: Value) -> Value:
        while True:
            if self.kind() == "range":
                self.take()  # range or subquery: same series
            elif self.peek() == "offset":
                self.take()
                if self.peek() == "-":
                    self.take()
                self.take()
            elif self.peek() == "@":
                self.take()
                if self.take() in ("start", "end"):
                    self.take("(")
                    self.take(")")
            else:
                return v

    def primary(self) -> Value:
        kind, text = self.toks[self.i] if self.i < len(self.toks) else ("", "")
        if kind == "string":
            self.take()
            return Value("string", frozenset(), text[1:-1])
        if kind in ("number", "var") or text.lower() in ("inf", "nan"):
            self.take()
            return Value("scalar")
        if text == "(":
            self.take()
            v = self.parse(0)
            self.take(")")
            return v
        if text == "{":
            self.problems.append(f"a selector without a metric name in {self.expr!r}")
            self.matchers()
            return Value("vector", None)
        if kind != "ident" or text in KEYWORDS:
            raise ValueError(f"unexpected {text!r} in {self.expr!r}")
        if text in AGGREGATIONS and self.peek(1) in ("(", "by", "without"):
            return self.aggregation()
        if self.peek(1) == "(":
            return self.call()
        return self.selector()

    def matchers(self) -> list[str]:
        self.take("{")
        names = []
        while self.peek() != "}":
            names.append(self.take())
            self.take()  # = != =~ !~
            self.take()  # the value (a string)
            if self.peek() == ",":
                self.take()
        self.take("}")
        return names

    def selector(self) -> Value:
        name = self.take()
        self.metrics.add(name)
        have = self.catalog.get(name)
        if have is None:
            self.problems.append(f"metric {name!r} is not exported")
        used = self.matchers() if self.peek() == "{" else []
        self.need(used, have, f"matchers of {name}")
        if self.kinds.get(name) == "created":
            self.problems.append(f"{name}: a _created series (when the counter was made) must not be queried")
        return Value("vector", have, src=frozenset({(name, "raw")}))

    def args(self) -> list[Value]:
        self.take("(")
        out = []
        while self.peek() != ")":
            out.append(self.parse(0))
            if self.peek() == ",":
                self.take()
        self.take(")")
        return out

    def aggregation(self) -> Value:
        name = self.take()
        grouping = (self.take(), self.label_list()) if self.peek() in ("by", "without") else None
        args = self.args()
        if grouping is None and self.peek() in ("by", "without"):
            grouping = (self.take(), self.label_list())
        have = args[-1].labels
        if grouping is None:
            out = frozenset()
        else:
            self.need(grouping[1], have, f"{name} {grouping[0]} ({', '.join(grouping[1])})")
            out = frozenset(grouping[1]) if grouping[0] == "by" else None if have is None else have - set(grouping[1])
        if name == "count_values" and out is not None:
            out |= {args[0].text}
        return Value("vector", out, src=frozenset() if name in ("count", "group") else args[-1].src)

    def call(self) -> Value:
        name = self.take()
        if name not in FUNCTIONS:
            self.problems.append(f"unknown function {name!r}")
        args = self.args()
        vectors = [a for a in args if a.kind == "vector"]
        out = self.call_labels(name, args, vectors)
        src = frozenset().union(*(a.src for a in vectors))
        raw = self.raw_counters(src)
        if name in RATE_FUNCTIONS:
            if bad := sorted(n if how == "raw" else f"{how}({n})" for n, how in src
                             if how != "raw" or self.kinds.get(n) == "gauge"):
                self.problems.append(f"{name}() over gauge value(s) {bad}: it is for counters (use deriv/delta/*_over_time)")
        elif name in GAUGE_FUNCTIONS and raw:
            self.problems.append(f"{name}() over counter(s) {raw}: it is for gauges (use rate/increase)")
        elif raw and name not in VALUE_BLIND | PASS_THROUGH:
            self.problems.append(f"cumulative counter(s) {raw} under {name}(): wrap them in rate/irate/increase first")
        if name == "histogram_quantile" and (not src or any(not n.endswith("_bucket") for n, _ in src)):
            self.problems.append(f"histogram_quantile over {sorted(n for n, _ in src)}: it needs only _bucket series")
        out.src = (frozenset() if name in VALUE_BLIND or out.kind != "vector" else src if name in PASS_THROUGH
                   else frozenset((n, name) for n, _ in src))
        return out

    def call_labels(self, name: str, args: list[Value], vectors: list[Value]) -> Value:
        if name in SCALAR_FUNCTIONS:
            return Value("scalar")
        if name == "vector" or not vectors:
            return Value("vector")
        have = vectors[0].labels
        if name == "histogram_quantile":
            self.need(["le"], have, "histogram_quantile")
            return Value("vector", None if have is None else have - {"le"})
        if name in ("label_replace", "label_join") and have is not None:
            sources = [args[3].text] if name == "label_replace" else [a.text for a in args[3:]]
            self.need([s for s in sources if s], have, f"{name} source label")
            return Value("vector", have | {args[1].text})
        return Value("vector", have)

    def binary(self, op, left: Value, right: Value, on, ignoring, include) -> Value:
        if left.kind != "vector":
            return right if right.kind == "vector" else Value("scalar")
        if right.kind != "vector":
            return left
        if None in (left.labels, right.labels):
            return Value("vector", None)
        if on is not None:
            self.need(on, left.labels, f"on ({', '.join(on)}), left side")
            self.need(on, right.labels, f"on ({', '.join(on)}), right side")
        if ignoring is not None:
            self.need(ignoring, left.labels | right.labels, f"ignoring ({', '.join(ignoring)})")
        if op == "or":
            return Value("vector", left.labels | right.labels)
        if op in ("and", "unless"):
            return Value("vector", left.labels)
        if include is not None:
            many, one = (left, right) if include[0] == "group_left" else (right, left)
            self.need(include[1], one.labels, f"{include[0]} ({', '.join(include[1])})")
            return Value("vector", many.labels | set(include[1]))
        if on is not None:
            return Value("vector", frozenset(on))
        return Value("vector", left.labels - set(ignoring or ()))


# ------------------------------------------------------------------ what the services export
# family type -> (sample suffix, extra label, kind of value) as prometheus_client writes them; kind "counter" is
# cumulative (histogram buckets, _sum and _count too), "created" a creation timestamp.
SAMPLE_SUFFIXES = {
    "counter": [("_total", None, "counter"), ("_created", None, "created")],
    "gauge": [("", None, "gauge")],
    "histogram": [("_bucket", "le", "counter"), ("_sum", None, "counter"), ("_count", None, "counter"),
                  ("_created", None, "created")],
    "summary": [("", "quantile", "gauge"), ("_sum", None, "counter"), ("_count", None, "counter"),
                ("_created", None, "created")],
    "gaugehistogram": [("_bucket", "le", "gauge"), ("_gsum", None, "gauge"), ("_gcount", None, "gauge")],
    "info": [("_info", None, "gauge")],
    "stateset": [("", None, "gauge")],
    "enum": [("", None, "gauge")],
    "unknown": [("", None, "unknown")],
}


@pytest.fixture(scope="module")
def exported() -> dict[str, frozenset]:
    """Sample name -> label names, for every opsd family in the default registry once the services are imported.

    Built from the families' types and the collectors' label names, not from
    samples: a labelled metric without children exports no sample yet.
    """
    for mod in SERVICE_MODULES:
        importlib.import_module(mod)  # defines metrics; starts nothing (main() is behind __name__ == "__main__")
    from prometheus_client import REGISTRY

    # The label names live on the collector objects; the registry keeps them in _collector_to_names.
    labelnames = {}
    for collector in list(REGISTRY._collector_to_names):
        if hasattr(collector, "_labelnames"):  # the metric wrappers (Counter, Gauge, ...); not the process/gc collectors
            for fam in collector.describe():
                labelnames[fam.name] = collector._labelnames
    out = {}
    for fam in REGISTRY.collect():
        if not fam.name.startswith("opsd_"):
            continue
        labels = labelnames.get(fam.name)
        assert labels is not None, f"no label names found for {fam.name} (prometheus_client internals changed?)"
        for suffix, extra, _ in SAMPLE_SUFFIXES[fam.type]:
            out[fam.name + suffix] = frozenset(labels) | TARGET_LABELS | ({extra} if extra else set())
    assert len(out) >= 20, f"only {sorted(out)} found: the service modules' metrics did not register"
    return out


@pytest.fixture(scope="module")
def catalog(exported) -> dict[str, frozenset]:
    return {**exported, **{m: DCGM_LABELS | TARGET_LABELS for m in DCGM_METRICS},
            **{m: frozenset(labels) | TARGET_LABELS for m, (_, labels) in REDIS_METRICS.items()}}


@pytest.fixture(scope="module")
def kinds(exported) -> dict[str, str]:
    """Sample name -> kind of value, from the registry families' .type (the listed DCGM fields are all gauges)."""
    from prometheus_client import REGISTRY

    out = {m: "gauge" for m in DCGM_METRICS} | {m: kind for m, (kind, _) in REDIS_METRICS.items()}
    for fam in REGISTRY.collect():
        if fam.name.startswith("opsd_"):
            out |= {fam.name + suffix: kind for suffix, _, kind in SAMPLE_SUFFIXES[fam.type]}
    assert set(out) >= set(exported) and out["opsd_queue_depth"] == "gauge" and out["opsd_groups_total"] == "counter"
    return out


# ------------------------------------------------------------------ the dashboard
def load() -> dict:
    return json.loads(DASHBOARD.read_text())


def all_panels(dash: dict) -> list[dict]:
    """Every panel, including those nested in collapsed rows."""
    out = []
    for p in dash["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def queries(dash: dict) -> list[tuple[str, dict]]:
    return [(p["title"], t) for p in all_panels(dash) if p["type"] != "row" for t in p.get("targets", [])]


def check(expr: str, catalog: dict, legend: str = "", kinds: dict | None = None) -> tuple[set, list]:
    """(metric names, problems) of one query; a legend's {{label}} must be on the series the query returns."""
    q = PromQL(expr, catalog, kinds or {})
    problems = list(q.problems)
    used = re.findall(r"\{\{\s*(\w+)\s*\}\}", legend)
    if used and q.result.labels is not None:
        missing = set(used) - q.result.labels
        if missing:
            problems.append(f"legend {legend!r} uses {sorted(missing)}, not on the result ({sorted(q.result.labels)})")
    return q.metrics, problems


def test_dashboard_loads_with_its_identity_and_variables():
    dash = load()
    assert dash["uid"] == "opsd-overview" and dash["title"] == "opsd"
    assert dash["schemaVersion"] >= 39
    assert dash["refresh"] == "10s" and dash["time"] == {"from": "now-1h", "to": "now"}
    others = [p for p in DASHBOARD.parent.glob("*.json") if p != DASHBOARD and json.loads(p.read_text()).get("uid") == dash["uid"]]
    assert not others, f"uid {dash['uid']} is also used by {others}"
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["role"]["multi"] and variables["role"]["datasource"]["uid"] == DATASOURCE


def test_panels_have_unique_ids_rows_units_descriptions_and_fit_the_grid():
    dash = load()
    panels = all_panels(dash)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {sorted(i for i in ids if ids.count(i) > 1)}"
    assert [p["title"] for p in panels if p["type"] == "row"] == ROWS
    cells = set()
    for p in panels:
        g = p["gridPos"]
        assert g["w"] > 0 and g["h"] > 0 and 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"panel {p['title']!r} overlaps another"
        cells |= mine
        if p["type"] == "row":
            continue
        assert p["type"] in ("timeseries", "stat"), p["title"]
        assert p["fieldConfig"]["defaults"].get("unit"), f"panel {p['title']!r} has no unit"
        assert len(p.get("description", "")) > 20, f"panel {p['title']!r} has no description"


def test_every_target_has_an_expr_on_the_datasource_variable():
    dash = load()
    for p in all_panels(dash):
        if p["type"] == "row":
            continue
        assert p["targets"], f"panel {p['title']!r} has no query"
        assert p["datasource"] == {"type": "prometheus", "uid": DATASOURCE}, p["title"]
        for t in p["targets"]:
            assert t.get("expr", "").strip(), f"a target of {p['title']!r} has no expr"
            assert t.get("datasource", p["datasource"])["uid"] == DATASOURCE, p["title"]


def test_every_query_references_only_exported_metrics_labels_and_types(exported, catalog, kinds):
    problems, referenced = [], set()
    for title, target in queries(load()):
        names, found = check(target["expr"], catalog, target.get("legendFormat", ""), kinds)
        referenced |= names
        problems += [f"{title}: {p}" for p in found]
        for name in names:  # opsd names from the registry, anything else from the exporters' lists only
            if not (name in exported if name.startswith("opsd_") else name in DCGM_METRICS | set(REDIS_METRICS)):
                problems.append(f"{title}: {name} is neither an opsd sample nor a listed DCGM or Redis metric")
    assert not problems, "\n".join(problems)
    assert {"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "redis_memory_used_bytes", "redis_memory_max_bytes",
            "redis_commands_processed_total", "redis_connected_clients"} <= referenced


@pytest.mark.parametrize("name", ["role", "namespace"])
def test_the_variables_query_an_exported_label_and_all_matches_compose(catalog, name):
    variable = {v["name"]: v for v in load()["templating"]["list"]}[name]
    m = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", variable["query"])
    assert m, variable["query"]
    assert m[1] in catalog and m[2] in catalog[m[1]], variable["query"]
    # All = .*, which also matches a series without the label (compose has no namespace): never an empty union.
    assert variable["includeAll"] and variable["allValue"] == ".*" and variable["current"]["value"] == ["$__all"]


def selectors(expr: str) -> list[tuple[str, str]]:
    """(metric name, its matchers' text) of every opsd_/redis_/DCGM_ selector in an expression."""
    return re.findall(r"\b(opsd_\w+|redis_\w+|DCGM_\w+)(?:\{([^}]*)\})?", re.sub(r'"[^"]*"', '""', expr))


def test_every_opsd_and_redis_query_is_filtered_to_the_chosen_runs():
    unfiltered = [(title, name) for title, t in queries(load()) for name, matchers in selectors(t["expr"])
                  if not name.startswith("DCGM_") and 'namespace=~""' not in matchers.replace("$namespace", "")]
    assert not unfiltered, f"selectors without namespace=~\"$namespace\": {unfiltered}"


def test_the_gpu_panels_show_only_the_gpus_of_opsd_pods():
    """Each DCGM series is kept only if an opsd series of the chosen namespace and roles has its (namespace, pod):
    the GPUs of the run's pods, not every GPU of the cluster (tests/test_dashboard_promql.py evaluates it)."""
    gpu = [(title, t["expr"]) for title, t in queries(load()) if "DCGM_" in t["expr"]]
    assert len(gpu) >= 2
    for title, expr in gpu:
        assert re.search(r'\) and on \(namespace, pod\) opsd_groups_total\{namespace=~"\$namespace", role=~"\$role"\}\)$',
                         expr), title
        for label in ("namespace", "pod"):
            assert f'"{label}", "$1", "exported_{label}", "(.+)"' in expr, (title, label)


def test_every_opsd_metric_is_on_the_dashboard(catalog):
    import opsd.metrics
    from prometheus_client.metrics import MetricWrapperBase

    families = {}  # family name -> the sample names it exports
    for obj in vars(opsd.metrics).values():
        if isinstance(obj, MetricWrapperBase):
            fam = next(iter(obj.describe()))
            families[fam.name] = {fam.name + s for s, *_ in SAMPLE_SUFFIXES[fam.type]}
    assert len(families) >= 20
    shown = set()
    for _, target in queries(load()):
        shown |= check(target["expr"], catalog)[0]
    missing = sorted(f for f, samples in families.items() if not samples & shown and f not in OMITTED)
    assert not missing, f"metrics of opsd/metrics.py on no panel (show them or add them to OMITTED): {missing}"
    assert set(OMITTED) <= set(families), "OMITTED names a metric that no longer exists"


# ------------------------------------------------------------------ negative controls: the checker can fail
def test_the_extractor_reports_a_misspelt_metric(catalog):
    names, problems = check('sum by (role) (rate(opsd_grups_total{role=~"$role"}[$__rate_interval]))', catalog)
    assert names == {"opsd_grups_total"}
    assert any("opsd_grups_total" in p for p in problems)


def test_the_extractor_skips_strings_ranges_label_lists_numbers_and_keywords(catalog, kinds):
    expr = ('label_replace(histogram_quantile(0.95, sum without (instance) (rate(opsd_job_seconds_bucket{role!="x"}'
            '[5m:1m] offset 1h30m))), "opsd_fake", "$1", "role", "(.*)") '
            '/ on (role) group_left () max by (role) (opsd_policy_version) > bool 2e3 or vector(1)  # opsd_comment')
    names, problems = check(expr, catalog, legend="{{role}} {{opsd_fake}}", kinds=kinds)
    assert names == {"opsd_job_seconds_bucket", "opsd_policy_version"}
    assert problems == []


@pytest.mark.parametrize(("expr", "legend", "reported"), [
    ("sum by (stream) (rate(opsd_groups_total[5m]))", "", "stream"),  # opsd_groups_total has no stream label
    ('opsd_queue_depth{role="rollout"}', "", "role"),  # the queue gauges are labelled by stream only
    ("sum by (stream) (sum by (role) (opsd_backpressure_seconds_total))", "", "stream"),  # dropped by the inner sum
    ("histogram_quantile(0.5, sum by (role) (rate(opsd_job_seconds_bucket[5m])))", "", "le"),
    ("sum by (role) (rate(opsd_tokens_total[5m]))", "{{stream}}", "stream"),
    ("rat(opsd_groups_total[5m])", "", "rat"),
    ("max by (gpu) (DCGM_FI_DEV_GPU_UTILIZATION)", "", "DCGM_FI_DEV_GPU_UTILIZATION"),
])
def test_the_checker_reports_wrong_labels_and_names(catalog, expr, legend, reported):
    _, problems = check(expr, catalog, legend)
    assert any(reported in p for p in problems), problems


@pytest.mark.parametrize("expr", [  # typed uses that are right, including the documented counter exceptions
    "resets(opsd_groups_total[1h])", "count by (role) (opsd_groups_total)", "absent(opsd_tokens_total)",
    "opsd_groups_total > bool 0", "rate(opsd_tokens_total[5m]) and on (role) opsd_groups_total",
    "sum(rate(opsd_job_seconds_sum[5m])) / sum(rate(opsd_job_seconds_count[5m]))", "deriv(opsd_queue_depth[10m])",
    "predict_linear(opsd_policy_version[1h], 3600)", "max_over_time(sum(rate(opsd_groups_total[5m]))[1h:1m])",
])
def test_the_type_checker_accepts_right_uses(catalog, kinds, expr):
    assert check(expr, catalog, kinds=kinds)[1] == []


@pytest.mark.parametrize(("expr", "reported"), [
    # rate/irate/increase/resets over a gauge, also through a subquery, or over a rate (a gauge-like value)
    ("sum by (stream) (rate(opsd_queue_depth[5m]))", "rate() over gauge value(s) ['opsd_queue_depth']"),
    ("irate(opsd_policy_version[5m])", "irate() over gauge"), ("increase(opsd_step_seconds[1h])", "increase() over gauge"),
    ("resets(opsd_queue_pending[1h])", "resets() over gauge"), ("rate(max(opsd_queue_depth)[5m:1m])", "rate() over gauge"),
    ("rate(rate(opsd_groups_total[5m])[10m:])", "rate(opsd_groups_total)"),
    # a cumulative counter sample used as it is, however wrapped
    ('sum by (role) (opsd_groups_total{role=~"$role"})', "cumulative counter(s) ['opsd_groups_total'] shown"),
    ("opsd_groups_total > 0", "shown"), ("rate(opsd_groups_total[5m]) / opsd_tokens_total", "['opsd_tokens_total'] shown"),
    ("opsd_job_seconds_sum / opsd_job_seconds_count", "['opsd_job_seconds_count', 'opsd_job_seconds_sum'] shown"),
    ("max_over_time(opsd_groups_total[1h])", "under max_over_time()"), ("opsd_tokens_total and opsd_groups_total", "shown"),
    ("histogram_quantile(0.9, sum by (le) (opsd_job_seconds_bucket))", "under histogram_quantile()"),
    ("time() - opsd_groups_created", "opsd_groups_created: a _created series"),
    # deriv & co. over a counter
    ("deriv(opsd_tokens_total[5m])", "deriv() over counter"), ("delta(opsd_groups_total[1h])", "delta() over counter"),
    ("idelta(opsd_job_seconds_count[5m])", "idelta() over counter"),
    ("predict_linear(opsd_tokens_total[1h], 3600)", "predict_linear() over counter"),
    # histogram_quantile over anything but _bucket series
    ('histogram_quantile(0.9, label_replace(rate(opsd_job_seconds_count[5m]), "le", "1", "", ""))', "only _bucket"),
    ("histogram_quantile(0.5, opsd_queue_depth)", "only _bucket"),
])
def test_the_type_checker_reports_misused_counters_gauges_and_histograms(catalog, kinds, expr, reported):
    _, problems = check(expr, catalog, kinds=kinds)
    assert any(reported in p for p in problems), problems
