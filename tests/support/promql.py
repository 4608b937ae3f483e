"""Just enough of Prometheus to evaluate the alert rules of docs/operations.md over scraped
samples, so that a rule and the metrics it reads cannot drift apart unnoticed.

The subset is what those rules use: metric selectors (``name``, ``name{label="v"}`` and
``name{label=~"A|B"}``),
``rate`` and ``increase`` over a range, ``sum``/``max``/``min`` with ``by`` or ``without``,
comparisons with a number (which filter, as in PromQL), and ``and`` / ``unless`` / ``or``
matching on every label. ``rate`` is the plain slope between the first and last sample of
the range (counter resets handled), without Prometheus's extrapolation to the range's
edges: the same verdict for "is it zero" and "is it above a threshold" whenever the samples
cover the range. Alerts honour ``for:`` as Prometheus does: the expression must have
returned something at every evaluation over that long.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

Labels = frozenset[tuple[str, str]]
Vector = dict[Labels, float]

_DURATION = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_TOKEN = re.compile(r"""\s*(?:(?P<num>\d+(?:\.\d+)?)(?P<unit>[smhd])?(?![\w])
                        |(?P<name>[a-zA-Z_:][\w:]*)|(?P<str>"[^"]*")
                        |(?P<op>==|!=|>=|<=|=~|[><(){}\[\],=]))""", re.VERBOSE)
_COMPARISONS: dict[str, Callable[[float, float], bool]] = {
    ">": lambda a, b: a > b, "<": lambda a, b: a < b, ">=": lambda a, b: a >= b,
    "<=": lambda a, b: a <= b, "==": lambda a, b: a == b, "!=": lambda a, b: a != b}


@dataclass
class Scrapes:
    """Samples by series: ``{(name, labels): [(t, value), ...]}`` in time order."""

    series: dict[tuple[str, Labels], list[tuple[float, float]]] = field(default_factory=dict)

    def add_text(self, t: float, exposition: str) -> None:
        """One scrape of a /metrics page taken at time ``t`` (seconds)."""
        for family in text_string_to_metric_families(exposition):
            for sample in family.samples:
                key = (sample.name, frozenset(sample.labels.items()))
                self.series.setdefault(key, []).append((t, float(sample.value)))

    def times(self) -> list[float]:
        return sorted({t for points in self.series.values() for t, _ in points})


def parse_duration(text: str) -> float:
    match = re.fullmatch(r"(\d+)([smhd])", text.strip())
    if match is None:
        raise ValueError(f"not a duration: {text!r}")
    return int(match.group(1)) * _DURATION[match.group(2)]


class _Parser:
    def __init__(self, text: str) -> None:
        self.tokens: list[tuple[str, str]] = []
        position = 0
        text = text.strip()
        while position < len(text):
            match = _TOKEN.match(text, position)
            if match is None or match.end() == position:
                raise ValueError(f"cannot parse {text[position:]!r}")
            position = match.end()
            kind = match.lastgroup
            if match.group("num") is not None:
                unit = match.group("unit")
                self.tokens.append(("dur" if unit else "num",
                                    match.group("num") + (unit or "")))
            elif kind is not None:
                self.tokens.append((kind, match.group(kind)))
        self.position = 0

    def peek(self) -> tuple[str, str] | None:
        return self.tokens[self.position] if self.position < len(self.tokens) else None

    def take(self, value: str | None = None) -> tuple[str, str]:
        token = self.peek()
        if token is None or (value is not None and token[1] != value):
            raise ValueError(f"expected {value!r}, got {token!r}")
        self.position += 1
        return token

    def parse(self) -> Expr:
        expr = self.set_op()
        if self.peek() is not None:
            raise ValueError(f"unexpected {self.peek()!r}")
        return expr

    def set_op(self) -> Expr:
        left = self.comparison()
        while (token := self.peek()) is not None and token[1] in ("and", "unless", "or"):
            self.take()
            left = SetOp(token[1], left, self.comparison())
        return left

    def comparison(self) -> Expr:
        left = self.atom()
        token = self.peek()
        if token is not None and token[1] in _COMPARISONS:
            self.take()
            return Compare(token[1], left, float(self.take()[1]))
        return left

    def labels(self) -> tuple[str, ...]:
        self.take("(")
        names = []
        while self.peek() != ("op", ")"):
            names.append(self.take()[1])
            if self.peek() == ("op", ","):
                self.take()
        self.take(")")
        return tuple(names)

    def atom(self) -> Expr:
        kind, value = self.take()
        if value == "(":
            inner = self.set_op()
            self.take(")")
            return inner
        if value in ("sum", "max", "min"):
            grouping: tuple[str, tuple[str, ...]] = ("without", ())
            if self.peek() in (("name", "by"), ("name", "without")):
                grouping = (self.take()[1], self.labels())
            self.take("(")
            inner = self.set_op()
            self.take(")")
            if self.peek() in (("name", "by"), ("name", "without")):
                grouping = (self.take()[1], self.labels())
            return Aggregate(value, grouping[0], grouping[1], inner)
        if value in ("rate", "increase"):
            self.take("(")
            selector = self.selector(self.take()[1])
            self.take("[")
            window = parse_duration(self.take()[1])
            self.take("]")
            self.take(")")
            return RangeFunction(value, selector, window)
        if kind == "name":
            return self.selector(value)
        raise ValueError(f"unexpected {value!r}")

    def selector(self, name: str) -> Selector:
        matchers: list[tuple[str, str, bool]] = []
        if self.peek() == ("op", "{"):
            self.take("{")
            while self.peek() != ("op", "}"):
                label = self.take()[1]
                regex = self.take()[1] == "=~"
                matchers.append((label, self.take()[1].strip('"'), regex))
                if self.peek() == ("op", ","):
                    self.take()
            self.take("}")
        return Selector(name, tuple(matchers))


def _matches(labels: Labels, label: str, value: str, regex: bool) -> bool:
    if not regex:
        return (label, value) in labels
    actual = dict(labels).get(label, "")
    return re.fullmatch(value, actual) is not None


class Expr:
    def eval(self, data: Scrapes, t: float) -> Vector:
        raise NotImplementedError


@dataclass
class Selector(Expr):
    name: str
    #: (label, value, is a regular expression: ``=~``, anchored as Prometheus anchors it)
    matchers: tuple[tuple[str, str, bool], ...]
    #: Prometheus's lookback: a series without a sample this recent is absent
    lookback_s: float = 300.0

    def matching(self, data: Scrapes) -> Iterable[tuple[Labels, list[tuple[float, float]]]]:
        for (name, labels), points in data.series.items():
            if name == self.name and all(_matches(labels, *m) for m in self.matchers):
                yield labels, points

    def eval(self, data: Scrapes, t: float) -> Vector:
        result: Vector = {}
        for labels, points in self.matching(data):
            recent = [value for at, value in points if t - self.lookback_s < at <= t]
            if recent:
                result[labels] = recent[-1]
        return result


@dataclass
class RangeFunction(Expr):
    function: str
    selector: Selector
    window_s: float

    def eval(self, data: Scrapes, t: float) -> Vector:
        result: Vector = {}
        for labels, points in self.selector.matching(data):
            inside = [(at, value) for at, value in points if t - self.window_s < at <= t]
            if len(inside) < 2:
                continue
            increase = 0.0
            for (_, before), (_, after) in itertools.pairwise(inside):
                increase += after - before if after >= before else after  # a counter reset
            span = inside[-1][0] - inside[0][0]
            rate = increase / span
            result[labels] = rate if self.function == "rate" else rate * self.window_s
        return result


@dataclass
class Aggregate(Expr):
    operator: str
    grouping: str
    labels: tuple[str, ...]
    inner: Expr

    def eval(self, data: Scrapes, t: float) -> Vector:
        groups: dict[Labels, list[float]] = {}
        for labels, value in self.inner.eval(data, t).items():
            if self.grouping == "by":
                key = frozenset((k, v) for k, v in labels if k in self.labels)
            else:
                key = frozenset((k, v) for k, v in labels if k not in self.labels)
            groups.setdefault(key, []).append(value)
        reduce: dict[str, Callable[[list[float]], float]] = {"sum": sum, "max": max,
                                                             "min": min}
        return {key: float(reduce[self.operator](values)) for key, values in groups.items()}


@dataclass
class Compare(Expr):
    operator: str
    left: Expr
    number: float

    def eval(self, data: Scrapes, t: float) -> Vector:
        test = _COMPARISONS[self.operator]
        return {k: v for k, v in self.left.eval(data, t).items() if test(v, self.number)}


@dataclass
class SetOp(Expr):
    operator: str
    left: Expr
    right: Expr

    def eval(self, data: Scrapes, t: float) -> Vector:
        left, right = self.left.eval(data, t), self.right.eval(data, t)
        if self.operator == "and":
            return {k: v for k, v in left.items() if k in right}
        if self.operator == "unless":
            return {k: v for k, v in left.items() if k not in right}
        return {**right, **left}


def parse(expression: str) -> Expr:
    return _Parser(expression).parse()


@dataclass(frozen=True)
class Rule:
    alert: str
    expr: str
    for_s: float = 0.0
    #: the rule's ``labels:`` and ``annotations:`` (one level, ``key: value`` lines)
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)


def firing(rule: Rule, data: Scrapes, *, time_scale: float = 1.0) -> list[float]:
    """The evaluation times (each scrape's) at which ``rule`` fires. ``time_scale`` divides
    the rule's ranges and ``for:``, for runs that compress minutes into seconds."""
    expr = parse(rule.expr)
    _scale(expr, time_scale)
    hold = rule.for_s / time_scale
    fired: list[float] = []
    pending_since: float | None = None
    for t in data.times():
        if expr.eval(data, t):
            pending_since = t if pending_since is None else pending_since
            if t - pending_since >= hold:
                fired.append(t)
        else:
            pending_since = None
    return fired


def _scale(expr: Expr, time_scale: float) -> None:
    if isinstance(expr, RangeFunction):
        expr.window_s /= time_scale
        expr.selector.lookback_s /= time_scale
    elif isinstance(expr, Selector):
        expr.lookback_s /= time_scale
    elif isinstance(expr, Aggregate):
        _scale(expr.inner, time_scale)
    elif isinstance(expr, Compare):
        _scale(expr.left, time_scale)
    elif isinstance(expr, SetOp):
        _scale(expr.left, time_scale)
        _scale(expr.right, time_scale)


def rules_from_yaml_block(text: str) -> list[Rule]:
    """The ``- alert:`` entries of a Prometheus rules file as docs/operations.md shows it
    (``expr:`` on one line or as a ``|`` block, optional ``for:``, ``labels:`` and
    ``annotations:`` of one level); no YAML library needed."""
    rules: list[Rule] = []
    lines = text.splitlines()
    index = 0
    current: dict[str, str] = {}
    maps: dict[str, dict[str, str]] = {"labels": {}, "annotations": {}}
    inside: str | None = None

    def flush() -> None:
        if current:
            rules.append(Rule(current["alert"], current["expr"],
                              parse_duration(current["for"]) if "for" in current else 0.0,
                              dict(maps["labels"]), dict(maps["annotations"])))
            current.clear()
            for values in maps.values():
                values.clear()

    def indent_of(line: str) -> int:
        return len(line) - len(line.lstrip())

    map_indent = 0
    while index < len(lines):
        raw = lines[index]
        line = raw.strip()
        index += 1
        if inside is not None and line and indent_of(raw) > map_indent:
            key, _, value = line.partition(":")
            maps[inside][key.strip()] = value.strip().strip('"')
            continue
        inside = None
        if line.startswith("- alert:"):
            flush()
            current["alert"] = line.split(":", 1)[1].strip()
        elif line.startswith("expr:"):
            value = line.split(":", 1)[1].strip()
            if value == "|":
                body = []
                indent = indent_of(lines[index])
                while index < len(lines) and indent_of(lines[index]) >= indent and (
                        lines[index].strip()):
                    body.append(lines[index].strip())
                    index += 1
                value = " ".join(body)
            current["expr"] = value
        elif line.startswith("for:"):
            current["for"] = line.split(":", 1)[1].strip()
        elif line in ("labels:", "annotations:"):
            inside = line[:-1]
            map_indent = indent_of(raw)
    flush()
    return rules


def by_name(rules: Iterable[Rule]) -> Mapping[str, Rule]:
    return {rule.alert: rule for rule in rules}
