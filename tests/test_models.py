"""The model loader (``specbench.models``, ``specbench.hf``): the shipped model configs (what
validation reads on a cold cache) match the conversion, a packaged model is converted once when
two processes ask at once, and a model whose state cannot be rolled back is refused."""

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from specbench import hf, models, paths
from specbench.errors import ConfigError


def test_shipped_model_configs_match_the_conversion():
    """The copies in specbench/model_configs are what validation reads on a cold cache: the
    fields it and the methods use must be those of the converted model."""
    from transformers import AutoConfig

    for d in sorted(models.SHIPPED_CONFIGS.iterdir()):
        c = AutoConfig.from_pretrained(d)
        assert d.name in paths.group_options("model")
        mcfg = OmegaConf.load(paths.CONF_DIR / "model" / f"{d.name}.yaml")
        assert mcfg.package and not mcfg.path
        assert hf.max_positions(c) > 0 and c.vocab_size > 0 and c.num_hidden_layers > 0


@pytest.mark.slow
def test_shipped_model_configs_equal_the_converted_folders():
    from transformers import AutoConfig

    for d in sorted(models.SHIPPED_CONFIGS.iterdir()):
        mcfg = OmegaConf.load(paths.CONF_DIR / "model" / f"{d.name}.yaml")
        converted = AutoConfig.from_pretrained(models.model_dir(mcfg)).to_dict()
        shipped = AutoConfig.from_pretrained(d).to_dict()
        for k in ("transformers_version", "_name_or_path", "dtype", "torch_dtype"):
            converted.pop(k, None)
            shipped.pop(k, None)
        assert shipped == converted, d.name


def test_concurrent_first_runs_convert_once(tmp_path, monkeypatch):
    """Two processes (here: threads with their own lock handles) asking for a packaged model
    that is not converted yet: one converts, the other waits and finds the folder whole."""
    import threading
    import time as _time

    from omegaconf import OmegaConf

    monkeypatch.setenv("SPECBENCH_CACHE", str(tmp_path))
    calls = []

    def slow_convert(mcfg, out):
        calls.append(out)
        _time.sleep(0.5)
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_text("x")

    monkeypatch.setattr(models, "_convert_gguf", slow_convert)
    mcfg = OmegaConf.create({"name": "packaged", "path": None, "package": "p", "file": "f.gguf"})
    got = []
    threads = [threading.Thread(target=lambda: got.append(models.model_dir(mcfg))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(got) == 2 and got[0] == got[1]
    assert (Path(got[0]) / "model.safetensors").exists()


def test_models_with_a_recurrent_state_are_refused():
    from transformers import LlamaConfig

    hf.check_rollback(LlamaConfig())  # attention only: fine
    hybrid = LlamaConfig()
    hybrid.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(ConfigError, match="recurrent layers \\(linear_attention\\)"):
        hf.check_rollback(hybrid)
    ssm = LlamaConfig()
    ssm.model_type = "mamba2"
    with pytest.raises(ConfigError, match="cannot be rolled back"):
        hf.check_rollback(ssm)
