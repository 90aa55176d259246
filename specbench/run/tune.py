"""``K=auto``: speculation sized per method and batch size. The best K (or tree size) falls as
the batch grows, because a wider verify stops being nearly free; a fair comparison of methods
compares each at its best.

For each setting the method lists (``Proposer.tune_space``: speculation lengths, or a tree
method's own size keys), a short untimed pilot decodes held-out prompts, the questions after
the job's ``limit`` (never the measured ones), at the job's batch size and measures the
method's acceptance (tau, acceptance per position), its verify width and its draft time per
step. The width is the one its verify forwards ran (``forward_nodes`` + 1): in a ragged batch
every row runs the widest row's draft, so pricing at the rows' own drafts (``valid_nodes``)
would favour settings that cut drafts short. The target's step cost T(bs, n) is profiled on the
spot, in the host state of the job, at the widths the candidates verify. Each candidate is priced
with the batch-aware bound

    S = tau T(bs, 1) / (T_draft + T(bs, width))

and the largest S wins (the narrower setting on a tie). With ``tune.cost`` (a GPU cost model,
``specbench.analysis.costmodel``: SpecDecode-Bench's fitted H100, a roofline ``<gpu>:<model>``, or
a fit of the user's own profile) T and T_draft come from the model at the job's batch size, width
and KV tokens (bs x the mean prefix) instead: the acceptance measured here, priced on that GPU,
with the drafting the method declares (``cost_kind``). The pilot's own verify time per step is
kept beside it (``t_verify_pilot``) but does not price: the pilots run one after another, minutes
apart on a host whose speed drifts, over steps whose rows leave as they finish, while the profile
times every width in one pass at the full batch. The record keeps every candidate's numbers under
``tuned``, so the choice can be checked and redone.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time

from omegaconf import DictConfig, OmegaConf, open_dict

from specbench import methods
from specbench.costs import forward_times
from specbench.errors import ConfigError


def wanted(cfg) -> bool:
    return str(cfg.get("K")) == "auto"


def with_setting(cfg: DictConfig, setting: dict) -> DictConfig:
    """``cfg`` with one candidate's overrides (dotted keys) applied, as a new config."""
    c = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    for key, v in setting.items():
        OmegaConf.update(c, key, v, merge=False, force_add=True)
    return c


def candidates(cfg: DictConfig, device) -> list[tuple[dict, DictConfig]]:
    """(setting, config) of every candidate the method lists for ``K=auto``; [] for a method
    with nothing to size (AR). Refuses a method that reads K but lists no settings."""
    method = methods.get(cfg.method.name)
    space = method.tune_space(cfg, device)
    if not space:
        probe = with_setting(cfg, {"K": 1})
        if method.spec_len(probe, device) is not None:
            raise ConfigError(f"K=auto: method {cfg.method.name} (as configured) lists no settings to choose among "
                              "(Proposer.tune_space); give K a number")
        return []
    return [(s, with_setting(cfg, {"K": 1, **s})) for s in space]  # K=1 where the setting sizes other keys


def check(cfg: DictConfig, target_config, device) -> list[tuple[dict, DictConfig]]:
    """The candidates that pass the method's own checks (one ConfigError line when none does)."""
    method = methods.get(cfg.method.name)
    ok, why = [], []
    for s, c in candidates(cfg, device):
        try:
            method.check(c, target_config)
            ok.append((s, c))
        except ConfigError as e:
            why.append(f"{s}: {e}")
    if why and not ok:
        raise ConfigError(f"K=auto: no candidate setting of {cfg.method.name} passes its checks ({why[0]})")
    if ok and cfg.tune.get("cost") is not None and method.cost_kind is None:
        raise ConfigError(f"tune.cost prices n-gram and EAGLE-style drafting only, and {cfg.method.name} declares "
                          "neither (Proposer.cost_kind); drop tune.cost to profile its costs here")
    return ok


def held_out(cfg: DictConfig, tokenizer) -> list:
    """The pilot's prompts: first turns of the ``tune.prompts`` questions after the measured
    ``limit`` ones (the pilot never sees a measured prompt)."""
    from specbench.run.workload import build_requests

    if cfg.limit is None:
        raise ConfigError("K=auto pilots on questions held out from the measured ones, and limit=null measures "
                          "them all: set limit=N (the pilot takes the questions after the first N)")
    n = int(cfg.tune.prompts)
    c = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    c.limit = int(cfg.limit) + n
    qs = build_requests(c, tokenizer)[int(cfg.limit):]
    if not qs:
        raise ConfigError(f"K=auto: dataset={cfg.dataset.name} has no questions after limit={cfg.limit} to pilot "
                          "on; lower limit")
    return [dataclasses.replace(q, turns=q.turns[:1]) for q in qs]


def _pilot(job) -> dict:
    """One candidate (``job``: its config, and the held-out prompts as its questions) decoded over
    the held-out prompts at the job's batch size, every prompt at least once (cycled to fill the
    last batch; untimed)."""
    from specbench.run.measure import MethodRun

    cfg, questions = job.cfg, job.questions
    bs = int(cfg.bs)
    n = -(-max(len(questions), bs) // bs) * bs  # every held-out prompt, in full batches of bs rows
    rows = [questions[i % len(questions)] for i in range(n)]
    pcfg = with_setting(cfg, {"max_new_tokens": pilot_tokens(cfg), "serving.batching": "static", "serving.rate": "inf",
                              "repeats": 1, "limit": n, "ctx": cfg.ctx})
    run = MethodRun(dataclasses.replace(job, cfg=pcfg, questions=rows, bar=None), cfg.method.name)
    for unit in run.units():
        run.run_unit(unit)
    m = run.metrics()[0]
    it = max(1, int(m["iterations"]))
    width = (m.get("forward_nodes") or 0.0) + 1.0  # the width its verifies ran, the pending token included
    return {"tau": m["tau"], "accept_rate_per_pos": m["accept_rate_per_pos"], "width": width,
            "t_draft": m["time_s"]["draft"] / it, "t_verify_pilot": m["time_s"]["verify"] / it,
            "spec_len": run.K or None}


def pilot_tokens(cfg) -> int:
    """New tokens per pilot row: ``tune.tokens``, or the job's own max_new_tokens."""
    t = cfg.tune.get("tokens")
    return int(cfg.max_new_tokens) if t is None else int(t)


def _priced(T: dict, width: float) -> float:
    """T(bs, width) from the profiled integer widths, linear in between."""
    lo, hi = math.floor(width), math.ceil(width)
    if lo == hi:
        return T[lo]
    return T[lo] + (T[hi] - T[lo]) * (width - lo)


def choose(job) -> tuple[DictConfig, dict | None]:
    """The config of ``job`` (a loaded ``workload.Job``) with the chosen setting, and what was
    chosen and why (None: nothing to size). Progress and the table of candidates go to stderr."""
    cfg, model, tokenizer, device, dtype = job.cfg, job.model, job.tokenizer, job.device, job.dtype
    name = cfg.method.name
    cands = check(cfg, model.config, device)
    if not cands:
        return cfg, None
    t0 = time.perf_counter()
    qs = held_out(cfg, tokenizer)
    bs = int(cfg.bs)
    rows = []
    for s, c in cands:
        print(f"[specbench] K=auto: piloting {name} {_show(s)} at bs={bs} on {len(qs)} held-out prompt(s)",
              file=sys.stderr, flush=True)
        rows.append({"setting": s, **_pilot(dataclasses.replace(job, cfg=c, questions=qs))})
    # the target's step cost, now, at the widths the candidates verify (and 1: AR's step)
    from specbench.run.data import render

    chat = bool(cfg.model.get("chat", True))
    ctx = cfg.ctx or round(sum(len(render(tokenizer, [], q.turns[0], chat)) for q in qs) / len(qs))
    ctx = int(ctx + pilot_tokens(cfg) // 2)  # the pilot's mean prefix over its decoding
    # the shape the job verifies: ragged rows at bs > 1 (the masked path), a tree where the drafts are
    # wider than deep (the 4D mask); AR's step (width 1) is a plain one
    for r in rows:
        r["tree"] = r["width"] - 1 > (r["spec_len"] or 0) + 1e-9
    cost = cfg.tune.get("cost")
    T = _modelled(cfg, cost, rows, bs, ctx) if cost is not None else _profiled(cfg, model, rows, bs, ctx, device, dtype)
    for r in rows:
        r["t_verify"] = _priced(T[r["tree"]], r["width"])
        r["bound"] = r["tau"] * T[r["tree"]][1] / (r["t_draft"] + r["t_verify"])
    best = max(range(len(rows)), key=lambda i: (round(rows[i]["bound"], 6), -i))
    chosen = rows[best]["setting"]
    info = {"by": "batch-aware bound: tau T(bs,1) / (T_draft + T(bs, width))", "bs": bs, "chosen": chosen,
            **({"cost_model": str(cost)} if cost is not None else {}),
            "prompts": [q.id for q in qs], "pilot_tokens": pilot_tokens(cfg), "ctx": ctx,
            # T(bs, width) per shape ("tree 7": a tree of 7 nodes), and "1": AR's plain step
            "cost_s": {"1": next(iter(T.values()))[1],
                       **{("tree " if tree else "") + str(w): t for tree, ts in T.items() for w, t in ts.items()}},
            "candidates": rows,
            "beats_ar": rows[best]["bound"] > 1.0,  # false: at this batch size no setting is expected to
            "seconds": time.perf_counter() - t0}     # beat plain decoding (the best one still runs)
    print(table(info), file=sys.stderr, flush=True)
    out = with_setting(cfg, {"K": 1, **chosen})
    with open_dict(out):
        out.K_auto = True if cost is None else str(cost)  # priced on a cost model: another job (records.JOB_KEYS)
        out.tuned = info
    return out, info


def _widths(rows) -> dict:
    """The integer widths each shape (plain or tree) is priced at: 1 (AR's step) and either side
    of every candidate's mean width."""
    return {tree: sorted({1} | {w for r in rows if r["tree"] == tree
                                for w in (math.floor(r["width"]), math.ceil(r["width"]))})
            for tree in sorted({r["tree"] for r in rows})}


def _profiled(cfg, model, rows, bs, ctx, device, dtype) -> dict:
    """T(bs, width) per shape (plain or tree), timed now on the target at the candidates' widths."""
    vocab = int(model.config.vocab_size)
    return {tree: forward_times(model, bs, widths, ctx, device, dtype, int(cfg.tune.reps), vocab, ragged=bs > 1,
                                tree=tree) for tree, widths in _widths(rows).items()}


def _modelled(cfg, spec, rows, bs, ctx) -> dict:
    """T(bs, width) per shape off the cost model ``spec`` at bs x ctx KV tokens, each row's draft
    time replaced by the model's for the method's ``cost_kind`` (the measured one kept as
    ``t_draft_here``). The candidates are those the method lists on this machine's device (a tree
    method's trees for a CPU here, not a GPU's)."""
    from specbench.analysis import costmodel

    cost, kind = costmodel.resolve(str(spec)), methods.get(cfg.method.name).cost_kind
    kv = bs * ctx
    T = {tree: {w: costmodel.step(cost, bs, w, kv) for w in widths} for tree, widths in _widths(rows).items()}
    for r in rows:
        # a chain drafts its width - 1 tokens one forward each; a tree one forward per depth, each over
        # that depth's nodes (as wide a read of the drafter's weights as one token): depth + 1 prices it
        drafted = r["spec_len"] + 1 if r["tree"] and r["spec_len"] else r["width"]
        r["t_draft_here"] = r["t_draft"]  # the forward alone prices n-gram drafting, as in analysis.replay
        r["t_draft"] = cost.draft(kind, bs, drafted, kv, cost.target(bs, r["width"], kv))
    return T


def _show(s: dict) -> str:
    return " ".join(f"{k.removeprefix('method.')}={v}" for k, v in s.items())


def table(info: dict) -> str:
    """The candidates as the pilot measured and priced them, the chosen one marked."""
    head = f"{'setting':<24} {'tau':>5} {'width':>6} {'draft ms':>9} {'verify ms':>10} {'bound':>6}"
    on = (f" on {info['cost_model']}: the cost model's target and GPU, acceptance from this job's model"
          if info.get("cost_model") else "")
    lines = [f"K=auto at bs={info['bs']} (T(bs,1) = {info['cost_s']['1'] * 1e3:.1f} ms{on}; "
             f"{info['seconds']:.0f} s of pilots on {len(info['prompts'])} held-out prompt(s))", head]
    for r in info["candidates"]:
        mark = " <- chosen" if r["setting"] == info["chosen"] else ""
        lines.append(f"{_show(r['setting']):<24} {r['tau']:>5.2f} {r['width']:>6.2f} {r['t_draft'] * 1e3:>9.2f} "
                     f"{r['t_verify'] * 1e3:>10.2f} {r['bound']:>5.2f}x{mark}")
    if not info.get("beats_ar", True):
        lines.append("no setting's bound exceeds 1: at this batch size the method is not expected to beat AR")
    return "\n".join(lines)
