"""Analysis of records: profile (cost curves), theory (closed-form bounds), bounds (a job's bounds
priced), simulate, figures, tables, report (the CLI), compare (regression). Installed as
``specbench.analysis``."""

if __name__ == "analysis":  # imported by its old name: an alias of specbench.analysis for one release
    from specbench._alias import alias

    alias(__name__, "specbench.analysis")
