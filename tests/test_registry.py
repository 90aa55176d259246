"""Every registered method, built-in or from another package (the example plug-in), built from
its own defaults and its ``tiny`` settings as a run builds it, decodes token-identically to plain
greedy decoding in fp32: bs 1 and 4 with ragged prompts, and with rows joining a running batch.
A new method is held to this by being registered; no list here names it."""

import sys
import tomllib

import pytest
import torch
from omegaconf import OmegaConf

from specbench import methods
from conftest import REPO, save_tiny_hf
from helpers import DEVICE, greedy_cases, run_engine, serve_engine

PLUGIN = REPO / "examples" / "plugin"
PLUGINS = tomllib.loads((PLUGIN / "pyproject.toml").read_text())["project"]["entry-points"]["specbench.methods"]
NAMES = methods.builtin() + sorted(PLUGINS)
N_NEW = 20


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = save_tiny_hf(tmp_path_factory.mktemp("registry") / "target")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval().to(DEVICE)
    model.generation_config.eos_token_id = None  # every row runs its N_NEW tokens
    return folder, model, AutoTokenizer.from_pretrained(folder), greedy_cases(model, N_NEW)


@pytest.fixture
def build(tiny, tmp_path, monkeypatch):
    """A fresh proposer of ``name`` for the tiny target, checked and built as a run does."""
    folder, model, tok, _ = tiny
    monkeypatch.syspath_prepend(str(PLUGIN / "src"))
    for name, target in PLUGINS.items():
        monkeypatch.setitem(methods.REGISTRY, name, target)

    def make(name):
        cls = methods.get(name)
        cfg = OmegaConf.create({"K": 3, "progress": False, "temperature": 0.0, "seed": 0,
                                "model": {"name": "tiny", "path": str(folder)},
                                "draft_model": {"name": "auto", "layers": None, "path": None},
                                "method": methods.defaults(name)})
        cfg = OmegaConf.merge(cfg, cls.tiny(model, tok, tmp_path / name))
        cls.check(cfg, model.config)
        return cls(cfg, model, tok, DEVICE, torch.float32)

    yield make
    sys.modules.pop("specbench_plugin_example", None)


@pytest.mark.parametrize("bs", [1, 4])
@pytest.mark.parametrize("name", NAMES)
def test_every_method_decodes_as_greedy(tiny, build, name, bs):
    _, model, _, cases = tiny
    prompts, refs = cases[bs]
    res = run_engine(model, build(name), prompts, N_NEW)
    assert [r.tokens for r in res] == refs
    assert all(len(r.accept_lens) == r.steps for r in res)


@pytest.mark.parametrize("name", NAMES)
def test_every_method_decodes_as_greedy_with_rows_joining(tiny, build, name):
    _, model, _, cases = tiny
    prop = build(name)
    if not prop.joins_rows():
        pytest.skip(f"{name} keeps per-row state without add_rows: batching=continuous refuses it")
    prompts, refs = cases[4]
    prompts, refs = prompts + prompts[:2], refs + refs[:2]  # six requests, three in flight: rows join and leave
    res, _ = serve_engine(model, prop, prompts, N_NEW, concurrency=3)
    assert [r.tokens for r in res] == refs


def test_the_registry_lists_every_built_in_method():
    """Each yaml under conf/method names a registered method (none is left out of the tests above)."""
    from specbench.paths import CONF_DIR

    assert {p.stem for p in (CONF_DIR / "method").glob("*.yaml")} <= set(methods.builtin())


@pytest.fixture
def documented():
    """docs/adding-a-method.md's method, written where a newcomer writes it: its module and its
    yaml, nothing else (removed afterwards)."""
    import re

    from specbench.paths import CONF_DIR

    text = (REPO / "docs" / "adding-a-method.md").read_text()
    code = re.search(r"## 1\..*?```python\n(.*?)```", text, re.S).group(1)
    yaml = re.search(r"## 2\..*?```yaml\n(.*?)```", text, re.S).group(1)
    files = [REPO / "methods" / "last_token.py", CONF_DIR / "method" / "last_token.yaml"]
    assert not any(f.exists() for f in files)
    try:
        files[0].write_text(code)
        files[1].write_text(yaml)
        yield "last_token"
    finally:
        for f in files:
            f.unlink(missing_ok=True)
        sys.modules.pop("specbench.methods.last_token", None)


def test_the_documented_method_is_one_module_and_one_yaml(tiny, build, documented):
    """The worked example runs as written: found beside its yaml, its drafts accepted, greedy
    identity at bs 4 and with rows joining."""
    assert documented in methods.names()
    _, model, _, cases = tiny
    prompts, refs = cases[4]
    res = run_engine(model, build(documented), prompts, N_NEW)
    assert [r.tokens for r in res] == refs and sum(sum(r.accept_lens) for r in res) > 0
    res, _ = serve_engine(model, build(documented), prompts + prompts[:2], N_NEW, concurrency=3)
    assert [r.tokens for r in res] == refs + refs[:2]
