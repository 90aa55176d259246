"""Running a job: validation and the settings' schema, the prompts (``data``), a method's
measured run (``measure``) and its metrics (``metrics``), memory and energy monitors, the
records, K=auto (``tune``), task scores (``quality``), the summary table and the runner that ties
them together. Above the decode core, below the command line."""
