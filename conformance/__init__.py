"""The conformance suite: the clause registry (clauses/), the seeded defects (mutants.toml),
the pytest plugin that runs every check per backend and per defect, the checks (cases/), and the
retro-conformance command that turns their results into results.json, junit.xml and report.md."""
