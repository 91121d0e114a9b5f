"""report.md of a results package."""

from __future__ import annotations

from . import html
from .outcomes import verdict_text

_MARK = {
    "not selected": "-",
    "pass": "pass",
    "fail": "**FAIL**",
    "crash": "**CRASH**",
    "not covered": "not covered",
    "not available": "n/a",
    "not supported": "not supported",
    "expected failure": "expected failure",
}


def report(results: dict) -> str:
    """report.md: the run, the verdict, what is not passing, the clause matrix, the gates, the
    failures with their messages, and the count of cases."""
    names = list(results["backends"])
    run = results["run"]
    lines = ["# retro conformance report", ""]
    lines += [f"- {fact}: `{value}`" for fact, value in html.run_facts(results)]
    if "partial" in run:
        lines.append(f"- partial: `{run['partial']}`")
    if run.get("merged"):
        lines.append(f"- merged from {run['shards']} shard(s)")
    lines += ["", "## Verdict", "", "| backend | status | verdict | clauses |", "|---|---|---|---|"]
    for n in names:
        b = results["backends"][n]
        status = b["status"] + (f" ({b.get('reason')})" if b["status"] != "available" and b.get("reason") else "")
        lines.append(f"| {n} | {status} | **{results['verdict'][n]}** | {verdict_text(results, n)} |")
    failing = html.not_passing(results)
    if failing:  # what a reader came for, before the matrix
        lines += ["", "## Not passing", ""]
        for cid, name, status, reason, checks in failing:
            lines.append(f"- **{cid}** on {name}: {status}: {(reason.strip().splitlines() or [''])[0]}")
            lines += [f"  - `` {check} ``" for check in checks]
    lines += [
        "",
        "## Clauses",
        "",
        "| clause | " + " | ".join(names) + " | evidence |",
        "|---|" + "---|" * len(names) + "---|",
    ]
    for cid, row in results["clauses"].items():
        why = "; ".join(
            dict.fromkeys(
                results["clause_details"][cid][n] for n in names if row[n] not in ("not selected", "not available")
            )
        )
        marks = [_MARK[row[n]] + html.scope_note(cid, row[n]) for n in names]
        lines.append(f"| {cid} | " + " | ".join(marks) + f" | {why} |")
    rows = html.bound_rows(results)
    if rows:  # each limit beside what the intact runs measured and the weakest defect it caught
        lines += [
            "",
            "## Bounds",
            "",
            "| " + " | ".join(html.BOUND_COLUMNS) + " |",
            "|---" * len(html.BOUND_COLUMNS) + "|",
        ]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
    for decision in results.get("gates", {}).values():
        lines += [
            "",
            f"## Gate: {decision['gate']}",
            "",
            f"**{decision['decision']}** on {', '.join(decision['targets'])}.",
        ]
        if decision["missing"]:
            lines += ["", "Missing:", "", *[f"- {m}" for m in decision["missing"]]]
        if decision["evidence"]:
            lines += ["", "Evidence:", "", *[f"- {e}" for e in decision["evidence"]]]
    bad = [c for c in results["cases"] if c["outcome"] in ("fail", "crash")]
    if bad:
        lines += ["", "## Failures", ""]
        for c in bad:
            label = c["id"] + (f" [defect {c['defect']}]" if c["defect"] else "")
            lines += [
                f"### {c['backend']}: {label} ({c['outcome']})",
                "",
                "Clauses: " + ", ".join(c["clauses"]),
                "",
                "```",
                c["message"].strip() or "(no message)",
                "```",
                "",
            ]
    counts: dict[str, int] = {}
    for c in results["cases"]:
        counts[c["outcome"]] = counts.get(c["outcome"], 0) + 1
    lines += [
        "",
        "## Cases",
        "",
        ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "none ran",
        "",
        f"digest `{results['digest']}`",
        "",
    ]
    return "\n".join(lines)
