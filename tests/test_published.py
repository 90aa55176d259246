"""Published drafter layouts (``specbench.drafters.formats``): fixtures written by the authors'
reference code (``tests/fixtures/make_reference.py``) load and give the reference's outputs; a
layout that does not match, or a drafter for another target, is refused in one line; our heads
exported in the published layout load back with the same logits; the engine stays token-identical
to AR with published heads."""

import shutil

import pytest
import torch
from omegaconf import OmegaConf

from conftest import REPO
from helpers import CPU, greedy_cases, run_engine, tiny_llama
from specbench.methods.medusa import Medusa
from specbench import kernels
from specbench.kernels import extension
from specbench.drafters import formats
from specbench.drafters.medusa import MedusaHeads
from specbench.errors import ConfigError

FIXTURES = REPO / "tests" / "fixtures"
MEDUSA1 = [FIXTURES / "medusa1-L1", FIXTURES / "medusa1-L2"]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0, scale=4.0)  # the target the fixtures were made on


def medusa_cfg(folder, **kw):
    m = {"name": "medusa", "checkpoint": str(folder), "tree": "default", "tree_size": "auto", "accept": "exact",
         "eps": 0.09, "delta": 0.3, **kw}
    return OmegaConf.create({"K": 3, "method": m, "model": {"name": "tiny", "path": "tiny"}})


@pytest.mark.parametrize("folder", MEDUSA1, ids=lambda p: p.name)
@pytest.mark.parametrize("kernel", ["torch", "native"])
def test_medusa1_fixture_gives_the_reference_logits(target, folder, kernel):
    if kernel == "native" and extension.unavailable():
        pytest.skip(f"native kernels: {extension.unavailable()}")
    assert formats.detect(folder) == "medusa1"
    heads = formats.medusa.load(folder, target, CPU, torch.float32)
    kernels.apply(heads, kernel)
    ref = torch.load(folder / "reference.pt", weights_only=True)
    with torch.no_grad():
        out = heads(ref["hidden"])
    assert out.shape == ref["logits"].shape
    assert torch.allclose(out, ref["logits"], rtol=1e-4, atol=1e-4), (out - ref["logits"]).abs().max()


def test_a_layout_that_does_not_match_is_refused_in_one_line(target, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(MEDUSA1[0], bad)
    state = torch.load(bad / formats.medusa.MEDUSA1_HEADS, weights_only=True)
    state["0.1.linear.weight"] = state.pop("0.0.linear.weight")  # a renamed key
    torch.save(state, bad / formats.medusa.MEDUSA1_HEADS)
    with pytest.raises(formats.FormatError) as e:
        formats.medusa.load(bad, target, CPU, torch.float32)
    msg = str(e.value)
    assert "\n" not in msg and "missing ['0.0.linear.weight']" in msg and "unexpected ['0.1.linear.weight']" in msg
    (bad / "config.json").write_text('{"medusa_num_heads": 4, "medusa_num_layers": 1}')  # declares a head it lacks
    with pytest.raises(formats.FormatError, match=r"missing \['0.0.linear.weight', '3.0.linear.bias'"):
        formats.medusa.check(bad, target.config)
    (bad / "config.json").write_text("{}")
    with pytest.raises(formats.FormatError, match="no medusa_num_heads"):
        formats.medusa.check(bad, target.config)


def test_a_drafter_for_another_target_is_refused(target):
    wider = tiny_llama(seed=0, vocab=128)
    with pytest.raises(formats.FormatError, match="the target has 128 tokens x 64: a drafter for another target"):
        formats.medusa.check(MEDUSA1[0], wider.config)
    with pytest.raises(ConfigError, match="a drafter for another target"):
        Medusa.check(medusa_cfg(MEDUSA1[0]), wider.config)
    Medusa.check(medusa_cfg(MEDUSA1[0]), target.config)  # fits


def test_our_heads_exported_load_back_with_our_logits(target, tmp_path):
    from specbench.train.export import export_medusa

    torch.manual_seed(0)
    vocab = torch.arange(3, 90, 2)  # a draft vocabulary: the export fills the rest from the target
    ours = MedusaHeads(target, vocab, 3)
    with torch.no_grad():
        ours.weight.normal_(0, 0.2)
        ours.bias.normal_(0, 0.2)
    export_medusa(ours, target, tmp_path / "out", "tiny")
    ref_keys = set(torch.load(MEDUSA1[0] / formats.medusa.MEDUSA1_HEADS, weights_only=True))
    assert set(torch.load(tmp_path / "out" / formats.medusa.MEDUSA1_HEADS, weights_only=True)) == ref_keys  # the reference's layout
    back = formats.medusa.load(tmp_path / "out", target, CPU, torch.float32)
    f = torch.randn(5, 64)
    with torch.no_grad():
        assert torch.allclose(back(f)[..., vocab], ours(f), rtol=1e-5, atol=1e-5)


def test_our_eagle_exported_loads_back_with_our_outputs(target, tmp_path):
    """export --format eagle: a drafter without an input norm, written in EAGLE-1's layout (the
    reference fixture's key set and config), loads back through the published loader with the
    same features and, on the draft vocabulary, the same logits; one with an input norm is refused."""
    from specbench.drafters.eagle import EagleDrafter

    torch.manual_seed(0)
    vocab = torch.arange(3, 90, 2)
    ours = EagleDrafter(target, vocab, input_norm=False)
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_(0, 0.2)
    formats.eagle1.save(tmp_path / "out", ours, dtype=torch.float32)
    ref_keys = set(torch.load(EAGLE1 / "pytorch_model.bin", weights_only=True)) - {"embed_tokens.weight"}
    assert set(torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)) == ref_keys
    assert formats.detect(tmp_path / "out") == "eagle1"
    back = formats.eagle1.load(tmp_path / "out", target, CPU, torch.float32)
    ref = {"hidden": torch.randn(2, 6, 64), "input_ids": torch.randint(0, 96, (2, 6))}
    h_back, h_ours = causal_step(back, ref), causal_step(ours.eval(), ref)
    assert torch.allclose(h_back, h_ours, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        assert torch.allclose(back.logits(h_back)[..., vocab], ours.logits(h_ours), rtol=1e-5, atol=1e-5)
    with pytest.raises(formats.FormatError, match="train it with drafter.input_norm=false"):
        formats.eagle1.save(tmp_path / "normed", EagleDrafter(target, vocab))


@pytest.mark.parametrize("bs", [1, 4])
def test_greedy_identity_with_published_heads(target, bs):
    """Through the method's own loading (``medusa.checkpoint`` = the fixture): a published
    checkpoint measures no head accuracies, so the method drafts a chain of its heads' top-1."""
    prompts, refs = greedy_cases(target, 20)[bs]
    cfg = medusa_cfg(MEDUSA1[0])
    Medusa.check(cfg, target.config)
    assert Medusa.spec_len(cfg, CPU) == 3
    prop = Medusa(cfg, target, None, CPU, torch.float32)
    assert prop.describe()["tree"] == "chain" and prop.describe()["checkpoint_format"] == "medusa1"
    res = run_engine(target, prop, prompts, 20)
    assert [r.tokens for r in res] == refs


EAGLE1 = FIXTURES / "eagle1"


def causal_step(d, ref):
    """A drafter's output features over a fixture's whole sequence, causal, positions 0..T-1 (as
    the reference's own forward ran it)."""
    f, ids = ref["hidden"], ref["input_ids"]
    B, T, _ = f.shape
    pos = torch.arange(T)[None].expand(B, T)
    empty = torch.zeros(B, d.block.Hk, 0, d.block.Dh)
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None].expand(B, T, T)
    with torch.no_grad():
        return d.step(f, ids, pos, (empty, empty), causal)[0]


def eagle_cfg(folder, **kw):
    m = {"name": "eagle", "version": 2, "checkpoint": str(folder), "top_k": 3, "depth": 3, "total_tokens": 8, **kw}
    return OmegaConf.create({"K": 4, "method": m, "model": {"name": "tiny", "path": "tiny"}})


@pytest.mark.parametrize("kernel", ["torch", "native"])
def test_eagle1_fixture_gives_the_reference_features(kernel):
    if kernel == "native" and extension.unavailable():
        pytest.skip(f"native kernels: {extension.unavailable()}")
    assert formats.detect(EAGLE1) == "eagle1"
    target = tiny_llama(seed=0, scale=4.0)
    kernels.apply(target, kernel)  # the drafter follows its target's path
    d = formats.eagle1.load(EAGLE1, target, CPU, torch.float32)
    assert d.block.ln1 is None and d.block.gate.out_features == 96  # its own layer shape, no input norm
    assert kernels.kernel_of(d) == kernel
    ref = torch.load(EAGLE1 / "reference.pt", weights_only=True)
    h = causal_step(d, ref)
    assert torch.allclose(h, ref["out"], rtol=1e-4, atol=1e-4), (h - ref["out"]).abs().max()


def test_eagle1_refusals(target, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(EAGLE1, bad)
    state = torch.load(bad / "pytorch_model.bin", weights_only=True)
    state["layers.0.input_layernorm.weight"] = torch.ones(64)  # a key EAGLE-1's layer 0 does not have
    del state["fc.bias"]
    torch.save(state, bad / "pytorch_model.bin")
    with pytest.raises(ConfigError) as e:
        from specbench.methods.eagle import Eagle

        Eagle.check(eagle_cfg(bad), target.config)
    msg = str(e.value)
    assert "\n" not in msg and "missing ['fc.bias']" in msg and "unexpected ['layers.0.input_layernorm.weight']" in msg
    narrow = tiny_llama(seed=0, hidden=32)
    with pytest.raises(formats.FormatError, match="the target's hidden size is 32: a drafter for another target"):
        formats.eagle1.check(EAGLE1, narrow.config)
    three = tmp_path / "eagle3"
    three.mkdir()
    (three / "config.json").write_text("{}")
    torch.save({"fc.weight": torch.zeros(1), "midlayer.hidden_norm.weight": torch.zeros(1)}, three / "pytorch_model.bin")
    assert formats.detect(three) == "eagle3"
    from specbench.methods.eagle import Eagle

    with pytest.raises(ConfigError, match="holds an EAGLE-3 drafter; set eagle.version=3"):
        Eagle.check(eagle_cfg(three), target.config)


@pytest.mark.parametrize("bs,tree", [(1, None), (4, None), (4, "mc_sim_7b_63")])
def test_greedy_identity_with_a_published_eagle(target, bs, tree):
    from specbench.methods.eagle import Eagle

    prompts, refs = greedy_cases(target, 20)[bs]
    cfg = eagle_cfg(EAGLE1, tree=tree)
    Eagle.check(cfg, target.config)
    prop = Eagle(cfg, target, None, CPU, torch.float32)
    assert prop.describe()["checkpoint_format"] == "eagle1" and prop.describe()["tree"] == (tree or "dynamic")
    if tree:
        with pytest.raises(ConfigError, match="EAGLE-1 static tree \\(mc_sim_7b_63\\), got 'vicuna_7b_stage2'"):
            Eagle.check(eagle_cfg(EAGLE1, tree="vicuna_7b_stage2"), target.config)  # Medusa's, not EAGLE's
    res = run_engine(target, prop, prompts, 20)
    assert [r.tokens for r in res] == refs


def test_medusas_published_trees_are_trees_and_run_as_named(target):
    from specbench.methods.medusa import named_trees

    trees = named_trees()
    assert len(trees["mc_sim_7b_63"]) == 63 and {"vicuna_7b_stage2", "zephyr_stage2"} <= set(trees)
    for name, paths in trees.items():  # every path's prefix is in the tree: it is a tree
        have = {tuple(p) for p in paths}
        assert all(tuple(p[:-1]) in have for p in paths if len(p) > 1), name
    with pytest.raises(ConfigError, match="published tree"):
        Medusa.check(medusa_cfg(MEDUSA1[0], tree="mc_sim_7b_64"), target.config)
    cfg = medusa_cfg(MEDUSA1[0], tree="mc_sim_7b_63")  # K=3: the fixture's three heads
    Medusa.check(cfg, target.config)
    prop = Medusa(cfg, target, None, CPU, torch.float32)
    assert prop.describe()["tree"] == "mc_sim_7b_63"
    assert prop.describe()["nodes"] == sum(len(p) <= 3 for p in trees["mc_sim_7b_63"]) == 61
    prompts, refs = greedy_cases(target, 20)[4]
    assert [r.tokens for r in run_engine(target, prop, prompts, 20)] == refs


EAGLE3 = FIXTURES / "eagle3"


@pytest.fixture(scope="module")
def target8():
    return tiny_llama(seed=0, layers=8, scale=4.0)  # the EAGLE-3 fixture's target: three distinct tap layers


@pytest.mark.parametrize("kernel", ["torch", "native"])
def test_eagle3_fixture_gives_the_reference_features_and_logits(kernel):
    if kernel == "native" and extension.unavailable():
        pytest.skip(f"native kernels: {extension.unavailable()}")
    assert formats.detect(EAGLE3) == "eagle3"
    target = tiny_llama(seed=0, layers=8, scale=4.0)
    kernels.apply(target, kernel)
    d = formats.eagle3.load(EAGLE3, target, CPU, torch.float32)
    assert d.taps == (1, 3, 4)  # the outputs of layers 1, 3, 4: the inputs of layers 2, L//2, L-3
    state = torch.load(EAGLE3 / "pytorch_model.bin", weights_only=True)
    assert torch.equal(d.vocab_ids, state["t2d"].nonzero().flatten())  # draft id i -> target id i + d2t[i]
    ref = torch.load(EAGLE3 / "reference.pt", weights_only=True)
    h = causal_step(d, ref)
    with torch.no_grad():
        logits = d.logits(h)
    assert torch.allclose(h, ref["out"], rtol=1e-4, atol=1e-4), (h - ref["out"]).abs().max()
    assert torch.allclose(logits, ref["logits"], rtol=1e-4, atol=1e-4)


def test_eagle3_refusals(target, target8, tmp_path):
    from specbench.methods.eagle import Eagle

    with pytest.raises(ConfigError, match="holds an EAGLE-3 drafter; set eagle.version=3"):
        Eagle.check(eagle_cfg(EAGLE3), target8.config)
    with pytest.raises(ConfigError, match="holds an EAGLE-1/2 drafter; set eagle.version=2"):
        Eagle.check(eagle_cfg(EAGLE1, version=3), target.config)
    with pytest.raises(ConfigError, match="no three distinct"):  # a 2-layer target has no three tap layers
        Eagle.check(eagle_cfg(EAGLE3, version=3), target.config)
    bad = tmp_path / "bad"
    shutil.copytree(EAGLE3, bad)
    state = torch.load(bad / "pytorch_model.bin", weights_only=True)
    del state["midlayer.hidden_norm.weight"]
    torch.save(state, bad / "pytorch_model.bin")
    with pytest.raises(ConfigError) as e:
        Eagle.check(eagle_cfg(bad, version=3), target8.config)
    assert "\n" not in str(e.value) and "missing ['midlayer.hidden_norm.weight']" in str(e.value)
    with pytest.raises(ConfigError, match="eagle.version must be 2"):
        Eagle.check(eagle_cfg(EAGLE3, version=4), target8.config)


@pytest.mark.parametrize("bs", [1, 4, 8, 32])
def test_greedy_identity_with_a_published_eagle3(target8, bs):
    from helpers import prompts_of, reference_greedy
    from specbench.methods.eagle import Eagle

    if bs in (1, 4):
        prompts, refs = greedy_cases(target8, 20)[bs]
    else:  # ragged prompts of 3..17 tokens
        prompts = prompts_of([3 + (7 * i) % 15 for i in range(bs)], seed=bs)
        refs = [reference_greedy(target8, p, 20) for p in prompts]
    cfg = eagle_cfg(EAGLE3, version=3)
    Eagle.check(cfg, target8.config)
    prop = Eagle(cfg, target8, None, CPU, torch.float32)
    assert prop.hidden_layers == (1, 3, 4) and prop.describe()["version"] == 3
    res = run_engine(target8, prop, prompts, 20)
    assert [r.tokens for r in res] == refs


def test_sampling_with_a_published_eagle3_follows_the_target(target8):
    """Seeded rows of one prompt at T=1: the 2nd and 3rd tokens (drafted by EAGLE-3's tree over
    its draft vocabulary, verified by the lossless rule) follow the target's exact marginals."""
    from helpers import chi2_pvalue
    from specbench.methods.eagle import Eagle
    from specbench.decode.verify import Sampling
    from test_verify import exact_marginals

    prop = Eagle(eagle_cfg(EAGLE3, version=3, top_k=3, depth=2, total_tokens=6), target8, None, CPU, torch.float32)
    prompt, n, s = [3, 5, 7, 9], 2000, Sampling(1.0)
    res = run_engine(target8, prop, [prompt] * n, 3, sampling=s, gen=torch.Generator().manual_seed(5))
    m2, m3 = exact_marginals(target8, prompt, s)
    assert sum(sum(r.accept_lens) for r in res) > n // 50  # drafts were really accepted from
    V = target8.config.vocab_size
    assert chi2_pvalue(torch.bincount(torch.tensor([r.tokens[1] for r in res]), minlength=V), m2) > 1e-3
    assert chi2_pvalue(torch.bincount(torch.tensor([r.tokens[2] for r in res]), minlength=V), m3) > 1e-3


SPECULATORS3 = FIXTURES / "speculators-eagle3"


def test_speculators_eagle3_gives_the_reference_outputs_and_runs(target8):
    """vLLM's speculators format, as its own converter wrote the EAGLE-3 fixture (the target
    layers named in config.json): the same features and logits as SafeAILab's reference, and
    greedy identity through method=eagle eagle.version=3."""
    from specbench.methods.eagle import Eagle

    assert formats.detect(SPECULATORS3) == "speculators-eagle3"
    d = formats.eagle3.load(SPECULATORS3, target8, CPU, torch.float32)
    assert d.taps == (1, 3, 4)  # eagle_aux_hidden_state_layer_ids [2, 4, 5]: the inputs of those layers
    ref = torch.load(EAGLE3 / "reference.pt", weights_only=True)
    h = causal_step(d, ref)
    with torch.no_grad():
        assert torch.allclose(d.logits(h), ref["logits"], rtol=1e-4, atol=1e-4)
    assert torch.allclose(h, ref["out"], rtol=1e-4, atol=1e-4)
    cfg = eagle_cfg(SPECULATORS3, version=3)
    Eagle.check(cfg, target8.config)
    prop = Eagle(cfg, target8, None, CPU, torch.float32)
    assert prop.describe()["checkpoint_format"] == "speculators-eagle3" and prop.describe()["version"] == 3
    prompts, refs = greedy_cases(target8, 20)[4]
    assert [r.tokens for r in run_engine(target8, prop, prompts, 20)] == refs
    with pytest.raises(ConfigError, match="holds an EAGLE-3 drafter; set eagle.version=3"):
        Eagle.check(eagle_cfg(SPECULATORS3), target8.config)


SPECULATORS31 = FIXTURES / "speculators-eagle3.1"


def test_eagle31_gives_its_references_two_drafting_steps_and_runs(target8):
    """EAGLE 3.1 in speculators' format (``fc_norm``: a norm per tapped layer before fc;
    ``norm_output``: the post-norm state fed back): the logits of both TTT steps of speculators'
    own forward; ``eagle.version=3.1`` decodes token-identically to greedy; version 3 is refused."""
    from specbench.methods.eagle import Eagle
    from specbench.decode.hidden import Tap

    ref = torch.load(SPECULATORS31 / "reference.pt", weights_only=True)
    d = formats.eagle3.load(SPECULATORS31, target8, CPU, torch.float32)
    assert d.fc_norm is not None and d.norm_output and formats.eagle3.version(SPECULATORS31) == 3.1
    tokens = ref["tokens"][None]
    T = tokens.shape[1]
    with Tap(target8, d.taps) as tap, torch.no_grad():
        target8(tokens)
        got = tap.take()
    taps = torch.cat([got[t] for t in d.taps], dim=-1)
    pos = torch.arange(T)[None]
    causal = torch.ones(T, T).tril().bool()[None]
    empty = torch.zeros(1, d.block.Hk, 0, d.block.Dh)
    with torch.no_grad():
        h0, k0, v0 = d.step(taps, tokens, pos, (empty, empty), causal)
        nxt = torch.cat([tokens[:, 1:], tokens.new_zeros(1, 1)], 1)  # its teacher-forced next tokens
        h1, _, _ = d.step(h0, nxt, pos + 1, (k0, v0), torch.cat([causal, torch.eye(T).bool()[None]], 2))
        torch.testing.assert_close(d.logits(h0)[0], ref["logits"][0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(d.logits(h1)[0, :-1], ref["logits"][1][:-1], rtol=1e-4, atol=1e-4)
    cfg = eagle_cfg(SPECULATORS31, version=3.1)
    Eagle.check(cfg, target8.config)
    prop = Eagle(cfg, target8, None, CPU, torch.float32)
    assert prop.describe()["version"] == 3.1
    prompts, refs = greedy_cases(target8, 20)[4]
    assert [r.tokens for r in run_engine(target8, prop, prompts, 20)] == refs
    with pytest.raises(ConfigError, match=r"holds an EAGLE-3.1 drafter \(fc_norm, norm_output\); set eagle.version=3.1"):
        Eagle.check(eagle_cfg(SPECULATORS31, version=3), target8.config)
    with pytest.raises(ConfigError, match="holds an EAGLE-3 drafter; set eagle.version=3"):
        Eagle.check(eagle_cfg(SPECULATORS3, version=3.1), target8.config)
    with pytest.raises(ConfigError, match="EAGLE 3.1 drafter .* not known to vLLM's eagle3 path"):
        Eagle.vllm_config(eagle_cfg(SPECULATORS31, version=3.1, top_k=1, depth=3, total_tokens=3))


def test_an_eagle31_drafter_without_its_norms_is_refused(target8, tmp_path):
    from safetensors.torch import load_file, save_file

    from specbench.methods.eagle import Eagle

    bad = tmp_path / "bad"
    shutil.copytree(SPECULATORS31, bad)
    state = load_file(str(bad / "model.safetensors"))
    save_file({k: v for k, v in state.items() if k != "fc_norm.2.weight"}, str(bad / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"missing \['fc_norm.2.weight'\]"):
        Eagle.check(eagle_cfg(bad, version=3.1), target8.config)


@pytest.mark.parametrize("change,match", [
    ({"norm_before_fc": True}, r"variant specbench does not draft with \(norm_before_fc=true\)"),
    ({"speculators_model_type": "mtp"}, "a speculators 'mtp' checkpoint; specbench reads speculators' eagle3"),
    ({"norm_before_residual": True}, r"\(norm_before_residual=true\)"),
    ({"eagle_aux_hidden_state_layer_ids": [2, 4, 9]}, r"inputs of layers \[2, 4, 9\]: a target of 8 layers"),
    ({"draft_vocab_size": 40}, "missing|lm_head is"),
])
def test_speculators_refusals(target8, tmp_path, change, match):
    import json

    from specbench.methods.eagle import Eagle

    bad = tmp_path / "bad"
    shutil.copytree(SPECULATORS3, bad)
    raw = json.loads((bad / "config.json").read_text())
    raw.update(change)
    (bad / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=match) as e:
        Eagle.check(eagle_cfg(bad, version=3), target8.config)
    assert "\n" not in str(e.value)


MEDUSA2 = FIXTURES / "medusa2"


def test_medusa2_heads_inside_their_model(target, tmp_path):
    """A Medusa-2 folder (the fine-tuned target with ``medusa_head.*`` in its own weights): the
    target loads from it, the heads give the Medusa-1 reference logits they were made from, decoding
    is token-identical to AR; a target from elsewhere and a missing head key are refused in one line."""
    from transformers import LlamaForCausalLM

    assert formats.detect(MEDUSA2) == "medusa2"
    model = LlamaForCausalLM.from_pretrained(MEDUSA2).eval()  # its medusa_head.* keys are not the model's
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), target.state_dict().values()))
    heads = formats.medusa.load(MEDUSA2, model, CPU, torch.float32)
    ref = torch.load(MEDUSA1[0] / "reference.pt", weights_only=True)
    with torch.no_grad():
        assert torch.allclose(heads(ref["hidden"]), ref["logits"], rtol=1e-4, atol=1e-4)
    cfg = medusa_cfg(MEDUSA2, tree="mc_sim_7b_63")
    with pytest.raises(ConfigError, match="is a Medusa-2 model .*: set model.path=.*medusa2 too"):
        Medusa.check(cfg, model.config)
    cfg.model.path = str(MEDUSA2)
    Medusa.check(cfg, model.config)
    prop = Medusa(cfg, model, None, CPU, torch.float32)
    assert prop.describe()["checkpoint_format"] == "medusa2"
    prompts, refs = greedy_cases(model, 20)[4]
    assert [r.tokens for r in run_engine(model, prop, prompts, 20)] == refs
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(MEDUSA2, bad)
    state = load_file(str(bad / "model.safetensors"))
    del state["medusa_head.2.1.weight"]
    save_file(state, str(bad / "model.safetensors"))
    cfg = medusa_cfg(bad)
    cfg.model.path = str(bad)
    with pytest.raises(ConfigError) as e:
        Medusa.check(cfg, model.config)
    assert "\n" not in str(e.value) and "not the Medusa-2 layout" in str(e.value) and "missing ['medusa_head.2.1.weight']" in str(e.value)
