"""The conformance checks: one file per clause family, each check citing the clauses it proves.

A new check, in two steps (CONTRIBUTING.md has the rest: a new clause, a new seeded defect):

1. Write a pytest function in the file of its family that cites its clauses and takes the
   ``backend`` fixture; make every model and context on that backend (``support.load``,
   ``support.context``) and assert only through the cited clauses::

       @pytest.mark.clause("CANCEL-04")
       def test_an_incomplete_period_never_reaches_a_later_call(backend, model_path, seed):
           ...
           expect("CANCEL-04", tr.period_position == 0, f"{tr.period_position} survived")

2. Run it on every backend this build has, with the clause's seeded defects:
   ``retro-conformance certify --backend all --clauses CANCEL-04``. The clause passes only where
   the intact check passes and each of its seeded defects is caught by an assertion bound to it;
   a check that no defect can fail proves nothing, so give the clause one (CONTRIBUTING.md).
"""
