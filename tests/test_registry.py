"""Every registered method, built-in or from another package (the example plug-in), built from
its own defaults and its ``tiny`` settings as a run builds it, decodes token-identically to plain
greedy decoding in fp32: bs 1 and 4 with ragged prompts, and with rows joining a running batch.
A new method is held to this by being registered; no list here names it."""

import sys
import tomllib
from collections import Counter

import pytest
import torch
from omegaconf import OmegaConf

from specbench import methods
from conftest import REPO, save_tiny_hf
from helpers import DEVICE, greedy_cases, run_engine, serve_engine
from specbench.decode.engine import Engine
from specbench.decode.timing import PhaseTimer
from specbench.decode.verify import Sampling

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
    monkeypatch.setattr(methods, "plugins", lambda: dict(PLUGINS))  # as if the example were installed

    def make(name, over=None):  # over: settings over the tiny ones ({"method": {"paths": 2}})
        cls = methods.get(name)
        cfg = OmegaConf.create({"K": 3, "progress": False, "sampling": {"temperature": 0.0}, "seed": 0,
                                "model": {"name": "tiny", "path": str(folder)},
                                "draft_model": {"name": "auto", "layers": None, "path": None},
                                "method": methods.settings(name)})
        cfg = OmegaConf.merge(cfg, cls.tiny(model, tok, tmp_path / name), over or {})
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
        pytest.skip(f"{name} keeps per-row state without add_rows: serving.batching=continuous refuses it")
    prompts, refs = cases[4]
    prompts, refs = prompts + prompts[:2], refs + refs[:2]  # six requests, three in flight: rows join and leave
    res, _ = serve_engine(model, prop, prompts, N_NEW, concurrency=3)
    assert [r.tokens for r in res] == refs


def test_the_registry_lists_every_built_in_method():
    """Each module of methods/ but base is a registered method (none is left out of the tests
    above), its settings a dataclass whose name is the method's."""
    from specbench.paths import REPO

    mods = {p.stem for p in (REPO / "methods").glob("*.py") if p.stem not in ("__init__", "base")}
    assert mods == set(methods.builtin()) and len(mods) >= 17
    for name in mods:
        assert methods.settings(name).name == name
        assert methods.get(name).Settings is not None


DOC = REPO / "docs" / "adding-a-method.md"


def doc_block(section: str, lang: str) -> str:
    """The first ``lang`` code block of docs/adding-a-method.md's section ``section`` ("1", "6")."""
    import re

    text = DOC.read_text()
    body = re.search(rf"^## {section}\.(.*?)(?=^## |\Z)", text, re.S | re.M).group(1)
    return re.search(rf"```{lang}\n(.*?)```", body, re.S).group(1)


@pytest.fixture
def documented():
    """docs/adding-a-method.md's two methods, written where a newcomer writes them: each a module,
    nothing else (removed afterwards). Section 1: last_token (a chain); section 6: last_token_tree
    (a tree)."""
    files = {REPO / "methods" / "last_token.py": doc_block("1", "python"),
             REPO / "methods" / "last_token_tree.py": doc_block("6", "python")}
    assert not any(f.exists() for f in files)
    try:
        for f, text in files.items():
            f.write_text(text)
        yield "last_token", "last_token_tree"
    finally:
        for f in files:
            f.unlink(missing_ok=True)
        for name in ("last_token", "last_token_tree"):
            sys.modules.pop(f"specbench.methods.{name}", None)


def test_the_documented_method_is_one_module(tiny, build, documented):
    """The worked example runs as written: found as a module, its settings its own, its drafts accepted, greedy
    identity at bs 4 and with rows joining."""
    name = documented[0]
    assert name in methods.names() and methods.keys(name) == ["name", "max_draft"]
    _, model, _, cases = tiny
    prompts, refs = cases[4]
    res = run_engine(model, build(name), prompts, N_NEW)
    assert [r.tokens for r in res] == refs and sum(sum(r.accept_lens) for r in res) > 0
    res, _ = serve_engine(model, build(name), prompts + prompts[:2], N_NEW, concurrency=3)
    assert [r.tokens for r in res] == refs + refs[:2]


def test_the_documented_method_records_the_K_it_drafts(tiny, build, documented):
    """With its cap below K (max_draft=2, K=3) the record's K (``spec_len``, as the runner reads it)
    is the longest draft it proposes, and ``describe()`` (the record's method_cfg) names the cap."""
    from specbench.run.measure import _spec_len

    name = documented[0]
    _, model, _, cases = tiny
    prompts, refs = cases[4]
    prop = build(name, {"method": {"max_draft": 2}})
    res = run_engine(model, prop, prompts, N_NEW)
    assert [r.tokens for r in res] == refs
    assert _spec_len(prop.cfg, name, DEVICE) == 2 == max(max(r.drafted) for r in res)
    assert prop.describe() == {"max_draft": 2}
    assert _spec_len(build(name).cfg, name, DEVICE) == 3  # max_draft 0: K


def test_the_documented_tree_method_drafts_trees_and_decodes_as_greedy(tiny, build, documented):
    """The tree example runs as written: its drafts branch, no path is deeper than its recorded K,
    some drafts are accepted, and it is greedy-identical at bs 1 and 4 and with rows joining."""
    from specbench.run.measure import _spec_len

    name = documented[1]
    assert name in methods.names()
    _, model, _, cases = tiny
    prop = build(name)
    K = _spec_len(prop.cfg, name, DEVICE)
    drafts, propose = [], prop.propose

    def watched(state):
        d = propose(state)
        if d is not None:
            drafts.append(d)
        return d

    prop.propose = watched
    for bs in (1, 4):
        prompts, refs = cases[bs]
        res = run_engine(model, prop, prompts, N_NEW)
        assert [r.tokens for r in res] == refs
        if bs == 4:
            assert sum(sum(r.accept_lens) for r in res) > 0
    chain = [torch.arange(d.n)[None].expand_as(d.parents) for d in drafts]
    assert any(bool(((d.parents.cpu() != c) & d.valid.cpu()).any()) for d, c in zip(drafts, chain))  # trees
    assert max(int(d.geometry()[0][:, 1:][d.valid].max()) for d in drafts) <= K
    prompts, refs = cases[4]
    res, _ = serve_engine(model, build(name), prompts + prompts[:2], N_NEW, concurrency=3)
    assert [r.tokens for r in res] == refs + refs[:2]


def owned_modules(prop) -> dict:
    """Every ``nn.Module`` a method can run, found from its attributes rather than its ``modules()``:
    through lists, dicts, wrapped methods and specbench's own objects (``TargetParts``, caches), each
    module's submodules and the modules it borrows outside its tree (``drafters.Borrowed``)."""
    from specbench.drafters import Borrowed
    from specbench.methods.base import Proposer

    found, seen, stack = {}, set(), [prop]
    while stack:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, torch.nn.Module):
            for m in o.modules():
                found[id(m)] = m
                stack.extend(vars(m).values())  # what it holds outside its tree (Borrowed, TargetParts)
        elif isinstance(o, Borrowed):
            stack.append(o.module)
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif hasattr(o, "__dict__") and (isinstance(o, Proposer) or
                                         type(o).__module__.startswith(("specbench", "methods"))):
            stack.extend(vars(o).values())
    return found


@pytest.mark.parametrize("name", NAMES)
def test_every_model_forward_a_method_runs_is_timed(tiny, build, name):
    """The timer charges to ``time_s.forward`` every forward of every module the method owns, whatever
    its entry (DFlash's ``block``/``logits``, P-EAGLE's ``run``, EAGLE's ``step``): the forwards a hook
    on each of those modules counts equal those it counts while the timer charges a forward (watched
    as a run watches them)."""
    from specbench.decode.timing import PhaseTimer

    _, model, _, cases = tiny
    prop = build(name)
    prompts, refs = cases[4]
    timer = PhaseTimer(DEVICE)
    eng = Engine(model, prop, Sampling(), DEVICE, torch.float32, set(), timer)
    counts = {"all": Counter(), "charged": Counter()}

    def seen(mod, _args):
        counts["all"][type(mod).__name__] += 1
        counts["charged"][type(mod).__name__] += timer.charging

    with timer.watching([model, *prop.modules()]):
        hooks = [m.register_forward_pre_hook(seen) for m in owned_modules(prop).values()]
        try:
            res = eng.generate(prompts, N_NEW)
        finally:
            for h in hooks:
                h.remove()
    assert [r.tokens for r in res] == refs
    assert counts["charged"] == counts["all"], f"forwards not timed: {dict(counts['all'] - counts['charged'])}"
    assert timer.totals()["forward"] > 0


def held_tensors(prop) -> int:
    """Bytes of every tensor storage the method holds outside its models' weights (its drafter's cache,
    per-row states): through its attributes, lists, dicts, wrapped methods and specbench's own objects."""
    from transformers import Cache

    from specbench.methods.base import Proposer

    storages, seen, stack = {}, set(), [prop]
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, torch.nn.Module):
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            s = o.untyped_storage()
            storages[(o.device, s.data_ptr())] = s.nbytes()
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif hasattr(o, "__dict__") and (isinstance(o, (Proposer, Cache)) or
                                         type(o).__module__.startswith(("specbench", "methods"))):
            stack.extend(vars(o).values())
    return sum(storages.values())


@pytest.mark.parametrize("name", NAMES)
def test_the_cpu_peak_counts_the_methods_caches(tiny, build, monkeypatch, name):
    """On the CPU a run's own peak memory is its weights plus the caches it holds (``own_peak``): the
    target's KV cache and the method's own tensors (DFlash's, P-EAGLE's and EAGLE's DrafterCache, MTP's cache,
    Leviathan's draft model's). The engine's peak holds at least the target's cache and the most the
    method held after any step."""
    from specbench.decode.kv import RaggedCache

    _, model, _, cases = tiny
    prop = build(name)
    prompts, refs = cases[4]
    kv, nbytes = [0], RaggedCache.nbytes
    monkeypatch.setattr(RaggedCache, "nbytes", lambda self: (n := nbytes(self),
                                                              kv.append(n) if self.model is model else None)[0])
    held, update = [0], prop.update
    prop.update = lambda state, accepted, hidden=None: (update(state, accepted, hidden), held.append(held_tensors(prop)))[0]
    eng = Engine(model, prop, Sampling(), DEVICE, torch.float32, set(), PhaseTimer(DEVICE))
    assert [r.tokens for r in eng.generate(prompts, N_NEW)] == refs
    assert max(kv) > 0
    assert eng.peak_cache_bytes >= max(kv) + max(held), (eng.peak_cache_bytes, max(kv), max(held))


def test_every_method_key_is_documented():
    """docs/methods.md names every key every built-in method's Settings declares."""
    doc = (REPO / "docs" / "methods.md").read_text()
    missing = [f"{name}.{k}" for name in methods.builtin() for k in methods.keys(name)
               if k != "name" and f"`{name}.{k}`" not in doc and f"`{name}.{k}." not in doc]
    assert not missing, f"docs/methods.md lacks {missing}"


def test_method_settings_are_held_to_their_types_strictly():
    """Hydra's node coerces nothing: a value of the wrong type, on the command line or in a composed
    config (a preset), is refused in one line, as the run's own settings are; one that fits runs as given."""
    from specbench.__main__ import preprocess
    from specbench.errors import ConfigError

    for argv, msg in ((["method=dspark", "dspark.sample_drafts=5"], "dspark.sample_drafts must be true or false, got 5"),
                      (["method=suffix", "suffix.max_depth=1.5"], "suffix.max_depth must be an integer, got 1.5"),
                      (["method=pld", "pld.max_ngram=0"], "pld.max_ngram must be an integer >= 1, got 0")):
        with pytest.raises(ConfigError) as e:
            preprocess(argv)
        assert str(e.value) == msg
    node = methods.settings("suffix")
    node.tree = 2
    with pytest.raises(ConfigError, match="suffix.tree must be true or false, got 2"):
        methods.check_types(node, "suffix")
    node = OmegaConf.merge(methods.settings("dspark"), {"threshold": 0})
    methods.check_types(node, "dspark")
    assert node.threshold == 0 and type(node.threshold) is int  # recorded as given (method_opts)


def test_a_class_with_the_old_config_file_is_told_what_to_declare(tmp_path, monkeypatch):
    (tmp_path / "filed.py").write_text("from specbench.api import Proposer\n"
                                       "class Filed(Proposer):\n    name = 'filed'\n    config_file = 'filed.yaml'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(KeyError, match="config_file is no longer read; declare its settings as a Settings dataclass"):
        methods.settings("filed:Filed")
