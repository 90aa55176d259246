"""Training a drafter on the distillation set: soft cross-entropy (KL up to a constant)
against the target's top-k distribution at every position, with resumable checkpoints and
a fixed seed."""

from __future__ import annotations

import math
import random
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from specbench.drafters import save as save_draft
from specbench.drafters.draft_lm import DraftLM
from specbench.errors import ConfigError
from specbench.train import card

DATA = "distill"  # the trainer of drafter=draft_lm (the interface: specbench/train/__init__.py)


def pick_vocab(items: list[dict], size: int, vocab_size: int, always: set[int]) -> torch.Tensor:
    """The ``size`` most frequent tokens of the distillation set (teacher top-1 targets and
    the text itself), always keeping special tokens. Sorted ids."""
    cnt = Counter()
    for it in items:
        cnt.update(it["tokens"].tolist())
        cnt.update(it["ids"][:, 0].tolist())
    chosen = set(always)
    for tok, _ in cnt.most_common():
        if len(chosen) >= size:
            break
        chosen.add(int(tok))
    # a vocabulary larger than what the data shows: fill with the lowest ids (byte-level pieces)
    t = 0
    while len(chosen) < min(size, vocab_size):
        chosen.add(t)
        t += 1
    return torch.tensor(sorted(chosen), dtype=torch.long)


def min_seq_len(dr) -> int:
    """A token and the next."""
    return 2


def check(cfg) -> None:
    """The settings that would leave a trainer nothing to do, refused in one line before the target
    loads (and its teacher pass runs): no steps, an empty batch, a held-out share that keeps every
    sequence, a ``seq_len`` too short for any position, too few sequences to hold one out and train."""
    from specbench.train import trainer

    t, dr = cfg.train, cfg.drafter
    tr = trainer(str(dr.kind))  # its DATA and min_seq_len
    if int(t.steps) < 1:
        raise ConfigError(f"train.steps={t.steps}: nothing to train; set train.steps >= 1")
    if int(t.batch_size) < 1:
        raise ConfigError(f"train.batch_size={t.batch_size}: set train.batch_size >= 1")
    if not 0 <= float(t.eval_frac) < 1:
        raise ConfigError(f"train.eval_frac={t.eval_frac}: the share held out must be in [0, 1) "
                          "(at least one sequence is always held out)")
    if int(t.seq_len) < tr.min_seq_len(dr):
        raise ConfigError(f"train.seq_len={t.seq_len} holds no position drafter={dr.kind} trains on: "
                          f"set train.seq_len >= {tr.min_seq_len(dr)}")
    if tr.DATA == "features":
        n, least, what = int(cfg.features.respond) + int(cfg.features.conversations), 2, \
            "features.respond + features.conversations"
    elif tr.DATA == "answers":  # the target's own answers only
        n, least, what = min(int(cfg.data.prompts), int(cfg.data.respond)), 4, "answered prompts (drafter.data.respond)"
    else:
        n, least, what = int(cfg.data.prompts), 2, "data.prompts"
    if n < least:
        raise ConfigError(f"{what} = {n}: one sequence is held out for the evaluation and the rest are trained on; "
                          f"ask for at least {least}")


def split(items: list, tcfg) -> tuple[list, list, int]:
    """The held-out sequences (the first ``train.eval_frac`` of them, at least one), the training
    ones, and the batch size: ``train.batch_size``, or all the training sequences when there are
    fewer (said in one line). Refused in one line when none is left to train on."""
    n_eval = max(1, int(len(items) * float(tcfg.eval_frac)))
    evals, trains = items[:n_eval], items[n_eval:]
    if not trains:
        raise ConfigError(f"{len(items)} sequence(s), {n_eval} held out for the evaluation: none left to train on; "
                          "build more (features.respond / features.conversations, or data.prompts)")
    bs = int(tcfg.batch_size)
    if len(trains) < bs:
        print(f"[train] {len(trains)} training sequences, fewer than train.batch_size={bs}: batches of "
              f"{len(trains)}", file=sys.stderr)
        bs = len(trains)
    return evals, trains, bs


def batches(items, batch_size: int, seq_len: int, gen: random.Random):
    """Batches of ``batch_size`` sequences, each pass over ``items`` in a new order (a pass's last
    partial batch is left out)."""
    if not 1 <= batch_size <= len(items):  # no whole batch: the loop below would never yield (``split`` sizes it)
        raise ValueError(f"batches of {batch_size} sequences from {len(items)}")
    order = list(range(len(items)))
    while True:
        gen.shuffle(order)
        for s in range(0, len(order) - batch_size + 1, batch_size):
            yield [items[i] for i in order[s:s + batch_size]]


def collate(batch, seq_len: int, lookup: torch.Tensor, train_on_prompt: bool):
    """tokens [B, L], attention mask, teacher ids mapped into the draft vocabulary [B, L, k]
    (-1 = outside), teacher probs [B, L, k], loss weight per position [B, L]."""
    L = min(seq_len, max(len(it["tokens"]) for it in batch))
    B = len(batch)
    k = batch[0]["ids"].shape[1]
    tok = torch.zeros(B, L, dtype=torch.long)
    mask = torch.zeros(B, L, dtype=torch.long)
    tid = torch.full((B, L, k), -1, dtype=torch.long)
    tp = torch.zeros(B, L, k)
    w = torch.zeros(B, L)
    for b, it in enumerate(batch):
        n = min(L, len(it["tokens"]))
        tok[b, :n] = it["tokens"][:n].long()
        mask[b, :n] = 1
        tid[b, :n] = lookup[it["ids"][:n].long()]
        tp[b, :n] = it["logp"][:n].float().exp()
        start = 0 if train_on_prompt else max(0, it["prompt_len"] - 1)
        w[b, start:n - 1] = 1.0  # the last position has no next token in the data (its teacher row still counts)
        w[b, n - 1] = 1.0 if n == len(it["tokens"]) else 0.0
    return tok, mask, tid, tp, w


def loss_fn(draft: DraftLM, tok, mask, tid, tp, w):
    h = draft.body(input_ids=tok, attention_mask=mask).last_hidden_state
    logq = torch.log_softmax(draft.reduced_logits(h).float(), dim=-1)  # [B, L, V']
    inside = tid >= 0
    p = tp * inside
    mass = p.sum(-1, keepdim=True)
    p = p / mass.clamp(min=1e-9)  # the teacher's top-k mass inside the draft vocabulary, renormalised
    lq = logq.gather(-1, tid.clamp(min=0))
    ce = -(p * lq).sum(-1)  # [B, L]
    ent = -(p * torch.log(p.clamp(min=1e-12))).sum(-1)
    valid = w * (mass.squeeze(-1) > 0)
    denom = valid.sum().clamp(min=1)
    loss = (ce * valid).sum() / denom
    kl = ((ce - ent) * valid).sum() / denom
    agree = (((logq.argmax(-1) == tid[..., 0]) & (tid[..., 0] >= 0)).float() * valid).sum() / denom
    return loss, kl.detach(), agree.detach()


def duration(seconds: float) -> str:
    """A time as people say it: under 1 s, 40 s, 12 min, 2.5 h."""
    if seconds < 1:
        return "under 1 s"
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def fit(model, params, step_fn, tcfg, state_path: Path, resume: bool, desc: str, progress: bool = True) -> list:
    """The loop every drafter trains with: AdamW, linear warm-up then cosine decay to 10%,
    gradient clipping, a progress bar (from the second step on, with the time a step and the run's
    estimated total), and a resumable checkpoint (``state_path``) every
    ``save_every`` steps. ``step_fn()`` draws the next batch (the data order comes from the
    seed alone, so a resumed run replays it) and returns (loss, *metrics). Returns the
    history of (loss, *metrics) per step of this run."""
    from tqdm.auto import tqdm

    opt = torch.optim.AdamW(params, lr=float(tcfg.lr), weight_decay=float(tcfg.weight_decay), betas=(0.9, 0.95))
    steps, warm = int(tcfg.steps), int(tcfg.warmup)

    def lr_at(s):
        if s < warm:
            return (s + 1) / warm
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, steps - warm)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    start = 0
    if state_path.exists() and resume:
        st = torch.load(state_path, weights_only=False)
        model.load_state_dict(st["model"], strict=False)
        opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"])
        torch.set_rng_state(st["torch_rng"])
        start = st["step"]
        print(f"[train] resumed at step {start}", file=sys.stderr)
        with torch.no_grad():
            for _ in range(start):  # replay the data order up to the resumed step
                step_fn(skip=True)
    history = []
    bar = tqdm(range(start, steps), desc=desc, disable=not progress, file=sys.stderr)
    model.train()
    t0 = first = time.perf_counter()
    for step in bar:
        loss, *metrics = step_fn()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, float(tcfg.grad_clip))
        opt.step()
        sched.step()
        history.append((loss.item(), *(float(m) for m in metrics)))
        done, now = step + 1 - start, time.perf_counter()
        if done == 1:
            first = now  # the first step (allocations, warm-up) is left out of the time a step
        cost = ""
        if done > 1:  # what the run costs, from the steps so far: a step's time and the whole run's
            per = (now - first) / (done - 1)
            total = now - t0 + per * (steps - step - 1)
            cost = f" | {per:.2f} s/step, ~{duration(total)} in all"
            if not progress and done == 3:  # the same, once, in the log
                print(f"[train] {desc}: {per:.2f} s a step, about {duration(total)} for {steps - start} steps",
                      file=sys.stderr, flush=True)
        bar.set_postfix_str(" ".join(f"{x:.3f}" for x in history[-1]) + cost)
        if (step + 1) % int(tcfg.save_every) == 0 or step + 1 == steps:
            if not progress:  # a log line per checkpoint when there is no bar
                print(f"[train] {desc} step {step + 1}/{steps}: " + " ".join(f"{x:.4f}" for x in history[-1]),
                      file=sys.stderr, flush=True)
            tmp = state_path.with_suffix(".tmp")
            torch.save({"model": model.own_state(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "torch_rng": torch.get_rng_state(), "step": step + 1}, tmp)
            tmp.rename(state_path)
    bar.close()
    model.eval()
    return history


def train(cfg, target, tokenizer, items: list[dict], out: Path, eos: set[int], device, progress: bool = True) -> dict:
    tcfg, dr = cfg.train, cfg.drafter
    torch.manual_seed(int(cfg.seed))
    rng = random.Random(int(cfg.seed))
    V = int(target.config.vocab_size)
    vocab_ids = pick_vocab(items, int(dr.draft_vocab) if dr.draft_vocab else V, V, eos)
    lookup = torch.full((V,), -1, dtype=torch.long)
    lookup[vocab_ids] = torch.arange(len(vocab_ids))
    draft = DraftLM(target, int(dr.layers), vocab_ids, init_from_target=dr.init == "target")
    draft.train()
    evals, trains, bs = split(items, tcfg)
    params = [p for p in draft.parameters() if p.requires_grad]
    it = batches(trains, bs, int(tcfg.seq_len), rng)

    def step(skip=False):
        b = next(it)
        return None if skip else loss_fn(draft, *collate(b, int(tcfg.seq_len), lookup, bool(tcfg.train_on_prompt)))

    t0 = time.time()
    history = fit(draft, params, step, tcfg, out / "_train_state.pt", bool(cfg.resume), f"train {dr.name}", progress)
    with torch.no_grad():
        ev = [loss_fn(draft, *collate(evals[i:i + 8], int(tcfg.seq_len), lookup, bool(tcfg.train_on_prompt)))
              for i in range(0, len(evals), 8)]
    ev_loss = sum(float(x[0]) for x in ev) / len(ev)
    ev_kl = sum(float(x[1]) for x in ev) / len(ev)
    ev_agree = sum(float(x[2]) for x in ev) / len(ev)
    last = history[-min(20, len(history)):] if history else [(math.nan,) * 3]
    summary = {
        "steps": int(tcfg.steps), "train_loss_last20": sum(h[0] for h in last) / len(last),
        "train_kl_last20": sum(h[1] for h in last) / len(last),
        "eval_loss": ev_loss, "eval_kl": ev_kl, "eval_top1_agreement": ev_agree,
        "train_seconds_this_run": time.time() - t0, "eval_sequences": len(evals), "train_sequences": len(trains),
        "trainable_params": sum(p.numel() for p in params), "draft_vocab": len(vocab_ids),
    }
    return {"draft": draft, "summary": summary, "loss_curve": [round(h[0], 4) for h in history[::10]]}


def finish(cfg, result: dict, out: Path, target_name: str, data_meta: dict, command: str) -> None:
    draft = result["draft"]
    meta = {
        "kind": "draft_lm", "name": cfg.drafter.name, "target": target_name,
        "target_vocab_size": int(draft.vocab_size), "layers": int(cfg.drafter.layers),
        "draft_vocab": int(len(draft.vocab_ids)), "seed": int(cfg.seed),
        "data": data_meta, "data_settings": {k: cfg.data[k] for k in cfg.data},
        "train_settings": {k: cfg.train[k] for k in cfg.train}, "train_summary": result["summary"],
        "loss_curve_every_10_steps": result["loss_curve"], "command": command,
    }
    save_draft(draft, out, meta)
    card.write(out, meta)


def said(s: dict) -> str:
    return f"eval KL {s['eval_kl']:.3f}, top-1 agreement {s['eval_top1_agreement']:.1%}"


def held_out(model, loss_of, evals: list, batch_size: int, history: list) -> dict:
    """The summary fields every feature-drafter trainer reports: the mean of ``loss_of``'s values
    (loss, then a top-1 agreement per draft position) over the held-out sequences in batches, the
    expected accepted drafts of a chain (the agreements' running products, summed) and the train
    loss of the last 20 steps of ``history``."""
    sums, n = None, 0
    model.eval()
    with torch.no_grad():
        for s in range(0, len(evals), batch_size):
            v = torch.tensor([float(x) for x in loss_of(evals[s:s + batch_size])])
            sums = v if sums is None else sums + v
            n += 1
    ev = (sums / max(1, n)).tolist()
    last = history[-min(20, len(history)):] if history else [(math.nan,)]
    return {"train_loss_last20": sum(h[0] for h in last) / len(last), "eval_loss": ev[0], "eval_top1_agreement": ev[1:],
            "eval_expected_accepted": sum(math.prod(ev[1:k + 1]) for k in range(1, len(ev)))}


def fit_and_score(cfg, model, items: list[dict], out: Path, loss_of, progress: bool = True, replay=None) -> dict:
    """The feature trainers' loop around ``fit``: the first ``train.eval_frac`` of the sequences are
    held out; the model fits batches of the rest (``loss_of(batch)`` -> (loss, *agreements); on a
    resumed run ``replay(batch)`` redraws a skipped step's random draws); then ``held_out`` scores
    it. Returns the summary's shared fields and the loss curve (every 10th step)."""
    tcfg = cfg.train
    evals, trains, bs = split(items, tcfg)
    params = [p for p in model.parameters() if p.requires_grad]
    it = batches(trains, bs, int(tcfg.seq_len), random.Random(int(cfg.seed)))

    def step(skip=False):
        b = next(it)
        if skip:
            if replay is not None:
                replay(b)
            return None
        return loss_of(b)

    t0 = time.time()
    history = fit(model, params, step, tcfg, out / "_train_state.pt", bool(cfg.resume), f"train {cfg.drafter.name}",
                  progress)
    train_s = time.time() - t0
    summary = {"steps": int(tcfg.steps), "batch_size": bs, **held_out(model, loss_of, evals, bs, history),
               "train_seconds_this_run": train_s, "eval_sequences": len(evals), "train_sequences": len(trains),
               "trainable_params": sum(p.numel() for p in params)}
    return {"summary": summary, "loss_curve": [round(h[0], 4) for h in history[::10]]}


def card_body(meta: dict) -> list[str]:
    """A draft LM's card's description, data and training sections (``card.render`` adds the rest)."""
    s = meta["train_summary"]
    d = meta["data"]
    lines = [
        f"# {meta['name']}: a draft LM for {meta['target']}",
        "",
        f"A {meta['layers']}-layer causal LM with {meta['target']}'s tokenizer for `method=leviathan`: the target's "
        f"token embedding (shared, frozen), {meta['layers']} transformer layer(s) of its own (initialised from the "
        f"target's first layers), and the target's output layer restricted to the {meta['draft_vocab']} most "
        "frequent tokens of the distillation data.",
        "",
        "## Data",
        f"- {d['sequences']} ShareGPT first turns ({d['dropped_for_benchmark_overlap']} dropped for overlapping "
        f"MT-Bench / HumanEval / GSM prompts), {d['answered']} of them answered by the target itself "
        f"(greedy, up to {meta['data_settings']['max_new_tokens']} tokens)",
        f"- {d['tokens']} token positions with the target's top-{meta['data_settings']['topk']} distribution, "
        f"{d['response_tokens']} of them in the target's own answers",
        "",
        "## Training",
        f"- {s['steps']} steps, batch {meta['train_settings']['batch_size']} x up to "
        f"{meta['train_settings']['seq_len']} tokens, AdamW lr {meta['train_settings']['lr']}, seed {meta['seed']}",
        f"- trainable parameters: {s['trainable_params']:,}",
        f"- final train loss (soft cross-entropy, last 20 steps): {s['train_loss_last20']:.3f}; "
        f"KL to the teacher's top-k: {s['train_kl_last20']:.3f}",
        f"- held-out ({s['eval_sequences']} sequences): loss {s['eval_loss']:.3f}, KL {s['eval_kl']:.3f}, "
        f"top-1 agreement with the target {s['eval_top1_agreement']:.1%}",
        "",
    ]
    return lines


def card_use(meta: dict, where: str) -> list[str]:
    """A draft LM's card's Use lines (``card.use_lines``): the run that picks the checkpoint at ``where``."""
    from omegaconf import OmegaConf

    from specbench.paths import CONF_DIR
    from specbench.run.schema import Config

    drafts = [p.stem for p in sorted((CONF_DIR / "draft_model").glob("*.yaml"))
              if OmegaConf.load(p).get("path") == where]
    pick = f"draft_model={drafts[0]}" if drafts else f"draft_model=smollm2-135m-draft draft_model.path={where}"
    k = Config.K
    return ["```bash", f"python -m specbench method=leviathan {pick}", "```", "",
            f"Drafts K={k} tokens a step by default (`K=...`)."]
