"""report.html: one self-contained page (no script, no network) of a results package: the verdict
and the gate decisions at the top, the clause x backend grid coloured by status, and each cell
linking to its evidence (the cases that ran, the seeded defects caught, CPU-oracle NMSE figures,
measurements)."""

from __future__ import annotations

import math
from html import escape

from . import registry
from .outcomes import CERTIFIED, SELECTION_PASSED, verdict_text

#: how the matrix marks a clause whose checks prove the harness alone (registry.Clause.backend_independent)
INDEPENDENT = "backend-independent"

#: a status's class and colour (the grid's legend, and what the browser test looks for)
COLOURS = {
    "pass": "#2e9d4f",
    "fail": "#d62c2c",
    "crash": "#7b1fa2",
    "not covered": "#e0a800",
    "not supported": "#4a7bd0",
    "expected failure": "#f07c1f",
    "not available": "#9e9e9e",
    "not selected": "#f2f2f2",
}


def scope_note(clause: str, status: str) -> str:
    """What the matrix adds to a clause's status: the pass of a backend-independent clause (its
    checks prove the harness's own code) says so, and certifies nothing of the backend that ran it."""
    return f" ({INDEPENDENT})" if status == "pass" and registry.clauses()[clause].backend_independent else ""


def css_class(status: str) -> str:
    return "s-" + status.replace(" ", "-")


def anchor(clause: str, backend: str) -> str:
    return f"ev-{clause}-{backend}"


_STYLE = (
    "body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}"
    "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}"
    "td.cell{min-width:7em;text-align:center}td.cell a{color:inherit;text-decoration:none;display:block}"
    ".legend span{display:inline-block;padding:2px 8px;margin:2px;border-radius:3px}"
    ".verdict{font-size:1.2em;font-weight:bold}.evidence{margin:0 0 1em 0}"
    "pre{white-space:pre-wrap;background:#f6f6f6;padding:4px}"
    + "".join(
        f".{css_class(s)}{{background:{c};color:{'#000' if s in ('not covered', 'not selected') else '#fff'}}}"
        for s, c in COLOURS.items()
    )
)


def not_passing(results: dict) -> list[tuple[str, str, str, str, list[str]]]:
    """What a reader of a report came for, first: each clause x backend that was judged and did not
    pass, as (clause, backend, status, reason, each failing intact check with its assertion)."""
    out = []
    for cid, row in results["clauses"].items():
        for name, status in row.items():
            if status in ("pass", "not selected", "not available"):
                continue
            checks = [
                f"{c['id']}: {(c['message'].strip().splitlines() or [''])[0][:300]}"
                for c in results["cases"]
                if c["backend"] == name
                and c["defect"] is None
                and cid in c["clauses"]
                and c["outcome"] in ("fail", "crash")
            ]
            out.append((cid, name, status, results["clause_details"][cid][name], checks))
    return out


def run_facts(results: dict) -> list[tuple[str, str]]:
    """The run as (fact, value): the build (pin, series, configuration), the machine, the devices."""
    run = results["run"]
    keys = ("start_time", "retro", "llama_cpp", "patch_series_sha256", "python", "platform", "seed", "selection")
    facts = [(k.replace("_", " "), str(run[k])) for k in keys if k in run]
    # a merged package's run is the summary: each shard's machine and build configuration (shards
    # of one build may differ in it: a Vulkan build beside a CPU one)
    merged = bool(run.get("merged"))
    for i, shard in enumerate(results.get("shards", []) if merged else [run], start=1):
        where = f"shard {i} " if merged else ""
        if merged:
            facts += [(f"{where}{k}", str(shard[k])) for k in ("python", "platform", "selection") if k in shard]
        if shard.get("build_config"):
            facts.append((f"{where}build", ", ".join(f"{k}={v}" for k, v in shard["build_config"].items())))
        if shard.get("numerics"):
            facts.append((f"{where}numerics", ", ".join(f"{k} {v}" for k, v in shard["numerics"].items())))
        if shard.get("warm_up_s"):
            facts.append((f"{where}warm-up", ", ".join(f"{k} {v:g} s" for k, v in shard["warm_up_s"].items())))
    for name, b in results["backends"].items():
        devices = [d.get("description") or d.get("name") for d in b.get("devices", [])] or [b.get("device")]
        if any(devices):
            facts.append((f"{name} devices", "; ".join(d for d in devices if d)))
    return facts


def _not_passing(results: dict) -> str:
    items = "".join(
        f'<li><a href="#{anchor(cid, name)}">{cid} on {escape(name)}</a>: '
        f'<span class="{css_class(status)}">&nbsp;{escape(status)}&nbsp;</span> {escape(reason)}'
        + "".join(f"<div><code>{escape(check)}</code></div>" for check in checks)
        + "</li>"
        for cid, name, status, reason, checks in not_passing(results)
    )
    return f'<h2>Not passing</h2><ul id="not-passing">{items}</ul>' if items else ""


def _run_facts(results: dict) -> str:
    run = results["run"]
    rows = "".join(f"<tr><th>{escape(k)}</th><td>{escape(v)}</td></tr>" for k, v in run_facts(results))
    if run.get("partial"):
        rows += f"<tr><th>partial</th><td>{escape(run['partial'])}</td></tr>"
    if run.get("merged"):
        rows += f"<tr><th>merged</th><td>{run['shards']} shard(s)</td></tr>"
    return f"<table>{rows}</table>"


def _verdicts(results: dict) -> str:
    rows = []
    for name, b in results["backends"].items():
        verdict = results["verdict"][name]
        # a selection that passed is not painted as a certification: the colour of "not selected"
        shade = {CERTIFIED: "pass", SELECTION_PASSED: "not selected", "not available": "not available"}
        cls = css_class(shade.get(verdict, "fail"))
        reason = f" ({escape(b.get('reason', ''))})" if b["status"] != "available" else ""
        rows.append(
            f'<tr><th>{escape(name)}</th><td class="verdict {cls}" data-verdict="{escape(verdict)}">'
            f"{escape(verdict)}</td><td>{escape(verdict_text(results, name))}{reason}</td></tr>"
        )
    return f'<table id="verdicts">{"".join(rows)}</table>'


def _gates(results: dict) -> str:
    parts = []
    for g in results.get("gates", {}).values():
        cls = css_class("pass" if g["decision"] == "enable" else "fail")
        missing = "".join(f"<li>{escape(m)}</li>" for m in g["missing"][:50])
        more = f"<li>... {len(g['missing']) - 50} more</li>" if len(g["missing"]) > 50 else ""
        evidence = "".join(f"<li>{escape(e)}</li>" for e in g["evidence"])
        parts.append(
            f'<div class="gate" data-gate="{escape(g["gate"])}"><p>Gate <b>{escape(g["gate"])}</b>: '
            f'<span class="{cls}" data-decision="{escape(g["decision"])}">&nbsp;{escape(g["decision"])}&nbsp;</span>'
            f" on {escape(', '.join(g['targets']))}</p>"
            + (
                f"<details><summary>missing ({len(g['missing'])})</summary><ul>{missing}{more}</ul></details>"
                if missing
                else ""
            )
            + (
                f"<details><summary>evidence ({len(g['evidence'])})</summary><ul>{evidence}</ul></details>"
                if evidence
                else ""
            )
            + "</div>"
        )
    return "".join(parts)


def _grid(results: dict) -> str:
    names = list(results["backends"])
    head = "<tr><th>clause</th>" + "".join(f"<th>{escape(n)}</th>" for n in names) + "</tr>"
    rows = []
    for cid, row in results["clauses"].items():
        cells = "".join(
            f'<td class="cell {css_class(row[n])}" data-clause="{cid}" data-backend="{escape(n)}" '
            f'data-status="{escape(row[n])}"><a href="#{anchor(cid, n)}">{escape(row[n] + scope_note(cid, row[n]))}</a></td>'
            for n in names
        )
        rows.append(f"<tr><th>{cid}</th>{cells}</tr>")
    legend = "".join(f'<span class="{css_class(s)}">{escape(s)}</span>' for s in COLOURS)
    return f'<p class="legend">{legend}</p><table id="grid">{head}{"".join(rows)}</table>'


BOUND_COLUMNS = ("bound", "limit", "largest intact error", "weakest seeded defect over it", "why so wide")


def bound_rows(results: dict) -> list[tuple[str, ...]]:
    """The bound table (results.bound_table) as text, one row per bound, per backend in each cell;
    each limit's reason once for the backends it applies to; a limit more than evidence.WIDE times
    the intact error with no reason of its own says so."""

    def per_backend(figures: dict[str, float]) -> str:
        return "; ".join(f"{n} {v:.3g}" for n, v in figures.items()) or "-"

    rows: list[tuple[str, ...]] = []
    for b in results.get("bounds", []):
        weakest = min(b["defects"].items(), key=lambda kv: kv[1]) if b["defects"] else None
        by_reason: dict[str, list[str]] = {}
        for name, reason in b["reason"].items():
            by_reason.setdefault(reason, []).append(name)
        why = [f"{', '.join(names)}: {reason}" for reason, names in by_reason.items()]
        if b["unexplained"]:
            why.append(f"NONE, yet wide on {', '.join(b['unexplained'])}")
        rows.append(
            (
                b["bound"],
                per_backend(b["limit"]),
                per_backend(b["intact"]),
                f"{weakest[0]} {weakest[1]:.3g}" if weakest else "-",
                "; ".join(why) or "-",
            )
        )
    return rows


#: the log axis every bound is drawn on: decades from LOG_AXIS[0] to LOG_AXIS[1] (0 sits at the left
#: edge, an error past the right edge at it), STRIP pixels wide
LOG_AXIS, STRIP = (-14, 4), 360
#: the colour of each backend's marks on the axis, in the order the bound table lists them
BACKEND_COLOURS = ("#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf")


def _x(value: float) -> float:
    lo, hi = LOG_AXIS
    decade = lo if value <= 0 else min(max(math.log10(value), lo), hi)
    return round((decade - lo) / (hi - lo) * STRIP, 1)


def bound_strip(bound: dict, colours: dict[str, str]) -> str:
    """One bound on the log axis, as inline SVG: each backend's limit (a bar) and largest intact
    error (a dot) in its colour, and the weakest seeded defect that crossed it (a red cross), so
    a loose limit (a bar far right of its dot) or a thin margin (a cross just right of a bar) is
    seen at a glance."""
    marks = [f'<line x1="0" y1="11" x2="{STRIP}" y2="11" stroke="#bbb"/>']
    for d in range(LOG_AXIS[0], LOG_AXIS[1] + 1, 2):
        marks.append(f'<line x1="{_x(10.0**d)}" y1="8" x2="{_x(10.0**d)}" y2="14" stroke="#bbb"/>')
    for name, limit in bound["limit"].items():
        x, c = _x(limit), colours.get(name, "#000")
        marks.append(
            f'<rect x="{x - 1}" y="2" width="3" height="18" fill="{c}"><title>{escape(name)} limit {limit:g}</title></rect>'
        )
    for name, error in bound["intact"].items():
        c = colours.get(name, "#000")
        marks.append(
            f'<circle cx="{_x(error)}" cy="11" r="4" fill="{c}"><title>{escape(name)} intact {error:.3g}</title></circle>'
        )
    if bound["defects"]:
        defect, error = min(bound["defects"].items(), key=lambda kv: kv[1])
        x = _x(error)
        marks.append(
            f'<path d="M{x - 4},7 L{x + 4},15 M{x - 4},15 L{x + 4},7" stroke="#d62c2c" stroke-width="2">'
            f"<title>{escape(defect)} {error:.3g}</title></path>"
        )
    return f'<svg class="strip" width="{STRIP}" height="22" role="img">{"".join(marks)}</svg>'


def _bounds(results: dict) -> str:
    bounds = results.get("bounds", [])
    names = list(dict.fromkeys(n for b in bounds for n in b["limit"]))
    colours = {n: BACKEND_COLOURS[i % len(BACKEND_COLOURS)] for i, n in enumerate(names)}
    lo, hi = LOG_AXIS
    key = " ".join(f'<span style="color:{c}">&#9679; {escape(n)}</span>' for n, c in colours.items())
    legend = (
        f"<p>Each bound on one logarithmic axis, 1e{lo} (and 0) to 1e{hi}, a tick every two decades: "
        f"the limit on each backend (bar) and its largest intact error (dot), {key}; the weakest "
        'seeded defect over it: <span style="color:#d62c2c">&#10005;</span>.</p>'
    )
    head = "<tr>" + "".join(f"<th>{c}</th>" for c in (*BOUND_COLUMNS, "on one log axis")) + "</tr>"
    body = "".join(
        "<tr>" + "".join(f"<td>{escape(v)}</td>" for v in row) + f"<td>{bound_strip(b, colours)}</td></tr>"
        for row, b in zip(bound_rows(results), bounds)
    )
    return f'{legend}<table id="bounds">{head}{body}</table>' if body else "<p>No check held an error to a bound.</p>"


def _case_line(c: dict) -> str:
    label = escape(c["id"]) + (f" [defect {escape(c['defect'])}]" if c["defect"] else "")
    extra = []
    if c.get("caught"):
        extra.append(f"caught by {escape(c['caught']['clause'])}: {escape(c['caught']['assertion'][:300])}")
    for o in c.get("bounds", []):
        extra.append(f"{escape(o['bound'])}: {escape(o['observation'])}: {o['error']:.3g} (limit {o['limit']:g})")
    for m in c.get("measurements", []):
        extra.append("measurement: " + escape(", ".join(f"{k}={v}" for k, v in m.items())))
    message = (
        f"<pre>{escape(c['message'].strip()[:2000])}</pre>" if c["message"].strip() and c["outcome"] != "caught" else ""
    )
    notes = "".join(f"<div>{e}</div>" for e in extra)
    return f'<li><span class="{css_class(_case_status(c["outcome"]))}">&nbsp;{escape(c["outcome"])}&nbsp;</span> {label} ({c["duration_s"]:.2f} s){notes}{message}</li>'


def _case_status(outcome: str) -> str:
    return {"caught": "pass", "survived": "fail"}.get(outcome, outcome)


def _evidence(results: dict) -> str:
    by_cell: dict[tuple[str, str], list[dict]] = {}
    for c in results["cases"]:
        for cid in c["clauses"]:
            by_cell.setdefault((cid, c["backend"]), []).append(c)
    parts = []
    for cid, row in results["clauses"].items():
        for name in results["backends"]:
            cases = by_cell.get((cid, name), [])
            items = "".join(_case_line(c) for c in cases) or "<li>no case ran</li>"
            parts.append(
                f'<div class="evidence" id="{anchor(cid, name)}"><h3>{cid} on {escape(name)}: '
                f'<span class="{css_class(row[name])}">&nbsp;{escape(row[name])}&nbsp;</span></h3>'
                f"<p>{escape(results['clause_details'][cid][name])}</p><ul>{items}</ul></div>"
            )
    return "".join(parts)


def report_html(results: dict) -> str:
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        "<title>retro conformance report</title>"
        f"<style>{_STYLE}</style></head><body>"
        "<h1>retro conformance report</h1>"
        f"<h2>Verdict</h2>{_verdicts(results)}{_gates(results)}{_not_passing(results)}"
        f"<h2>Run</h2>{_run_facts(results)}"
        f"<h2>Clauses</h2>{_grid(results)}"
        f"<h2>Bounds</h2>{_bounds(results)}"
        f"<h2>Evidence</h2>{_evidence(results)}"
        f"<p>digest <code>{escape(results['digest'])}</code></p>"
        "</body></html>\n"
    )
