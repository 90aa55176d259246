"""Training drafters by self-distillation from the target: `python -m specbench.train`."""
