"""Training a P-EAGLE drafter (``specbench/drafters/peagle.py``) on the feature set, as the paper
(AWS, arXiv 2602.01469) and speculators train it: every position is a verified entry, and
chains of mask slots hang off sampled anchors, fewer the deeper (COD sampling).

A sequence's entries: position i (the target's fused taps h_i, the token x_{i+1}) at depth 0 for
every i; then depth d = 1..``depths``-1 keeps a random share max(r^d, r_min) of the anchors that
reached depth d-1 (r ``down_sample``, r_min ``down_sample_min``; speculators' defaults 0.7 and
0.2), a mask slot at a + d for each kept anchor a. ``PEagleDrafter.train_forward`` runs them
in one forward (entry j sees the verified entries up to its anchor and its chain's slots up to
its depth). The entry at position a + d drafts x_{a+d+2}; its loss is the soft cross-entropy
towards the target's distribution of that token over the draft vocabulary (the target's output
rows of it, on the stored final state at a + d + 1), every entry weighted alike.

Held-out sequences give the summary: the top-1 agreement with the target's greedy token per
depth (teacher-forced: each slot's anchor chain is the data's).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from specbench.drafters import vocab_by_frequency
from specbench.drafters.eagle3 import layer_config, tap_layers
from specbench.drafters.peagle import PEagleDrafter
from specbench.errors import ConfigError
from specbench.train.dflash import mask_token
from specbench.train.heads import collate
from specbench.train.loop import fit_and_score

DATA = "features"  # the trainer of drafter=peagle (the interface: specbench/train/__init__.py)


def layers(cfg, num_target_layers: int) -> list:
    """EAGLE-3's: the states at the inputs of layers 2, L//2, L-3, and the teacher's."""
    return [*tap_layers(num_target_layers), "final"]


def min_seq_len(dr) -> int:
    """A context before the entry, the entry and the token after it."""
    return 3


def said(s: dict) -> str:
    return f"held-out top-1 agreement per depth {[round(x, 3) for x in s['eval_top1_agreement']]}"


def cod_entries(n: int, depths: int, ratio: float, ratio_min: float, gen: torch.Generator) -> tuple:
    """(anchor, depth) of a sequence whose positions 0..n-1 have a teacher: every position at depth
    0, then per depth d a random share max(ratio^d, ratio_min) of the n - d positions whose chain
    can reach it, drawn from the anchors kept at depth d-1 (the slot at a + d must be below n)."""
    anchors, depth = [torch.arange(n)], [torch.zeros(n, dtype=torch.long)]
    pool = torch.arange(n)
    for d in range(1, depths):
        pool = pool[pool + d < n]
        k = min(len(pool), int((n - d) * max(ratio ** d, ratio_min)))
        if k <= 0:
            break
        pool = pool[torch.randperm(len(pool), generator=gen)[:k]].sort().values
        anchors.append(pool)
        depth.append(torch.full((k,), d, dtype=torch.long))
    return torch.cat(anchors), torch.cat(depth)


def peagle_loss(model: PEagleDrafter, tok, taps, fin, valid, head_rows, dr, gen):
    """The batch's mean soft cross-entropy over its sequences' entries, and top-1 agreement per depth."""
    depths = int(dr.depths)
    total, hits, counts = 0.0, torch.zeros(depths), torch.zeros(depths)
    for b in range(tok.shape[0]):
        T = int(valid[b].sum())
        n = T - 2  # entry i reads (h_i, x_{i+1}); the teacher of x_{i+2} is the final state at i + 1
        if n < 1:
            continue
        anchor, depth = cod_entries(n, depths, float(dr.down_sample), float(dr.down_sample_min), gen)
        anchor, depth = anchor.to(tok.device), depth.to(tok.device)
        out = model.train_forward(taps[b:b + 1, :T - 1], tok[b:b + 1, 1:T], anchor, depth)
        logits = model.logits(out)[0].float()
        with torch.no_grad():
            p = torch.softmax(F.linear(fin[b, anchor + depth + 1].float(), head_rows), -1)
        ce = -(p * torch.log_softmax(logits, -1)).sum(-1)
        total = total + ce.mean()
        right = (logits.argmax(-1) == p.argmax(-1)).float().cpu()
        dcpu = depth.cpu()
        hits += torch.zeros(depths).index_add_(0, dcpu, right)
        counts += torch.bincount(dcpu, minlength=depths)[:depths].float()
    agree = (hits / counts.clamp(min=1)).tolist()
    return (total / tok.shape[0], *agree)


def train(cfg, target, tokenizer, items: list[dict], out: Path, eos: set[int], device, progress: bool = True) -> dict:
    tcfg, dr = cfg.train, cfg.drafter
    torch.manual_seed(int(cfg.seed))
    gen = torch.Generator().manual_seed(int(cfg.seed))
    tc = target.config.get_text_config()
    V = int(tc.vocab_size)
    if int(dr.depths) < 1 or int(dr.layers) < 1:
        raise ConfigError(f"drafter.depths and drafter.layers must be >= 1, got {dr.depths} and {dr.layers}")
    mask = mask_token(dr, tokenizer, items)
    vocab_ids = vocab_by_frequency([it["tokens"] for it in items], dr.draft_vocab, V, eos)
    lc = layer_config(target.config, len(vocab_ids))
    lc.num_hidden_layers = int(dr.layers)
    if getattr(lc, "layer_types", None):  # one type a layer, as the config checks
        lc.layer_types = ["full_attention"] * int(dr.layers)
    model = PEagleDrafter(target, lc, len(vocab_ids), mask, int(dr.depths))
    with torch.no_grad():
        model.d2t.copy_(vocab_ids - torch.arange(len(vocab_ids)))
    model.to(device)
    head_rows = target.get_output_embeddings().weight.detach()[vocab_ids.to(device)].float()
    L = int(tcfg.seq_len)

    def loss_of(batch):
        tok, taps, valid = collate(batch, L, device, layers=model.taps)
        fin = collate(batch, L, device)[1]
        return peagle_loss(model, tok, taps, fin, valid, head_rows, dr, gen)

    def replay(batch):  # a skipped step's COD draws
        for v in collate(batch, L, "cpu")[2]:
            n = int(v.sum()) - 2
            if n >= 1:
                cod_entries(n, int(dr.depths), float(dr.down_sample), float(dr.down_sample_min), gen)

    res = fit_and_score(cfg, model, items, out, loss_of, progress, replay)
    res["summary"] |= {"draft_vocab": len(vocab_ids), "mask_token_id": mask}
    return {"draft": model, **res}


def finish(cfg, result: dict, out: Path, target_name: str, data_meta: dict, command: str) -> None:
    """Write the checkpoint in speculators' ``peagle`` layout (bf16), its drafter.json and card."""
    from specbench.drafters.formats.peagle import save
    from specbench.train import card

    model, dr = result["draft"], cfg.drafter
    meta = card.feature_meta(cfg, result, target_name, data_meta, command,
                             kind="peagle", name=dr.name, target=target_name,
                             target_vocab_size=int(model.vocab_size), draft_vocab=int(model.d2t.numel()))
    save(out, model)
    card.write(out, meta)


def card_body(meta: dict) -> list[str]:
    """Its card's description, data and training sections (``card.render`` adds the rest)."""
    from specbench.train import card

    s, ts, dr = meta["train_summary"], meta["train_settings"], meta["drafter"]
    agree = ", ".join(f"{x:.1%}" for x in s["eval_top1_agreement"])
    return [
        f"# {meta['name']}: P-EAGLE drafter for {meta['target']}", "",
        "A parallel EAGLE-3 drafter for `method=peagle` (vLLM's speculators `peagle` layout): fc([the target's states "
        f"at the inputs of layers 2, L//2, L-3]) -> {dr['layers']} layers (EAGLE-3's first) over [embedding; feature], "
        f"mask slots (token {s['mask_token_id']}, a learned `mask_hidden` feature) drafting a step's {dr['depths']} "
        f"tokens in one forward -> its own head over {meta['draft_vocab']} draft tokens. Only its own weights are "
        f"stored ({s['trainable_params']:,} parameters, bf16); the embedding is the target's.",
        *card.feature_data(meta),
        "", "## Training",
        f"- COD sampling (depth d keeps max({dr['down_sample']}^d, {dr['down_sample_min']}) of the chains), soft "
        f"cross-entropy towards the target's distribution; {card.budget(s, ts)}, seed {meta['seed']}",
        card.losses(s),
        card.agreement(s, "depth (teacher-forced)", agree, "a step (product)"),
    ]


def card_use(meta: dict, where: str) -> list[str]:
    """Its card's Use lines (``card.use_lines``): the run that picks the checkpoint at ``where``."""
    return ["```bash", f"python -m specbench method=peagle peagle.checkpoint={where}", "```", "",
            f"Drafts the {meta['drafter']['depths']} tokens a step it was trained for; `peagle.K=<k>` drafts k."]
