"""What changed between two results packages (two releases, two pull requests, two machines):
the builds, each clause's status and each case's result code per backend (regressions first),
bounded errors that moved (against the CPU oracle, numpy), and timings that changed beyond
noise. The headline is the verdict per clause and backend: a seeded-defect run whose result changed is listed apart and is never a
regression by itself (a defect is written for one path; whether it escaped every check is its
clause's status, which is compared). `retro-conformance diff`
prints it and exits 1 on a regression, so that CI can gate on it; `--markdown` writes the same
as a section for a pull request."""

from __future__ import annotations

from dataclasses import dataclass, field

from . import results

#: a clause or case that read one of these before and reads anything else now has regressed
GOOD_CLAUSE = ("pass",)
GOOD_CASE = ("pass", "caught", "not available")
#: no longer compared: the new package did not run it there (selection, absent backend)
NOT_COMPARED = ("not selected", "not available")
#: a case's duration changed beyond noise when it moved by both this factor and this many seconds
TIMING_FACTOR, TIMING_FLOOR_S = 1.5, 0.5
#: a bounded error moved when it changed by more than this share of its limit
BOUND_SHARE = 0.1


@dataclass
class Change:
    where: str  # "BASE-02 on cpu", "cpu: test_base.py::test_x [defect BASE-02]"
    old: str
    new: str
    detail: str = ""

    def line(self) -> str:
        return f"{self.where}: {self.old} -> {self.new}" + (f" ({self.detail})" if self.detail else "")


@dataclass
class Diff:
    builds: list[str] = field(default_factory=list)
    verdicts: list[Change] = field(default_factory=list)
    regressions: list[Change] = field(default_factory=list)  # clauses, then cases
    improvements: list[Change] = field(default_factory=list)
    other: list[Change] = field(default_factory=list)
    clauses: list[Change] = field(default_factory=list)  # every clause whose status changed, as compared
    defect_runs: list[Change] = field(default_factory=list)  # seeded-defect runs whose result changed
    not_compared: list[Change] = field(default_factory=list)
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    bounded: list[Change] = field(default_factory=list)
    timings: list[Change] = field(default_factory=list)

    @property
    def regressed(self) -> bool:
        return bool(self.regressions)


def _build(res: dict) -> dict:
    run = res["shards"][0] if res["shards"] else res["run"]
    return {
        "retro": res["run"].get("retro") or run.get("retro"),
        "llama.cpp": res["run"].get("llama_cpp") or run.get("llama_cpp"),
        "patch series": res["run"].get("patch_series_sha256") or run.get("patch_series_sha256"),
        "patches": run.get("patches") or [],
    }


def _case_label(c: dict) -> str:
    return f"{c['backend']}: {c['id']}" + (f" [defect {c['defect']}]" if c["defect"] else "")


def compare(old: dict, new: dict) -> Diff:
    results.verify(old)
    results.verify(new)
    d = Diff()
    a, b = _build(old), _build(new)
    for key in ("retro", "llama.cpp", "patch series"):
        if a[key] != b[key]:
            d.builds.append(f"{key}: {a[key]} -> {b[key]}")
    gone, came = sorted(set(a["patches"]) - set(b["patches"])), sorted(set(b["patches"]) - set(a["patches"]))
    if gone or came:
        d.builds.append(f"patches: removed {gone or 'none'}, added {came or 'none'}")

    for name in sorted(set(old["verdict"]) | set(new["verdict"])):
        was, now = old["verdict"].get(name, "absent"), new["verdict"].get(name, "absent")
        if was != now:
            d.verdicts.append(Change(name, was, now))

    # a clause the new registry no longer has reads "absent" there: not compared, but listed
    for cid in dict.fromkeys([*new["clauses"], *old["clauses"]]):
        for name in sorted(set(old["clauses"].get(cid, {})) | set(new["clauses"].get(cid, {}))):
            was = old["clauses"].get(cid, {}).get(name, "absent")
            now = new["clauses"].get(cid, {}).get(name, "absent")
            if was == now:
                continue
            change = Change(f"{cid} on {name}", was, now, new["clause_details"].get(cid, {}).get(name, ""))
            uncompared = now in NOT_COMPARED or now == "absent"
            if not uncompared:
                d.clauses.append(change)
            _file(d, change, was in GOOD_CLAUSE, now in GOOD_CLAUSE, uncompared)

    before = {results.case_key(c): c for c in old["cases"]}
    after = {results.case_key(c): c for c in new["cases"]}
    for k in sorted(before.keys() | after.keys()):
        if k not in after:
            d.removed.append(_case_label(before[k]))
            continue
        c = after[k]
        if k not in before:
            d.added.append(f"{_case_label(c)} ({c['outcome']})")
            continue
        p = before[k]
        if p["outcome"] != c["outcome"]:
            change = Change(
                _case_label(c),
                p["outcome"],
                c["outcome"],
                c["message"].strip().splitlines()[0][:200] if c["message"].strip() else "",
            )
            if p["defect"] is not None:
                d.defect_runs.append(change)
            else:
                _file(d, change, p["outcome"] in GOOD_CASE, c["outcome"] in GOOD_CASE, c["outcome"] == "not available")
        if p["defect"] is None and c["outcome"] == p["outcome"] == "pass":
            slow, fast = max(p["duration_s"], c["duration_s"]), min(p["duration_s"], c["duration_s"])
            if slow - fast > TIMING_FLOOR_S and slow > TIMING_FACTOR * max(fast, 1e-9):
                d.timings.append(Change(_case_label(c), f"{p['duration_s']:.2f} s", f"{c['duration_s']:.2f} s"))
        figures = {o["observation"]: o for o in p.get("bounds", [])}
        for o in c.get("bounds", []):
            q = figures.get(o["observation"])
            if q is not None and abs(o["error"] - q["error"]) > BOUND_SHARE * o["limit"]:
                crossed = q["error"] <= q["limit"] < o["error"]
                change = Change(
                    f"{_case_label(c)}: {o['observation']}",
                    f"{q['error']:.3g}",
                    f"{o['error']:.3g}",
                    f"{o['bound']} {o['limit']:g}" + (", now beyond it" if crossed else ""),
                )
                d.bounded.append(change)
                if crossed and c["defect"] is None:  # a defect run's figures are its clause's to judge
                    d.regressions.append(change)
    d.timings.sort(key=lambda ch: -abs(float(ch.new.split()[0]) - float(ch.old.split()[0])))
    return d


def _file(d: Diff, change: Change, was_good: bool, now_good: bool, uncompared: bool) -> None:
    if uncompared:
        d.not_compared.append(change)
    elif was_good and not now_good:
        d.regressions.append(change)
    elif now_good and not was_good:
        d.improvements.append(change)
    else:
        d.other.append(change)


def _sections(d: Diff) -> list[tuple[str, list[str]]]:
    return [
        ("Regressions", [c.line() for c in d.regressions]),
        ("Verdicts", [c.line() for c in d.verdicts]),
        ("Builds", d.builds),
        ("Improvements", [c.line() for c in d.improvements]),
        ("Other changes", [c.line() for c in d.other]),
        ("No longer compared", [c.line() for c in d.not_compared]),
        ("Seeded-defect runs that changed (their clauses' statuses above decide)", [c.line() for c in d.defect_runs]),
        ("Cases added", d.added),
        ("Cases removed", d.removed),
        ("bounded errors that moved", [c.line() for c in d.bounded]),
        (f"Timings beyond noise (x{TIMING_FACTOR:g} and {TIMING_FLOOR_S:g} s)", [c.line() for c in d.timings]),
    ]


def headline(d: Diff) -> str:
    """The regressions counted, then the clauses whose status changed (the verdict's units)."""
    head = f"{len(d.regressions)} regression(s)" if d.regressed else "no regression"
    if d.clauses:
        first = sorted(d.clauses, key=lambda c: c not in d.regressions)  # a regressed clause is never hidden
        shown = "; ".join(f"{c.where}: {c.old} -> {c.new}" for c in first[:3])
        more = f"; and {len(d.clauses) - 3} more" if len(d.clauses) > 3 else ""
        head += f"; {len(d.clauses)} clause status(es) changed: {shown}{more}"
    return head


def summary(d: Diff, limit: int | None = 20) -> list[str]:
    lines = [f"diff: {headline(d)}"]
    for title, items in _sections(d):
        if items:
            lines.append(f"{title}:")
            shown = items if limit is None else items[:limit]
            lines += [f"  {i}" for i in shown]
            if len(items) > len(shown):
                lines.append(f"  ... {len(items) - len(shown)} more")
    return lines


def markdown(d: Diff, old_name: str, new_name: str) -> str:
    lines = [f"## Conformance: `{old_name}` -> `{new_name}`", "", f"**{headline(d)}**", ""]
    for title, items in _sections(d):
        if items:
            lines += [f"### {title}", "", *[f"- {i}" for i in items], ""]
    return "\n".join(lines)
