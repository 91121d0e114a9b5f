"""The vocabulary of results, defined once: the result codes of a case run and of a clause on a
backend, the reasons a clause reads as it does, and the two outcomes a check ends with that are
neither pass nor fail, as exception types the plugin reads by type (pytest's skip, subclassed: a
runner without the plugin still sees a skip, never a pass)."""

from __future__ import annotations

from typing import ClassVar

import pytest

#: result codes of one case: the intact run's, and a seeded-defect run's (caught / survived)
CASE_CODES = ("pass", "fail", "not supported", "crash", "expected failure", "not available", "caught", "survived")
#: statuses of a clause on a backend; only "pass" counts towards "certified"
CLAUSE_CODES = (
    "pass",
    "fail",
    "crash",
    "expected failure",
    "not supported",
    "not covered",
    "not available",
    "not selected",
)

#: the verdict of a backend: "certified" only when every clause of the registry was run and passed
#: there; a run of a selection whose clauses all pass reads SELECTION_PASSED, never "certified"
CERTIFIED = "certified"
SELECTION_PASSED = "selection passed"
VERDICTS = (CERTIFIED, "not certified", SELECTION_PASSED, "not available")
#: the exit codes of certify and merge: each verdict its own, so that a script cannot read a
#: selection that passed as a certification
EXIT_CERTIFIED, EXIT_NOT_CERTIFIED, EXIT_HARNESS_ERROR, EXIT_SELECTION_PASSED = 0, 1, 2, 3


def verdict_text(results: dict, name: str) -> str:
    """What a backend's verdict rests on, in the words every output uses: the clauses that pass of
    those run, and for a selection that it is not a certification."""
    passing = sum(results["clauses"][c][name] == "pass" for c in results["selected"])
    run, total = len(results["selected"]), len(results["clauses"])
    if run < total:
        return f"passed {passing} of {run} selected; not a certification ({total} clauses in the registry)"
    return f"{passing} of {total} clauses pass"


#: the reason of a clause whose implemented part passes while the binding lacks the rest
PARTLY_IMPLEMENTED = "passes where implemented"
#: the reasons a clause reads "not covered" because no check of it exists yet, or none of them ran
NO_CHECK = "no check cites it"
NO_CHECK_RAN = "no check citing it ran"


class Outcome(pytest.skip.Exception):  # type: ignore[misc,name-defined]
    """A check's end that is neither pass nor fail; `code` is its case result code."""

    code: ClassVar[str]

    def __init__(self, reason: str) -> None:
        super().__init__(f"{self.code}: {reason}")
        self.reason = reason


class NotSupported(Outcome):
    """The backend does not do what the check needs (never counts towards certified)."""

    code = "not supported"


class NotAvailable(Outcome):
    """The backend under test is absent from this machine or build."""

    code = "not available"
