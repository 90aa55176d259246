"""Tiny random models and a reference decoder for the unit tests; the composed config and a job's
config on the tiny HF folders (``tiny_cfg``) for the tests that run jobs."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from omegaconf import OmegaConf, open_dict
import specbench.tiny

from specbench import methods
from specbench.methods.base import Proposer
from specbench.decode.engine import Engine
from specbench.decode.timing import PhaseTimer
from specbench.decode.verify import Sampling

CPU = torch.device("cpu")
# The device the decode tests run on (``device`` fixture): ``SPECBENCH_TEST_DEVICE=cuda pytest -m "not slow"``
# is the GPU suite (conftest skips the CPU-only modules there).
DEVICE = torch.device(os.environ.get("SPECBENCH_TEST_DEVICE", "cpu"))
CONF = str(Path(__file__).resolve().parent.parent / "conf")


def tiny_llama(seed: int = 0, vocab: int = 96, layers: int = 2, hidden: int = 64, scale: float = 1.0,
               device: torch.device = DEVICE):
    return specbench.tiny.tiny_llama(seed, vocab, layers, hidden, scale, device)  # on the test device by default


def tiny_qwen3(seed: int = 0, vocab: int = 96, layers: int = 2, hidden: int = 32, device: torch.device = DEVICE):
    """A tiny random Qwen3 (q/k norms; the speculators MTP fixture's layer kind), its weights drawn by
    ``specbench.drafters.randomize`` (the same on every transformers version)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from specbench.drafters import randomize

    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    m = randomize(Qwen3ForCausalLM(cfg), seed).eval()
    m.generation_config.eos_token_id = None
    return m.to(device)


@torch.no_grad()
def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding by full recomputation, no cache: the ground truth."""
    seq = list(prompt)
    for _ in range(n):
        logits = model(torch.tensor([seq], device=model.device)).logits[0, -1]
        seq.append(int(logits.argmax()))
    return seq[len(prompt):]


def cfg_for(**kw):
    base = {"K": 4, "method": {"name": "x", "max_ngram": 3, "min_ngram": 1}, "draft_model": {"name": "self_layers", "layers": 1}}
    base.update(kw)
    return OmegaConf.create(base)


def run_engine(model, proposer: Proposer | None, prompts, n, sampling=None, eos=(), gen=None, prefill_chunk=None):
    proposer = proposer or Proposer(cfg_for(), model, None, DEVICE, torch.float32)
    eng = Engine(model, proposer, sampling or Sampling(), DEVICE, torch.float32, set(eos), PhaseTimer(DEVICE),
                 prefill_chunk=prefill_chunk)
    return eng.generate(prompts, n, gen)


def serve_engine(model, proposer: Proposer | None, prompts, n, concurrency, arrivals=None, sampling=None, eos=(),
                 gen=None, prefill_chunk=None):
    """``serving.batching=continuous``: the prompts as requests (arriving at ``arrivals`` seconds, else at
    once), at most ``concurrency`` in flight. Results in the prompts' order."""
    from specbench.decode.engine import Request, Requests

    proposer = proposer or Proposer(cfg_for(), model, None, DEVICE, torch.float32)
    eng = Engine(model, proposer, sampling or Sampling(), DEVICE, torch.float32, set(eos), PhaseTimer(DEVICE),
                 prefill_chunk=prefill_chunk)
    arrivals = arrivals or [0.0] * len(prompts)
    out = eng.serve(Requests([Request(i, p, a) for i, (p, a) in enumerate(zip(prompts, arrivals))]), n, gen,
                    concurrency=concurrency)
    return [out[i] for i in range(len(prompts))], eng


def prompts_of(lengths, vocab=96, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (L,), generator=g).tolist() for L in lengths]


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit, p-value by the Wilson-Hilferty approximation.
    Cells with tiny expected counts are pooled into one."""
    import math

    n = float(counts.sum())
    exp = probs.double() * n
    big = exp >= 5
    obs = torch.cat([counts.double()[big], counts.double()[~big].sum()[None]])
    ex = torch.cat([exp[big], exp[~big].sum()[None]])
    keep = ex > 0
    obs, ex = obs[keep], ex[keep]
    stat = float(((obs - ex) ** 2 / ex).sum())
    k = max(1, len(ex) - 1)
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


def greedy_cases(model, n_new: int) -> dict:
    """Reference cases for identity tests: {batch size: (ragged prompts, their greedy continuations)}
    for bs 1 and 4."""
    out = {}
    for lengths in ([7], [5, 11, 3, 8]):
        ps = prompts_of(lengths)
        out[len(lengths)] = (ps, [reference_greedy(model, p, n_new) for p in ps])
    return out


def greedy_batch(model, bs: int, n_new: int) -> tuple[list, list]:
    """Ragged prompts for a batch of ``bs`` rows and their greedy continuations: ``greedy_cases``'
    for bs 1 and 4, else rows of 3..9 tokens."""
    if bs in (1, 4):
        return greedy_cases(model, n_new)[bs]
    prompts = [[1 + (3 * b + j) % 90 for j in range(3 + b % 7)] for b in range(bs)]
    return prompts, [reference_greedy(model, p, n_new) for p in prompts]


def record_drafts(prop) -> list:
    """Wrap ``prop.propose``: the returned list gets, per step, (each row's sequence so far, the
    step's draft tokens), for tests that redraft every step from scratch."""
    steps, propose = [], prop.propose

    def record(state):
        draft = propose(state)
        steps.append(([list(s) for s in state.seqs], draft.tokens.clone()))
        return draft

    prop.propose = record
    return steps


def tiny_qwen3_next(seed: int = 0):
    """A tiny random Qwen3-Next (a linear-attention layer, then a full-attention MoE layer; its
    RMSNorms scale by 1 + w, so theirs are drawn near 0), on the CPU."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = Qwen3NextConfig(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                          shared_expert_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                          layer_types=["linear_attention", "full_attention"], linear_num_value_heads=2,
                          linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                          max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                          pad_token_id=0)
    from specbench.drafters import randomize

    m = randomize(Qwen3NextForCausalLM(cfg), seed).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    m.generation_config.eos_token_id = None
    return m


def copy_folder(src, dest_parent):
    """A copy of the checkpoint folder ``src`` under ``dest_parent`` (to break it in a test)."""
    import shutil

    dest = dest_parent / src.name
    shutil.copytree(src, dest)
    return dest


def edit_config(folder, **changes):
    """Set keys of ``folder/config.json`` (None: remove the key)."""
    import json

    raw = json.loads((folder / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            raw.pop(k, None)
        else:
            raw[k] = v
    (folder / "config.json").write_text(json.dumps(raw))


def rekey(folder, fn):
    """Rewrite ``folder/model.safetensors`` as ``fn(its state dict)``."""
    from safetensors.torch import load_file, save_file

    f = folder / "model.safetensors"
    save_file(fn(load_file(str(f))), str(f))


def assert_sampling_follows_the_target(target, prop, prompt=(3, 5, 7, 9), n=2000, seed=5):
    """Seeded rows of one prompt at T=1 through ``prop``: drafts were accepted from, and the 2nd and
    3rd tokens follow the target's exact marginals (chi-square)."""
    from test_verify import exact_marginals

    s = Sampling(1.0)
    res = run_engine(target, prop, [list(prompt)] * n, 3, sampling=s, gen=torch.Generator().manual_seed(seed))
    m2, m3 = exact_marginals(target, list(prompt), s)
    assert sum(sum(r.accept_lens) for r in res) > n // 50  # drafts were really accepted from
    V = target.config.vocab_size
    assert chi2_pvalue(torch.bincount(torch.tensor([r.tokens[1] for r in res]), minlength=V), m2) > 1e-3
    assert chi2_pvalue(torch.bincount(torch.tensor([r.tokens[2] for r in res]), minlength=V), m3) > 1e-3


def composed(overrides=()):
    """conf/config.yaml as Hydra composes it with ``overrides``."""
    from hydra import compose, initialize_config_dir  # not on the GPU machine: only where a test composes

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def register_fakes(monkeypatch, **classes):
    """Register test-only proposer classes under these method names for one test."""
    real_get, real_plugins = methods.get, methods.plugins
    monkeypatch.setattr(methods, "plugins", lambda: {**real_plugins(), **{name: "x:y" for name in classes}})
    monkeypatch.setattr(methods, "get", lambda n: classes.get(n) or real_get(n))


def tiny_cfg(tiny_dirs, tmp_path, **over):
    # the sweep's AR run once (the default pairs every job with its own AR): tests ask for paired
    cfg = composed(["model=hf", "dataset=jsonl", "draft_model=self_layers", "ar_baseline=sweep"])
    with open_dict(cfg):
        cfg.model.path = str(tiny_dirs["target"])
        cfg.dataset.path = str(tiny_dirs["questions"])
        cfg.results_dir = str(tmp_path)
        cfg.records = str(tmp_path / "records.jsonl")
        cfg.max_new_tokens = 12
        cfg.limit = 4
        cfg.progress = False
        cfg.draft_model.layers = 1
        for k, v in over.items():
            if k == "method":  # a method of its own (a fake's name, or its keys as given): untyped
                cfg.method = OmegaConf.merge(OmegaConf.to_container(cfg.method), v)
            else:
                OmegaConf.update(cfg, k, v, force_add=True)
    return cfg
