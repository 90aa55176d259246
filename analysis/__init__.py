"""Analysis of records: profile (cost curves), theory (closed-form bounds), bounds (a job's bounds
priced), simulate, figures, tables, report (the CLI), compare (regression); ingest (traces recorded
elsewhere), costmodel (a step's cost on a named GPU), replay (SpecDecode-Bench's simulator).
Installed as ``specbench.analysis``."""
