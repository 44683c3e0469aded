"""report.html: one self-contained file (images inline) with a kernel x layout heatmap of the
worst ratio, and for each failing or near-failing row, error by token position with the segment
boundaries and the tolerance drawn, for the forward output and dq."""
from __future__ import annotations

import base64
import io
from pathlib import Path

import jinja2

from harness.judge import judging, tallies
from harness.judge import vocabulary as v
from harness.views.markdown import (
    none_bad,
    env_line,
    process_lines,
    run_line,
    timed_kernels,
)
from harness.views.summary import (
    coverage_lines,
    fmt,
    digest_lines,
    known_lines,
    refusal_lines,
    skipped_kernel_lines,
    not_judged_lines,
    outcome_text,
    padding_lines,
    power_rows,
    unfinished,
)

PLOTTED_CHECKS = tuple(c.name for c in v.TENSORS if c.traced)
MAX_PLOTS = 24

_TEMPLATE = jinja2.Template("""<!doctype html>
<html><head><meta charset="utf-8"><title>Attention harness report</title>
<style>
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; font-size: 13px; }
td, th { border: 1px solid #ccc; padding: 3px 6px; }
th { background: #f2f2f2; }
.bad { color: #b00; font-weight: bold; }
.caught { color: #06c; }
img { max-width: 100%; }
.plot { margin: 1em 0 2em 0; }
</style></head><body>
<h1>Attention harness report</h1>
{% if unfinished %}<p class="bad">{{ unfinished }}</p>
{% endif %}{% if deaths %}<p class="bad">{{ deaths }}</p>
{% endif %}<p>{{ run_line }} · {{ env_line }}</p>
<p>{{ counts }}</p>
<h2>Overview: worst error/tolerance ratio per kernel and layout</h2>
<img alt="heatmap" src="data:image/png;base64,{{ heatmap }}">
<h2>Problems ({{ bad|length }})</h2>
{% if nothing %}<p class="bad">Nothing was judged: no check measured anything (every kernel x case skipped, or none finished). This run is not a pass.</p>
{% elif not bad %}{% if not deaths %}<p{% if unfinished %} class="bad"{% endif %}>{{ none_bad }}</p>{% endif %}
{% else %}<table><tr><th>kernel</th><th>check</th><th>segment</th><th>tokens</th><th>max abs err</th>
<th>tolerance</th><th>ratio</th><th>worst token</th><th>case id</th></tr>
{% for r in bad %}<tr class="bad"><td>{{ r.kernel }}</td><td>{{ r.check }}</td>
<td>{{ r.where }} {{ r.outcome }}</td><td>{{ r.tokens }}</td><td>{{ r.err }}</td>
<td>{{ r.tol }}</td><td>{{ r.ratio }}</td><td>{{ r.worst_token }}</td><td><code>{{ r.case_id }}</code>
{% if r.message %}<br>{{ r.message }}{% endif %}</td></tr>
{% endfor %}</table>{% endif %}
{% if digest %}<h2>Failing checks, per kernel</h2><ul>{% for line in digest %}<li class="bad">{{ line }}</li>{% endfor %}</ul>{% endif %}
{% if refused %}<h2>Features refused before computing</h2><ul>{% for line in refused %}<li>{{ line }}</li>{% endfor %}</ul>{% endif %}
{% if idle %}<h2>Kernels that skipped every case</h2><ul>{% for line in idle %}<li>{{ line }}</li>{% endfor %}</ul>{% endif %}
{% if known %}<h2>Known upstream bugs</h2><ul>{% for line in known %}<li>{{ line }}</li>{% endfor %}</ul>{% endif %}
<h2>Not judged ({{ n_unjudged }} checks; {{ n_unprobed }} unprobed tensors)</h2>
{% if not_judged %}<ul>{% for line in not_judged %}<li>{{ line }}</li>{% endfor %}</ul>
{% else %}<p>Every check was judged.</p>{% endif %}
{% if coverage %}<p>Leak-probe coverage below 100%:</p><ul>{% for line in coverage %}<li>{{ line }}</li>{% endfor %}</ul>{% endif %}
{% if power %}<h2>Leak probe: power and false alarms</h2><table><tr><th>kernel</th><th>smallest detectable leak (fraction of scale)</th><th>false-alarm probability (run)</th></tr>
{% for k, d, p in power %}<tr><td>{{ k }}</td><td>{{ d }}</td><td>{{ p }}</td></tr>{% endfor %}</table>{% endif %}
{% if padding %}<h2>Padding hygiene</h2><ul>{% for line in padding %}<li>{{ line }}</li>{% endfor %}</ul>{% endif %}
{% if timing or left_out %}<h2>Where the time went</h2>{% endif %}
{% if timing %}<table><tr><th>kernel</th><th>wall s</th><th>programs</th><th>lower s</th>
<th>compile s</th><th>waited s</th><th>runs</th><th>execute s</th><th>of which probe build s</th><th>host s</th></tr>
{% for k, t in timing %}<tr><td>{{ k }}</td><td>{{ "%.1f"|format(t.wall_s or 0) }}</td><td>{{ t.programs }}</td><td>{{ "%.1f"|format(t.lower_s) }}</td>
<td>{{ "%.1f"|format(t.compile_s) }}</td><td>{{ "%.1f"|format(t.wait_s or 0) }}</td><td>{{ t.runs }}</td><td>{{ "%.1f"|format(t.execute_s) }}</td><td>{{ "%.1f"|format(t.probe_execute_s or 0) }}</td><td>{{ "%.1f"|format(t.host_s or 0) }}</td></tr>
{% endfor %}</table>{% endif %}
{% if left_out %}<p>{{ left_out }}</p>{% endif %}
{% for line in processes %}<p>{{ line }}</p>{% endfor %}
<h2>Error by token position (failing and near-failing rows)</h2>
<p>Grey lines: segment boundaries. Dashed: each segment's tolerance. Red points: tokens over it.
{% if dropped %} {{ dropped }} more rows not plotted.{% endif %}</p>
{% for p in plots %}<div class="plot"><h3 class="{{ p.css }}">{{ p.title }}</h3>
<img alt="{{ p.title }}" src="data:image/png;base64,{{ p.png }}"></div>
{% endfor %}
</body></html>
""")


def _figure(margins: dict | None = None, **kwargs):
    """A figure of matplotlib's object API: no pyplot, no global state, nothing to close; laid
    out once when drawn (constrained), not drawn twice to find a tight box; or, with `margins`
    (subplots_adjust's, for a figure whose labels are always alike), not laid out at all:
    constrained layout was a third of a trace plot's drawing."""
    from matplotlib.figure import Figure
    fig = Figure(layout=None if margins else "constrained", **kwargs)
    if margins:
        fig.subplots_adjust(**margins)
    return fig, fig.subplots()


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    return base64.b64encode(buf.getvalue()).decode()


def _plain_log_ticks(axis) -> None:
    """Log-axis labels as plain text (1e-03): matplotlib's default typesets each as math, which
    took most of a report's drawing time."""
    from matplotlib.ticker import FuncFormatter, NullFormatter
    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:.0e}"))
    axis.set_minor_formatter(NullFormatter())


def _heatmap(records) -> str:
    import numpy as np

    kernels, layouts, cells = tallies.grid(records)
    if not kernels or not layouts:
        # Nothing finished (an empty shard, a run stopped before its first pair): no picture,
        # rather than an empty one (matplotlib warns on a zero-size image).
        fig, ax = _figure(figsize=(4, 1))
        ax.axis("off")
        ax.text(0.5, 0.5, "no kernel x layout cell to show", ha="center", va="center")
        return _png(fig)
    values = np.full((len(kernels), len(layouts)), np.nan)
    for i, k in enumerate(kernels):
        for j, lay in enumerate(layouts):
            cell = cells.get((k, lay))
            if cell is not None and cell.heat is not None:
                values[i, j] = cell.heat
    fig, ax = _figure(figsize=(1.3 * len(layouts) + 3, 0.5 * len(kernels) + 1.8))
    im = ax.imshow(values, cmap="RdYlGn_r", vmin=-2, vmax=2, aspect="auto")
    ax.set_xticks(range(len(layouts)), layouts, rotation=35, ha="right")
    ax.set_yticks(range(len(kernels)), kernels)
    for i, k in enumerate(kernels):
        for j, lay in enumerate(layouts):
            cell = cells.get((k, lay))
            if cell is None:
                continue
            ratio = fmt(cell.worst_ratio, 2) if cell.has_ratio else "—"
            label = cell.status if not cell.measured else f"{ratio}\n{cell.status}"
            ax.text(j, i, label, ha="center", va="center", fontsize=7)
    fig.colorbar(im, ax=ax, label="log10(worst ratio); > 0 fails")
    return _png(fig)


# A trace plot's margins (fractions of its 10 x 2.8 inch figure): room for the y label and its
# 1e-03 ticks, the x label, and the segment names above the axes.
TRACE_MARGINS = {"left": 0.085, "right": 0.99, "bottom": 0.17, "top": 0.9}


def _trace_plot(trace) -> str:
    import numpy as np

    err = np.array([np.inf if x is None else x for x in trace.token_err], float)
    fig, ax = _figure(TRACE_MARGINS, figsize=(10, 2.8))
    pos = np.arange(err.size)
    compared = np.zeros(err.size, bool)
    for seg in trace.segments:
        compared[seg["start"]:seg["start"] + seg["length"]] = True
    finite = np.isfinite(err) & compared  # padding is never compared: not drawn
    ax.plot(pos[finite], np.maximum(err[finite], 1e-8), lw=0.8, color="#333")
    last = 0
    for seg in trace.segments:
        start, stop = seg["start"], seg["start"] + seg["length"]
        tol = trace.tolerance[str(seg["number"])]
        # None: the reference left no tolerance there (judging.no_tolerance): nothing to draw.
        over = [] if tol is None else [
            p for p in range(start, stop) if not judging.within(float(err[p]), tol)]
        if tol is not None:
            ax.hlines(tol, start, stop - 0.01, colors="#c60", linestyles="dashed", lw=1)
        ax.scatter(over, np.maximum(np.where(np.isfinite(err[over]), err[over], 1e3), 1e-8),
                   s=4, color="red", zorder=3)
        ax.axvline(start, color="#999", lw=0.6)
        ax.text(start + 0.5, 1.02, f"s{seg['number']}", transform=ax.get_xaxis_transform(),
                fontsize=7, color="#555")
        last = stop
    if last < err.size:
        ax.axvspan(last, err.size, color="#eee", label="padding (not compared)")
    ax.set_yscale("log")
    _plain_log_ticks(ax.yaxis)
    ax.set_xlim(0, err.size)
    ax.set_xlabel("token position in row")
    ax.set_ylabel("max |err| over heads")
    return _png(fig)


def _problem_rows(records) -> list[dict]:
    rows = []
    for r in tallies.bad(records):
        ratio = v.has_ratio(r.check)
        rows.append({"kernel": r.kernel, "check": r.check, "where": r.where,
                     "outcome": r.outcome, "tokens": r.tokens, "err": fmt(r.max_abs_err),
                     "tol": fmt(r.tolerance) if ratio else v.rule(r.check),
                     "ratio": fmt(r.ratio) if ratio else "—", "worst_token": r.worst_token,
                     "case_id": r.case_id, "message": r.message[:300]})
    return rows


# Plots of unexpected failures first, then catches, then near misses.
_PLOT_ORDER = {v.FAIL: 0, v.MISSED: 0, v.CAUGHT: 1}
_PLOT_CSS = {v.FAIL: "bad", v.MISSED: "bad", v.CAUGHT: "caught"}


def _plots(records, traces) -> tuple[list[dict], int]:
    outcome = tallies.row_outcomes(records)
    wanted = [t for t in traces if t.check in PLOTTED_CHECKS]
    key = lambda t: (t.kernel, t.case_id, t.check, t.row)
    wanted.sort(key=lambda t: _PLOT_ORDER.get(outcome.get(key(t)), 2))
    plots = []
    for t in wanted[:MAX_PLOTS]:
        state = outcome.get(key(t))
        state = state if state in _PLOT_ORDER else (
            "near-failing" if state in (v.OK, None) else state)
        plots.append({"title": f"{t.kernel} · {t.check} · row {t.row} · {t.case_id} · {state}",
                      "css": _PLOT_CSS.get(state, ""), "png": _trace_plot(t)})
    return plots, max(0, len(wanted) - MAX_PLOTS)


def write_html(path: Path, header: dict, records: list, traces: list) -> None:
    plots, dropped = _plots(records, traces)
    timing, left_out = timed_kernels(header)
    path.write_text(_TEMPLATE.render(
        header=header, env_line=env_line(header.get("environment", {})),
        run_line=run_line(header, marked=False), unfinished=unfinished(header),
        deaths=(tallies.unblamed_text(d) if (d := tallies.unblamed(header)) else None),
        none_bad=none_bad(records, header),
        counts=outcome_text(records), heatmap=_heatmap(records), bad=_problem_rows(records),
        nothing=tallies.judged_nothing(records, header), plots=plots, dropped=dropped,
        not_judged=not_judged_lines(records), known=known_lines(records),
        digest=digest_lines(records), refused=refusal_lines(records),
        idle=skipped_kernel_lines(records),
        coverage=coverage_lines(records), power=power_rows(records),
        padding=padding_lines(records),
        n_unjudged=tallies.counts(records).get(v.UNJUDGED, 0),
        n_unprobed=sum(tallies.unprobed(records).values()), timing=timing, left_out=left_out,
        processes=[line for line in process_lines(header) if line]))
