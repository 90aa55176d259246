"""Native MTP: speculators' layout gives its own training forward's logits; DeepSeek-V3's module
(MLA, MoE experts stored one by one) and MiMo's are read out of their target's own checkpoint and
compute their family's equations; the module's kept entries draft what a full recompute drafts;
the method is lossless (greedy identity at bs 1/4/32, with rows joining, and under sampling)."""

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from specbench import methods
from specbench.decode.hidden import Tap
from specbench.decode.verify import Sampling, Synthetic
from specbench.drafters import formats, randomize
from specbench.drafters.mtp import MTPDrafter
from specbench.errors import ConfigError
from conftest import REPO
from helpers import (DEVICE, tiny_qwen3_next, record_drafts, assert_sampling_follows_the_target, copy_folder, edit_config, greedy_batch, greedy_cases,
                     reference_greedy, rekey, run_engine, serve_engine, tiny_llama, tiny_qwen3)
from test_feature_methods import feature_setup, frozen_target8, patch_eval_slice  # noqa: F401 - a fixture

FIXTURE = REPO / "tests" / "fixtures" / "speculators-mtp"
CPU = torch.device("cpu")


def cfg_of(folder=None, path=None, K=3):
    return OmegaConf.create({"K": K, "sampling": {"temperature": 0.0}, "model": {"name": "tiny", "path": str(path) if path else None},
                             "method": {**methods.settings("mtp"), "checkpoint": str(folder) if folder else None}})


def proposer(target, folder=None, device=CPU, path=None, K=3):
    cfg = cfg_of(folder, path, K)
    methods.get("mtp").check(cfg, target.config)
    return methods.get("mtp")(cfg, target, None, device, torch.float32)


def final_states(target, tokens):
    with Tap(target, ("final",)) as tap, torch.no_grad():
        target(tokens)
        return tap.take()["final"]


def test_speculators_layout_gives_its_training_forwards_logits():
    ref = torch.load(FIXTURE / "reference.pt")
    target = tiny_qwen3(seed=0, device=CPU)
    assert formats.detect(FIXTURE) == "speculators-mtp" and formats.mtp.steps(FIXTURE) == 2
    tokens = ref["tokens"][None]
    torch.testing.assert_close(final_states(target, tokens)[0], ref["hidden"])
    d = formats.mtp.load(FIXTURE, target, CPU, torch.float32)
    assert d.family == "speculators" and type(d.layer).__name__ == "Qwen3DecoderLayer" and d.head is None
    with torch.no_grad():
        for got, want in zip(d.train_logits(tokens, ref["hidden"][None], 2), ref["logits"], strict=True):
            torch.testing.assert_close(got[0], want, atol=1e-5, rtol=1e-5)
    prompt = tokens[0, :9].tolist()
    assert run_engine(target, proposer(target, FIXTURE), [prompt], 16)[0].tokens == reference_greedy(target, prompt, 16)


def tiny_deepseek(seed=0):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                           n_group=1, topk_group=1, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=16,
                           kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                           max_position_embeddings=512, tie_word_embeddings=False, num_nextn_predict_layers=1)
    m = randomize(DeepseekV3ForCausalLM(cfg), seed).eval()
    m.generation_config.eos_token_id = None
    return m


def tiny_mimo(seed=0):
    """MiMo-7B is a Qwen2 with ``model.mtp_layers.0.*`` beside its weights."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)
    m = randomize(Qwen2ForCausalLM(cfg), seed).eval()
    m.generation_config.eos_token_id = None
    return m


def native_folder(target, folder: Path, family: str, own_head=False, seed=1, per_expert=True) -> Path:
    """The target saved as its authors ship it: its own weights plus the MTP module's keys
    (``num_nextn_predict_layers: 1``), random; DeepSeek's experts one by one, as its checkpoints
    store them."""
    import json

    from safetensors.torch import load_file, save_file

    target.save_pretrained(folder)
    raw = json.loads((folder / "config.json").read_text())
    raw["num_nextn_predict_layers"] = 1
    (folder / "config.json").write_text(json.dumps(raw))
    d = randomize(MTPDrafter(target, "speculators"), seed)  # any family: the same parameters
    prefix, names = formats.mtp.FUSE[family]
    prefix = prefix.format(L=target.config.num_hidden_layers)
    layer = formats.mtp.LAYER_PREFIX.get(family, prefix)
    ours = {v: k for k, v in names.items()}
    extra = {}
    for k, v in d.state_dict().items():
        part, _, rest = k.partition(".")
        if part == "layer":
            extra[layer + rest] = v
        else:
            extra[f"{prefix}{ours[part]}.{rest}"] = v
    if family == "deepseek":
        head = target.lm_head.weight.detach().clone()
        extra[f"{prefix}shared_head.head.weight"] = head + 0.5 if own_head else head
        extra[f"{prefix}embed_tokens.weight"] = target.model.embed_tokens.weight.detach().clone()
    if per_expert:
        for k in [k for k in extra if k.endswith("experts.gate_up_proj")]:
            gu, down = extra.pop(k), extra.pop(k.replace("gate_up_proj", "down_proj"))
            base, half = k[: -len(".gate_up_proj")], gu.shape[1] // 2
            for i in range(gu.shape[0]):
                extra[f"{base}.{i}.gate_proj.weight"] = gu[i, :half]
                extra[f"{base}.{i}.up_proj.weight"] = gu[i, half:]
                extra[f"{base}.{i}.down_proj.weight"] = down[i]
    f = folder / "model.safetensors"
    save_file(load_file(str(f)) | {k: v.contiguous() for k, v in extra.items()}, str(f))
    return folder


def equations(target, d, family, tokens, h, steps=2):
    """The family's MTP equations written out over the loaded parts (a causal mask, no cache)."""
    T = tokens.shape[1]
    n = T - steps - 1
    pos = torch.arange(n)[None]
    mask = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)[None, None]
    state, out = h[:, :n], []
    for k in range(steps):
        e = target.model.embed_tokens(tokens[:, k + 1:k + 1 + n])
        if family in ("deepseek", "mimo") and k == 0:  # vLLM's modules read no token at position 0
            e = torch.cat([torch.zeros_like(e[:, :1]), e[:, 1:]], 1)
        e, g = d.enorm(e), d.hnorm(state)
        x = d.proj(torch.cat([g, e] if family == "mimo" else [e, g], -1))
        y = d.layer(x, attention_mask=mask, position_ids=pos, position_embeddings=target.model.rotary_emb(x, pos))
        y = y[0] if isinstance(y, tuple) else y
        head = d.head if d.head is not None else target.lm_head
        out.append(head(d.norm(y)))
        state = y if family == "deepseek" else d.norm(y)
    return out


@pytest.mark.parametrize("family, make", [("deepseek", tiny_deepseek), ("mimo", tiny_mimo)])
def test_native_modules_are_read_from_the_targets_checkpoint(tmp_path, family, make):
    target = make()
    folder = native_folder(target, tmp_path / "t", family)
    assert formats.detect(folder) == "native-mtp" and formats.mtp.family(folder) == family
    prop = proposer(target, path=folder)  # mtp.checkpoint null: the target's own folder
    d = prop.drafter
    assert d.family == family and d.head is None and d.embedding is None  # DeepSeek's copies equal the target's
    tokens = torch.tensor([[1, 17, 33, 5, 60, 12, 9, 41, 77, 3]])
    h = final_states(target, tokens)
    with torch.no_grad():
        for got, want in zip(d.train_logits(tokens, h, 2), equations(target, d, family, tokens, h), strict=True):
            torch.testing.assert_close(got, want)
    prompts, refs = greedy_cases(target, 10)[4]
    assert [r.tokens for r in run_engine(target, prop, prompts, 10)] == refs


@pytest.mark.parametrize("family, make", [("deepseek", tiny_deepseek), ("mimo", tiny_mimo),
                                          ("speculators", tiny_qwen3)])
def test_deepseek_and_mimo_modules_read_no_token_at_position_0(tmp_path, family, make):
    """vLLM zeroes the embedding of the entry at position 0 for DeepSeek's and MiMo's modules (not
    for speculators'): the first prompt token's state drafts the same whatever token follows it."""
    target = make()
    d = randomize(MTPDrafter(target, family), 1)
    h = torch.randn(1, 3, d.config.hidden_size)
    pos = torch.arange(3)[None]
    with torch.no_grad():
        a, b, c = (d(torch.tensor([t]), h, position_ids=pos, use_cache=False).out
                   for t in ([5, 6, 7], [9, 6, 7], [5, 9, 7]))
    assert torch.equal(a, b) == (family != "speculators")
    assert not torch.allclose(a[:, 1:], c[:, 1:])  # position 1 reads its token in every family


def test_deepseeks_own_head_is_kept_where_it_differs(tmp_path):
    target = tiny_deepseek()
    d = proposer(target, path=native_folder(target, tmp_path / "t", "deepseek", own_head=True)).drafter
    assert d.head is not None and torch.equal(d.head.weight, target.lm_head.weight + 0.5)
    assert methods.get("mtp").draft_label(cfg_of()) == "native"


@pytest.mark.parametrize("bs", [1, 4])
def test_the_kept_entries_draft_what_a_full_recompute_drafts(bs):
    """Rows accept ragged runs (synthetic acceptance); every step's drafts equal a recompute over
    the whole sequence so far: its verified entries, then each draft fed back."""
    target = tiny_qwen3(seed=0, device=CPU)
    prop = proposer(target, FIXTURE, K=4)
    steps = record_drafts(prop)
    prompts = [[1, 5, 9, 3, 7, 11, 2][: 4 + b] for b in range(bs)]
    res = run_engine(target, prop, prompts, 18, sampling=Sampling(synthetic=Synthetic(0.8, seed=0)))
    assert sum(len(r.tokens) for r in res) >= 18 * bs
    d = prop.drafter
    for seqs, drafts in steps:
        for b, seq in enumerate(seqs):
            n = len(seq) - 1  # verified entries 0..n-1: (h_i, x_{i+1})
            toks, h = torch.tensor([seq[1:]]), final_states(target, torch.tensor([seq[:-1]]))
            want = []
            with torch.no_grad():
                for _ in range(prop.K):
                    y = d(toks, h, position_ids=torch.arange(toks.shape[1])[None], cache=None, use_cache=False).out[:, -1]
                    want.append(int(d.logits(y).argmax()))
                    toks = torch.cat([toks, torch.tensor([[want[-1]]])], 1)
                    h = torch.cat([h, d.fed_back(y)[:, None]], 1)
            assert drafts[b].tolist() == want, (n, b)
    assert len({len(s[0]) for s, _ in steps[1:]} | {0}) > 1


def random_mtp(target, folder, seed=0):
    d = randomize(MTPDrafter(target, "speculators"), seed)
    formats.mtp.save(folder, d, dtype=torch.float32)
    return folder


@pytest.mark.parametrize("bs", [1, 4, 32])
def test_greedy_identity_at_any_batch_size(tmp_path, bs):
    target = tiny_llama(seed=2, layers=4, scale=4.0)
    prop = proposer(target, random_mtp(target, tmp_path / "d"), DEVICE)
    prompts, refs = greedy_batch(target, bs, 12)
    assert [r.tokens for r in run_engine(target, prop, prompts, 12)] == refs


def test_greedy_identity_with_rows_joining(tmp_path):
    target = tiny_llama(seed=3, layers=4, scale=4.0)
    prop = proposer(target, random_mtp(target, tmp_path / "d"), DEVICE, K=5)
    prompts = [[1 + (5 * b + j) % 90 for j in range(2 + b)] for b in range(6)]
    res, _ = serve_engine(target, prop, prompts, 10, concurrency=2)
    assert [r.tokens for r in res] == [reference_greedy(target, p, 10) for p in prompts]


def test_sampling_follows_the_target_distribution(tmp_path):
    target = tiny_llama(seed=0, layers=4, vocab=12, device=CPU)
    assert_sampling_follows_the_target(target, proposer(target, random_mtp(target, tmp_path / "d")))


@pytest.mark.parametrize("change, match", [
    (lambda f: rekey(f, lambda s: {k: v for k, v in s.items() if "input_proj" not in k}),
     r"not the speculators MTP layout: missing \['mtp_layers.0.input_proj.weight'\]"),
    (lambda f: rekey(f, lambda s: {k: v for k, v in s.items() if "q_norm" not in k}),
     r"does not fit a Qwen3DecoderLayer: missing \['layer.self_attn.q_norm.weight'\], unexpected \[\]"),
    (lambda f: rekey(f, lambda s: s | {"mtp_layers.0.extra.weight": torch.zeros(2)}),
     r"unexpected \['layer.extra.weight'\]"),
    (lambda f: rekey(f, lambda s: s | {"mtp_layers.0.input_proj.weight": torch.zeros(32, 48)}),
     r"layer needs \(32, 64\)"),
    (lambda f: edit_config(f, num_nextn_predict_layers=2), "2 MTP modules declared; specbench drafts with one"),
])
def test_refusals_in_one_line(tmp_path, change, match):
    target = tiny_qwen3(seed=0, device=CPU)
    folder = copy_folder(FIXTURE, tmp_path)
    change(folder)
    with pytest.raises(ConfigError, match=match) as e:
        methods.get("mtp").check(cfg_of(folder), target.config)
    assert "\n" not in str(e.value)


def test_other_targets_and_checkpoints_are_refused(tmp_path):
    qwen, llama = tiny_qwen3(seed=0, device=CPU), tiny_llama(seed=0, hidden=32, device=CPU)
    with pytest.raises(ConfigError, match="made for a target of hidden_size 32; the target has 64"):
        methods.get("mtp").check(cfg_of(FIXTURE), tiny_llama(seed=0, device=CPU).config)
    with pytest.raises(ConfigError, match=r"does not fit a LlamaDecoderLayer: missing \[\], unexpected \['layer.self_attn.k_norm"):
        methods.get("mtp").check(cfg_of(FIXTURE), llama.config)  # the same sizes, another layer
    with pytest.raises(ConfigError, match="holds no MTP module; name a speculators mtp folder"):
        methods.get("mtp").check(cfg_of(REPO / "tests" / "fixtures" / "speculators-peagle"), qwen.config)
    qwen.save_pretrained(tmp_path / "plain")
    with pytest.raises(ConfigError, match=r"the target's checkpoint holds no MTP module; this target ships no MTP module: "
                                          r"train one \(python -m specbench.train drafter=mtp"):
        methods.get("mtp").check(cfg_of(path=tmp_path / "plain"), qwen.config)
    target = tiny_deepseek()
    folder = native_folder(target, tmp_path / "ds", "deepseek")
    edit_config(folder, num_nextn_predict_layers=2)
    with pytest.raises(ConfigError, match="2 MTP modules declared"):
        methods.get("mtp").check(cfg_of(path=folder), target.config)
    edit_config(folder, num_nextn_predict_layers=1, quantization_config={"quant_method": "fp8"})
    with pytest.raises(ConfigError, match="a fp8 checkpoint"):
        methods.get("mtp").check(cfg_of(path=folder), target.config)
    assert methods.get("mtp").vllm_config(cfg_of()) == {"method": "mtp", "num_speculative_tokens": 3}


def test_mtp_trainer_end_to_end(feature_setup, monkeypatch):
    """`drafter=mtp` (FastMTP's recipe) on an 8-layer target: training lowers the held-out loss,
    the checkpoint is written in speculators' layout with its card, resumes where it stopped, loads
    through method=mtp, and decoding with it is token-identical to greedy with drafts accepted."""
    from specbench.train import features, mtp as train_mtp

    _, tok, convs, cfg, root = feature_setup
    target = frozen_target8()
    patch_eval_slice(monkeypatch, convs)
    dr = {"kind": "mtp", "name": "tiny_mtp", "steps": 3, "beta": 0.6, "init": "target"}
    c = OmegaConf.merge(cfg, {"drafter": dr, "features": {"dir": str(root / "features-mtp")}, "train": {"steps": 60}})
    items = features.load(features.build(target, tok, "tiny8", c.features, DEVICE, torch.float32, progress=False,
                                         convs=convs))
    out0, out = root / "mtp_0", root / "mtp"
    out0.mkdir()
    out.mkdir()
    before = train_mtp.train(OmegaConf.merge(c, {"train": {"steps": 1, "lr": 1e-9}}), target, None, items, out0, {2},
                             DEVICE, progress=False)["summary"]
    res = train_mtp.train(c, target, None, items, out, {2}, DEVICE, progress=False)
    s = res["summary"]
    assert s["eval_loss"] < before["eval_loss"] and len(s["eval_top1_agreement"]) == 3  # per step
    assert s["step_weights"] == pytest.approx([1 / 1.96, 0.6 / 1.96, 0.36 / 1.96])
    train_mtp.finish(c, res, out, "tiny8", {**features.stats(items), "dropped": {}, "key": "k"}, "python -m x")
    assert formats.detect(out) == "speculators-mtp" and formats.mtp.steps(out) == 3
    assert (out / "README.md").read_text().startswith("# tiny_mtp")
    again = train_mtp.train(c, target, None, items, out, {2}, DEVICE, progress=False)  # resumed at its last step
    assert again["summary"]["train_seconds_this_run"] < s["train_seconds_this_run"]
    prop = proposer(target, out, DEVICE)
    ps = [it["tokens"][:it["prompt_len"]].tolist() for it in items if it["answered"]][:3]  # answers it trained on
    got = run_engine(target, prop, ps, 16)
    assert [r.tokens for r in got] == [reference_greedy(target, p, 16) for p in ps]
    assert sum(sum(r.accept_lens) for r in got) > 0


def test_the_trainers_step_k_learns_the_targets_distribution_of_the_token_k_plus_2_ahead():
    """Step k's entry i (x_{i+k+1}, its state) is held to the target's distribution of x_{i+k+2}: its
    output layer on the final state at i+k+1, written out here; a padded position is not taught."""
    from specbench.train.mtp import mtp_loss, step_weights

    target = tiny_llama(seed=4, layers=2, device=CPU)
    d = randomize(MTPDrafter(target, "speculators"), 3)
    tok = torch.tensor([[1, 17, 33, 5, 60, 12, 9, 41, 77, 3], [4, 8, 15, 16, 23, 42, 7, 0, 0, 0]])
    valid = tok != 0
    fin = final_states(target, tok)
    w = step_weights(0.6, 3)
    got = mtp_loss(d, tok, fin, valid, w, target.lm_head, 3)
    n, want = 10 - 3 - 1, 0.0
    with torch.no_grad():
        logits = d.train_logits(tok, fin, 3)
        for k in range(3):
            p = torch.softmax(target.lm_head(fin[:, k + 1:k + 1 + n]), -1)
            ce = -(p * torch.log_softmax(logits[k], -1)).sum(-1)
            ok = valid[:, k + 2:k + 2 + n]
            want = want + w[k] * ce[ok].mean()
    torch.testing.assert_close(got[0], want)


def test_glm_checkpoints_without_a_head_of_their_own_use_the_targets(tmp_path):
    """GLM-4.6/4.7 ship no ``shared_head.head`` (nor an embedding copy): the target's are used."""
    from safetensors.torch import load_file, save_file

    target = tiny_deepseek()
    folder = native_folder(target, tmp_path / "t", "deepseek")
    f = folder / "model.safetensors"
    L = target.config.num_hidden_layers
    save_file({k: v for k, v in load_file(str(f)).items()
               if k not in (f"model.layers.{L}.shared_head.head.weight", f"model.layers.{L}.embed_tokens.weight")}, str(f))
    d = proposer(target, path=folder).drafter
    assert d.head is None and d.embedding is None


def test_the_moe_router_stays_fp32_in_a_bf16_run(tmp_path):
    target = tiny_deepseek().to(torch.bfloat16)
    d = formats.mtp.load(native_folder(target, tmp_path / "t", "deepseek"), target, CPU, torch.bfloat16)
    assert d.proj.weight.dtype == torch.bfloat16
    assert d.layer.mlp.gate.weight.dtype == torch.float32 and d.layer.mlp.gate.e_score_correction_bias.dtype == torch.float32


def test_qwen3_next_norms_scale_by_one_plus_their_weight(tmp_path):
    """Qwen3-Next's (and Qwen3.5's) RMSNorms scale by 1 + w: the fusion's and final norms are read so."""
    target = tiny_qwen3_next(seed=0)
    folder = native_folder(target, tmp_path / "t", "qwen3_next")
    edit_config(folder, num_nextn_predict_layers=None, mtp_num_hidden_layers=1)
    from safetensors.torch import load_file

    raw = load_file(str(folder / "model.safetensors"))
    d = formats.mtp.load(folder, target, CPU, torch.float32)
    assert d.family == "qwen3_next" and type(d.layer).__name__ == "Qwen3NextDecoderLayer"
    torch.testing.assert_close(d.enorm.weight, raw["mtp.pre_fc_norm_embedding.weight"] + 1)
    torch.testing.assert_close(d.norm.weight, raw["mtp.norm.weight"] + 1)


def test_a_native_qwen3_next_module_gives_what_speculators_reads_from_it():
    """The native Qwen3-Next fixture (``make_reference.py qwen3-next-mtp``): speculators' converter
    and MTP model read its ``mtp.*`` keys; our loader reads the same folder to the same logits."""
    from transformers import AutoModelForCausalLM

    folder = REPO / "tests/fixtures/qwen3-next-mtp"
    ref = torch.load(folder / "reference.pt")
    target = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokens = ref["tokens"][None]
    torch.testing.assert_close(final_states(target, tokens)[0], ref["hidden"], atol=1e-5, rtol=1e-5)
    assert formats.detect(folder) == "native-mtp"
    d = formats.mtp.load(folder, target, CPU, torch.float32)
    assert d.family == "qwen3_next" and type(d.layer).__name__ == "Qwen3NextDecoderLayer" and not d.blank_first
    with torch.no_grad():
        for got, want in zip(d.train_logits(tokens, ref["hidden"][None], 2), ref["logits"], strict=True):
            torch.testing.assert_close(got[0], want, atol=1e-5, rtol=1e-5)


def test_keys_outside_the_speculators_layout_are_refused(tmp_path):
    target = tiny_qwen3(seed=0, device=CPU)
    folder = copy_folder(FIXTURE, tmp_path)
    rekey(folder, lambda s: s | {"mtp_layers.1.input_proj.weight": torch.zeros(32, 64)})
    with pytest.raises(ConfigError, match=r"keys outside the speculators MTP layout: \['mtp_layers.1.input_proj.weight'\]"):
        methods.get("mtp").check(cfg_of(folder), target.config)
