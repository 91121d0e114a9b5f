"""junit.xml of a results package: what a CI dashboard reads must say what the verdict says."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

from . import registry
from .outcomes import verdict_text

#: a case run's JUnit element, for an intact run of a check: a failure or a crash there fails its
#: clause, so a certified run shows none. A seeded-defect run is never a failure or an error: whether
#: its defect was caught somewhere is the clause's verdict (<backend>.clauses); the run itself is a
#: plain test case carrying its result code (a property and a line of system-out).
JUNIT_CASE = {
    "pass": None,
    "fail": "failure",
    "crash": "error",
    "not supported": "skipped",
    "not available": "skipped",
    "expected failure": "skipped",
}
#: a clause's JUnit element: red whenever the clause keeps its backend from being certified ("not
#: supported", "expected failure" and a clause no check covers included, each with its reason);
#: skipped only where nothing was asked of the backend: outside the run's selection, or absent
JUNIT_CLAUSE = {
    "pass": None,
    "fail": "failure",
    "crash": "error",
    "not covered": "failure",
    "not supported": "failure",
    "expected failure": "failure",
    "not available": "skipped",
    "not selected": "skipped",
}


def case_element(outcome: str, defect: str | None) -> str | None:
    if defect is not None:
        if outcome == "survived" and registry.seeded("HARNESS-06"):  # seeded defect: a survival reads as a failure
            return "failure"
        return None
    return JUNIT_CASE[outcome]


def _suite(
    root: ET.Element, name: str, rows: list[tuple[str, str, float, str, str, str | None]], props: dict[str, str]
) -> None:
    """One testsuite: rows of (classname, name, seconds, result code, message, element). A row with
    no element carries its result code as a property, and its message as system-out."""
    kinds = [r[5] for r in rows]
    suite = ET.SubElement(
        root,
        "testsuite",
        name=name,
        tests=str(len(rows)),
        failures=str(kinds.count("failure")),
        errors=str(kinds.count("error")),
        skipped=str(kinds.count("skipped")),
    )
    p = ET.SubElement(suite, "properties")
    for k, v in props.items():
        ET.SubElement(p, "property", name=k, value=v)
    for classname, label, seconds, code, message, element in rows:
        tc = ET.SubElement(suite, "testcase", classname=classname, name=label, time=f"{seconds:.6f}")
        if element == "skipped":
            ET.SubElement(tc, "skipped", message=f"{code}: {message[:500]}")
        elif element is not None:
            ET.SubElement(tc, element, message=f"{code}: {message[:500]}").text = message
        else:
            ET.SubElement(ET.SubElement(tc, "properties"), "property", name="result", value=code)
            if message:
                ET.SubElement(tc, "system-out").text = f"{code}: {message}"


#: the name of the test case that carries a backend's verdict in <backend>.clauses
VERDICT_CASE = "verdict"
#: its element: red whenever the backend is not certified, even where every clause run passed (a
#: run that left checks out: -k, --exitfirst); skipped for a selection and an absent backend
JUNIT_VERDICT = {
    "certified": None,
    "not certified": "failure",
    "selection passed": "skipped",
    "not available": "skipped",
}


def _verdict_row(results: dict, name: str) -> tuple[str, str, float, str, str, str | None]:
    verdict = results["verdict"][name]
    reason = verdict_text(results, name)
    if results["run"].get("partial"):
        reason += f"; the run left checks out ({results['run']['partial']})"
    return (f"{name}.clauses", VERDICT_CASE, 0.0, verdict, reason, JUNIT_VERDICT[verdict])


def write(results: dict, path: Path) -> None:
    """Per backend, two suites: `<backend>.clauses`, one test case per clause (the verdict's unit: a
    clause that does not pass is a failure, with the reason, or an error for a crash) and one for
    the verdict itself (red unless certified; skipped for a selection or an absent backend), and
    `<backend>`, one per case run (each intact check and each seeded-defect run; only an intact
    run's failure or crash is one there, and each such fails its clause too). A certified backend
    shows no failure and no error in either suite."""
    root = ET.Element("testsuites", name="retro-conformance")
    for name, b in results["backends"].items():
        # a dashboard's summary of the suite: the verdict and what it rests on (a selection says it
        # is not a certification)
        props = {"status": b["status"], "verdict": results["verdict"][name], "clauses": verdict_text(results, name)}
        if b["status"] != "available":
            props["reason"] = b.get("reason", "")
        clause_rows = []
        for cid, row in results["clauses"].items():
            reason = results["clause_details"][cid][name]
            element = JUNIT_CLAUSE[row[name]]
            if element in ("failure", "error"):
                # what a person needs from the dashboard: each failing check and its assertion
                reason += "".join(
                    f"\n{c['id']}: {c['message']}"
                    for c in results["cases"]
                    if c["backend"] == name and c["defect"] is None and cid in c["clauses"]
                    if c["outcome"] in ("fail", "crash")
                )
            clause_rows.append((f"{name}.clauses", cid, 0.0, row[name], reason, element))
        clause_rows.append(_verdict_row(results, name))
        _suite(root, f"{name}.clauses", clause_rows, props)
        case_rows = []
        for c in (c for c in results["cases"] if c["backend"] == name):
            label = c["id"] + (f"[defect-{c['defect']}]" if c["defect"] else "")
            message = f"{' '.join(c['clauses'])}: {c['message']}"
            case_rows.append(
                (
                    f"{name}.{c['id'].split('::')[0]}",
                    label,
                    c["duration_s"],
                    c["outcome"],
                    message,
                    case_element(c["outcome"], c["defect"]),
                )
            )
        _suite(root, name, case_rows, props)
    ET.indent(root)
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)
