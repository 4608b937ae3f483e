"""The monitor's page at ``/``: every application at a glance, for the on-call engineer.

Rendered on the server from the last evaluations, no script: a ``meta refresh`` reloads it
every interval. The applications in trouble come first. Each shows its status and why, its
workers, and its shards as the resharding lineage (a child under its parents, indented),
each with its owner, checkpoint age, lag and a small inline SVG chart of the lag over the
window; parked, recovering and finished shards are marked. Lease owners, parked reasons and
errors are written by users and processors: every text goes through ``html.escape``.
"""

from __future__ import annotations

import html
import time
from collections.abc import Iterator, Sequence

from kclpy.ops.monitor.watch import AppView, ShardView

_COLOURS = {"OK": "#2e7d32", "WARN": "#ef6c00", "ERR": "#c62828", "STOP": "#c62828",
            "STALL": "#c62828", "REWIND": "#c62828"}
_GREY = "#757575"
_RANK = {"ERR": 0, "WARN": 1, "-": 2, "OK": 4}
CHART_WIDTH = 160
CHART_HEIGHT = 32

_STYLE = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#212121}
h1{font-size:1.4em}h2{font-size:1.15em;margin-top:1.8em}
.badge{display:inline-block;padding:0.1em 0.6em;border-radius:0.3em;color:#fff;
font-weight:bold}
table{border-collapse:collapse;margin-top:0.5em}
th,td{padding:0.25em 0.7em;border-bottom:1px solid #e0e0e0;text-align:left;
vertical-align:middle;font-size:0.92em}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.mark{font-size:0.8em;padding:0.05em 0.4em;border:1px solid;border-radius:0.25em;
margin-right:0.3em}
.parked{color:#6a1b9a}.recovering{color:#1565c0}.finished{color:#757575}
.retention{color:#c62828}.waiting{color:#757575}
.reasons{margin:0.3em 0;color:#424242}.error{color:#c62828}
"""


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _badge(status: str) -> str:
    colour = _COLOURS.get(status, _GREY)
    return f'<span class="badge" style="background:{colour}">{_e(status)}</span>'


def _age(seconds: float | None, observed_s: float) -> str:
    if seconds is None:
        return f"&ge; {observed_s:.0f}s"
    return f"{seconds:.0f}s"


def chart(history: Sequence[tuple[float, int, int]], window_s: float) -> str:
    """The lag (seconds behind) over the window as an SVG polyline: the right edge is now,
    the left edge the window's start; the scale is the largest lag shown (in the title)."""
    if not history:
        return ""
    top = max(millis for _, millis, _ in history) or 1
    points = " ".join(
        f"{CHART_WIDTH * (1 - min(ago, window_s) / window_s):.1f},"
        f"{CHART_HEIGHT - 2 - (CHART_HEIGHT - 4) * millis / top:.1f}"
        for ago, millis, _ in history)
    latest = history[-1][1]
    colour = "#c62828" if latest and latest >= top else "#1565c0"
    return (f'<svg class="lag" width="{CHART_WIDTH}" height="{CHART_HEIGHT}" '
            f'viewBox="0 0 {CHART_WIDTH} {CHART_HEIGHT}" role="img">'
            f"<title>lag over the last {window_s:g}s, up to {top / 1000:.1f}s</title>"
            f'<rect width="{CHART_WIDTH}" height="{CHART_HEIGHT}" fill="#fafafa"/>'
            f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" '
            f'points="{points}"/></svg>')


def _marks(shard: ShardView) -> str:
    marks: list[str] = []
    if shard.parked is not None:
        since = shard.parked.get("atMs")
        when = (time.strftime(" since %Y-%m-%d %H:%M:%SZ", time.gmtime(int(since) / 1000))
                if isinstance(since, int | float) else "")
        why = shard.parked.get("reason") or "-"
        by = shard.parked.get("by")
        error = shard.parked.get("error")
        title = f"parked by {by}{when}: {why}" + (f" ({error})" if error else "")
        marks.append(f'<span class="mark parked" title="{_e(title)}">PARKED</span> '
                     f"{_e(why)}{_e(when)}")
    if shard.recovering:
        marks.append('<span class="mark recovering">RECOVERING</span>')
    if shard.waiting_on_parents:
        marks.append('<span class="mark waiting">WAITING ON PARENTS</span>')
    if shard.finished:
        marks.append('<span class="mark finished">FINISHED</span>')
    if shard.behind_retention:
        marks.append('<span class="mark retention">BEHIND RETENTION</span>')
    return " ".join(marks)


def lineage(shards: Sequence[ShardView]) -> Iterator[tuple[int, ShardView]]:
    """The shards of one stream depth first from the roots (those whose parents have no
    lease), each child after its first parent, with its depth; every shard once."""
    by_id = {shard.shard_id: shard for shard in shards}
    children: dict[str, list[ShardView]] = {}
    roots: list[ShardView] = []
    for shard in shards:
        known = [p for p in shard.parents if p in by_id]
        if known:
            children.setdefault(sorted(known)[0], []).append(shard)
        else:
            roots.append(shard)
    shown: set[str] = set()

    def walk(shard: ShardView, depth: int) -> Iterator[tuple[int, ShardView]]:
        if shard.shard_id in shown:
            return
        shown.add(shard.shard_id)
        yield depth, shard
        for child in sorted(children.get(shard.shard_id, []), key=lambda s: s.shard_id):
            yield from walk(child, depth + 1)

    for root in sorted(roots, key=lambda s: s.shard_id):
        yield from walk(root, 0)
    for shard in shards:  # a cycle in hand-edited leases: still listed
        yield from walk(shard, 0)


def _shard_row(depth: int, shard: ShardView, window_s: float) -> str:
    behind = "-" if shard.records_behind is None else (
        f"{shard.records_behind}" + ("" if shard.records_exact else "+"))
    seconds = "-" if shard.millis_behind is None else f"{shard.millis_behind / 1000:.1f}s"
    indent = "&nbsp;&nbsp;" * depth + ("&#x2514; " if depth else "")
    return (f'<tr class="shard" data-shard="{_e(shard.shard_id)}" '
            f'data-status="{_e(shard.status)}" data-depth="{depth}">'
            f"<td>{indent}{_e(shard.shard_id)}</td><td>{_badge(shard.status)}</td>"
            f"<td>{_e(shard.owner or '-')}</td>"
            f'<td class="num">{_age(shard.checkpoint_age_s, shard.observed_s)}</td>'
            f'<td class="num">{behind}</td><td class="num">{seconds}</td>'
            f"<td>{chart(shard.history, window_s)}</td><td>{_marks(shard)}</td>"
            f'<td class="reason">{_e(shard.reason)}</td></tr>')


def _application(view: AppView) -> str:
    parts = [f'<section class="application" id="app-{_e(view.name)}" '
             f'data-status="{_e(view.status)}">',
             f"<h2>{_e(view.name)} {_badge(view.status)}</h2>",
             f'<p>table {_e(view.table)}; streams {_e(", ".join(view.streams) or "-")}; '
             f"live workers {len(view.live_workers)} of {len(view.owners)} owners "
             f"({_e(', '.join(view.live_workers) or 'none')}); window {view.window_s:g}s, "
             f"{view.complete:.0%} observed</p>"]
    if view.error:
        parts.append(f'<p class="error">last sample failed: {_e(view.error)}</p>')
    if view.reasons:
        parts.append('<ul class="reasons">' + "".join(
            f"<li>{_e(reason)}</li>" for reason in view.reasons) + "</ul>")
    if view.unleased_shards:
        parts.append(f"<p>open shards without a lease: "
                     f"{_e(', '.join(view.unleased_shards))}</p>")
    for stream in view.streams:
        shards = [s for s in view.shards if s.stream == stream]
        parts.append(f"<h3>{_e(stream)}</h3><table><thead><tr><th>shard</th>"
                     "<th>status</th><th>owner</th><th>checkpoint age</th>"
                     "<th>records behind</th><th>behind</th><th>lag over the window</th>"
                     "<th></th><th>why</th></tr></thead><tbody>")
        parts += [_shard_row(depth, shard, view.window_s) for depth, shard in lineage(shards)]
        parts.append("</tbody></table>")
    parts.append("</section>")
    return "\n".join(parts)


def render(views: Sequence[AppView], refresh_s: float, now_ms: int) -> str:
    """The whole page."""
    generated = time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(now_ms / 1000))
    counts = {status: sum(1 for v in views if v.status == status) for status in
              ("ERR", "WARN", "OK")}
    summary = ", ".join(f"{n} {status}" for status, n in counts.items() if n) or "none yet"
    # the worst first: the page is read from the top when something is wrong
    ranked = sorted(views, key=lambda v: (_RANK.get(v.status, 3), v.name))
    body = "\n".join(_application(view) for view in ranked) or (
        "<p>No application evaluated yet: the first round is under way.</p>")
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta http-equiv="refresh" content="{max(1, round(refresh_s))}">'
            f"<title>kclpy monitor: {_e(summary)}</title><style>{_STYLE}</style></head>"
            f"<body><h1>kclpy monitor</h1><p>{len(views)} application(s): {_e(summary)}; "
            f"evaluated by {generated}; this page reloads every {refresh_s:g}s. "
            f'JSON: <a href="/v1/applications">/v1/applications</a>, metrics: '
            f'<a href="/metrics">/metrics</a>.</p>\n{body}\n</body></html>\n')
