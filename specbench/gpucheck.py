"""The GPU check: everything a short loan of a GPU machine should run, prepared here and run there
in one command (docs/gpu.md).

    python -m specbench.gpucheck kit [--kit .gpu]                  # here: wheels, tokenizer, prompts
    python -m specbench.gpucheck run --out OUT [--device cuda] [--shape llama-3.1-8b] [--budget 420]

``kit`` writes what the GPU machine lacks into ``.gpu/`` (git-ignored, at most 20 MiB): wheels of the
pure-Python packages specbench imports there (hydra-core, omegaconf, antlr4; setuptools, to build
specbench's own), SmolLM2's tokenizer and
chat template, the prompts (MT-Bench's 80 questions, then HumanEval's, one turn each) and the long
texts ``ctx=N`` pads with. ``run`` installs the wheels into a temporary folder, and the checkout beside
them as a user installs it (``pip install``: specbench's code as it is at the run, not at the kit; no
finder of our own), builds random-weight
targets of a shipped shape on the device (``model=random``) and random EAGLE / EAGLE-3 / Medusa
drafters of the right shapes, then runs the steps below in order of value until ``--budget`` seconds
are spent, each under the time that is left, and leaves at most 8 files in ``--out``: what a partial
run has measured still comes back.

Steps (``--size full``; ``--size tiny`` is the same script on a few prompts and batch sizes 1 and 3,
the dry run CI keeps from rotting). The first six give what a first loan must bring back (issue 56);
the dry run graphs AR only:
1. ``suite``: the device-portable tests on the device (``SPECBENCH_TEST_DEVICE``) and the ``gpu`` ones;
2. ``modes``: AR at each batch size eager and ``compile=graphs`` (its step time against the HBM roofline);
3. ``audit``: ``specbench.audit`` on the device (host reads, ops and bytes a step);
4. ``real``: PLD, Lookahead and SuffixDecoding, greedy, at each batch size, eager and graphed, paired with AR;
5. ``synthetic``: EAGLE-3 at the published profile, eager and graphed, at each batch size; then EAGLE,
   Medusa, DFlash, DSpark, P-EAGLE, MTP and Leviathan (2 self layers) under ``accept=synthetic`` at the
   profile and flat rates 0.5 and 0.8, eager;
6. ``memory``: AR at the largest batch size with ``ctx=2048``: peak memory against the live KV;
7. ``continuous``: PLD and EAGLE (synthetic) with ``serving.batching=continuous`` at the largest batch size;
8. ``profile``: the target's cost curve (``analysis.profile``) at two context lengths;
9. ``compile``: ``compile=true`` (torch.compile) for AR and PLD at the two smallest batch sizes;
10. ``report``: the figures and tables of every record (``specbench.analysis.report``), packed.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
KIT = REPO / ".gpu"
KIT_LIMIT = 20 << 20
# Pure-Python packages specbench imports that the GPU image lacks (docs/environment.md).
WHEELS = ("hydra-core", "omegaconf", "antlr4-python3-runtime", "setuptools")  # setuptools: builds the checkout

# A published acceptance profile and flat rates beside it (conditional acceptance per draft depth).
# EAGLE-3 (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B) on Llama-3.1-8B-Instruct, MT-Bench's 80 prompts, 7 drafts
# a step, greedy: mean acceptance length 3.53 (vLLM issue #26191); the flat rate with that length at
# 7 drafts is 0.743 (1 + a + ... + a^7 = 3.53). docs/gpu.md says where each number comes from.
PROFILES = {"eagle3-llama3.1-8b-mtbench": 0.743}
RATES = [PROFILES["eagle3-llama3.1-8b-mtbench"], 0.5, 0.8]

# The real step's methods: their drafts are real on any target (they copy from the context), so they run
# greedy with token identity checked. On a random target their acceptance is not that of text (docs/gpu.md).
REAL = ("pld", "lookahead", "suffix")

SIZES = {  # batch sizes, new tokens, profile points, suite selection, each step's cap (s)
    "full": {"bs": "1,32,128", "tokens": 64, "ctx": [512, 2048], "mem_ctx": 2048,
             "profile_bs": "1,8,32,128", "profile_n": "1,2,4,8,16,32,64",
             "suite": ["tests/test_gpu.py", "tests/test_graphs.py", "tests/test_synthetic.py", "tests/test_engine.py",
                       "tests/test_verify.py", "tests/test_serving.py", "tests/test_feature_methods.py",
                       "tests/test_training_free.py"],
             # the first six steps (the note's numbers) fit in 420 s; the rest take what is left
             "caps": {"suite": 60, "modes": 80, "audit": 30, "real": 80, "synthetic": 140, "memory": 30,
                      "continuous": 30, "profile": 40, "compile": 40, "report": 30}},
    "tiny": {"bs": "1,3", "tokens": 12, "ctx": [64], "mem_ctx": 256, "profile_bs": "1,3", "profile_n": "1,4",
             "suite": ["tests/test_synthetic.py::test_chain_acceptance_per_position_and_tau_match_the_rates",
                       "tests/test_gpu.py"],
             "caps": {"suite": 120, "modes": 240, "audit": 240, "real": 360, "synthetic": 640, "memory": 90,
                      "continuous": 120, "profile": 120, "compile": 240, "report": 120}},
}


# ---------------------------------------------------------------------------- the kit (here)
def build_kit(kit: Path = KIT) -> dict:
    """Write the kit into ``kit``; returns what it holds. Needs this machine's package registry."""
    from specbench.run import data as D
    from specbench.models import load_tokenizer, model_cfg

    if kit.exists():
        shutil.rmtree(kit)
    wheels = kit / "wheels"
    wheels.mkdir(parents=True)
    pins = [f"{p}=={md.version(p)}" for p in WHEELS]  # the versions this checkout is tested with
    # pure-Python packages: one wheel serves CPython 3.12 on any platform; antlr4 4.9.3 is published as
    # an sdist only, so pip builds its wheel here
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), *pins], check=True)
    bad = [w.name for w in wheels.glob("*.whl") if not w.name.endswith("-py3-none-any.whl")]
    if bad:
        raise RuntimeError(f"the kit holds pure-Python wheels only; these are not: {bad}")
    load_tokenizer(model_cfg("smollm2-135m")).save_pretrained(kit / "tokenizer")
    with (kit / "prompts.jsonl").open("w") as f:  # MT-Bench first, then HumanEval: bs 128 has 128 prompts
        for q in D.mt_bench() + D.humaneval():
            f.write(json.dumps({"question_id": q.id, "category": q.category, "turns": q.turns[:1]}) + "\n")
    cache = kit / "cache" / "data"  # ctx=N pads with the first long ShareGPT texts (data.long_texts)
    cache.mkdir(parents=True)
    (cache / "sharegpt_v2.json").write_text(json.dumps({"first_turns": [], "long": [
        {"id": f"long-{i}", "text": t} for i, t in enumerate(D.long_texts()[:8])]}))
    size = sum(p.stat().st_size for p in kit.rglob("*") if p.is_file())
    if size > KIT_LIMIT:
        raise RuntimeError(f"the kit is {size / 2**20:.1f} MiB, over its {KIT_LIMIT >> 20} MiB")
    info = {"wheels": sorted(w.name for w in wheels.glob("*.whl")), "bytes": size,
            "made": time.strftime("%Y-%m-%dT%H:%M:%S")}
    (kit / "KIT.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


# ---------------------------------------------------------------------------- random drafters (there)
# the random drafters random_drafters writes there, a folder each: not a table of drafter kinds
# (drafters.KINDS), those the check measures (Leviathan drafts with the target's own layers there)
KINDS = ("eagle", "eagle3", "medusa", "dflash", "dspark", "peagle", "mtp")


def random_drafters(shape: str, device: str, dtype: str, tokenizer: str | None, out: Path) -> dict[str, Path]:
    """Random EAGLE (EAGLE-1/2 layer), EAGLE-3, Medusa, DFlash, DSpark, P-EAGLE and MTP drafters of the right shapes
    for the random target ``model=random model.shape=<shape>``, saved as the loaders read them:
    {kind: folder}."""
    import torch
    from omegaconf import OmegaConf

    from specbench import drafters
    from specbench.drafters.eagle import EagleDrafter
    from specbench.drafters.eagle3 import Eagle3Drafter, layer_config
    from specbench.drafters.medusa import MedusaHeads
    from specbench.drafters.dflash import DFlashDrafter, default_layer_ids, layer_config as block_layers
    from specbench.drafters.dspark import DSparkDrafter
    from specbench.drafters.formats.dflash import save as save_block
    from specbench.drafters.formats.eagle3 import save as save_eagle3
    from specbench.drafters.formats.mtp import save as save_mtp
    from specbench.drafters.formats.peagle import save as save_peagle
    from specbench.drafters.mtp import MTPDrafter
    from specbench.drafters.peagle import PEagleDrafter
    from specbench.models import load_model, resolve_device, resolve_dtype
    from specbench.paths import CONF_DIR

    mcfg = OmegaConf.load(CONF_DIR / "model" / "random.yaml")
    mcfg.shape, mcfg.tokenizer = shape, tokenizer
    dev = resolve_device(device)
    target = load_model(mcfg, dev, resolve_dtype(dtype, dev))
    V = int(target.config.vocab_size)
    torch.manual_seed(1)
    name = str(mcfg.name)
    meta = {"name": "random", "target": name, "target_vocab_size": V, "seed": 1,
            "note": "random weights of the right shapes (specbench.gpucheck): for costs under accept=synthetic"}
    folders = {k: out / k for k in KINDS}
    with torch.no_grad():
        e = EagleDrafter(target, torch.arange(V), input_norm=True).to(dev)
        drafters.save(e, folders["eagle"], {**meta, "kind": "eagle", "draft_vocab": V})
        dv = min(V, 32000)  # EAGLE-3's draft vocabulary on Llama-3.1-8B
        e3 = Eagle3Drafter(target, layer_config(target.config, dv), dv).to(dev)
        e3.d2t.copy_(torch.randperm(V, device=dev)[:dv].sort().values - torch.arange(dv, device=dev))
        save_eagle3(folders["eagle3"], e3)
        m = MedusaHeads(target, torch.arange(V), 4).to(dev)
        m.weight.normal_(0, 0.02)
        acc = [[0.6 * 0.7 ** h * 0.5 ** r for r in range(10)] for h in range(4)]  # a decaying profile: the tree's shape
        drafters.save(m, folders["medusa"], {**meta, "kind": "medusa", "draft_vocab": V, "heads": 4, "acc": acc,
                                             "drafter": {"kind": "medusa", "heads": 4, "tree_size": 32}})
        L, mask = int(target.config.num_hidden_layers), V - 1
        ids = default_layer_ids(L, 5)  # Z Lab's Qwen3-8B drafters: 5 layers, block 16; DeepSpec's DSpark: block 7
        df = DFlashDrafter(target, block_layers(target.config, 5, mask, 16, ids), ids, 16, mask).to(dev)
        save_block(folders["dflash"], df)
        ds = DSparkDrafter(target, block_layers(target.config, 5, mask, 7, ids), ids, 7, mask, "next", markov_rank=256).to(dev)
        save_block(folders["dspark"], ds)
        pc = layer_config(target.config, dv)
        pc.num_hidden_layers = 2  # a deeper drafter than EAGLE-3's: its K drafts come from one forward
        pe = PEagleDrafter(target, pc, dv, mask, 8).to(dev)
        pe.d2t.copy_(e3.d2t)
        save_peagle(folders["peagle"], pe)
        mt = MTPDrafter(target, "speculators").to(dev)  # one module, as DeepSeek-V3 ships
        save_mtp(folders["mtp"], mt, steps=3)
    del target, e, e3, m, df, ds, pe, mt
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return folders


# ---------------------------------------------------------------------------- the run (there)
class Budget:
    def __init__(self, seconds: float):
        self.t0, self.seconds = time.monotonic(), seconds

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.t0)


def _sweep(base: list[str], extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "specbench", "--multirun", *base, *extra]  # --multirun: a list value among the swept


def plan(a, kit: Path, work: Path, drafts: dict[str, Path]) -> list[tuple[str, list[list[str]]]]:
    """The steps' commands, in order of value: [(step, [command, ...])]. A step's commands share its
    time fairly; inside one, Hydra runs the first swept setting slowest (what matters most first)."""
    size = SIZES[a.size]
    runs = work / "run"
    rel = os.path.relpath(kit, REPO) if kit.is_relative_to(REPO) else str(kit)  # records name no machine path
    base = ["model=random", f"model.shape={a.shape}", f"model.tokenizer={rel}/tokenizer", "dataset=jsonl",
            f"dataset.path={rel}/prompts.jsonl", "dataset.max_turns=1", f"max_new_tokens={size['tokens']}",
            f"device={a.device}", f"dtype={a.dtype}", f"results_dir={runs}", "ar_baseline=paired", "progress=false",
            "resume=true", "limit='${max:${bs},4}'"]  # a full batch of prompts at each batch size, 4 at bs 1
    big = f"bs={size['bs'].split(',')[-1]}"
    sweep_bs = f"bs={size['bs']}"
    graphed = ["compile=false,graphs", "kernel=torch"]  # eager and captured, side by side
    modes = [_sweep(base, ["method=ar", sweep_bs, *graphed])]
    # the dry run (a CPU, tiny) keeps graphs to AR's modes and audits three methods: on the CPU a graph
    # is a fullgraph trace of its own per bucket, no faster than eager, and the budget is CI's
    tiny = a.size == "tiny"
    beside = [] if tiny else graphed
    audit = [[sys.executable, "-m", "specbench.audit", "--device", a.device, "--bs", "1,8", "--no-compile",
              "--out", str(work / "audit.json"), *(["--methods", "ar", "pld", "eagle"] if tiny else [])]]
    # one process (one import, one target built) for the three (Hydra runs the method slowest)
    real = [_sweep(base, [sweep_bs, "method=" + ",".join(REAL), *beside])]
    rates = "accept.rates=" + ",".join(str(r) for r in RATES)  # the profile first, at every batch size
    eagle3 = ["method=eagle", "eagle.version=3", f"eagle.checkpoint={drafts['eagle3']}"]
    synthetic = [_sweep(base, ["accept=synthetic", f"accept.rates={RATES[0]}", sweep_bs, *eagle3, *beside])]
    synthetic += [_sweep(base, ["accept=synthetic", rates, sweep_bs, *m]) for m in (
        eagle3,
        ["method=eagle", f"eagle.checkpoint={drafts['eagle']}"],
        ["method=medusa", f"medusa.checkpoint={drafts['medusa']}"],
        ["method=dflash", f"dflash.checkpoint={drafts['dflash']}"],
        ["method=dspark", f"dspark.checkpoint={drafts['dspark']}", "dspark.threshold=0.3"],
        ["method=peagle", f"peagle.checkpoint={drafts['peagle']}", "peagle.K=4"],
        ["method=mtp", f"mtp.checkpoint={drafts['mtp']}", "K=3"],
        ["method=leviathan", "draft_model=self_layers", "draft_model.layers=2"])]
    continuous = [_sweep(base, ["method=pld", "serving.batching=continuous", big]),
                  _sweep(base, ["method=eagle", f"eagle.checkpoint={drafts['eagle']}", "serving.batching=continuous",
                                "accept=synthetic", "accept.rates=0.8", big])]
    profile = [[sys.executable, "-m", "specbench.analysis.profile", "--model", "random", "--shape", a.shape,
                "--device", a.device, "--dtype", a.dtype, "--bs", size["profile_bs"], "--n", size["profile_n"],
                "--ctx", str(c), "--draft-layers", "0", "--reps", "3", "--results-dir", str(runs), *shape]
               for c, shape in [(c, []) for c in size["ctx"]] + [(size["ctx"][0], ["--ragged", "--tree"])]]
    compile_ = [_sweep(base, ["method=ar,pld", "compile=true", "kernel=torch", "bs=" + ",".join(size["bs"].split(",")[:2])])]
    memory = [_sweep(base, ["method=ar", f"ctx={size['mem_ctx']}", big])]
    suite = [[sys.executable, "-m", "pytest", "-q", "-m", "not slow", "-p", "no:cacheprovider", "-k", "not rest",
              f"--junitxml={work / 'suite.xml'}", *size["suite"]]]  # REST's pydivsufsort is not carried
    report = [[sys.executable, "-m", "specbench.analysis.report", str(runs / "records.jsonl"), "--out", str(work / "report")]]
    return [("suite", suite), ("modes", modes), ("audit", audit), ("real", real), ("synthetic", synthetic),
            ("memory", memory), ("continuous", continuous), ("profile", profile), ("compile", compile_),
            ("report", report)]


def _install(kit: Path, site: Path) -> None:
    wheels = sorted(str(w) for w in (kit / "wheels").glob("*.whl"))
    if not wheels:
        raise SystemExit(f"specbench.gpucheck: no wheels in {kit / 'wheels'}: run `make gpu-kit` first")
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--disable-pip-version-check", "--target", str(site)]
    subprocess.run([*pip, *wheels], check=True)
    # the checkout, as `pip install .` installs it (methods/, analysis/ and conf/ inside the package),
    # built by the kit's setuptools: no build isolation, nothing fetched
    shutil.rmtree(REPO / "build", ignore_errors=True)  # an in-tree build would ship a stale build/lib too
    r = subprocess.run([*pip, "--no-build-isolation", str(REPO)], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(site)))
    if r.returncode:
        raise SystemExit(f"specbench.gpucheck: pip could not install the checkout:\n{(r.stdout + r.stderr)[-3000:]}")


def _run(cmd: list[str], env: dict, log, timeout: float) -> str:
    """Run ``cmd`` (its output into ``log``) for at most ``timeout`` s: ok, failed (rc) or timeout."""
    log.write(f"\n$ {' '.join(cmd)}\n")
    log.flush()
    if timeout < 5:
        log.write("[gpucheck] skipped: the budget is spent\n")
        return "skipped"
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
    try:
        rc = p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
        p.wait()
        log.write(f"\n[gpucheck] stopped after {timeout:.0f} s (its time in the budget)\n")
        return "timeout"
    return "ok" if rc == 0 else f"failed ({rc})"


def run(a) -> int:
    kit, out = Path(a.kit).resolve(), Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    budget = Budget(a.budget)
    size = SIZES[a.size]
    work = Path(tempfile.mkdtemp(prefix="specbench-gpucheck-"))
    site = work / "site"
    _install(kit, site)
    sys.path.insert(0, str(site))  # this process reads the records with them too (omegaconf, there)
    # the installed specbench, not the checkout's folder that the working directory would put first
    from specbench.run.records import code_state

    paths = [str(site), *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]  # no "" (the cwd)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), PYTHONSAFEPATH="1",
               SPECBENCH_CODE_STATE=code_state(REPO) or "",  # the records name the checkout's code, not site's
               SPECBENCH_CACHE=str(work / "cache"), PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="1",
               SPECBENCH_TEST_DEVICE=a.device, TOKENIZERS_PARALLELISM="false")
    shutil.copytree(kit / "cache", work / "cache")
    status: dict[str, str] = {}
    results_of: dict[str, list[str]] = {}  # each step's commands: ok, failed (rc), timeout or skipped
    with (out / "gpucheck.log").open("w") as log:
        log.write(f"[gpucheck] {time.strftime('%Y-%m-%dT%H:%M:%S')} device={a.device} shape={a.shape} "
                  f"size={a.size} budget={a.budget} s\n")
        log.flush()
        t = time.monotonic()  # the random drafters, in a process of their own (its device memory goes with it)
        code = ("import sys; from pathlib import Path; from specbench.gpucheck import random_drafters; "
                "random_drafters(*sys.argv[1:5], Path(sys.argv[5]))")
        res = _run([sys.executable, "-c", code, a.shape, a.device, a.dtype, str(kit / "tokenizer"),
                    str(work / "drafts")], env, log, budget.left())
        drafts = {k: work / "drafts" / k for k in KINDS}
        status["drafters"] = f"{res} ({time.monotonic() - t:.0f} s)"
        results_of["drafters"] = [res]
        for step, cmds in plan(a, kit, work, drafts):
            if step in a.skip:
                status[step] = "skipped (--skip)"
                results_of[step] = ["skipped"]
                continue
            t = time.monotonic()
            log.write(f"\n===== {step} ({budget.left():.0f} s left)\n")
            results = []
            for i, cmd in enumerate(cmds):  # each command its share of what is left of the step's time
                share = (size["caps"][step] - (time.monotonic() - t)) / (len(cmds) - i)
                results.append(_run(cmd, env, log, min(budget.left(), share)))
            status[step] = f"{', '.join(results) or 'nothing to run'} ({time.monotonic() - t:.0f} s)"
            results_of[step] = results
            log.write(f"[gpucheck] {step}: {status[step]}\n")
            log.flush()
        _collect(work, out, status, a, kit)
    print(f"[gpucheck] done in {time.monotonic() - budget.t0:.0f} s; in {out}:", file=sys.stderr)
    for k, v in status.items():
        print(f"  {k:<11} {v}", file=sys.stderr)
    shutil.rmtree(work, ignore_errors=True)
    return 0 if all(r in ("ok", "skipped") for rs in results_of.values() for r in rs) else 1


def _collect(work: Path, out: Path, status: dict, a, kit: Path) -> None:
    """At most 8 files in ``out``: gpucheck.log, suite.xml, records.jsonl, cost_curves.jsonl,
    summary.txt, report.tar.gz, status.json, audit.json."""
    runs = work / "run"
    for name in ("suite.xml", "audit.json"):
        if (work / name).exists():
            shutil.copy(work / name, out / name)
    for name in ("records.jsonl", "cost_curves.jsonl"):  # records name no path of this machine
        if (runs / name).exists():
            text = (runs / name).read_text().replace(str(work), "$GPUCHECK").replace(str(kit), "$KIT") \
                .replace(str(REPO) + "/", "")
            (out / name).write_text(text)
    from specbench.run import records as R

    if (out / "records.jsonl").exists():
        from specbench.run.summary import summary_table

        recs = R.read(out / "records.jsonl")
        (out / "summary.txt").write_text(summary_table(recs) + "\n" + real_note(recs))
    if (work / "report").exists():
        with tarfile.open(out / "report.tar.gz", "w:gz") as tar:
            tar.add(work / "report", arcname="report")
    env = {"device": a.device, "shape": a.shape, "size": a.size, "budget_s": a.budget}
    memory = []
    if (out / "records.jsonl").exists():
        recs = R.read(out / "records.jsonl")
        memory = [memory_of(r, a.shape) for r in recs if r.get("ctx") and r.get("status") == "ok"]
    try:
        import torch

        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name()
        env["torch"] = torch.__version__
        env["transformers"] = md.version("transformers")
    except Exception as e:  # noqa: BLE001 - the status file is written whatever fails
        env["error"] = str(e)
    (out / "status.json").write_text(json.dumps({"steps": status, "memory": memory, "env": env}, indent=1) + "\n")


def real_note(recs: list[dict]) -> str:
    """The summary's line on the real step: what its numbers are on a random target."""
    taus = [r["metrics"]["tau"] for r in recs if r.get("method") in REAL and not r.get("accept")
            and r.get("status") == "ok" and (r.get("metrics") or {}).get("tau") is not None]
    if not taus:
        return ""
    return (f"\ncopying methods ({', '.join(REAL)}): tau {min(taus):.2f}-{max(taus):.2f} on a random target, "
            "whose greedy output gives copying methods little to copy: it checks token identity (match_ar) and "
            "costs; its speedups are those methods' cost at that acceptance, not a speedup on text (docs/gpu.md)\n")


def memory_of(rec: dict, shape: str) -> dict:
    """A ``ctx`` job's peak memory against what it must hold: the weights and the live KV cache
    (every row's ctx + new tokens, K and V of every layer). On a GPU the peak is the allocator's."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from specbench.models import DTYPES, shape_file

    cfg = AutoConfig.from_pretrained(shape_file(shape))
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    width = torch.empty((), dtype=DTYPES[rec["dtype"]]).element_size()
    head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head * width * rec["bs"] * \
        (rec["ctx"] + rec["max_new_tokens"])
    peak = rec["metrics"]["peak_mem_bytes"]
    need = params * width + kv
    return {"method": rec["method"], "bs": rec["bs"], "ctx": rec["ctx"], "device": rec["device"], "peak_bytes": peak,
            "weights_bytes": params * width, "live_kv_bytes": kv, "peak_over_weights_and_kv": peak / need}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specbench.gpucheck", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    k = sub.add_parser("kit", help="write the kit (wheels, tokenizer, prompts) into --kit")
    k.add_argument("--kit", default=str(KIT))
    r = sub.add_parser("run", help="run the check on this machine's device")
    r.add_argument("--out", required=True, help="folder for the (at most 8) result files")
    r.add_argument("--kit", default=str(KIT))
    r.add_argument("--device", default="cuda")
    r.add_argument("--dtype", default="auto")
    r.add_argument("--shape", default="llama-3.1-8b", help="a shape of specbench/shapes")
    r.add_argument("--size", default=None, choices=sorted(SIZES), help="full, or tiny (default: tiny for shape tiny)")
    r.add_argument("--budget", type=float, default=420.0, help="seconds for all steps (each stops at what is left)")
    r.add_argument("--skip", default="", help="steps not to run, comma-separated (e.g. compile on a CPU)")
    a = ap.parse_args(argv)
    if a.cmd == "kit":
        info = build_kit(Path(a.kit))
        print(f"[gpucheck] kit in {a.kit}: {info['bytes'] / 2**20:.1f} MiB; wheels: {', '.join(info['wheels'])}")
        return 0
    a.size = a.size or ("tiny" if a.shape == "tiny" else "full")
    a.skip = {x for x in a.skip.split(",") if x}
    unknown = a.skip - set(SIZES["full"]["caps"])
    if unknown:
        ap.error(f"unknown --skip step(s) {sorted(unknown)}; steps: {', '.join(SIZES['full']['caps'])}")
    from specbench.errors import ConfigError
    from specbench.models import shape_file

    try:
        shape_file(a.shape)  # an unknown shape: one line, before anything runs
    except ConfigError as e:
        ap.error(str(e))
    if not (Path(a.kit) / "wheels").is_dir():
        ap.error(f"no kit at {a.kit}: run `make gpu-kit` here and carry .gpu to the GPU machine (docs/gpu.md)")
    return run(a)


if __name__ == "__main__":
    sys.exit(main())
