"""The distillation pipeline, a tiny end-to-end drafter training run (seconds), and the
checkpoints' cards."""

import json

import pytest
import torch
from omegaconf import OmegaConf

from helpers import CPU, cfg_for, prompts_of, reference_greedy, run_engine
from specbench.methods.leviathan import Leviathan
from specbench.drafters import is_draft_checkpoint
from specbench.drafters import load as load_draft
from specbench.drafters.draft_lm import DraftLM
from specbench.train import distill, loop


def test_benchmark_overlap_is_dropped():
    bench = [distill._norm("Compose an engaging travel blog post about a recent trip to Hawaii, highlighting")]
    texts = ["please COMPOSE an engaging   travel blog post about a recent trip to Hawaii, highlighting culture",
             "Write a poem about the sea", "compose an engaging travel blog"]
    kept, dropped = distill.drop_overlap(texts, bench)
    assert kept == ["Write a poem about the sea"] and dropped == 2


def test_benchmark_texts_cover_every_set():
    texts = distill.benchmark_texts()
    assert len(texts) > 80 * 2 + 164 + 100 - 10


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    from conftest import save_tiny_hf
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("train")
    folder = save_tiny_hf(root / "target", seed=0)
    target = __import__("transformers").AutoModelForCausalLM.from_pretrained(folder).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    tok = AutoTokenizer.from_pretrained(folder)
    prompts = [" ".join(f"w{(i * 13 + j * 7) % 90}" for j in range(5 + i % 7)) for i in range(24)]
    cfg = OmegaConf.create({
        "seed": 0, "resume": True,
        "drafter": {"kind": "draft_lm", "name": "tiny_draft", "layers": 1, "draft_vocab": 48, "init": "target"},
        "data": {"prompts": 24, "respond": 12, "max_prompt_tokens": 32, "max_new_tokens": 12, "temperature": 0.0,
                 "gen_bs": 6, "teacher_bs": 8, "topk": 8, "shard_size": 10, "seed": 0, "store_hidden": False,
                 "dir": str(root / "distill")},
        "train": {"steps": 30, "batch_size": 4, "seq_len": 64, "lr": 3e-3, "weight_decay": 0.0, "warmup": 3,
                  "grad_clip": 1.0, "save_every": 10, "eval_frac": 0.1, "train_on_prompt": True},
    })
    return target, tok, prompts, cfg, root


def test_distillation_set(tiny_setup):
    target, tok, prompts, cfg, root = tiny_setup
    data_root = distill.build(target, tok, "tiny", cfg.data, CPU, torch.float32, progress=False, prompts=prompts)
    assert sorted(p.name for p in data_root.glob("shard_*.pt")) == ["shard_0000.pt", "shard_0001.pt", "shard_0002.pt"]
    items = distill.load(data_root)
    st = distill.stats(items)
    assert st["sequences"] == 24 and st["answered"] == 12
    it = items[0]
    assert it["answered"] and len(it["tokens"]) > it["prompt_len"]
    # the answer is the target's own greedy continuation
    plen = it["prompt_len"]
    assert it["tokens"][plen:].tolist() == reference_greedy(target, it["tokens"][:plen].tolist(),
                                                            len(it["tokens"]) - plen)
    # the stored top-k is the target's distribution at each position
    logits = target(it["tokens"][None].long()).logits[0]
    top = torch.topk(torch.log_softmax(logits, -1), 8, dim=-1)
    assert torch.equal(it["ids"].long(), top.indices)
    assert torch.allclose(it["logp"].float(), top.values, atol=1e-2)
    assert not items[-1]["answered"] and len(items[-1]["tokens"]) == items[-1]["prompt_len"]
    # a second build reuses the shards (resumable, no target work)
    mtimes = {p: p.stat().st_mtime for p in data_root.glob("shard_*.pt")}
    distill.build(target, tok, "tiny", cfg.data, CPU, torch.float32, progress=False, prompts=prompts)
    assert mtimes == {p: p.stat().st_mtime for p in data_root.glob("shard_*.pt")}


def test_tiny_training_end_to_end(tiny_setup):
    target, tok, prompts, cfg, root = tiny_setup
    items = distill.load(distill.build(target, tok, "tiny", cfg.data, CPU, torch.float32, progress=False,
                                       prompts=prompts))
    out = root / "ckpt"
    out.mkdir()
    before = DraftLM(target, 1, loop.pick_vocab(items, 48, 96, {2}))
    with torch.no_grad():
        l0 = loop.loss_fn(before, *loop.collate(items[:8], 64, _lookup(before), True))[0].item()
    res = loop.train(cfg, target, None, items, out, {2}, CPU, progress=False)
    s = res["summary"]
    assert s["eval_loss"] < l0  # it learned
    assert s["draft_vocab"] == 48 and s["steps"] == 30
    loop.finish(cfg, res, out, "tiny", {**distill.stats(items), "dropped_for_benchmark_overlap": 0},
                "python -m specbench.train ...")
    assert is_draft_checkpoint(out) and (out / "README.md").read_text().startswith("# tiny_draft")
    # reload and decode with it: token-identical to plain greedy, drafts accepted
    draft = load_draft(out, target, CPU, torch.float32)
    ps = prompts_of([6, 9], vocab=96)
    refs = [reference_greedy(target, p, 16) for p in ps]
    lev = Leviathan(cfg_for(K=3), target, None, CPU, torch.float32, draft_model=draft)
    res2 = run_engine(target, lev, ps, 16)
    assert [r.tokens for r in res2] == refs
    assert sum(sum(r.accept_lens) for r in res2) > 0
    # draft logits are -inf outside its vocabulary
    logits = draft(torch.tensor([ps[0]])).logits[0, -1]
    assert torch.isinf(logits).sum() == 96 - 48


def test_training_resumes_where_it_stopped(tiny_setup):
    target, tok, prompts, cfg, root = tiny_setup
    items = distill.load(distill.build(target, tok, "tiny", cfg.data, CPU, torch.float32, progress=False,
                                       prompts=prompts))
    full_dir, part_dir = root / "full", root / "part"
    full_dir.mkdir()
    part_dir.mkdir()
    full = loop.train(cfg, target, None, items, full_dir, {2}, CPU, progress=False)
    short = OmegaConf.merge(cfg, {"train": {"steps": 30}})
    # stop after 20 steps by training a 20-step schedule's first part: emulate with save_every and a crash
    calls = {"n": 0}
    real = loop.loss_fn

    def crash_after_20(*a):
        calls["n"] += 1
        if calls["n"] > 20:
            raise KeyboardInterrupt
        return real(*a)

    loop.loss_fn = crash_after_20
    try:
        with pytest.raises(KeyboardInterrupt):
            loop.train(short, target, None, items, part_dir, {2}, CPU, progress=False)
    finally:
        loop.loss_fn = real
    assert (part_dir / "_train_state.pt").exists()
    resumed = loop.train(short, target, None, items, part_dir, {2}, CPU, progress=False)
    a, b = full["draft"].own_state(), resumed["draft"].own_state()
    for k in a:
        if a[k].is_floating_point():
            assert torch.allclose(a[k], b[k], atol=1e-5), k


def _lookup(draft):
    lk = torch.full((draft.vocab_size,), -1, dtype=torch.long)
    lk[draft.vocab_ids] = torch.arange(len(draft.vocab_ids))
    return lk


def test_shipped_cards_are_portable_and_made_from_todays_defaults():
    """Every checkpoint's drafter.json and README.md are what `python -m specbench.train.card`
    writes now: no path of the training machine, tree sizes and K read from the code."""
    from specbench.train import card

    folders = card.shipped()
    assert {f.name for f in folders} >= {"draft_lm", "eagle", "medusa", "specdec"}
    assert card.main(["--check"]) == 0, "run `python -m specbench.train.card` and commit the cards"
    for f in folders:
        for name in ("drafter.json", "README.md"):
            assert card.absolute_paths((f / name).read_text()) == [], f / name
    from specbench.methods.eagle import AUTO
    from specbench.methods.medusa import AUTO_CPU_TREE

    eagle = (card.REPO / "checkpoints/smollm2-135m/eagle/README.md").read_text()
    assert f"{AUTO['cpu']['total_tokens']} nodes verified on a CPU" in eagle
    assert f"tree has {AUTO_CPU_TREE} nodes on a CPU" in (card.REPO / "checkpoints/smollm2-135m/medusa/README.md").read_text()


def test_card_check_fails_on_a_stale_card_and_a_machine_path(tmp_path, monkeypatch):
    import shutil

    from specbench.train import card

    src = card.REPO / "checkpoints/smollm2-135m/eagle"
    ck = tmp_path / "eagle"
    ck.mkdir()
    for name in ("drafter.json", "README.md"):
        shutil.copy(src / name, ck / name)
    assert card.main([str(ck)]) == 0  # outside the repo its card names no folder of this machine
    assert "eagle.checkpoint=<this folder>" in (ck / "README.md").read_text()
    assert card.main(["--check", str(ck)]) == 0
    from specbench.methods import eagle as eagle_method

    monkeypatch.setitem(eagle_method.AUTO["cpu"], "total_tokens", 9)  # the code's default moved
    assert card.main(["--check", str(ck)]) == 1
    assert card.main([str(ck)]) == 0 and "9 nodes verified on a CPU" in (ck / "README.md").read_text()
    meta = json.loads((ck / "drafter.json").read_text())
    # training on a machine with a local sources file and an out folder: both dropped
    meta["feature_settings"]["sources"] = "/data/me/.cache/sources.pt"
    meta["command"] += " features.sources=/data/me/.cache/sources.pt out=/tmp/ck/eagle"
    card.write(ck, meta)
    assert card.absolute_paths((ck / "drafter.json").read_text() + (ck / "README.md").read_text()) == []
    assert "out=" not in json.loads((ck / "drafter.json").read_text())["command"]
    meta["data"]["note"] = "features from /home/me/features"  # anything else naming a path is refused
    with pytest.raises(ValueError, match="/home/me/features"):
        card.write(ck, meta)
