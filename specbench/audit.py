"""GPU readiness, measured on any machine: for every registered method on a tiny random target, at
each batch size with ragged prompts, what one decoding step (``Engine._step``: propose, verify,
accept, commit, update) does besides the model forwards.

- ``host_reads_per_step``: reads that wait for the device: ``.item()``, ``int()``/``float()``/
  ``bool()`` of a tensor, ``.tolist()``, ``.cpu()``, and ops whose output size depends on
  the data (boolean-mask indexing, ``nonzero``, ``masked_select``, ``unique``).
- ``ops_per_step``: tensor ops launched outside the forwards of the target and of the method's own
  modules (``Proposer.modules()``): on a GPU each is a kernel launch the step pays for.
- ``bytes_per_step``: bytes of new tensors made outside the target's forward (the engine's and the
  method's, drafter forwards included): what caches that grow by copying cost.
- ``fullgraph``: whether the verify forward (the target over the step's nodes, through its cache)
  and the method's ``propose`` trace with ``torch.compile(fullgraph=True)`` (no graph break), and
  the first break's reason where not.

Counted with a ``TorchDispatchMode`` over every decoding step of the batch but the first two (the
first checks the draft's values once a batch, a read of its own; the second runs the compile
checks), per step, on the device's code path (small trees are walked on host lists on the CPU only:
``walk.LIST_WALK`` is off here). A method that truly cannot avoid a read says why in its
``audit_note`` (``Proposer.audit_note``), printed beside its row.

    python -m specbench.audit [--bs 1,8] [--tokens 24] [--methods pld eagle] [--no-compile] [--out results/audit.json]
    make audit
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# ops whose output size depends on the values: each waits for the device before the host goes on
DATA_DEPENDENT = {"aten.nonzero", "aten.masked_select", "aten._unique2", "aten.unique_consecutive",
                  "aten.unique_dim", "aten._local_scalar_dense"}
# Tensor methods that bring values to the host (``.numpy()`` is not one: a device tensor refuses it, so
# code that calls it on its own runs on host tensors, as the CPU's fast argmax does)
HOST_METHODS = ("tolist", "cpu")


def _tiny_target(folder: Path):
    """The unit tests' tiny target (``specbench.tiny``), saved (the methods' ``tiny`` settings read the
    folder) and loaded back, running its tokens to the end (no EOS)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specbench.tiny import save_tiny_hf

    save_tiny_hf(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # every row runs its tokens
    return model, AutoTokenizer.from_pretrained(folder)


class _Count(TorchDispatchMode):
    """Host reads, ops outside the model forwards, and bytes of new tensors outside the target's."""

    def __init__(self, depth: dict):
        super().__init__()
        self.depth = depth  # {"target": calls open, "method": calls open}
        self.reads, self.ops, self.bytes, self.bytes_by = Counter(), 0, 0, Counter()
        self.quiet = 0  # inside a counted host method (.tolist() on a device tensor copies first)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.quiet:
            return out
        name = str(func.overloadpacket)
        inputs = [a for a in tree_leaves((args, kwargs or {})) if isinstance(a, torch.Tensor)]
        if name in DATA_DEPENDENT or (name in ("aten.index", "aten.index_put", "aten.index_put_") and any(
                a.dtype == torch.bool for a in tree_leaves(args[1]) if isinstance(a, torch.Tensor))) or (
                name == "aten.repeat_interleave" and isinstance(args[1] if len(args) > 1 else args[0], torch.Tensor)
                and (kwargs or {}).get("output_size") is None):  # repeats given as a tensor: its sum sizes the output
            self.reads[name.replace("aten._local_scalar_dense", "item/int/float/bool")] += 1
        elif name == "aten._to_copy" and (kwargs or {}).get("device") == torch.device("cpu") and \
                inputs and inputs[0].device.type != "cpu":
            self.reads["to cpu"] += 1
        if not self.depth["target"] and not self.depth["method"]:
            self.ops += 1
        if not self.depth["target"]:
            seen = {a.untyped_storage().data_ptr() for a in inputs}
            for o in tree_leaves(out):
                if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in seen:
                    self.bytes += o.untyped_storage().nbytes()
                    self.bytes_by[name] += o.untyped_storage().nbytes()
                    seen.add(o.untyped_storage().data_ptr())
        return out


@contextmanager
def _host_methods(counter: _Count):
    """Count ``Tensor.tolist/cpu`` (on the CPU they reach no dispatch: a device would wait)."""
    saved = {m: getattr(torch.Tensor, m) for m in HOST_METHODS}

    def wrap(name, f):
        def g(self, *a, **k):
            if counter.quiet == 0:
                counter.reads[name] += 1
            counter.quiet += 1
            try:
                return f(self, *a, **k)
            finally:
                counter.quiet -= 1
        return g

    for m, f in saved.items():
        setattr(torch.Tensor, m, wrap(m, f))
    try:
        yield
    finally:
        for m, f in saved.items():
            setattr(torch.Tensor, m, f)


@contextmanager
def _depths(target, modules):
    """Open forward calls of the target's and of the method's modules (``_Count`` reads them)."""
    depth = {"target": 0, "method": 0}
    handles = []
    for key, mods in (("target", [target]), ("method", modules)):
        for m in {id(x): x for root in mods for x in root.modules()}.values():
            handles.append(m.register_forward_pre_hook(lambda *_, k=key: depth.__setitem__(k, depth[k] + 1)))
            handles.append(m.register_forward_hook(lambda *_, k=key: depth.__setitem__(k, depth[k] - 1)))
    try:
        yield depth
    finally:
        for h in handles:
            h.remove()


def _fullgraph(fn, *args) -> tuple[bool, str | None, object]:
    """Trace ``fn(*args)`` with ``torch.compile(fullgraph=True)`` (the eager backend: a trace, no
    kernels), run it, and say whether it broke; a break runs ``fn`` eagerly instead."""
    import torch._dynamo as dynamo

    dynamo.reset()
    try:
        out = torch.compile(fn, fullgraph=True, backend="eager", dynamic=False)(*args)
        return True, None, out
    except Exception as e:  # noqa: BLE001 - a graph break (or what dynamo cannot trace) is the answer
        why = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        return False, why, fn(*args)
    finally:
        dynamo.reset()


def tiny_proposer(name: str, model, tok, folder: Path, device):
    """Method ``name`` on the tiny target saved in ``folder / "target"`` (``_tiny_target``), with its
    own ``tiny`` settings (a random drafter saved under ``folder / name``), checked and built."""
    from omegaconf import OmegaConf

    from specbench import methods

    cls = methods.get(name)
    cfg = OmegaConf.create({"K": 3, "progress": False, "sampling": {"temperature": 0.0}, "seed": 0,
                            "model": {"name": "tiny", "path": str(folder / "target")},
                            "draft_model": {"name": "auto", "layers": None, "path": None},
                            "method": methods.settings(name)})
    cfg = OmegaConf.merge(cfg, cls.tiny(model, tok, folder / name))
    cls.check(cfg, model.config)
    return cls(cfg, model, tok, torch.device(device), torch.float32)


def audit_one(name: str, bs: int, tokens: int, folder: Path, model, tok, device, compile_check: bool = True,
              ctx: int | None = None) -> dict:
    """One method at one batch size: its per-step counts (see the module's docstring)."""
    from specbench.decode import walk
    from specbench.decode.engine import Engine
    from specbench.decode.timing import PhaseTimer
    from specbench.decode.verify import Sampling

    prop = tiny_proposer(name, model, tok, folder, device)
    eng = Engine(model, prop, Sampling(), device, torch.float32, set(), PhaseTimer(device))
    g = torch.Generator().manual_seed(bs)
    lo, hi = (4, 24) if ctx is None else (max(1, ctx - 8), ctx + 1)  # ragged prompts (``ctx``: up to that long)
    prompts = [torch.randint(3, 96, (int(n),), generator=g).tolist() for n in torch.randint(lo, hi, (bs,), generator=g)]
    row = {"method": name, "bs": bs, "ctx": ctx, "host_reads_per_step": None, "ops_per_step": None, "bytes_per_step": None,
           "fullgraph": None, "reads": {}, "steps": 0, "note": getattr(prop, "audit_note", None)}
    step, steps = Engine._step, []
    with _depths(model, prop.modules()) as depth:
        counter = _Count(depth)

        def counted(self, batch, tap, t0):
            steps.append(len(batch.res))
            if len(steps) == 2 and compile_check:  # the second step runs the compile checks, uncounted
                return _checked(self, batch, tap, t0, row)
            if len(steps) <= 2:  # the batch's first step: its draft's values checked once
                return step(self, batch, tap, t0)
            with counter, _host_methods(counter):
                return step(self, batch, tap, t0)

        eng._step = counted.__get__(eng)
        list_walk, walk.LIST_WALK = walk.LIST_WALK, 0  # the device's walk, as a GPU runs it
        try:
            eng.generate(prompts, tokens)
        finally:
            walk.LIST_WALK = list_walk
    n = max(1, len(steps) - 2)  # the engine steps counted
    row.update(steps=n, host_reads_per_step=round(sum(counter.reads.values()) / n, 2),
               ops_per_step=round(counter.ops / n, 1), bytes_per_step=int(counter.bytes / n),
               reads={k: round(v / n, 2) for k, v in sorted(counter.reads.items())},
               bytes_by_op={k: int(v / n) for k, v in counter.bytes_by.most_common(6)})
    return row


def _checked(eng, batch, tap, t0, row) -> tuple:
    """``Engine._step`` with its verify forward and the method's ``propose`` traced fullgraph."""
    from specbench.decode.engine import Engine

    cache, prop = batch.cache, eng.proposer
    forward, propose = cache.forward, prop.propose
    result = {}

    def verify_forward(*a, **k):
        ok, why, out = _fullgraph(forward, *a, **k) if not k else (None, "keyword arguments", forward(*a, **k))
        result["verify"] = ok if why is None else f"no: {why}"
        return out

    def draft(state):
        ok, why, out = _fullgraph(propose, state)
        result["draft"] = ok if why is None else f"no: {why}"
        return out

    cache.forward, prop.propose = verify_forward, draft
    try:
        return Engine._step(eng, batch, tap, t0)  # the class's step: the instance's is the counting wrapper
    finally:
        cache.forward, prop.propose = forward, propose
        row["fullgraph"] = result


def audit(names=None, bss=(1, 8), tokens: int = 24, device="cpu", compile_check: bool = True, progress=True,
          ctxs=(None,)) -> list:
    """Every method (``names``: default every built-in one) at every batch size and context length
    (``ctxs``: prompts up to that many tokens; None: 4-23)."""
    from specbench import methods

    names = names or methods.builtin()
    device = torch.device(device)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model, tok = _tiny_target(folder / "target")
        model.to(device)
        for name in names:
            for bs in bss:
                for ctx in ctxs:
                    try:
                        rows.append(audit_one(name, bs, tokens, folder, model, tok, device, compile_check, ctx))
                    except Exception as e:  # noqa: BLE001 - one method's failure is its row, not the audit's end
                        rows.append({"method": name, "bs": bs, "ctx": ctx, "error": f"{type(e).__name__}: {e}"[:200]})
                    if progress:
                        r = rows[-1]
                        print(f"audit {name} bs={bs} ctx={ctx or '4-23'}: "
                              + (r.get("error") or f"{r['host_reads_per_step']} reads/step"), file=sys.stderr)
    return rows


def table(rows: list) -> str:
    """The rows as a Markdown table."""
    head = "| method | bs | ctx | host reads/step | ops/step | bytes/step | fullgraph (verify, draft) | reads |\n" \
        "|---|---|---|---|---|---|---|---|\n"

    def fg(v):
        if v is None:
            return "not checked"
        return ", ".join(f"{k}: {'yes' if x is True else x}" for k, x in v.items())

    out = []
    for r in rows:
        if "error" in r:
            out.append(f"| {r['method']} | {r['bs']} | {r.get('ctx') or '4-23'} | error: {r['error']} | | | | |")
            continue
        reads = ", ".join(f"{k} {v}" for k, v in sorted(r["reads"].items()))
        out.append(f"| {r['method']} | {r['bs']} | {r.get('ctx') or '4-23'} | {r['host_reads_per_step']} | {r['ops_per_step']} | "
                   f"{r['bytes_per_step']} | {fg(r['fullgraph'])} | {reads}" + (f" ({r['note']})" if r.get("note") else "") + " |")
    return head + "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specbench.audit", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bs", default="1,8", help="batch sizes (ragged prompts)")
    ap.add_argument("--tokens", type=int, default=24, help="new tokens a row (its steps)")
    ap.add_argument("--ctx", default="", help="context lengths: prompts up to that long (default 4-23 tokens), "
                                              "e.g. 16,256: do a method's bytes a step grow with its context?")
    ap.add_argument("--methods", nargs="*", help="registered methods (default: every built-in one)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-compile", action="store_true", help="skip the fullgraph checks (the slow part)")
    ap.add_argument("--out", default="results/audit.json")
    a = ap.parse_args(argv)
    from specbench import methods
    from specbench.errors import did_you_mean

    try:
        ctxs = [int(c) for c in a.ctx.split(",") if c.strip()] or [None]
        bss = [int(b) for b in a.bs.split(",")]
    except ValueError:
        ap.error(f"--bs {a.bs} / --ctx {a.ctx}: comma-separated positive integers, e.g. --bs 1,8 --ctx 16,256")
    if any(b < 1 for b in bss) or any(c is not None and c < 1 for c in ctxs) or a.tokens < 2:
        ap.error("--bs and --ctx take positive integers, --tokens at least 2")
    known = methods.builtin()
    for m in a.methods or ():
        if m not in known and ":" not in m:
            ap.error(f"unknown method {m};{did_you_mean(m, known)} built-in: {', '.join(known)} (or module:Class)")
    rows = audit(a.methods, bss, a.tokens, a.device, not a.no_compile, ctxs=ctxs)
    keep = ("method", "bs", "ctx", "host_reads_per_step", "ops_per_step", "bytes_per_step", "fullgraph", "reads", "bytes_by_op", "note",
            "error")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps([{k: r[k] for k in keep if k in r} for r in rows], indent=1) + "\n")
    print(table(rows))
    print(f"audit: {len(rows)} rows in {a.out}")
    failed = [f"{r['method']} bs={r['bs']}" for r in rows if "error" in r]
    if failed:
        print(f"audit: {len(failed)} row(s) failed ({', '.join(failed)}): their error is in the table", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
