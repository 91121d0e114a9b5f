"""The conformance checks. Each cites the clauses it proves with @pytest.mark.clause."""
