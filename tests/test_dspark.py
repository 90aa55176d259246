"""DSpark: the published layouts (DeepSpec's, speculators') load strictly and give their
reference's drafts, Markov-corrected logits and confidences; the confidence cut verifies a prefix;
the method is lossless (greedy identity at bs 1/4/32, with rows joining, and under sampling); our
trainer writes DeepSpec's layout, which loads back."""

import json

import pytest
import torch
from omegaconf import OmegaConf

from specbench import methods
from specbench.decode.hidden import Tap
from specbench.decode.verify import Sampling
from specbench.drafters import formats, randomize
from specbench.drafters.dflash import layer_config
from specbench.drafters.dspark import DSparkDrafter
from specbench.errors import ConfigError
from conftest import REPO
from helpers import (DEVICE, record_drafts, assert_sampling_follows_the_target, copy_folder, edit_config, greedy_batch,
                     reference_greedy, rekey, run_engine, serve_engine, tiny_llama)
from test_feature_methods import feature_setup, frozen_target8, patch_eval_slice  # noqa: F401 - a fixture

FIXTURES = REPO / "tests" / "fixtures"
DEEPSPEC = {"gated": FIXTURES / "deepspec-dspark-gated"}  # W2 (gate * W1[prev]): vanilla's head with a gate
SPECULATORS = FIXTURES / "speculators-dspark"
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def target4():
    return tiny_llama(seed=0, layers=4, scale=4.0, device=CPU)


def cfg_of(folder, name="dspark", **method):
    return OmegaConf.create({"K": 3, "sampling": {"temperature": 0.0}, "model": {"name": "tiny", "path": None},
                             "method": {**methods.settings(name), "checkpoint": str(folder), **method}})


def proposer(target, folder, device=CPU, **method):
    cfg = cfg_of(folder, **method)
    methods.get("dspark").check(cfg, target.config)
    return methods.get("dspark")(cfg, target, None, device, torch.float32)


def taps_of_tokens(target, d, tokens):
    with Tap(target, d.taps) as tap, torch.no_grad():
        target(tokens)
        got = tap.take()
    return torch.cat([got[t] for t in d.taps], dim=-1)


@pytest.mark.parametrize("kind", ["gated"])
def test_deepspecs_layout_drafts_what_its_evaluator_drafted(target4, kind):
    """DeepSpec's first block after a prompt: its drafts (B of them: slot k drafts x_{p+k+1}), the
    Markov-corrected logits and the confidence logits, from our cache-and-block path."""
    folder = DEEPSPEC[kind]
    ref = torch.load(folder / "reference.pt")
    assert formats.detect(folder) == "deepspec"
    prop = proposer(target4, folder)
    d = prop.drafter
    assert isinstance(d, DSparkDrafter) and d.anchor == "next" and d.markov_head.kind == kind
    assert d.taps == (1, "final") and methods.get("dspark").spec_len(cfg_of(folder), CPU) == 5
    steps = record_drafts(prop)
    tokens = ref["tokens"]
    got = run_engine(target4, prop, [tokens[:-1].tolist()], 3)[0].tokens
    assert got == reference_greedy(target4, tokens[:-1].tolist(), 3)
    assert steps[0][1][0].tolist() == ref["drafts"].tolist()
    taps = taps_of_tokens(target4, d, tokens[None])
    with torch.no_grad():  # the block at the last token, teacher-forced on the reference's drafts
        h = d.train_forward(taps, tokens[None], torch.ones(1, len(tokens), dtype=torch.bool),
                            torch.tensor([[len(tokens) - 1]]))[0, 0]
        prev = torch.cat([tokens[-1:], ref["drafts"][:-1]])
        logits, conf = d.train_logits(h, prev)
    torch.testing.assert_close(logits, ref["logits"], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(conf, ref["confidence_logits"], atol=2e-4, rtol=1e-4)
    with torch.no_grad():
        ids, c, _ = d.draft(h[None], tokens[-1:])
    assert ids[0].tolist() == ref["drafts"].tolist()
    torch.testing.assert_close(c[0], ref["confidence_logits"], atol=2e-4, rtol=1e-4)


def test_speculators_layout_gives_its_training_forwards_logits(target4):
    """speculators' dspark (an rnn Markov head over a draft vocabulary of half the target's, aux
    ids = Z Lab's + 1, sample_from_anchor by default): its training forward's corrected logits
    and confidence logits at its anchors, teacher-forced on the data's tokens."""
    ref = torch.load(SPECULATORS / "reference.pt")
    assert formats.detect(SPECULATORS) == "speculators-dspark"
    d = formats.dflash.load(SPECULATORS, target4, CPU, torch.float32)
    assert d.layer_ids == [1, 3] and d.anchor == "next" and d.markov_head.kind == "rnn" and d.lm_head is not None
    tokens = ref["tokens"][None]
    taps = taps_of_tokens(target4, d, tokens)
    anchors = ref["anchors"][None]
    with torch.no_grad():
        h = d.train_forward(taps, tokens, torch.ones_like(tokens, dtype=torch.bool), anchors)[0]  # [A, B, d]
        prev = tokens[0, anchors[0][:, None] + torch.arange(4)]  # slot k's previous token: x_{p+k}
        logits, conf = d.train_logits(h, prev)
    torch.testing.assert_close(logits, ref["logits"], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(conf, ref["confidence_logits"], atol=2e-4, rtol=1e-4)
    prop = proposer(target4, SPECULATORS, threshold=0.5)
    prompt = tokens[0, :9].tolist()
    assert run_engine(target4, prop, [prompt], 16)[0].tokens == reference_greedy(target4, prompt, 16)


def random_dspark(target, folder, block=4, layers=2, kind="vanilla", rank=8, seed=0, anchor="next"):
    tc = target.config
    ids = list(range(1, tc.num_hidden_layers))[-layers:]
    d = DSparkDrafter(target, layer_config(tc, layers, tc.vocab_size - 1, block, ids), ids, block, tc.vocab_size - 1,
                      anchor, markov_rank=rank, markov_type=kind)
    randomize(d, seed)
    formats.dflash.save(folder, d, dtype=torch.float32)
    return folder


def test_the_confidence_cut_verifies_the_prefix_before_the_first_doubt(tmp_path):
    """A row keeps its drafts up to the first slot whose confidence is below the threshold; the
    chain is as wide as the longest kept prefix; threshold 0 keeps every draft."""
    target = tiny_llama(seed=1, layers=4, device=CPU)
    prop = proposer(target, random_dspark(target, tmp_path / "d", block=6, kind="rnn"), threshold=0.5)
    h = torch.randn(3, 6, target.config.hidden_size)
    first = torch.tensor([3, 4, 5])
    with torch.no_grad():
        ids, conf, _ = prop.drafter.draft(h, first)
        draft = prop.drafts(h, first)
    p = torch.sigmoid(conf)
    want = [next((k for k in range(6) if p[b, k] < 0.5), 6) for b in range(3)]
    n = max(want)
    assert draft.tokens.shape == (3, n) and draft.tokens.tolist() == ids[:, :n].tolist()
    assert draft.valid.sum(1).tolist() == want
    prop.threshold = 0.0
    assert prop.drafts(h, first).tokens.shape == (3, 6)


def test_a_bonus_anchor_rnn_head_runs_its_state_through_the_anchor_slot():
    """speculators' ``sample_from_anchor: false``: slot 0 drafts nothing, but the rnn head's
    recurrence starts there (previous token: the anchor's), so slot k's previous tokens are
    [x_p, x_p, d_1, ...] as its training forward reads them: the biases drafting used are those."""
    target = tiny_llama(seed=1, layers=4, device=CPU)
    tc = target.config
    d = DSparkDrafter(target, layer_config(tc, 1, 95, 5, [3]), [3], 5, 95, "bonus", markov_rank=8, markov_type="rnn")
    randomize(d)
    biases, step = [], d.markov_head.step

    def spy(prev, h, state=None):
        out = step(prev, h, state)
        biases.append(out[0])
        return out

    d.markov_head.step = spy
    with torch.no_grad():
        h, first = torch.randn(2, 5, tc.hidden_size, generator=torch.Generator().manual_seed(1)), torch.tensor([3, 4])
        ids, conf, _ = d.draft(h, first)
        d.markov_head.step = step
        want = d.markov_head.teacher_forced(torch.cat([first[:, None], first[:, None], ids[:, :-1]], 1), h)
    assert ids.shape == (2, 4) and len(biases) == 5  # the anchor slot's step, then one per draft
    torch.testing.assert_close(torch.stack(biases[1:], 1), want[:, 1:])


@pytest.mark.parametrize("bs", [1, 4, 32])
def test_greedy_identity_at_any_batch_size(tmp_path, bs):
    target = tiny_llama(seed=2, layers=4, scale=4.0)
    prop = proposer(target, random_dspark(target, tmp_path / "d", kind="gated"), DEVICE, threshold=0.4)
    prompts, refs = greedy_batch(target, bs, 12)
    assert [r.tokens for r in run_engine(target, prop, prompts, 12)] == refs


def test_greedy_identity_with_rows_joining(tmp_path):
    target = tiny_llama(seed=3, layers=4, scale=4.0)
    prop = proposer(target, random_dspark(target, tmp_path / "d", block=3, kind="rnn"), DEVICE, block_size=5,
                    threshold=0.3)
    prompts = [[1 + (5 * b + j) % 90 for j in range(2 + b)] for b in range(6)]
    res, _ = serve_engine(target, prop, prompts, 10, concurrency=2)
    assert [r.tokens for r in res] == [reference_greedy(target, p, 10) for p in prompts]


@pytest.mark.parametrize("sample_drafts", [True, False])
def test_sampling_follows_the_target_distribution(tmp_path, sample_drafts):
    """Seeded rows of one prompt at T=1, drafts cut by confidence, sampled from the drafter (min(1,
    p/q)) or its argmax (the one-hot rule): the 2nd and 3rd tokens follow the target's exact
    marginals (chi-square)."""
    target = tiny_llama(seed=0, layers=4, vocab=12, device=CPU)
    prop = proposer(target, random_dspark(target, tmp_path / "d", block=4, layers=1), threshold=0.2,
                    sample_drafts=sample_drafts)
    assert_sampling_follows_the_target(target, prop)


def test_at_a_temperature_drafts_are_drawn_from_the_drafters_distribution(tmp_path):
    """As DeepSpec: at T > 0 each slot's draft is drawn from q, the drafter's warped distribution
    (its Markov bias from the slot before included), and carried with the draft for the min(1, p/q)
    rule; dspark.sample_drafts=false drafts each slot's argmax."""
    target = tiny_llama(seed=0, layers=4, vocab=12, device=CPU)
    folder = random_dspark(target, tmp_path / "d", block=4, layers=1)
    got, steps = {}, {}
    for sample_drafts in (True, False):
        prop = proposer(target, folder, sample_drafts=sample_drafts)
        steps[sample_drafts] = record_drafts(prop)  # (each row's sequence, its drafts) per step
        drafts, propose = [], prop.propose
        prop.propose = lambda state, propose=propose, drafts=drafts: drafts.append(propose(state)) or drafts[-1]
        run_engine(target, prop, [[3, 5, 7, 9]] * 64, 3, sampling=Sampling(1.0), gen=torch.Generator().manual_seed(1))
        got[sample_drafts] = drafts

    def distinct_drafts_of_one_sequence(step):  # rows whose sequences are equal: how many drafts they got
        seqs, tokens = step
        by = {}
        for seq, row in zip(seqs, tokens.tolist()):
            by.setdefault(tuple(seq), set()).add(tuple(row))
        return max(len(v) for v in by.values())

    assert all(d.q is None for d in got[False])
    assert distinct_drafts_of_one_sequence(steps[False][0]) == 1  # argmax: one sequence, one draft
    for d in got[True]:
        assert d.q is not None and d.q.shape == (*d.tokens.shape, 12)
        torch.testing.assert_close(d.q.sum(-1), torch.ones(d.tokens.shape))
        assert (d.q.gather(2, d.tokens[..., None]) > 0).all()
    assert distinct_drafts_of_one_sequence(steps[True][0]) > 1  # drawn: rows of one sequence draw apart


@pytest.mark.parametrize("change, match", [
    (lambda f: rekey(f, lambda s: {k: v for k, v in s.items() if k != "markov_head.markov_w2.weight"}),
     r"a gated Markov head of rank 8, a confidence head over the Markov embedding\): missing \['markov_head.markov_w2"),
    (lambda f: edit_config(f, markov_head_type="vanilla"), r"unexpected \['markov_head.gate_proj.bias'"),
    (lambda f: edit_config(f, markov_rank=4), r"markov_head.markov_w1.weight is \(96, 8\); config.json and the target make it \(96, 4\)"),
    (lambda f: edit_config(f, markov_head_type="lstm"), "head types vanilla, gated, rnn"),
    (lambda f: edit_config(f, target_layer_ids=[-1, 3]), r"read the embeddings \(-1\)"),
    (lambda f: edit_config(f, architectures=["Gemma4DSparkModel"]), "reads its Qwen3 layers"),
    (lambda f: rekey(f, lambda s: {k: v for k, v in s.items() if k != "lm_head.weight"}), r"missing \['lm_head.weight'\]"),
])
def test_deepspec_refusals_in_one_line(target4, tmp_path, change, match):
    folder = copy_folder(DEEPSPEC["gated"], tmp_path)
    change(folder)
    with pytest.raises(ConfigError, match=match) as e:
        methods.get("dspark").check(cfg_of(folder), target4.config)
    assert "\n" not in str(e.value)


def test_each_method_refuses_the_others_checkpoints(target4):
    with pytest.raises(ConfigError, match="is a dspark drafter .*: run it with method=dspark"):
        methods.get("dflash").check(cfg_of(DEEPSPEC["gated"], "dflash"), target4.config)
    with pytest.raises(ConfigError, match="is a dflash drafter \\(no DSpark heads\\): run it with method=dflash"):
        methods.get("dspark").check(cfg_of(FIXTURES / "dflash"), target4.config)
    with pytest.raises(ConfigError, match="dspark.threshold must be a number in"):
        methods.get("dspark").check(cfg_of(SPECULATORS, threshold=1.5), target4.config)


def test_our_layout_is_deepspecs_without_the_targets_copies(tmp_path):
    target = tiny_llama(seed=5, layers=4, device=CPU)
    folder = random_dspark(target, tmp_path / "d", block=6, layers=1, kind="rnn")
    raw = json.loads((folder / "config.json").read_text())
    assert raw["architectures"] == ["Qwen3DSparkModel"] and raw["block_size"] == 6 and raw["target_layer_ids"] == [3]
    assert (raw["markov_rank"], raw["markov_head_type"], raw["enable_confidence_head"],
            raw["confidence_head_with_markov"], raw["mask_token_id"]) == (8, "rnn", True, True, 95)
    assert formats.detect(folder) == "deepspec"
    d = formats.dflash.load(folder, target, CPU, torch.float32)
    assert d.block_size == 6 and d.drafts == 6 and d.lm_head is None and d.embed_tokens is None


def test_backend_vllm_runs_vllms_dspark():
    cls = methods.get("dspark")
    assert cls.vllm_config(cfg_of(SPECULATORS)) == {"method": "dspark", "model": str(SPECULATORS),
                                                   "num_speculative_tokens": 4}
    with pytest.raises(ConfigError, match="does not map dspark.threshold"):
        cls.vllm_config(cfg_of(SPECULATORS, threshold=0.5))


def test_dspark_trainer_end_to_end(feature_setup, monkeypatch):
    """`drafter=dspark` on an 8-layer target: the held-out loss falls, every one of the B slots is
    trained, the checkpoint is DeepSpec's layout with its card, and decoding with it (confidence
    cut on) is token-identical to greedy with drafts accepted."""
    from specbench.train import dflash as train_dflash, features

    _, tok, convs, cfg, root = feature_setup
    target = frozen_target8()
    patch_eval_slice(monkeypatch, convs)
    dr = OmegaConf.load(REPO / "conf" / "drafter" / "dspark.yaml")
    dr = OmegaConf.merge(dr, {"name": "tiny_dspark", "target_layers": [3, 7], "block_size": 4, "mask_token_id": 95,
                              "anchors": 6, "markov_rank": 8, "markov_type": "rnn"})
    c = OmegaConf.merge(cfg, {"drafter": dr, "features": {"layers": [3, "final"], "dir": str(root / "features-ds")},
                              "train": {"steps": 40}})
    fs = features.build(target, tok, "tiny8", c.features, DEVICE, torch.float32, progress=False, convs=convs)
    items = features.load(fs)
    out0, out = root / "dspark_0", root / "dspark"
    out0.mkdir()
    out.mkdir()
    before = train_dflash.train(OmegaConf.merge(c, {"train": {"steps": 1, "lr": 1e-9}}), target, tok, items, out0,
                                {2}, DEVICE, progress=False)["summary"]
    res = train_dflash.train(c, target, tok, items, out, {2}, DEVICE, progress=False)
    s = res["summary"]
    assert s["eval_loss"] < before["eval_loss"] and len(s["eval_top1_agreement"]) == 4  # slot 0 drafts too
    assert isinstance(res["draft"], DSparkDrafter) and res["draft"].markov_head.kind == "rnn"
    train_dflash.finish(c, res, out, "tiny8", {**features.stats(items), "dropped": {}, "key": "k"}, "python -m x")
    assert formats.detect(out) == "deepspec"
    card = (out / "README.md").read_text()
    assert card.startswith("# tiny_dspark: DSpark drafter") and "dspark.threshold" in card
    prop = proposer(target, out, DEVICE, threshold=0.2)
    ps = [it["tokens"][:it["prompt_len"]].tolist() for it in items if it["answered"]][:3]
    got = run_engine(target, prop, ps, 16)
    assert [r.tokens for r in got] == [reference_greedy(target, p, 16) for p in ps]
    assert sum(sum(r.accept_lens) for r in got) > 0


def test_as_a_member_of_combo_or_sam_it_drafts_deterministic_candidates(tmp_path):
    """combo and SAM take their members' drafts apart (``Draft.rows``, no q): a DSpark member does not
    sample its drafts, whatever dspark.sample_drafts says."""
    from specbench.methods import member_cfg

    target = tiny_llama(seed=0, layers=4, vocab=12, device=CPU)
    folder = random_dspark(target, tmp_path / "d", block=4, layers=1)
    cfg = member_cfg(OmegaConf.create({"K": 3, "sampling": {"temperature": 1.0}, "model": {"name": "tiny", "path": None}}), "dspark",
                     {"checkpoint": str(folder)})
    prop = methods.get("dspark")(cfg, target, None, CPU, torch.float32)
    assert not prop.sample_drafts
    drafts, propose = [], prop.propose
    prop.propose = lambda state: drafts.append(propose(state)) or drafts[-1]
    run_engine(target, prop, [[3, 5, 7, 9]] * 4, 3, sampling=Sampling(1.0), gen=torch.Generator().manual_seed(1))
    assert drafts and all(d.q is None and d.rows() for d in drafts)
