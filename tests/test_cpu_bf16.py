"""dtype=bf16 on a CPU without bf16 matrix units (AMX-BF16): one line, once, before the run (issue 55,
item 14). specbench's CPU kernels (kernel=native, onednn) take fp32 only, so a bf16 job runs torch's own
path, at 0.49-0.65x fp32's tokens/s on such a CPU (docs/cpu-backend.md gives the runs that measured it)."""

import pytest
import torch
from omegaconf import open_dict

from specbench import models

CPU = torch.device("cpu")


@pytest.fixture
def no_native_bf16(monkeypatch):
    monkeypatch.setattr(models, "cpu_bf16_native", lambda: False)
    monkeypatch.setattr(models, "_DTYPE_NOTES", set())  # each test starts as a fresh process does


def test_bf16_on_a_cpu_without_native_bf16_says_so_once(no_native_bf16, capsys):
    assert models.resolve_dtype("bf16", CPU) is torch.bfloat16
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith("[specbench] dtype=bf16") and "fp32" in line and "docs/cpu-backend.md" in line, line
    assert models.resolve_dtype("bfloat16", CPU) is torch.bfloat16  # the other name: the same note, not again
    assert models.resolve_dtype("bf16", CPU) is torch.bfloat16
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("name", ["fp32", "float32", "auto", "fp16"])
def test_no_note_for_other_dtypes(no_native_bf16, capsys, name):
    models.resolve_dtype(name, CPU)
    assert capsys.readouterr().err == ""


def test_no_note_where_bf16_is_native_or_off_the_cpu(monkeypatch, capsys):
    monkeypatch.setattr(models, "_DTYPE_NOTES", set())
    monkeypatch.setattr(models, "cpu_bf16_native", lambda: True)
    models.resolve_dtype("bf16", CPU)
    monkeypatch.setattr(models, "cpu_bf16_native", lambda: False)
    models.resolve_dtype("bf16", torch.device("cuda"))  # a GPU's bf16 is its default
    assert capsys.readouterr().err == ""


def test_the_note_comes_before_the_run(no_native_bf16, tiny_dirs, tmp_path, capsys):
    """The runner's validation, before any model loads, is where a job first resolves its dtype."""
    from hydra import compose, initialize_config_dir

    from conftest import REPO
    from specbench.run import runner

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["model=hf", "dataset=jsonl", "method=ar", "dtype=bf16"])
    with open_dict(cfg):
        cfg.model.path, cfg.dataset.path = str(tiny_dirs["target"]), str(tiny_dirs["questions"])
        cfg.results_dir = str(tmp_path)
        cfg.device = "cpu"
    models._MODELS.clear()
    runner.validate(cfg)
    assert not models._MODELS  # nothing loaded yet
    assert "[specbench] dtype=bf16" in capsys.readouterr().err
    cfg.dtype = "fp32"
    models._DTYPE_NOTES.clear()
    runner.validate(cfg)
    assert capsys.readouterr().err == ""


def test_native_bf16_is_read_from_the_cpu():
    """AMX-BF16 tiles, as torch's CPU feature probe (cpuinfo) reports them and /proc/cpuinfo names them."""
    from pathlib import Path

    native = models.cpu_bf16_native()
    assert isinstance(native, bool)
    info = Path("/proc/cpuinfo")
    if info.exists():
        flags = {f for line in info.read_text().splitlines() if line.startswith("flags") for f in line.split()}
        assert native == ("amx_bf16" in flags)
