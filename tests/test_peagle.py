"""P-EAGLE: speculators' layout loads strictly and gives its own training forward's logits (COD
entries: verified positions and mask-slot chains); the incremental drafter (entries kept per layer,
the step's new entries and its mask slots in one forward) drafts what a full recompute drafts; the method is lossless (greedy
identity at bs 1/4/32, with rows joining, and under sampling)."""


import pytest
import torch
from omegaconf import OmegaConf

from specbench import methods
from specbench.decode.hidden import Tap
from specbench.decode.verify import Sampling, Synthetic
from specbench.drafters import formats, randomize
from specbench.drafters.eagle3 import layer_config
from specbench.drafters.peagle import PEagleDrafter
from specbench.errors import ConfigError
from conftest import REPO
from helpers import (DEVICE, record_drafts, assert_sampling_follows_the_target, copy_folder, edit_config, greedy_batch,
                     reference_greedy, rekey, run_engine, serve_engine, tiny_llama)
from test_feature_methods import feature_setup, frozen_target8, patch_eval_slice  # noqa: F401 - a fixture

FIXTURE = REPO / "tests" / "fixtures" / "speculators-peagle"
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def target8():
    return tiny_llama(seed=0, layers=8, scale=4.0, device=CPU)


def cfg_of(folder, **method):
    return OmegaConf.create({"K": 3, "sampling": {"temperature": 0.0}, "model": {"name": "tiny", "path": None},
                             "method": {**methods.settings("peagle"), "checkpoint": str(folder), **method}})


def proposer(target, folder, device=CPU, **method):
    cfg = cfg_of(folder, **method)
    methods.get("peagle").check(cfg, target.config)
    return methods.get("peagle")(cfg, target, None, device, torch.float32)


def taps_of(target, d, tokens):
    with Tap(target, d.taps) as tap, torch.no_grad():
        target(tokens)
        got = tap.take()
    return torch.cat([got[t] for t in d.taps], dim=-1)


def test_speculators_layout_gives_its_training_forwards_logits(target8):
    """Two layers (EAGLE-3's first, a Llama layer), EAGLE 3.1's norms, half the vocabulary: the
    logits of every entry its COD sampling drew, verified positions and mask slots alike."""
    ref = torch.load(FIXTURE / "reference.pt")
    assert formats.detect(FIXTURE) == "speculators-peagle"
    d = formats.peagle.load(FIXTURE, target8, CPU, torch.float32)
    assert len(d.layers) == 2 and d.depths == 4 and d.norm_output and d.fc_norm is not None
    assert set(ref["depth"].tolist()) == {0, 1, 2, 3}
    tokens = ref["tokens"][None]
    with torch.no_grad():
        h = d.train_forward(taps_of(target8, d, tokens), tokens, ref["anchor"], ref["depth"])
        torch.testing.assert_close(d.logits(h)[0], ref["logits"], atol=1e-4, rtol=1e-4)
    prop = proposer(target8, FIXTURE)
    assert methods.get("peagle").spec_len(cfg_of(FIXTURE), CPU) == 4 and prop.describe()["version"] == 3.1
    prompt = tokens[0, :9].tolist()
    assert run_engine(target8, prop, [prompt], 16)[0].tokens == reference_greedy(target8, prompt, 16)


def random_peagle(target, folder, layers=2, depths=4, seed=0):
    tc = target.config
    V = tc.vocab_size
    lc = layer_config(tc, V)
    lc.num_hidden_layers = layers
    d = PEagleDrafter(target, lc, V, V - 1, depths, layers=tuple(range(1, min(tc.num_hidden_layers, 4))))
    randomize(d, seed)
    formats.peagle.save(folder, d, dtype=torch.float32)
    return folder


@pytest.mark.parametrize("bs", [1, 4])
def test_the_kept_entries_draft_what_a_full_recompute_drafts(tmp_path, bs):
    """Rows accept ragged runs (synthetic acceptance); every step's drafts equal the training
    forward's over the whole sequence so far: its positions as verified entries, the last one's
    argmax the first draft, a chain of mask slots at it the rest."""
    target = tiny_llama(seed=1, layers=6, device=CPU)
    prop = proposer(target, random_peagle(target, tmp_path / "d"))
    runs, run = [], prop.drafter.run
    prop.drafter.run = lambda *a, **k: (runs.append(len(steps)), run(*a, **k))[1]
    steps = record_drafts(prop)
    prompts = [[1, 5, 9, 3, 7, 11, 2][: 4 + b] for b in range(bs)]
    res = run_engine(target, prop, prompts, 18, sampling=Sampling(synthetic=Synthetic(0.8, seed=0)))
    assert sum(len(r.tokens) for r in res) >= 18 * bs
    # one drafter forward a step, as vLLM's parallel drafting: the verified entries and the mask slots together
    assert [runs.count(i) for i in range(len(steps))] == [1] * len(steps)
    d, K = prop.drafter, prop.K
    for seqs, drafts in steps:
        for b, seq in enumerate(seqs):
            n = len(seq) - 1  # verified entries 0..n-1, entry i pairs h_i with x_{i+1}
            tokens = torch.tensor([seq[1:]])
            taps = taps_of(target, d, torch.tensor([seq[:-1]]))
            anchor = torch.cat([torch.arange(n), torch.full((K - 1,), n - 1)])
            depth = torch.cat([torch.zeros(n, dtype=torch.long), torch.arange(1, K)])
            with torch.no_grad():
                logits = d.logits(d.train_forward(taps, tokens, anchor, depth))[0]
            want = d.vocab_ids[logits[n - 1:].argmax(-1)]
            assert drafts[b].tolist() == want.tolist()
    assert len({len(s[0]) for s, _ in steps[1:]} | {0}) > 1


@pytest.mark.parametrize("bs", [1, 4, 32])
def test_greedy_identity_at_any_batch_size(tmp_path, bs):
    target = tiny_llama(seed=2, layers=4, scale=4.0)
    prop = proposer(target, random_peagle(target, tmp_path / "d"), DEVICE)
    prompts, refs = greedy_batch(target, bs, 12)
    assert [r.tokens for r in run_engine(target, prop, prompts, 12)] == refs


def test_greedy_identity_with_rows_joining(tmp_path):
    target = tiny_llama(seed=3, layers=4, scale=4.0)
    prop = proposer(target, random_peagle(target, tmp_path / "d", depths=3), DEVICE, K=5)
    prompts = [[1 + (5 * b + j) % 90 for j in range(2 + b)] for b in range(6)]
    res, _ = serve_engine(target, prop, prompts, 10, concurrency=2)
    assert [r.tokens for r in res] == [reference_greedy(target, p, 10) for p in prompts]


def test_sampling_follows_the_target_distribution(tmp_path):
    target = tiny_llama(seed=0, layers=4, vocab=12, device=CPU)
    prop = proposer(target, random_peagle(target, tmp_path / "d", layers=1, depths=3))
    assert_sampling_follows_the_target(target, prop)


@pytest.mark.parametrize("change, match", [
    (lambda f: rekey(f, lambda s: {k: v for k, v in s.items() if k != "mask_hidden"}),
     r"not P-EAGLE's layout \(2 layers, draft_vocab_size=48\): missing \['mask_hidden'\]"),
    (lambda f: rekey(f, lambda s: {k: v for k, v in s.items() if not k.startswith("layers.1.")}),
     r"missing \['layers.1.input_layernorm.weight'"),
    (lambda f: edit_config(f, norm_before_fc=True), r"\(norm_before_fc=true\)"),
    (lambda f: edit_config(f, mask_token_id=None), "no mask_token_id"),
    (lambda f: edit_config(f, mask_token_id=700), "outside the target's 96 tokens"),
    (lambda f: edit_config(f, eagle_aux_hidden_state_layer_ids=[2, 4, 9]), "inputs of layers"),
])
def test_refusals_in_one_line(target8, tmp_path, change, match):
    folder = copy_folder(FIXTURE, tmp_path)
    change(folder)
    with pytest.raises(ConfigError, match=match) as e:
        methods.get("peagle").check(cfg_of(folder), target8.config)
    assert "\n" not in str(e.value)


def test_other_checkpoints_and_settings_are_refused(target8, tmp_path):
    with pytest.raises(ConfigError, match="holds no P-EAGLE drafter"):
        methods.get("peagle").check(cfg_of(REPO / "tests" / "fixtures" / "speculators-eagle3.1"), target8.config)
    with pytest.raises(ConfigError, match="does not exist"):
        methods.get("peagle").check(cfg_of(tmp_path / "none"), target8.config)
    with pytest.raises(ConfigError, match="peagle.K must be null"):
        methods.get("peagle").check(cfg_of(FIXTURE, K=0), target8.config)
    with pytest.raises(ConfigError, match="a speculators 'peagle' checkpoint; .* and peagle \\(method=peagle\\)"):
        methods.get("eagle").check(OmegaConf.create({"K": 3, "sampling": {"temperature": 0.0}, "model": {"name": "t", "path": None},
                                                     "method": {**methods.settings("eagle"), "checkpoint": str(FIXTURE),
                                                                "version": 3}}), target8.config)
    with pytest.raises(NotImplementedError):  # backend=vllm: "no counterpart in vLLM" (not mapped yet)
        methods.get("peagle").vllm_config(cfg_of(FIXTURE))


def test_our_layout_round_trips(tmp_path):
    target = tiny_llama(seed=5, layers=4, device=CPU)
    folder = random_peagle(target, tmp_path / "d", layers=3, depths=5)
    assert formats.detect(folder) == "speculators-peagle"
    d = formats.peagle.load(folder, target, CPU, torch.float32)
    assert len(d.layers) == 3 and d.depths == 5 and d.taps == (0, 1, 2)


def test_cod_sampling_thins_the_chains_depth_by_depth():
    from specbench.train.peagle import cod_entries

    anchor, depth = cod_entries(40, 4, 0.7, 0.2, torch.Generator().manual_seed(0))
    counts = torch.bincount(depth).tolist()
    assert counts[0] == 40 and counts == [40, int(39 * 0.7), int(38 * 0.49), int(37 * 0.343)]
    assert int((anchor + depth).max()) < 40  # every slot has a teacher
    for d in range(1, 4):  # a chain at depth d went on from one kept at depth d-1
        assert set(anchor[depth == d].tolist()) <= set(anchor[depth == d - 1].tolist())


def test_peagle_trainer_end_to_end(feature_setup, monkeypatch):
    """`drafter=peagle` on an 8-layer target: COD training lowers the held-out loss, the checkpoint
    is written in speculators' layout with its card, resumes, loads through method=peagle, and
    decoding with it is token-identical to greedy with drafts accepted."""
    from specbench.drafters.eagle3 import tap_layers
    from specbench.train import features, peagle as train_peagle

    _, tok, convs, cfg, root = feature_setup
    target = frozen_target8()
    patch_eval_slice(monkeypatch, convs)
    dr = {"kind": "peagle", "name": "tiny_peagle", "layers": 2, "depths": 3, "draft_vocab": 64, "mask_token_id": 95,
          "down_sample": 0.7, "down_sample_min": 0.2}
    c = OmegaConf.merge(cfg, {"drafter": dr, "features": {"layers": [*tap_layers(8), "final"],
                                                          "dir": str(root / "features-pe")}, "train": {"steps": 60}})
    items = features.load(features.build(target, tok, "tiny8", c.features, CPU, torch.float32, progress=False,
                                         convs=convs))
    out0, out = root / "peagle_0", root / "peagle"
    out0.mkdir()
    out.mkdir()
    before = train_peagle.train(OmegaConf.merge(c, {"train": {"steps": 1, "lr": 1e-9}}), target, tok, items, out0, {2},
                                CPU, progress=False)["summary"]
    res = train_peagle.train(c, target, tok, items, out, {2}, CPU, progress=False)
    s = res["summary"]
    assert s["eval_loss"] < before["eval_loss"] and len(s["eval_top1_agreement"]) == 3  # per depth
    train_peagle.finish(c, res, out, "tiny8", {**features.stats(items), "dropped": {}, "key": "k"}, "python -m x")
    assert formats.detect(out) == "speculators-peagle" and formats.peagle.depths(out) == 3
    assert (out / "README.md").read_text().startswith("# tiny_peagle")
    again = train_peagle.train(c, target, tok, items, out, {2}, CPU, progress=False)  # resumed at its last step
    assert again["summary"]["train_seconds_this_run"] < s["train_seconds_this_run"]
    prop = proposer(target, out)
    ps = [it["tokens"][:it["prompt_len"]].tolist() for it in items if it["answered"]][:3]  # answers it trained on
    got = run_engine(target, prop, ps, 16)
    assert [r.tokens for r in got] == [reference_greedy(target, p, 16) for p in ps]
    assert sum(sum(r.accept_lens) for r in got) > 0


def test_the_trainer_holds_each_entry_to_the_targets_distribution_two_ahead():
    """The entry at position a + d (anchor a, depth d) drafts x_{a+d+2}: it is held to the target's
    distribution of that token (its output rows of the draft vocabulary on the final state at
    a + d + 1), written out here over the same COD draw."""
    from specbench.train.peagle import cod_entries, peagle_loss

    target = tiny_llama(seed=4, layers=6, device=CPU)
    V = target.config.vocab_size
    lc = layer_config(target.config, V)
    lc.num_hidden_layers = 2
    d = randomize(PEagleDrafter(target, lc, V, V - 1, 3, layers=(2, 3, 4)), 1)
    tok = torch.tensor([[1, 17, 33, 5, 60, 12, 9, 41, 77, 3, 28, 50]])
    valid = torch.ones_like(tok, dtype=torch.bool)
    with Tap(target, (*d.taps, "final")) as tap, torch.no_grad():
        target(tok)
        got = tap.take()
    taps, fin = torch.cat([got[t] for t in d.taps], -1), got["final"]
    dr = OmegaConf.create({"depths": 3, "down_sample": 0.7, "down_sample_min": 0.2})
    head = target.lm_head.weight
    loss = peagle_loss(d, tok, taps, fin, valid, head, dr, torch.Generator().manual_seed(7))[0]
    anchor, depth = cod_entries(10, 3, 0.7, 0.2, torch.Generator().manual_seed(7))
    with torch.no_grad():
        logits = d.logits(d.train_forward(taps[:, :11], tok[:, 1:], anchor, depth))[0]
        p = torch.softmax(fin[0, anchor + depth + 1] @ head.T, -1)
    torch.testing.assert_close(loss, -(p * torch.log_softmax(logits, -1)).sum(-1).mean())
