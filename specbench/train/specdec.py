"""Training SpecDec's Spec-Drafter on the self-distillation set (``specbench.train.distill``).

SpecDec distils the target at the sequence level: the drafter learns the target's own
(greedy) continuations. Training positions are therefore cut points inside the answers the
target wrote itself: for a cut ``p`` the context is ``tokens[:p]`` and query ``j`` must
predict ``tokens[p + j]``. One forward serves many cuts of a sequence: the sequence is
followed by ``groups`` blocks of ``k`` queries, block ``g`` seeing the tokens before its cut
``p_g`` and its own queries (a 4D attention mask), at positions ``p_g .. p_g + k - 1``.
Loss: cross-entropy of every query against its token (tokens outside the draft vocabulary
are skipped), weight 0.8^j. Held-out: top-1 agreement per query and the tau a greedy chain
would reach, 1 + sum_j P(queries 0..j all right).
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from specbench.drafters import save as save_draft
from specbench.drafters import vocab_by_frequency
from specbench.drafters.specdec import SpecDrafter
from specbench.errors import ConfigError
from specbench.train import card
from specbench.train.loop import batches, fit, split

DATA = "answers"  # the trainer of drafter=specdec (the interface: specbench/train/__init__.py)


def min_seq_len(dr) -> int:
    """A token and the next."""
    return 2


def said(s: dict) -> str:
    return (f"held-out agreement per query {[round(x, 3) for x in s['eval_query_agreement']]}, "
            f"chain tau {s['eval_chain_tau']:.2f}")


def answered(items: list[dict]) -> list[dict]:
    """Sequences with at least two answer tokens written by the target."""
    return [it for it in items if it["answered"] and len(it["tokens"]) - it["prompt_len"] >= 2]


def collate(batch, seq_len: int, k: int, groups: int, V: int, lookup: torch.Tensor, rng: random.Random):
    """input ids [B, T] (queries as ids V..V+k-1), positions [B, T], additive-ready bool
    mask [B, T, T], labels [B, groups, k] in the draft vocabulary (-1 = none)."""
    B = len(batch)
    L = min(seq_len, max(len(it["tokens"]) for it in batch))
    T = L + groups * k
    ids = torch.zeros(B, T, dtype=torch.long)
    pos = torch.zeros(B, T, dtype=torch.long)
    ok = torch.zeros(B, T, T, dtype=torch.bool)
    labels = torch.full((B, groups, k), -1, dtype=torch.long)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    for b, it in enumerate(batch):
        tok = it["tokens"].long()
        n = min(L, len(tok))
        ids[b, :n] = tok[:n]
        pos[b, :L] = torch.arange(L)
        ok[b, :L, :L] = causal
        ok[b, :, n:L] = False
        ok[b, torch.arange(n, L), torch.arange(n, L)] = True  # padding sees itself
        lo = min(it["prompt_len"] + 1, n - 1)
        cuts = list(range(lo, n))
        cuts = sorted(rng.sample(cuts, min(groups, len(cuts))))
        for g in range(groups):
            s = L + g * k
            ids[b, s:s + k] = V + torch.arange(k)
            if g >= len(cuts):  # an unused block sees only itself
                ok[b, s:s + k, s:s + k] = torch.eye(k, dtype=torch.bool)
                pos[b, s:s + k] = torch.arange(k)
                continue
            p = cuts[g]
            ok[b, s:s + k, :p] = True
            ok[b, s:s + k, s:s + k] = True
            pos[b, s:s + k] = p + torch.arange(k)
            want = tok[p:p + k]  # may run past the data: those queries have no label
            labels[b, g, : len(want)] = lookup[want]
    return ids, pos, ok, labels


def loss_fn(model: SpecDrafter, ids, pos, ok, labels, L: int):
    B, groups, k = labels.shape
    neg = torch.finfo(torch.float32).min
    mask = torch.where(ok, 0.0, neg)[:, None]
    h = model.body(inputs_embeds=model.embed(ids), attention_mask=mask, position_ids=pos).last_hidden_state
    hq = h[:, L:].reshape(B, groups, k, -1)
    logits = model.reduced_logits(hq).float()
    valid = labels >= 0
    ce = F.cross_entropy(logits.flatten(0, 2), labels.clamp(min=0).flatten(), reduction="none").view(B, groups, k)
    w = (0.8 ** torch.arange(k, dtype=torch.float32))[None, None] * valid
    loss = (ce * w).sum() / w.sum().clamp(min=1)
    right = (logits.argmax(-1) == labels) & valid
    per_q = right.sum((0, 1)).float() / valid.sum((0, 1)).clamp(min=1)
    return loss, *per_q.detach()


def chain_stats(model: SpecDrafter, batches) -> dict:
    """Held-out per-query agreement and the tau of a greedy chain (cuts with all k labels)."""
    right, run, n = 0.0, 0.0, 0
    with torch.no_grad():
        for ids, pos, ok, labels, L in batches:
            B, groups, k = labels.shape
            mask = torch.where(ok, 0.0, torch.finfo(torch.float32).min)[:, None]
            h = model.body(inputs_embeds=model.embed(ids), attention_mask=mask, position_ids=pos).last_hidden_state
            pred = model.reduced_logits(h[:, L:].reshape(B, groups, k, -1)).argmax(-1)
            full = (labels != -1).all(-1)  # -1 also marks a token outside the draft vocabulary: a sure miss
            r = (pred == labels)[full].float()  # [cuts, k]; cuts that run past the data are left out
            right = right + r.sum(0)
            run = run + r.cumprod(-1).sum(0)
            n += int(r.shape[0])
    agree = (right / max(1, n)).tolist() if n else []
    prefix = (run / max(1, n)).tolist() if n else []
    return {"eval_query_agreement": agree, "eval_chain_tau": 1 + sum(prefix), "eval_cuts": n}


def train(cfg, target, tokenizer, items: list[dict], out: Path, eos: set[int], device, progress: bool = True) -> dict:
    tcfg, dr = cfg.train, cfg.drafter
    torch.manual_seed(int(cfg.seed))
    rng = random.Random(int(cfg.seed))
    V = int(target.config.get_text_config().vocab_size)
    items = answered(items)
    if len(items) < 4:
        raise ConfigError(f"the distillation set has {len(items)} answered sequences (of 2 answer tokens or more), "
                          "SpecDec trains on at least 4: raise drafter.data.respond")
    vocab_ids = vocab_by_frequency([it["tokens"][it["prompt_len"]:] for it in items], dr.draft_vocab, V, eos)
    lookup = torch.full((V,), -1, dtype=torch.long)
    lookup[vocab_ids] = torch.arange(len(vocab_ids))
    k, groups, L = int(dr.k), int(dr.groups), int(tcfg.seq_len)
    model = SpecDrafter(target, int(dr.layers), vocab_ids, k, init_from_target=dr.init == "target")
    model.queries.requires_grad_(True)
    evals, trains, bs = split(items, tcfg)
    params = [p for p in model.parameters() if p.requires_grad]
    it = batches(trains, bs, L, rng)

    def step(skip=False):
        b = next(it)
        ids, pos, ok, labels = collate(b, L, k, groups, V, lookup, rng)  # always drawn: keeps the rng in step
        return None if skip else loss_fn(model, ids, pos, ok, labels, ids.shape[1] - groups * k)

    t0 = time.time()
    history = fit(model, params, step, tcfg, out / "_train_state.pt", bool(cfg.resume), f"train {dr.name}", progress)
    train_s = time.time() - t0
    erng = random.Random(1)
    ev = []
    for s in range(0, len(evals), bs):
        ids, pos, ok, labels = collate(evals[s:s + bs], L, k, groups, V, lookup, erng)
        ev.append((ids, pos, ok, labels, ids.shape[1] - groups * k))
    model.eval()
    stats = chain_stats(model, ev)
    last = history[-min(20, len(history)):] if history else [(math.nan,)]
    summary = {"steps": int(tcfg.steps), "train_loss_last20": sum(h[0] for h in last) / len(last), **stats,
               "train_seconds_this_run": train_s, "eval_sequences": len(evals), "train_sequences": len(trains),
               "trainable_params": sum(p.numel() for p in params), "draft_vocab": len(vocab_ids)}
    return {"draft": model, "summary": summary, "loss_curve": [round(h[0], 4) for h in history[::10]]}


def finish(cfg, result: dict, out: Path, target_name: str, data_meta: dict, command: str) -> None:
    model, dr, s = result["draft"], cfg.drafter, result["summary"]
    meta = {
        "kind": "specdec", "name": dr.name, "target": target_name, "target_vocab_size": int(model.vocab_size),
        "layers": int(dr.layers), "k": int(dr.k), "draft_vocab": len(model.vocab_ids), "seed": int(cfg.seed),
        "drafter": {x: dr[x] for x in dr if x != "data"}, "data": data_meta,
        "data_settings": {x: cfg.data[x] for x in cfg.data}, "train_settings": {x: cfg.train[x] for x in cfg.train},
        "train_summary": s, "loss_curve_every_10_steps": result["loss_curve"], "command": command,
    }
    save_draft(model, out, meta)
    card.write(out, meta)


def card_body(meta: dict) -> list[str]:
    """Its card's description, data and training sections (``card.render`` adds the rest)."""
    s, d, ds, ts = meta["train_summary"], meta["data"], meta["data_settings"], meta["train_settings"]
    agree = ", ".join(f"{x:.1%}" for x in s["eval_query_agreement"])
    lines = [
        f"# {meta['name']}: SpecDec Spec-Drafter for {meta['target']}", "",
        f"A non-autoregressive drafter for `method=specdec`: {meta['k']} learned [MASK] queries after the context "
        f"predict {meta['k']} draft tokens in one forward; the target's token embedding (shared, frozen), "
        f"{meta['layers']} transformer layer(s) of its own (initialised from the target's first layers), the "
        f"target's output layer restricted to the {meta['draft_vocab']} most frequent answer tokens. Only the "
        f"drafter's own weights are stored ({s['trainable_params']:,} parameters, bf16).",
        "", "## Data",
        f"- {s['train_sequences'] + s['eval_sequences']} ShareGPT training-slice first turns answered by the target "
        f"itself (greedy, up to {ds['max_new_tokens']} tokens; {d['dropped_for_benchmark_overlap']} prompts dropped "
        f"for overlapping MT-Bench / HumanEval / GSM prompts); distillation set key {d['key']}",
        f"- training cuts: {meta['drafter']['groups']} random cut points per answer per step",
        "", "## Training",
        f"- {s['steps']} steps, batch {ts['batch_size']} sequences, AdamW lr {ts['lr']}, seed {meta['seed']}, "
        f"{s['train_seconds_this_run']:.0f} s this run",
        f"- final train loss (last 20 steps): {s['train_loss_last20']:.3f}",
        f"- held-out ({s['eval_sequences']} answers, {s['eval_cuts']} cuts): top-1 agreement with the target's "
        f"greedy token per query: {agree}; tau of a greedy {meta['k']}-token chain: {s['eval_chain_tau']:.2f}",
    ]
    return lines


def card_use(meta: dict, where: str) -> list[str]:
    """Its card's Use lines (``card.use_lines``): the run that picks the checkpoint at ``where``, and
    how it drafts and verifies there by default."""
    mconf = card.method_defaults("specdec")
    return [*card.run_block("specdec", where),
            f"{meta['k']} draft tokens per forward (the checkpoint's queries; K above {meta['k']} is capped); "
            f"verification `specdec.beta={mconf['beta']}` (1 = exact, lossless), `specdec.tol={mconf['tol']}`."]
