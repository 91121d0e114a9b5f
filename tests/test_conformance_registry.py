"""The clause registry against shared/CONTRACTS.md, and the seeded-defect registry."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from conftest import REPO
from retro.conformance import registry

CONTRACTS = REPO.parent / "shared" / "CONTRACTS.md"
SCHEMA = Path(registry.__file__).parent / "results.schema.json"


def test_registry_holds_every_clause_of_the_contracts_and_no_other():
    """Against the spec's clause list kept as data (retro/contracts.ids): on any
    checkout, with or without shared/ beside it."""
    assert set(registry.clauses()) == set(registry.spec_ids())
    assert len(registry.spec_ids()) == len(set(registry.spec_ids()))


def test_the_spec_list_is_the_one_contracts_md_names():
    if not CONTRACTS.is_file():
        pytest.skip("shared/CONTRACTS.md is not beside this checkout (the list in the repo was checked above)")
    named = list(dict.fromkeys(registry.ID_IN_TEXT.findall(CONTRACTS.read_text(encoding="utf-8"))))
    assert named == registry.spec_ids(), f"retro/contracts.ids must list, one per line in this order: {named}"


def test_the_schema_uses_the_registrys_id_grammar():
    defs = json.loads(SCHEMA.read_text(encoding="utf-8"))["$defs"]
    assert defs["clauseId"]["pattern"] == registry.ID_PATTERN.pattern
    assert defs["defectId"]["pattern"] == f"^{registry.DEFECT_GRAMMAR}$"
    assert all(registry.DEFECT_PATTERN.match(d) for d in registry.defects())


def test_every_clause_has_text_and_a_known_document():
    for c in registry.clauses().values():
        assert c.text.strip(), c.id
        assert registry.ID_PATTERN.match(c.id)
    subs = [c for c in registry.clauses().values() if c.parent]
    assert {c.id for c in subs} == {f"FAIL-04{x}" for x in "abcdef"}


def test_every_seeded_defect_names_a_clause_and_says_where_it_lives():
    defects = registry.defects()
    assert {"BASE-01", "BASE-01.eval-period", "BASE-02", "BASE-03"} <= set(defects)
    tiny = ["BASE-01", "BASE-01.eval-period", "BASE-01.swiglu-back"]
    assert registry.defects_of("BASE-01") == [*tiny, "BASE-01.class-blocks"]
    # a defect runs at the shape profiles it names (the default one when it names none)
    assert registry.defects_of("BASE-01", shapes=["tiny"]) == tiny
    assert registry.defects_of("BASE-01", "vulkan", shapes=["realistic"]) == []
    assert registry.defects_of("BASE-01", "rpc", shapes=["tiny", "realistic"]) == registry.defects_of("BASE-01")
    for d in defects.values():
        assert d.where and d.defect and d.clause in registry.clauses()


def test_the_described_defects_are_the_compiled_switches():
    from retro._native import hooks

    registry.check_switches(list(hooks.defects()))
    with pytest.raises(ValueError, match="undescribed"):
        registry.check_switches([*hooks.defects(), "BASE-02.extra"])


def test_selection_by_prefix():
    assert registry.select(["BASE"]) == ["BASE-01", "BASE-02", "BASE-03"]
    assert registry.select(["FAIL-04"]) == ["FAIL-04"]
    assert registry.select(["FAIL-04a", "FAIL-04b"]) == ["FAIL-04a", "FAIL-04b"]
    # a prefix selects exactly the registry's IDs that begin with it, in registry order
    everything = list(registry.clauses())
    for prefix in ("FAIL", "TX-", "TX-ACC", "HARNESS"):
        assert registry.select([prefix]) == [c for c in everything if c.startswith(prefix)]
    assert registry.select(None) == list(registry.clauses())
    # what --clauses gives, as a person types it
    assert registry.prefixes(" CANCEL-01, BASE ,") == ["CANCEL-01", "BASE"] and registry.prefixes("") is None
    assert registry.unknown_ids(["BASE-01", "NOPE-01"]) == ["NOPE-01"]


def test_a_defect_that_cannot_show_on_a_backend_does_not_run_there() -> None:
    assert "HARNESS-01" not in registry.defects_of("HARNESS-01", "cpu")
    assert {"HARNESS-01", "HARNESS-01.absent"} <= set(registry.defects_of("HARNESS-01", "rpc"))
    assert registry.defects_of("BASE-01", "cpu") == registry.defects_of("BASE-01", "rpc")


def test_nmse_is_test_backend_ops_measure() -> None:
    import numpy as np

    from retro.conformance.evidence import nmse

    e = np.array([1.0, -2.0, 2.0])
    assert nmse(e, e) == 0.0
    assert nmse(e + np.array([0.0, 0.0, 3.0]), e) == pytest.approx(1.0)  # 9 / 9
    assert nmse(np.zeros(2), np.zeros(2)) == 0.0
    assert nmse(np.ones(2), np.zeros(3)) == float("inf")


def test_every_path_a_clause_names_is_driven_by_a_check_citing_it(tmp_path):
    """Clause.paths (clauses/*.toml): each is a parameter of a check citing the clause, or a path
    the check declares with @pytest.mark.drives; collected as a certification collects them."""
    import subprocess
    import sys

    from retro.conformance import cli

    report = tmp_path / "paths.json"
    cases = Path(cli.__file__).parent / "cases"
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "pytest", str(cases), "-c", str(cli.INI), "--rootdir", str(cases.parent), "-q"),
            *(
                "--import-mode=importlib",
                "-p",
                "retro.conformance.plugin",
                "--backend=cpu",
                "--no-defects",
                "--shape=all",
            ),
            *("--collect-only", f"--paths-report={report}"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    driven = {c: set(p) for c, p in json.loads(report.read_text(encoding="utf-8")).items()}
    assert registry.undriven(driven) == {}
    assert sum(len(c.paths) for c in registry.clauses().values()) >= 40
    # and the rule itself: a path no citing check drives is named
    some = next(c for c in registry.clauses().values() if c.paths)
    assert registry.undriven({**driven, some.id: set(some.paths[1:])}) == {some.id: [some.paths[0]]}


def test_a_path_is_a_name_and_a_value():
    assert registry.PATH_PATTERN.match("head=fused") and registry.PATH_PATTERN.match("value=-inf")
    assert not registry.PATH_PATTERN.match("fused") and not registry.PATH_PATTERN.match("a=b,c=d")


def test_every_reviewers_defect_names_its_clause_and_each_escape_what_catches_it_since():
    """reviewed_defects.toml: defects by reviewers who had not read the checks, each with its first
    judgment kept; an escape names what catches it now, and a seeded defect it names exists."""
    reviewed = registry.reviewed_defects()
    assert reviewed
    for d in reviewed.values():
        # a line of the patched fork is named as the mutation runner names it (llama.cpp/...)
        assert d.why and d.original != d.mutated, d.id
        assert d.file.startswith("llama.cpp/") or (REPO / d.file).parent.is_dir(), d.id
        seeded = re.findall(r"seeded as (\S+)", d.caught_since)
        assert all(s in registry.defects() for s in seeded), (d.id, seeded)
    assert sum(len(registry.reviewed_of(c)) for c in registry.clauses()) == len(reviewed)


# Clauses short of registry.OWN_CATCHES_WANTED own-clause catches at first judgment, with their count:
# a finding, shown, that only new blind rounds (defect lists committed before judgment) shrink. A
# clause's entry goes when it reaches the figure; no entry is ever added.
SHORT_BY_THE_RULE: dict[str, int] = {}


def test_reviewers_defects_are_counted_by_the_rule():
    """A reviewer's defect counts for a clause only when that clause's own assertion caught it at first
    judgment: not when another clause caught it, nor once a check grown for it catches it since."""
    d = next(d for d in registry.reviewed_defects().values() if d.first_judgment == "caught")
    assert d.counts
    assert not dataclasses.replace(d, caught_by=tuple(c for c in registry.clauses() if c != d.clause)[:1]).counts
    escaped = dataclasses.replace(d, first_judgment="escaped", caught_by=(), caught_since="a grown check")
    assert not escaped.counts


def test_every_clause_has_three_reviewers_defects_caught_by_its_own_clause_or_is_named_short():
    """Every clause has OWN_CATCHES_WANTED defects, written by a reviewer who had not read its check,
    that its own assertion caught at first judgment, or it is named in SHORT_BY_THE_RULE with the
    count it has: the list is the truth, shrinks as rounds land, and never hides a clause."""
    short = {c: n for c in registry.clauses() if (n := registry.own_catches(c)) < registry.OWN_CATCHES_WANTED}
    assert short == SHORT_BY_THE_RULE


def test_every_shape_profile_is_consistent():
    """The shape table (conformance/shapes.py): each profile's model is a valid spec, its windows
    split into whole micro-batches, and a published vocabulary has the size the spec says."""
    from retro.conformance import shapes
    from retro.testing.models import VOCABULARIES

    assert shapes.DEFAULT in shapes.SHAPES
    for s in shapes.SHAPES.values():
        assert s.window % s.micro_batch == 0 and s.decode_batch % s.decode_micro_batch == 0, s.name
        if s.spec.vocabulary:
            assert VOCABULARIES[s.spec.vocabulary] == s.spec.n_vocab, s.name
        assert s.purpose, f"{s.name}: say which kernels and paths its sizes reach"


#: a context's or a window's size written as a number in a check: the shape table holds them
#: (SHAPE-01 and SHAPE-02's refused values are inputs of the check, not its geometry)
GEOMETRY_LITERAL = re.compile(r"\bn_(ctx|batch|ubatch)\s*=\s*[0-9]+\s*[,)]|support\.windows\([^,]+,\s*[0-9]+\s*,")


def test_no_check_holds_a_geometry_literal_of_its_own():
    cases = Path(registry.__file__).parent / "cases"
    found = [
        f"{path.name}:{number}: {line.strip()}"
        for path in sorted(cases.glob("*.py"))
        if path.name != "test_shapes.py"
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if GEOMETRY_LITERAL.search(line)
    ]
    assert not found, "\n".join(found)
