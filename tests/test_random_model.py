"""``model=random``: a random-weight target of every shipped shape (``specbench/shapes``) whose greedy
output depends on its context. The GPU check's real step runs PLD, Lookahead and SuffixDecoding on it; a
target that repeats two or three tokens hands copying methods their own output back (PLD tau 3.2-3.5 on
MT-Bench prompts), and the acceptance and speedups recorded from it are artefacts (issue 55, item 6).

A shape over ``MAX_PARAMS`` (llama-3.1-8b: 8B parameters) is built here with its width cut to ``NARROW``
and its feed-forward width in proportion; its depth, heads, head size, KV heads, vocabulary, tied or
untied head and RoPE stay. That stands for the full shape because the spread that made it collapse is
set by ``random_model`` whatever the width: the attention logits' std (``models.ATTENTION_LOGIT_STD``),
as the logits' std is (``model.logit_std``). What HF's fixed 0.02 init
still leaves to the width (the token embedding's share of the residual stream) was measured at
llama-3.1-8b's depth at widths 256, 512 and 1024 (docs/gpu.md)."""

import json

import pytest
import torch

from specbench import models as M

MAX_PARAMS = 200e6  # what a CPU test builds and decodes 4 x 64 tokens on in seconds
NARROW = 256
TOKENS = 64
SHAPES = sorted(p.stem for p in M.SHAPES.glob("*.json"))


def params_of(cfg: dict) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())


def affordable(name: str, folder) -> bool:
    """Write shape ``name`` into ``folder``, narrowed when too big for a CPU test; whether it was."""
    cfg = json.loads(M.shape_file(name).read_text())
    narrowed = params_of(cfg) > MAX_PARAMS
    if narrowed:
        cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])  # the heads stay as they are
        cfg["intermediate_size"] = cfg["intermediate_size"] * NARROW // cfg["hidden_size"]
        cfg["hidden_size"] = NARROW
        assert params_of(cfg) <= MAX_PARAMS
    (folder / f"{name}.json").write_text(json.dumps(cfg))
    return narrowed


@pytest.mark.slow  # SmolLM2-135M's tokenizer (the random target's default) comes from the packaged model
@pytest.mark.parametrize("shape,dtype", [(s, "fp32") for s in SHAPES] + [("tiny", "bf16")])
def test_random_target_greedy_output_is_not_degenerate(shape, dtype, tmp_path, monkeypatch):
    from omegaconf import OmegaConf

    from specbench.paths import CONF_DIR
    from specbench.run import data as D

    mcfg = OmegaConf.load(CONF_DIR / "model" / "random.yaml")
    mcfg.shape = shape
    tok = M.load_tokenizer(mcfg)
    narrowed = affordable(shape, tmp_path)
    monkeypatch.setattr(M, "SHAPES", tmp_path)
    model = M.random_model(mcfg, torch.device("cpu"), M.DTYPES[dtype])
    distinct = []
    for q in D.mt_bench()[:4]:  # the prompts the GPU check's real step runs at bs 1 (its kit: MT-Bench first)
        ids = torch.tensor([D.render(tok, [], q.turns[0], chat=True)])
        out = model.generate(ids, max_new_tokens=TOKENS, min_new_tokens=TOKENS, do_sample=False)
        distinct.append(len(set(out[0, ids.shape[1]:].tolist())))
    assert min(distinct) >= TOKENS // 2, (shape, "narrowed" if narrowed else "full", distinct)
