"""Training the feature-level drafters (Medusa heads, EAGLE) on the feature set.

Targets come from the frozen target itself: the teacher distribution at a position is the
target's output layer applied to the stored final hidden state, restricted to the draft
vocabulary (a softmax over a subset is the renormalised restriction). Losses:

- Medusa: head k on f_t against the teacher's distribution for token t+1+k (which the
  target computes from f_{t+k}); soft cross-entropy, weight 0.8^(k-1).
- EAGLE: smooth L1 from the predicted to the real next feature plus ``cls_weight`` x soft
  cross-entropy of their distributions, for each of ``ttt_steps`` unrolled steps
  (training-time test), weight 0.8^(s-1); optional uniform noise on the input features.
- EAGLE-3: soft cross-entropy only (its output is no feature the target has), over its own
  draft-vocabulary head, for each of ``ttt_steps`` unrolled steps, weight 0.8^(s-1); the input
  is the target's states at three layers (``features.layers`` is set to them), the teacher the
  target's distribution at the next position restricted to the draft vocabulary.

Held-out sequences give the summary: top-1 agreement with the target's greedy token per
head / per unrolled step, and Medusa's per-rank accuracies that shape its tree.
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from specbench.drafters import vocab_by_frequency
from specbench.drafters.eagle import EagleDrafter
from specbench.drafters.eagle3 import Eagle3Drafter, layer_config, tap_layers
from specbench.drafters.medusa import MedusaHeads, sparse_tree
from specbench.train import card
from specbench.train.loop import batches, fit, split

RANKS = 10  # Medusa per-rank accuracies measured for the tree
DATA = "features"  # the trainer of drafter=medusa, eagle and eagle3 (the interface: specbench/train/__init__.py)


def layers(cfg, num_target_layers: int) -> list:
    """EAGLE-3: the states at the inputs of layers 2, L//2, L-3, and the teacher's; else the final state."""
    if cfg.drafter.kind == "eagle3":
        return [*tap_layers(num_target_layers), "final"]
    return list(cfg.features.layers)


def min_seq_len(dr) -> int:
    """A token and the next."""
    return 2


def said(s: dict) -> str:
    return f"held-out top-1 agreement {[round(x, 3) for x in s['eval_top1_agreement']]}"


def collate(batch, seq_len: int, device, dtype=torch.float32, layers=("final",)):
    """tokens [B, T], features [B, T, d x len(layers)] (the stored states of ``layers``,
    concatenated), valid [B, T]; sequences longer than ``seq_len`` keep their start."""
    T = min(seq_len, max(len(it["tokens"]) for it in batch))
    d = sum(batch[0]["hidden"][str(k)].shape[-1] for k in layers)
    tok = torch.zeros(len(batch), T, dtype=torch.long)
    f = torch.zeros(len(batch), T, d, dtype=torch.float16)
    valid = torch.zeros(len(batch), T, dtype=torch.bool)
    for b, it in enumerate(batch):
        n = min(T, len(it["tokens"]))
        tok[b, :n] = it["tokens"][:n].long()
        f[b, :n] = torch.cat([it["hidden"][str(k)][:n] for k in layers], dim=-1)
        valid[b, :n] = True
    return tok.to(device), f.to(device=device, dtype=dtype), valid.to(device)


def _soft_ce(logits, teacher_logits, w):
    p = torch.softmax(teacher_logits.float(), -1)
    ce = -(p * torch.log_softmax(logits.float(), -1)).sum(-1)
    agree = (logits.argmax(-1) == teacher_logits.argmax(-1)).float()
    den = w.sum().clamp(min=1)
    return (ce * w).sum() / den, (agree * w).sum() / den


def eagle_loss(model: EagleDrafter, tok, f, valid, steps: int, cls_weight: float, noise: float):
    fin = f[:, :-1]
    if noise > 0 and model.training:
        fin = fin + (torch.rand_like(fin) * 2 - 1) * noise
    preds = model.train_forward(fin, tok[:, 1:], valid[:, 1:], steps)  # [S, B, T-1, d]
    target = f[:, 1:]
    t_logits = model.logits(target)
    T = target.shape[1]
    total, agrees = 0.0, []
    for s in range(steps):
        w = (valid[:, 1:] & (torch.arange(T, device=f.device) >= s)[None]).float()
        reg = (F.smooth_l1_loss(preds[s], target, reduction="none").mean(-1) * w).sum() / w.sum().clamp(min=1)
        ce, agree = _soft_ce(model.logits(preds[s]), t_logits, w)
        total = total + 0.8 ** s * (reg + cls_weight * ce)
        agrees.append(agree.detach())
    return (total, *agrees)


def eagle31(dr) -> bool:
    """Whether ``drafter=eagle3`` trains EAGLE 3.1 (``drafter.version=3.1``: a norm per tap before
    ``fc``, the post-norm state fed back) rather than EAGLE-3 (``3``)."""
    from specbench.errors import ConfigError

    v = float(dr.get("version", 3))
    if v not in (3.0, 3.1):
        raise ConfigError(f"drafter.version must be 3 or 3.1 (EAGLE 3.1's fc_norm and norm_output), got {dr.get('version')!r}")
    return v == 3.1


def eagle3_loss(model: Eagle3Drafter, tok, f3, fin, valid, steps: int, head_rows: torch.Tensor):
    """``f3`` [B, T, 3H] the concatenated taps, ``fin`` [B, T, H] the target's final states,
    ``head_rows`` [V', H] the target's output rows of the draft vocabulary (the teacher)."""
    preds = model.train_forward(f3[:, :-1], tok[:, 1:], valid[:, 1:], steps)  # [S, B, T-1, H]
    t_logits = F.linear(fin[:, 1:], head_rows)
    T = t_logits.shape[1]
    total, agrees = 0.0, []
    for s in range(steps):
        w = (valid[:, 1:] & (torch.arange(T, device=fin.device) >= s)[None]).float()
        ce, agree = _soft_ce(model.logits(preds[s]), t_logits, w)
        total = total + 0.8 ** s * ce
        agrees.append(agree.detach())
    return (total, *agrees)


def medusa_loss(model: MedusaHeads, tok, f, valid, ranks: bool = False):
    H = model.n_heads
    T = f.shape[1]
    logits = model(f)  # [H, B, T, V']
    t_logits = model.logits_of(f)
    total, agrees, rank_hits = 0.0, [], []
    for k in range(1, H + 1):
        if T <= k:
            agrees.append(torch.zeros(()))
            continue
        w = (valid[:, k:] & valid[:, :-k]).float()
        ce, agree = _soft_ce(logits[k - 1][:, :-k], t_logits[:, k:], w)
        total = total + 0.8 ** (k - 1) * ce
        agrees.append(agree.detach())
        if ranks:  # where the target's greedy token ranks among head k's candidates
            want = t_logits[:, k:].argmax(-1)
            top = logits[k - 1][:, :-k].topk(RANKS, dim=-1).indices
            hit = (top == want[..., None]).float() * w[..., None]
            rank_hits.append(hit.sum((0, 1)) / w.sum().clamp(min=1))
    if ranks:
        return total, agrees, rank_hits
    return (total, *agrees)


def train(cfg, target, tokenizer, items: list[dict], out: Path, eos: set[int], device, progress: bool = True) -> dict:
    tcfg, dr = cfg.train, cfg.drafter
    if device.type == "cuda":  # the drafter trains in TF32 on a GPU (the teacher pass ran in full fp32)
        torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(int(cfg.seed))
    rng = random.Random(int(cfg.seed))
    V = int(target.config.get_text_config().vocab_size)
    vocab_ids = vocab_by_frequency([it["tokens"] for it in items], dr.draft_vocab, V, eos)
    if dr.kind == "eagle":
        model = EagleDrafter(target, vocab_ids, input_norm=bool(dr.get("input_norm", True)))
        # start from the target's last layer: a decoder layer that already reads its features
        if dr.get("init") == "target":
            model.block.load_from(target.model.layers[-1])
    elif dr.kind == "eagle3":
        v31 = eagle31(dr)
        model = Eagle3Drafter(target, layer_config(target.config, len(vocab_ids)), len(vocab_ids), fc_norm=v31,
                              norm_output=v31)
        with torch.no_grad():
            model.d2t.copy_(vocab_ids - torch.arange(len(vocab_ids)))
        head_rows = target.get_output_embeddings().weight.detach()[vocab_ids.to(device)].float()
    elif dr.kind == "medusa":
        model = MedusaHeads(target, vocab_ids, int(dr.heads))
    else:
        raise ValueError(f"unknown feature drafter kind {dr.kind!r}")
    model.to(device)
    evals, trains, bs = split(items, tcfg)
    params = [p for p in model.parameters() if p.requires_grad]
    L = int(tcfg.seq_len)
    it = batches(trains, bs, L, rng)

    def loss_of(batch, steps=None):
        if dr.kind == "eagle3":
            tok, f3, valid = collate(batch, L, device, layers=model.taps)
            fin = collate(batch, L, device)[1]
            return eagle3_loss(model, tok, f3, fin, valid, steps or int(dr.ttt_steps), head_rows)
        tok, f, valid = collate(batch, L, device)
        if dr.kind == "eagle":
            return eagle_loss(model, tok, f, valid, int(dr.ttt_steps), float(dr.cls_weight), float(dr.noise))
        return medusa_loss(model, tok, f, valid)

    def step(skip=False):
        b = next(it)
        return None if skip else loss_of(b)

    t0 = time.time()
    history = fit(model, params, step, tcfg, out / "_train_state.pt", bool(cfg.resume), f"train {dr.name}", progress)
    train_s = time.time() - t0
    # held-out evaluation
    sums, n = None, 0
    rank_sum = None
    with torch.no_grad():
        for s in range(0, len(evals), bs):
            batch = evals[s:s + bs]
            tok, f, valid = collate(batch, L, device)
            if dr.kind == "eagle3":
                vals = loss_of(batch, max(int(dr.ttt_steps), 4))
            elif dr.kind == "eagle":
                vals = eagle_loss(model, tok, f, valid, max(int(dr.ttt_steps), 4), float(dr.cls_weight), 0.0)
            else:
                loss, agrees, ranks = medusa_loss(model, tok, f, valid, ranks=True)
                vals = (loss, *agrees)
                r = torch.stack(ranks).cpu()
                rank_sum = r if rank_sum is None else rank_sum + r
            v = torch.tensor([float(x) for x in vals])
            sums = v if sums is None else sums + v
            n += 1
    ev = (sums / max(1, n)).tolist()
    last = history[-min(20, len(history)):] if history else [(math.nan,)]
    summary = {
        "steps": int(tcfg.steps), "train_loss_last20": sum(h[0] for h in last) / len(last),
        "eval_loss": ev[0], "eval_top1_agreement": ev[1:],
        "train_seconds_this_run": train_s, "eval_sequences": len(evals), "train_sequences": len(trains),
        "trainable_params": sum(p.numel() for p in params), "draft_vocab": len(vocab_ids),
    }
    extra = {}
    if dr.kind == "medusa":
        acc = (rank_sum / max(1, n)).tolist()
        extra["acc"] = acc
        summary["tree_expected_accepted"] = sum(math.prod(acc[d][i] for d, i in enumerate(p))
                                                for p in sparse_tree(acc, int(dr.tree_size)))
    return {"draft": model, "summary": summary, "extra": extra, "loss_curve": [round(h[0], 4) for h in history[::10]]}


def finish(cfg, result: dict, out: Path, target_name: str, data_meta: dict, command: str) -> None:
    """Write the checkpoint (bf16 weights, drafter.json) and its card."""
    from specbench.drafters import save

    model, dr, s = result["draft"], cfg.drafter, result["summary"]
    meta = {
        "kind": dr.kind, "name": dr.name, "target": target_name, "target_vocab_size": int(model.vocab_size),
        "draft_vocab": int(len(model.vocab_ids)), "seed": int(cfg.seed), "drafter": {k: dr[k] for k in dr},
        "data": data_meta, "feature_settings": {k: cfg.features[k] for k in cfg.features},
        "train_settings": {k: cfg.train[k] for k in cfg.train}, "train_summary": s,
        "loss_curve_every_10_steps": result["loss_curve"], "command": command, **result["extra"],
    }
    if dr.kind == "medusa":
        meta["heads"] = int(dr.heads)
    if dr.kind == "eagle3":  # SafeAILab's layout (what eagle.version=3 and the authors' code read)
        from specbench.drafters.formats.eagle3 import save as save_eagle3

        save_eagle3(out, model)  # card.write adds drafter.json and the card
    else:
        save(model, out, meta)
    card.write(out, meta)


def card_body(meta: dict) -> list[str]:
    """Its card's description, data and training sections (``card.render`` adds the rest)."""
    s, d, fs, ts = meta["train_summary"], meta["data"], meta["feature_settings"], meta["train_settings"]
    what = {
        "eagle": "EAGLE feature-level drafter for `method=eagle`: fc([token embedding; target feature]) -> one "
                 "decoder layer -> the target's output layer restricted to the draft vocabulary",
        "medusa": f"{meta.get('heads')} Medusa heads for `method=medusa`: a residual SiLU block per head on the "
                  "target's last hidden state, then the target's output layer restricted to the draft vocabulary",
        "eagle3": "EAGLE-3 drafter for `method=eagle eagle.version=3`: fc([the target's states at the inputs of "
                  "layers 2, L//2, L-3]) -> one decoder layer over [embedding; feature] -> its own head over the "
                  "draft vocabulary (SafeAILab's EAGLE-3 layout)",
    }[meta["kind"]]
    agree = ", ".join(f"{x:.1%}" for x in s["eval_top1_agreement"])
    per = "unrolled step (tree depth)" if meta["kind"] in ("eagle", "eagle3") else "head"
    lines = [
        f"# {meta['name']}: {meta['kind']} drafter for {meta['target']}", "",
        f"{what} ({meta['draft_vocab']} most frequent tokens of the feature set). Only the drafter's own weights "
        f"are stored ({s['trainable_params']:,} parameters, bf16); "
        + ("the embedding is the target's." if meta["kind"] == "eagle3" else
           "the embedding and output layer are the target's."),
        "", "## Data",
        f"- {d['sequences']} sequences of the ShareGPT training slice ({d['tokens']:,} token positions): "
        f"{d['answered']} first turns answered by the target itself (greedy, up to {fs['max_new_tokens']} tokens; "
        f"{d['answer_tokens']:,} answer tokens) and {d['sequences'] - d['answered']} whole conversations "
        f"(both roles, up to {fs['max_tokens']} tokens)",
        f"- dropped: {d['dropped']} (overlap with MT-Bench / HumanEval / GSM-Symbolic prompts, or a duplicate of "
        "the evaluation slice)",
        f"- stored per position: the target's hidden states at layers {fs['layers']} (fp16); feature set key {d['key']}",
        "", "## Training",
        f"- {card.budget(s, ts)}, seed {meta['seed']}, {s['train_seconds_this_run']:.0f} s",
        card.losses(s),
        f"- held-out top-1 agreement with the target's greedy token, per {per}: {agree}",
    ]
    if meta.get("acc"):
        lines.append(f"- expected accepted drafts of the {meta['drafter']['tree_size']}-node tree it was trained "
                     f"for (product of per-rank accuracies): {s['tree_expected_accepted']:.2f}")
    return lines


def card_use(meta: dict, where: str) -> list[str]:
    """Its card's Use lines (``card.use_lines``): the run that picks the checkpoint at ``where``, and
    the tree it drafts there by default."""
    kind = meta["kind"]
    if kind == "eagle3":
        v = meta.get("drafter", {}).get("version", 3)
        return ["```bash", f"python -m specbench method=eagle eagle.version={v} eagle.checkpoint={where}", "```", ""]
    if kind == "eagle":
        from specbench.methods.eagle import AUTO

        c, g = AUTO["cpu"], AUTO["cuda"]
        return [*card.run_block("eagle", where),
                f"Draft tree with `eagle.top_k`, `eagle.depth` and `eagle.total_tokens` at `auto` "
                f"(methods/eagle.py): top_k {c['top_k']}, depth {c['depth']}, {c['total_tokens']} nodes "
                f"verified on a CPU; top_k {g['top_k']}, depth {g['depth']}, {g['total_tokens']} nodes on a GPU."]
    from specbench.methods.medusa import AUTO_CPU_TREE

    acc = meta.get("acc")

    def expected(n):
        if not acc:
            return ""
        e = sum(math.prod(acc[d][i] for d, i in enumerate(p)) for p in sparse_tree(acc, n))
        return f" (expected accepted drafts by the heads' held-out accuracies: {e:.2f})"

    own = int(meta["drafter"]["tree_size"])
    return [*card.run_block("medusa", where),
            f"{meta.get('heads')} heads; with `medusa.tree_size=auto` (methods/medusa.py) the sparse "
            f"tree has {AUTO_CPU_TREE} nodes on a CPU{expected(AUTO_CPU_TREE)} and the checkpoint's "
            f"{own} on a GPU{expected(own)}."]
