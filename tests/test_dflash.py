"""DFlash: the published layouts load strictly and give their reference's outputs (Z Lab's
``dflash_generate`` drafts, speculators' training forward), the incremental drafter cache drafts
what a full recompute drafts, and the method is lossless (greedy identity at bs 1/4/32 and with
rows joining; the sampling rule's chi-square test)."""

import json

import pytest
import torch
from omegaconf import OmegaConf

from specbench import methods
from specbench.decode.hidden import Tap
from specbench.decode.verify import Sampling, Synthetic
from specbench.drafters import formats, randomize
from specbench.drafters.dflash import DFlashDrafter, default_layer_ids, exp_decay, layer_config, taps_of
from specbench.errors import ConfigError
from conftest import REPO
from helpers import (DEVICE, record_drafts, assert_sampling_follows_the_target, copy_folder, edit_config, greedy_batch,
                     reference_greedy, rekey, run_engine, serve_engine, tiny_llama)
from test_feature_methods import feature_setup, frozen_target8, patch_eval_slice  # noqa: F401 - a fixture

FIXTURES = REPO / "tests" / "fixtures"
ZLAB, SPECULATORS = FIXTURES / "dflash", FIXTURES / "speculators-dflash"
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def target4():
    return tiny_llama(seed=0, layers=4, scale=4.0, device=CPU)


def cfg_of(folder, **method):
    return OmegaConf.create({"K": 3, "sampling": {"temperature": 0.0}, "model": {"name": "tiny", "path": None},
                             "method": {**methods.settings("dflash"), "checkpoint": str(folder), **method}})


def proposer(target, folder, device=CPU, **method):
    cfg = cfg_of(folder, **method)
    methods.get("dflash").check(cfg, target.config)
    return methods.get("dflash")(cfg, target, None, device, torch.float32)


def spy_logits(prop):
    seen = []
    logits = prop.drafter.logits

    def spy(h):
        out = logits(h)
        seen.append(out.detach().clone())
        return out

    prop.drafter.logits = spy
    return seen


def test_z_labs_layout_drafts_what_its_reference_drafted(target4):
    """Every step's draft logits equal those of Z Lab's own ``dflash_generate`` on the same
    target (its target layer 3 is the last: HF's normed final state), and the output is its output."""
    ref = torch.load(ZLAB / "reference.pt")
    assert formats.detect(ZLAB) == "dflash"
    prop = proposer(target4, ZLAB)
    assert prop.drafter.taps == (1, "final") and prop.drafter.anchor == "bonus" and methods.get("dflash").spec_len(
        cfg_of(ZLAB), CPU) == 3
    seen = spy_logits(prop)
    out = run_engine(target4, prop, [ref["prompt"].tolist()], len(ref["output"]))[0].tokens
    assert out == ref["output"].tolist()
    assert len(seen) >= len(ref["draft_logits"]) - 1
    for mine, theirs in zip(seen, ref["draft_logits"]):
        torch.testing.assert_close(mine[0], theirs, atol=2e-4, rtol=1e-4)


def test_speculators_layout_gives_its_training_forwards_logits(target4):
    """speculators' dflash: aux ids are HF ``hidden_states`` indices (Z Lab's + 1), a head of its
    own over a draft vocabulary mapped by d2t, ``sample_from_anchor`` (B drafts): its own training
    forward's logits at the anchors it drew."""
    ref = torch.load(SPECULATORS / "reference.pt")
    assert formats.detect(SPECULATORS) == "speculators-dflash"
    d = formats.dflash.load(SPECULATORS, target4, CPU, torch.float32)
    assert d.layer_ids == [1, 3] and d.taps == (1, "final") and d.anchor == "next" and d.drafts == 4
    tokens = ref["tokens"][None]
    with Tap(target4, d.taps) as tap, torch.no_grad():
        target4(tokens)
        got = tap.take()
    taps = torch.cat([got[t] for t in d.taps], dim=-1)
    with torch.no_grad():
        h = d.train_forward(taps, tokens, torch.ones_like(tokens, dtype=torch.bool), ref["anchors"][None])
    torch.testing.assert_close(d.logits(h)[0], ref["logits"], atol=2e-4, rtol=1e-4)
    prop = proposer(target4, SPECULATORS)
    assert methods.get("dflash").spec_len(cfg_of(SPECULATORS), CPU) == 4
    prompt = tokens[0, :9].tolist()
    assert run_engine(target4, prop, [prompt], 16)[0].tokens == reference_greedy(target4, prompt, 16)


def random_dflash(target, folder, block=4, layers=2, seed=0):
    tc = target.config
    ids = list(range(1, tc.num_hidden_layers))[-layers:]  # the last is the target's normed final state
    d = DFlashDrafter(target, layer_config(tc, layers, tc.vocab_size - 1, block, ids), ids, block, tc.vocab_size - 1)
    randomize(d, seed)
    formats.dflash.save(folder, d, dtype=torch.float32)
    return folder


@pytest.mark.parametrize("bs", [1, 4])
def test_the_drafter_cache_drafts_what_a_full_recompute_drafts(tmp_path, bs):
    """Rows accept several drafts a step (synthetic acceptance), so the cache appends ragged runs
    of verified tokens; every step's drafts equal a recompute over the whole sequence so far."""
    target = tiny_llama(seed=1, layers=6, device=CPU)
    prop = proposer(target, random_dflash(target, tmp_path / "d", block=5, layers=2))
    seen = spy_logits(prop)
    steps = record_drafts(prop)
    prompts = [[1, 5, 9, 3, 7, 11, 2][: 4 + b] for b in range(bs)]
    res = run_engine(target, prop, prompts, 18, sampling=Sampling(synthetic=Synthetic(0.8, seed=0)))
    assert sum(len(r.tokens) for r in res) >= 18 * bs
    d = prop.drafter
    for (seqs, drafts), logits in zip(steps, seen):
        for b, seq in enumerate(seqs):
            tokens = torch.tensor([seq])
            with Tap(target, d.taps) as tap, torch.no_grad():
                target(tokens)
                got = tap.take()
            taps = torch.cat([got[t] for t in d.taps], dim=-1)
            with torch.no_grad():
                h = d.train_forward(taps, tokens, torch.ones_like(tokens, dtype=torch.bool),
                                    torch.tensor([[len(seq) - 1]]))
            full = d.logits(h[0, 0, 1:])
            torch.testing.assert_close(logits[b], full, atol=1e-4, rtol=1e-4)
            assert drafts[b].tolist() == full.argmax(-1).tolist()
    assert len({len(s[0]) for s, _ in steps[1:]} | {0}) > 1


@pytest.mark.parametrize("bs", [1, 4, 32])
def test_greedy_identity_at_any_batch_size(tmp_path, bs):
    target = tiny_llama(seed=2, layers=4, scale=4.0)
    prop = proposer(target, random_dflash(target, tmp_path / "d"), DEVICE)
    prompts, refs = greedy_batch(target, bs, 12)
    assert [r.tokens for r in run_engine(target, prop, prompts, 12)] == refs


def test_greedy_identity_with_rows_joining(tmp_path):
    target = tiny_llama(seed=3, layers=4, scale=4.0)
    prop = proposer(target, random_dflash(target, tmp_path / "d", block=3), DEVICE, block_size=6)
    prompts = [[1 + (5 * b + j) % 90 for j in range(2 + b)] for b in range(6)]
    res, _ = serve_engine(target, prop, prompts, 10, concurrency=2)
    assert [r.tokens for r in res] == [reference_greedy(target, p, 10) for p in prompts]


def test_sampling_follows_the_target_distribution(tmp_path):
    """Seeded rows of one prompt at T=1: the 2nd and 3rd tokens (drafted by the block's argmax,
    verified by the lossless rule) follow the target's exact marginals (chi-square)."""
    target = tiny_llama(seed=0, layers=4, vocab=12, device=CPU)  # a small vocabulary: random drafts pass often
    prop = proposer(target, random_dflash(target, tmp_path / "d", block=4, layers=1))
    assert_sampling_follows_the_target(target, prop)


def test_layer_ids_and_decay():
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33] and default_layer_ids(30, 1) == [15]
    assert taps_of([1, 29], 30) == (1, "final")
    with pytest.raises(ValueError, match="decoder layers 0..29"):
        taps_of([30], 30)
    w = exp_decay(4, 4.0, "bonus")
    assert w[0] == 0 and w[1] == 1 and torch.isclose(w[2], torch.exp(torch.tensor(-0.25)))
    assert exp_decay(4, 4.0, "next")[0] == 1


@pytest.mark.parametrize("change, match", [
    (lambda f: rekey(f, lambda s: {k: v for k, v in s.items() if k != "hidden_norm.weight"}),
     r"not DFlash's layout \(2 draft layers, no DSpark heads\): missing \['hidden_norm.weight'\]"),
    (lambda f: rekey(f, lambda s: {**s, "layers.0.self_attn.qkv_proj.weight": s["layers.0.self_attn.q_proj.weight"].clone()}),
     r"fused q\|k\|v projections"),
    (lambda f: rekey(f, lambda s: {**s, "layers.0.self_attn.sinks": torch.zeros(4)}), "attention sinks"),
    (lambda f: edit_config(f, layer_types=["sliding_attention", "full_attention"]), "sliding-window layers"),
    (lambda f: (f / "mask_embedding.pt").write_bytes(b""), "a mask_embedding.pt sidecar"),
    (lambda f: edit_config(f, num_target_layers=36), "made for a target of 36 layers; the target has 4"),
    (lambda f: edit_config(f, dflash_config={"mask_token_id": 95, "target_layer_ids": [1, 7]}), "decoder layers 0..3"),
    (lambda f: edit_config(f, dflash_config={"target_layer_ids": [1, 3]}), "no mask_token_id"),
    (lambda f: edit_config(f, head_dim=8), r"layers.0.self_attn.q_proj.weight is \(64, 64\), config.json makes it \(32, 64\)"),
    (lambda f: edit_config(f, hidden_act="gelu"), "hidden_act=gelu"),
    (lambda f: edit_config(f, dflash_config={"mask_token_id": 500, "target_layer_ids": [1, 3]}), "outside the target's 96 tokens"),
])
def test_z_lab_refusals_in_one_line(target4, tmp_path, change, match):
    folder = copy_folder(ZLAB, tmp_path)
    change(folder)
    with pytest.raises(ConfigError, match=match) as e:
        methods.get("dflash").check(cfg_of(folder), target4.config)
    assert "\n" not in str(e.value)


def test_a_drafter_for_another_target_is_refused(tmp_path):
    wide = tiny_llama(seed=0, layers=4, hidden=128, device=CPU)
    with pytest.raises(ConfigError, match="hidden size 64 for a target of 64; the target's is 128"):
        methods.get("dflash").check(cfg_of(ZLAB), wide.config)
    with pytest.raises(ConfigError, match="holds no DFlash drafter"):
        methods.get("dflash").check(cfg_of(FIXTURES / "eagle3"), wide.config)
    with pytest.raises(ConfigError, match="does not exist: train one"):
        methods.get("dflash").check(cfg_of(tmp_path / "nothing"), wide.config)
    with pytest.raises(ConfigError, match="dflash.block_size must be null"):
        methods.get("dflash").check(cfg_of(ZLAB, block_size=1), wide.config)


def test_speculators_refusals(target4, tmp_path):
    folder = copy_folder(SPECULATORS, tmp_path)
    edit_config(folder, aux_hidden_state_layer_ids=[0, 4])
    with pytest.raises(ConfigError, match="read the embeddings"):
        methods.get("dflash").check(cfg_of(folder), target4.config)
    folder = copy_folder(SPECULATORS, tmp_path / "b")
    rekey(folder, lambda s: {k: v for k, v in s.items() if k != "d2t"})
    with pytest.raises(ConfigError, match=r"missing \['d2t'\]"):
        methods.get("dflash").check(cfg_of(folder), target4.config)


def test_the_trained_layout_round_trips_and_z_labs_code_would_read_it(tmp_path):
    target = tiny_llama(seed=5, layers=4, device=CPU)
    folder = random_dflash(target, tmp_path / "d", block=6, layers=1)
    raw = json.loads((folder / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["block_size"] == 6
    assert raw["dflash_config"] == {"mask_token_id": 95, "target_layer_ids": [3]}
    d = formats.dflash.load(folder, target, CPU, torch.float32)
    assert d.block_size == 6 and d.taps == ("final",) and d.drafts == 5


def test_dflash_trainer_end_to_end(feature_setup, monkeypatch):
    """`drafter=dflash` on an 8-layer target: training on anchored blocks lowers the held-out loss,
    the checkpoint is written in Z Lab's layout with its card, resumes where it stopped, loads
    through method=dflash, and decoding with it is token-identical to greedy with drafts accepted."""
    from specbench.train import dflash as train_dflash, features

    _, tok, convs, cfg, root = feature_setup
    target = frozen_target8()
    patch_eval_slice(monkeypatch, convs)
    dr = {"kind": "dflash", "name": "tiny_dflash", "layers": 2, "target_layers": [3, 7], "block_size": 4,
          "mask_token_id": 95, "anchors": 6, "gamma": 4.0, "init": "target"}
    c = OmegaConf.merge(cfg, {"drafter": dr, "features": {"layers": [3, "final"], "dir": str(root / "features-df")},
                              "train": {"steps": 60}})
    fs = features.build(target, tok, "tiny8", c.features, DEVICE, torch.float32, progress=False, convs=convs)
    items = features.load(fs)
    out0, out = root / "dflash_0", root / "dflash"
    out0.mkdir()
    out.mkdir()
    before = train_dflash.train(OmegaConf.merge(c, {"train": {"steps": 1, "lr": 1e-9}}), target, tok, items, out0,
                                {2}, DEVICE, progress=False)["summary"]
    res = train_dflash.train(c, target, tok, items, out, {2}, DEVICE, progress=False)
    s = res["summary"]
    assert s["eval_loss"] < before["eval_loss"] and len(s["eval_top1_agreement"]) == 3  # per drafted slot
    assert s["mask_token_id"] == 95
    assert s["trained_block_positions"] == 60 * 4 * 6 * 3
    train_dflash.finish(c, res, out, "tiny8", {**features.stats(items), "dropped": {}, "key": "k"}, "python -m x")
    assert formats.detect(out) == "dflash" and (out / "README.md").read_text().startswith("# tiny_dflash")
    again = train_dflash.train(c, target, tok, items, out, {2}, DEVICE, progress=False)  # resumed at its last step
    assert again["summary"]["train_seconds_this_run"] < s["train_seconds_this_run"]
    prop = proposer(target, out, DEVICE)
    assert prop.hidden_layers == (3, "final")
    ps = [it["tokens"][:it["prompt_len"]].tolist() for it in items if it["answered"]][:3]  # answers it trained on
    got = run_engine(target, prop, ps, 16)
    assert [r.tokens for r in got] == [reference_greedy(target, p, 16) for p in ps]
    assert sum(sum(r.accept_lens) for r in got) > 0


def test_the_mask_token_is_one_the_data_never_holds():
    from types import SimpleNamespace

    from specbench.train.dflash import mask_token

    tok = SimpleNamespace(mask_token_id=None, eos_token_id=2, bos_token_id=1, pad_token_id=None,
                          added_tokens_decoder={0: "a", 1: "b", 2: "c", 5: "d", 7: "e"})
    items = [{"tokens": torch.tensor([3, 7, 9])}]
    assert mask_token(OmegaConf.create({}), tok, items) == 5  # 7 occurs, 2 and 1 are EOS/BOS
    assert mask_token(OmegaConf.create({"mask_token_id": 11}), tok, items) == 11
    tok.mask_token_id = 4
    assert mask_token(OmegaConf.create({}), tok, items) == 4
    tok.mask_token_id, tok.added_tokens_decoder = None, {7: "e"}
    with pytest.raises(ConfigError, match="set drafter.mask_token_id"):
        mask_token(OmegaConf.create({}), tok, items)


def test_backend_vllm_runs_vllms_dflash_with_the_trained_block():
    cls = methods.get("dflash")
    assert cls.vllm_config(cfg_of(ZLAB)) == {"method": "dflash", "model": str(ZLAB), "num_speculative_tokens": 3}
    with pytest.raises(ConfigError, match="leave dflash.block_size=null"):
        cls.vllm_config(cfg_of(ZLAB, block_size=6))
    with pytest.raises(ConfigError, match="sample_from_anchor: true"):
        cls.vllm_config(cfg_of(SPECULATORS))
