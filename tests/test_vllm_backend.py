"""``backend=vllm``: the adapter (worker protocol, request records, acceptance counted per step,
pairing with vLLM's own AR, refusals) against a stand-in vLLM that decodes a tiny model
(tests/fixtures/fake_vllm), the draft export for vLLM's ``draft_model``, the report's two-engine
table, and, where ``make setup-vllm`` has made vLLM's environment, one real vLLM job (slow)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

from specbench.run import records as R
from specbench.run import runner
from specbench.errors import ConfigError
from helpers import tiny_cfg

REPO = Path(__file__).resolve().parent.parent
FAKE = Path(__file__).parent / "fixtures" / "fake_vllm"
PLD = {"name": "pld", "max_ngram": 3, "min_ngram": 1}


@pytest.fixture
def fake_vllm(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(FAKE))
    from specbench.engines.vllm import engine as vllm_engine

    vllm_engine.version.cache_clear()
    yield
    vllm_engine.version.cache_clear()


def vcfg(tiny_dirs, tmp_path, **over):
    return tiny_cfg(tiny_dirs, tmp_path, **{"backend": "vllm", "vllm.python": sys.executable, **over})


def test_a_paired_vllm_job_records_what_ours_records(tiny_dirs, tmp_path, fake_vllm, monkeypatch):
    import tempfile

    logs = tmp_path / "logs"
    logs.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(logs))
    ar, pld = runner.run(vcfg(tiny_dirs, tmp_path, method=PLD, bs=2, ar_baseline="paired", K=3), sweep_id="v")
    assert ar["status"] == pld["status"] == "ok", (ar["error"], pld["error"])
    for rec in (ar, pld):
        assert rec["backend"] == "vllm" and rec["backend_version"] == "0.0.0-fake" and rec["kernel"] is None
        assert rec["vllm_cfg"]["enforce_eager"] is True and rec["vllm_cfg"]["prefix_caching"] is False
        assert len(rec["requests"]) == 8  # 4 questions x 2 turns: the second turn holds the first answer
        assert {q["turn"] for q in rec["requests"]} == {1, 2}
    assert pld["paired_with"] == ar["job_id"] and pld["ar_job_id"] == ar["job_id"]
    assert not list(logs.glob("specbench-vllm-*"))  # the workers' logs go after a clean exit
    m = pld["metrics"]
    assert m["match_ar"] == 1.0  # the stand-in verifies greedily, as vLLM does
    lens = [int(c, 36) for q in pld["requests"] for c in q["accepts"]]
    assert m["steps"] == len(lens) == sum(q["steps"] for q in pld["requests"])
    assert m["tau"] == pytest.approx(1 + sum(lens) / len(lens))
    for q in pld["requests"]:  # a step's tokens are 1 + its accepted drafts; the prefill gives the first
        assert q["new_tokens"] == 1 + q["steps"] + q["accepted"] or q["eos"] or q["new_tokens"] == 12
    v = m["vllm"]
    c = v["counters"]
    assert c["vllm:spec_decode_num_drafts"] > 0 and sum(c["vllm:spec_decode_num_accepted_tokens_per_pos"]) == \
        c["vllm:spec_decode_num_accepted_tokens"]
    # vLLM's own figure counts drafted steps only: never below ours, over every step
    assert v["tau_drafted"] == pytest.approx(1 + c["vllm:spec_decode_num_accepted_tokens"] /
                                             c["vllm:spec_decode_num_drafts"])
    assert v["tau_drafted"] >= m["tau"] - 1e-9 and 0 < v["drafted_step_share"] <= 1
    # acceptance per position, both forms, counted as our engine counts them (over every step) ...
    alphas = [sum(x >= i for x in lens) / len(lens) for i in range(1, max(lens + [3]) + 1)]
    assert m["accept_rate_per_pos"] == pytest.approx(alphas)
    assert m["accept_rate_per_pos_cond"] == pytest.approx([a / p if p else None for a, p in zip(alphas, [1.0] + alphas)])
    # ... and vLLM's own (over drafted steps): its per-position rate is marginal, accepted at i over drafts
    drafts, per_pos = c["vllm:spec_decode_num_drafts"], c["vllm:spec_decode_num_accepted_tokens_per_pos"]
    marg = [x / drafts for x in per_pos]
    assert v["accept_rate_per_pos_drafted"] == pytest.approx(marg)
    assert v["accept_rate_per_pos_cond_drafted"] == pytest.approx([a / p if p else None for a, p in zip(marg, [1.0] + marg)])
    assert pld["method_cfg"]["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3,
                                                       "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    assert m["peak_mem_bytes"] > 0 and m["verify_share"] is None
    # vLLM's AR never pairs with ours, nor ours with vLLM's
    ours = dict(ar, backend=None, backend_version=None, vllm_cfg=None)
    assert R.baseline_key(ours) != R.baseline_key(ar)


def test_a_continuous_vllm_stream_serves_every_turn(tiny_dirs, tmp_path, fake_vllm):
    rec, = runner.run(vcfg(tiny_dirs, tmp_path, method={"name": "ar"}, bs=2, **{"serving.batching": "continuous"}), sweep_id="c")
    assert rec["status"] == "ok", rec["error"]
    assert rec["serving"]["concurrency"] == 2 and len(rec["requests"]) == 8
    seconds = {(q["id"], q["turn"]): q for q in rec["requests"]}
    for (i, turn), q in seconds.items():
        if turn == 2:  # a next turn arrives when the first is answered
            first = seconds[(i, 1)]
            assert q["arrival_s"] == pytest.approx(first["arrival_s"] + first["wall_s"], abs=1e-6)
    assert rec["metrics"]["in_flight"]["mean"] <= 2


def test_the_hosts_work_between_turns_is_off_the_clock_on_vllm_as_on_ours(tiny_dirs, tmp_path, fake_vllm, monkeypatch):
    """Rendering a next turn (here a tokenizer 0.3 s slow) is the harness's work: our engine leaves it
    out of its clock (``harness_s``), and so must vLLM's worker, in wall, queue and TTFT alike."""
    import time

    from specbench.run import data as D

    render = D.render
    slow = 0.3

    def slow_render(tokenizer, history, turn, chat):
        if history:  # a next turn: rendered while the stream runs
            time.sleep(slow)
        return render(tokenizer, history, turn, chat)

    monkeypatch.setattr(D, "render", slow_render)
    # one two-turn question: while its next turn renders, the engine has nothing else to do
    rec, = runner.run(vcfg(tiny_dirs, tmp_path, method={"name": "ar"}, bs=1, limit=1, **{"serving.batching": "continuous"},
                           warmup=False), sweep_id="s")
    assert rec["status"] == "ok", rec["error"]
    first, second = sorted(rec["requests"], key=lambda q: q["turn"])
    assert second["arrival_s"] == pytest.approx(first["arrival_s"] + first["wall_s"], abs=1e-6)
    assert second["queue_s"] < slow / 3, second  # it waited for no render (TTFT = this queue + its prefill)
    assert rec["metrics"]["wall_s"] < first["wall_s"] + second["wall_s"] + slow / 3


@pytest.mark.parametrize("over,msg", [
    ({"method": {"name": "lookahead", "W": 5, "N": 3, "G": 3}},
     "method lookahead has no counterpart in vLLM; with backend=vllm run one of: ar, dflash, dspark, eagle, leviathan, medusa, mtp, pld"),
    ({"method": {"name": "medusa", "checkpoint": "checkpoints/smollm2-135m/medusa", "tree": "default",
                 "tree_size": "auto", "accept": "exact", "eps": 0.09, "delta": 0.3}},
     "vLLM's medusa drafts a chain (each head's top-1), not medusa.tree=default: with backend=vllm set medusa.tree=chain"),
    ({"method": {"name": "eagle", "version": 2, "checkpoint": "checkpoints/smollm2-135m/eagle", "top_k": "auto",
                 "depth": "auto", "total_tokens": "auto", "tree": None}},
     "backend=vllm runs EAGLE-3 drafters in SafeAILab's or vLLM's speculators layout"),
    ({"K": "auto"}, "K=auto pilots candidates on our engine: with backend=vllm give K"),
    ({"compile": True}, "compile=true is our engine's torch.compile: with backend=vllm set vllm.enforce_eager=false"),
    ({"vllm.python": "/no/such/python"}, "backend=vllm needs vLLM's environment, and /no/such/python does not exist: "
                                         "run `make setup-vllm`"),
    ({"backend": "vlm"}, "unknown backend 'vlm'; did you mean vllm? choices: specbench, vllm"),
])
def test_vllm_refusals(tiny_dirs, tmp_path, over, msg):
    cfg = vcfg(tiny_dirs, tmp_path, method=PLD, **{k: v for k, v in over.items() if k != "method"})
    if "method" in over:
        from omegaconf import OmegaConf

        cfg.method = OmegaConf.create(over["method"])
    with pytest.raises(ConfigError, match=re.escape(msg)):
        runner.validate(cfg)


def test_a_worker_that_fails_to_start_fails_the_job_in_one_line(tiny_dirs, tmp_path, fake_vllm, monkeypatch):
    import tempfile

    rec, = runner.run(vcfg(tiny_dirs, tmp_path, method={"name": "ar"}, **{"model.path": str(tmp_path)}), sweep_id="x")
    assert rec["status"] == "error"
    assert "\n" not in rec["error"]
    logs = tmp_path / "logs"
    logs.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(logs))
    monkeypatch.setenv("FAKE_VLLM_FAIL", "1")  # now vLLM itself fails as its engine starts
    rec, = runner.run(vcfg(tiny_dirs, tmp_path / "w", method={"name": "ar"}), sweep_id="y")
    assert rec["status"] == "error" and "\n" not in rec["error"] and "told to fail" in rec["error"]
    kept = list(logs.glob("specbench-vllm-*"))
    assert kept and str(kept[0]) in rec["error"]  # a failure keeps its log, and the error names it


def _draft_lm(target, seed=0):
    from specbench.drafters.draft_lm import DraftLM

    g = torch.Generator().manual_seed(seed)
    vocab = torch.randperm(target.config.vocab_size, generator=g)[:40].sort().values
    d = DraftLM(target, 1, vocab)
    with torch.no_grad():
        for p in d.body.layers.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return d, vocab


def test_our_drafts_export_as_plain_hf_folders_with_our_scores(tiny_dirs, tmp_path):
    """vLLM's draft_model loads a plain HF folder: a trained DraftLM exported scores its draft
    vocabulary as ours does (0 elsewhere), and draft_model=self_layers is the target's first layers."""
    from transformers import AutoModelForCausalLM

    from specbench.drafters.draft_lm import hf_folder
    from specbench.models import self_layers_draft

    target = AutoModelForCausalLM.from_pretrained(tiny_dirs["target"], dtype=torch.float32).eval()
    ids = torch.tensor([[5, 9, 11, 30, 2, 7, 7, 40]])
    d, vocab = _draft_lm(target)
    own = {f"body.{k}": v for k, v in d.body.state_dict().items() if k.startswith(("layers.", "norm."))}
    own["vocab_ids"] = vocab
    out = Path(hf_folder(str(tiny_dirs["target"]), tmp_path / "trained", 1, own))
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 1
    with torch.no_grad():
        a, b = d(ids).logits, hf(ids).logits
    torch.testing.assert_close(b[..., vocab], a[..., vocab], rtol=1e-5, atol=1e-5)
    rest = torch.ones(b.shape[-1], dtype=torch.bool)
    rest[vocab] = False
    assert b[..., rest].abs().max() == 0
    out2 = Path(hf_folder(str(tiny_dirs["target"]), tmp_path / "self", 1))
    hf2 = AutoModelForCausalLM.from_pretrained(out2, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf2(ids).logits, self_layers_draft(target, 1)(ids).logits, rtol=1e-5, atol=1e-5)


def test_our_medusa_heads_export_in_vllms_layout_with_our_scores(tiny_dirs, tmp_path):
    """vLLM's Medusa: per head x + SiLU(W x + b), then the head's output layer; on the draft
    vocabulary the exported heads score as ours, 0 elsewhere; only the first k heads go."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from specbench.drafters.medusa import MedusaHeads, vllm_folder

    target = AutoModelForCausalLM.from_pretrained(tiny_dirs["target"], dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    vocab = torch.randperm(target.config.vocab_size, generator=g)[:30].sort().values
    heads = MedusaHeads(target, vocab, 3)
    with torch.no_grad():
        heads.weight.copy_(0.1 * torch.randn(heads.weight.shape, generator=g))
        heads.bias.copy_(0.1 * torch.randn(heads.bias.shape, generator=g))
    ck = tmp_path / "ck"
    ck.mkdir()
    save_file({"weight": heads.weight.detach().clone(), "bias": heads.bias.detach().clone(), "vocab_ids": vocab},
              str(ck / "model.safetensors"))
    out = Path(vllm_folder(ck, str(tiny_dirs["target"]), tmp_path / "vm", 2))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "medusa" and cfg["num_heads"] == 2 and cfg["medusa_fc_bias"] is True
    w = load_file(str(out / "model.safetensors"))
    assert not any(k.startswith("blocks.2.") for k in w)
    f = torch.randn(5, target.config.hidden_size, generator=g)
    with torch.no_grad():
        ours = heads(f)  # [heads, 5, draft vocab]
    for i in range(2):
        h = f + torch.nn.functional.silu(f @ w[f"blocks.{i}.layers.0.weight"].T + w[f"blocks.{i}.layers.0.bias"])
        full = h @ w[f"lm_heads.{i}.weight"].T
        torch.testing.assert_close(full[:, vocab], ours[i], rtol=1e-5, atol=1e-5)
        rest = torch.ones(full.shape[-1], dtype=torch.bool)
        rest[vocab] = False
        assert full[:, rest].abs().max() == 0


def test_the_report_puts_the_two_engines_side_by_side(tiny_dirs, tmp_path, fake_vllm):
    from specbench.analysis import load, report, tables

    runner.run(vcfg(tiny_dirs, tmp_path, method=PLD, K=3, ar_baseline="paired"), sweep_id="v")
    runner.run(tiny_cfg(tiny_dirs, tmp_path, method=PLD, K=3, ar_baseline="paired"), sweep_id="o")
    written = report.build(tmp_path / "records.jsonl", tmp_path / "rep")
    assert tmp_path / "rep" / "engines.md" in written and tmp_path / "rep" / "engines.png" in written
    t = tables.engines_table(load.load(tmp_path / "records.jsonl"))
    row, = t.to_dict("records")
    assert row["method"] == "pld K=3" and row["specbench tau"] >= 1 and row["vllm tau"] >= 1
    assert row["vllm tau (drafted steps)"] >= row["vllm tau"] - 1e-9


VLLM_PY = REPO / ".venv-vllm" / "bin" / "python"


@pytest.mark.slow
@pytest.mark.skipif(not VLLM_PY.exists(), reason="vLLM's environment is not set up (make setup-vllm)")
def test_real_vllm_ar_and_ngram(tmp_path):
    """vLLM itself (make setup-vllm) on the packaged SmolLM2: AR and ngram, 2 prompts, 16 tokens."""
    from helpers import composed

    cfg = composed(["backend=vllm", "method=pld", "limit=2", "max_new_tokens=16", "ar_baseline=paired",
                    "dataset.max_turns=1", f"results_dir={tmp_path}", "progress=false"])
    ar, pld = runner.run(cfg, sweep_id="real")
    assert ar["status"] == pld["status"] == "ok", (ar["error"], pld["error"])
    assert ar["backend_version"].startswith("0.") and pld["metrics"]["match_ar"] == 1.0
    assert pld["metrics"]["tau"] >= 1.0 and ar["metrics"]["tokens_per_s"] > 0
    assert all(q["new_tokens"] >= 1 for q in pld["requests"])


@pytest.mark.parametrize("backend", ["specbench", "vllm"])
def test_requests_in_flight_mean_the_same_on_both_backends(tiny_dirs, tmp_path, fake_vllm, backend):
    """One definition of requests in flight (docs/records.md): over the stream's whole wall, idle time
    counting as 0. Requests arriving about 0.25 s apart with 2-token answers are in flight a small
    share of the time: the mean is well under 1 on both engines (it read >= 1 when idle time was
    folded into the next step, or dropped)."""
    make = vcfg if backend == "vllm" else tiny_cfg
    cfg = make(tiny_dirs, tmp_path, method={"name": "ar"}, bs=2, serving={"batching": "continuous", "rate": 4.0}, max_new_tokens=2,
               warmup=False, limit=4, **{"dataset.max_turns": 1})
    rec, = runner.run(cfg, sweep_id=backend)
    assert rec["status"] == "ok", rec["error"]
    f = rec["metrics"]["in_flight"]
    assert 0 < f["mean"] < 0.8, f
    busy = sum(q["wall_s"] - q["queue_s"] for q in rec["requests"])
    assert f["mean"] == pytest.approx(busy / rec["metrics"]["wall_s"], rel=1e-6)


@pytest.mark.parametrize("backend", ["specbench", "vllm"])
def test_a_request_waiting_for_a_free_row_is_queued_alike_on_both_backends(tiny_dirs, tmp_path, fake_vllm, backend):
    """queue_s is the wait for a free row, on both engines: three requests at once with one row
    (bs=1) are admitted one after another, the later ones queued about the earlier ones' time
    (vLLM's was the hand-off to its scheduler, about 0 while its scheduler queued them), and no
    more than one is ever in flight."""
    make = vcfg if backend == "vllm" else tiny_cfg
    cfg = make(tiny_dirs, tmp_path, method={"name": "ar"}, bs=1, **{"serving.batching": "continuous"}, max_new_tokens=6,
               warmup=False, limit=3, **{"dataset.max_turns": 1})
    rec, = runner.run(cfg, sweep_id=backend)
    assert rec["status"] == "ok", rec["error"]
    reqs = sorted(rec["requests"], key=lambda q: q["queue_s"])
    assert reqs[0]["queue_s"] < 0.05 and reqs[1]["queue_s"] > 0 and reqs[2]["queue_s"] > reqs[1]["queue_s"]
    for a, b in zip(reqs, reqs[1:]):  # admitted when the one before it finished
        assert b["arrival_s"] + b["queue_s"] >= a["arrival_s"] + a["wall_s"] - 1e-3
    assert rec["metrics"]["in_flight"]["mean"] <= 1.0 + 1e-9
