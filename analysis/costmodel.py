"""A decoding step's cost on a GPU we do not have: from the hardware (a roofline), or a linear
form fitted to measurements (SpecDecode-Bench's H100 constants, or the user's own
``analysis.profile`` curve). Both price the bound, the trace-driven simulator and the replay
(``analysis.replay``) wherever a measured cost curve does.

T(b, n, kv): one target forward over b rows of n new tokens each on kv cached tokens in all.

- roofline (``<gpu>:<model>``): max(bytes / HBM bandwidth, FLOPs / peak dense bf16 tensor
  throughput) + a fixed overhead a step. Bytes: every linear weight once (the output layer
  included; an embedding lookup reads a few rows) and the KV cache of every row. FLOPs: 2 per
  weight per new token, and attention's two products of each new token with its row's prefix.
- linear (``specdecode-bench-h100``, or a fitted JSON): c_kv kv + c_tok b n + c_fixed, plus the
  overhead a step; EAGLE drafting d_kv kv + d_k width + d_fixed, n-gram drafting a share of
  the verify (SpecDecode-Bench's ``predictor.py`` form, fitted on an H100 under vLLM with CUDA
  graphs).

    python -m specbench.analysis.costmodel list
    python -m specbench.analysis.costmodel show --cost h100-sxm:llama-3.1-8b --bs 1,32,128 --n 1,2,4,8 --ctx 1024
    python -m specbench.analysis.costmodel fit results/cost_curves.jsonl --out my-gpu.json
    python -m specbench.analysis.costmodel curve --cost my-gpu.json --model <records' model> --results-dir results/
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specbench.errors import ConfigError, did_you_mean


@dataclass(frozen=True)
class GPU:
    name: str
    hbm_gbs: float  # memory bandwidth, GB/s (10^9 bytes)
    bf16_tflops: float  # peak dense bf16 tensor throughput (no sparsity), 10^12 FLOP/s
    memory_gb: float
    source: str


# As their makers publish them (datasheets; dense bf16, i.e. half the "with sparsity" figure).
GPUS = {g.name: g for g in (
    GPU("a100-40gb", 1555, 312, 40, "NVIDIA A100 datasheet (SXM4 40GB): 1,555 GB/s, BF16 Tensor Core 312 TFLOPS"),
    GPU("a100-80gb", 2039, 312, 80, "NVIDIA A100 datasheet (SXM4 80GB): 2,039 GB/s, BF16 Tensor Core 312 TFLOPS"),
    GPU("h100-sxm", 3350, 989, 80, "NVIDIA H100 datasheet (SXM5): 3.35 TB/s, BF16 Tensor Core 1,979 TFLOPS with "
                                   "sparsity (989 dense)"),
    GPU("h200", 4800, 989, 141, "NVIDIA H200 datasheet (SXM): 4.8 TB/s, BF16 Tensor Core 1,979 TFLOPS with sparsity "
                                "(989 dense)"),
    GPU("b200", 8000, 2250, 180, "NVIDIA HGX B200 specifications, per GPU: 8 TB/s HBM3e, FP16/BF16 4.5 PFLOPS with "
                                 "sparsity (2.25 dense)"),
    GPU("l4", 300, 121, 24, "NVIDIA L4 datasheet: 300 GB/s, BF16 Tensor Core 242 TFLOPS with sparsity (121 dense)"),
    GPU("rtx-4090", 1008, 165.2, 24, "NVIDIA Ada Lovelace architecture whitepaper (GeForce RTX 4090): 1,008 GB/s, "
                                     "peak BF16 Tensor TFLOPS with FP32 accumulate 165.2 dense"),
)}


@dataclass(frozen=True)
class Shape:
    """A decoder's dimensions (a Llama-like stack; ``head`` the output layer's rows)."""
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool = False
    extra_in: int = 0  # EAGLE-3's head: q/k/v take [embedding; feature] (2H wide), and fc (3H -> H)
    head: int | None = None  # a draft vocabulary narrower than the target's

    def linear_params(self) -> int:
        """Weights one forward multiplies by (every linear layer and the output layer)."""
        h, kvd = self.hidden, self.kv_heads * self.head_dim
        qd = self.heads * self.head_dim
        attn = (h + self.extra_in) * (qd + 2 * kvd) + qd * h
        mlp = 3 * h * self.intermediate
        fc = 3 * h * h if self.extra_in else 0
        return self.layers * (attn + mlp) + fc + h * (self.head or self.vocab)

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


ALIASES = {"h100": "h100-sxm", "a100": "a100-80gb", "4090": "rtx-4090", "rtx4090": "rtx-4090"}

# The shapes we ship (specbench/shapes: Llama-3.1-8B, SmolLM2-135M), two more, and EAGLE-3's
# drafter for Llama-3.1-8B (one layer, a 32k draft vocabulary).
SHAPES = {s.name: s for s in (
    Shape("llama-3.1-8b", 32, 4096, 32, 8, 128, 14336, 128256),
    Shape("smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152, tied=True),
    Shape("llama-3.1-70b", 80, 8192, 64, 8, 128, 28672, 128256),
    Shape("qwen3-8b", 36, 4096, 32, 8, 128, 12288, 151936),
    Shape("eagle3-llama-3.1-8b", 1, 4096, 32, 8, 128, 14336, 128256, extra_in=4096, head=32000),
)}

# SpecDecode-Bench's step overhead (vLLM's scheduling and sampling between forwards, H100): the
# roofline's default fixed cost a step, beside the hardware's
STEP_OVERHEAD_S = 1.20683946e-03


@dataclass
class Roofline:
    gpu: GPU
    shape: Shape
    overhead_s: float = STEP_OVERHEAD_S
    dtype_bytes: int = 2
    bw_eff: float = 1.0  # share of the bandwidth a forward reaches (1: the datasheet's)
    draft_shape: Shape | None = None
    ngram_share: float = 0.0

    @property
    def name(self) -> str:
        return f"{self.gpu.name}:{self.shape.name}"

    def _forward(self, shape: Shape, b: int, n: int, kv: float) -> float:
        tokens = b * n
        byts = shape.linear_params() * self.dtype_bytes + kv * shape.kv_bytes_per_token(self.dtype_bytes)
        flops = 2 * shape.linear_params() * tokens + 4 * shape.layers * shape.heads * shape.head_dim * n * kv
        return max(byts / (self.gpu.hbm_gbs * 1e9 * self.bw_eff), flops / (self.gpu.bf16_tflops * 1e12))

    def target(self, b: int, n: int, kv: float) -> float:
        """Seconds of one target forward (without the step's overhead)."""
        return self._forward(self.shape, b, n, kv)

    def draft(self, kind: str, b: int, width: int, kv: float, verify_s: float) -> float:
        """Seconds of a step's drafting for ``width`` - 1 drafts per row: a drafter's sequential
        forwards (its own one-layer cache, a fraction of the target's), n-gram a share of the verify."""
        if kind == "ngram":
            return self.ngram_share * verify_s
        if kind in ("eagle", "eagle3"):
            d = self.draft_shape or SHAPES["eagle3-llama-3.1-8b"]
            kv_d = kv * d.layers / self.shape.layers
            return max(1, width - 1) * self._forward(d, b, 1, kv_d)
        return 0.0

    def describe(self) -> dict:
        return {"kind": "roofline", "gpu": asdict(self.gpu), "shape": asdict(self.shape),
                "overhead_s": self.overhead_s, "bw_eff": self.bw_eff, "dtype_bytes": self.dtype_bytes}


@dataclass
class Linear:
    name: str
    c_kv: float
    c_tok: float
    c_fixed: float
    overhead_s: float = 0.0
    draft_c_kv: float = 0.0
    draft_c_width: float = 0.0
    draft_c_fixed: float = 0.0
    ngram_share: float = 0.0
    source: str = ""
    fit: dict = field(default_factory=dict)

    def target(self, b: int, n: int, kv: float) -> float:
        return self.c_kv * kv + self.c_tok * b * n + self.c_fixed

    def draft(self, kind: str, b: int, width: int, kv: float, verify_s: float) -> float:
        """SpecDecode-Bench's drafting costs: EAGLE linear in the KV tokens and the row's verify
        width (what its predictor is passed), n-gram a share of the verify."""
        if kind == "ngram":
            return self.ngram_share * verify_s
        if kind in ("eagle", "eagle3"):
            return self.draft_c_kv * kv + self.draft_c_width * width + self.draft_c_fixed
        return 0.0

    def describe(self) -> dict:
        return {"kind": "linear", **asdict(self)}


# SpecDecode-Bench's predictor.py (class Llama8BH100, "fitted with instructcoder bs=1,8,16,32,64")
SPECDECODE_BENCH_H100 = Linear(
    "specdecode-bench-h100", c_kv=3.92645679e-08, c_tok=2.10103129e-05, c_fixed=5.88590713e-03,
    overhead_s=1.20683946e-03, draft_c_kv=2.37768493e-09, draft_c_width=8.41429603e-07,
    draft_c_fixed=2.13526175e-03, ngram_share=0.005875,
    source="SpecDecode-Bench simulator predictor.py: Llama-3.1-8B-Instruct, H100, vLLM with CUDA graphs")
NAMED = {SPECDECODE_BENCH_H100.name: SPECDECODE_BENCH_H100}


def resolve(spec: str):
    """A cost model by name: ``specdecode-bench-h100``, ``<gpu>:<model>[:<overhead ms>]`` (the
    roofline), or a JSON file written by ``costmodel fit``. One ConfigError line otherwise."""
    if spec in NAMED:
        return NAMED[spec]
    p = Path(spec)
    if spec.endswith(".json"):
        if not p.exists():
            raise ConfigError(f"cost model file {spec} does not exist")
        try:
            d = json.loads(p.read_text())
            d.pop("kind", None)
            return Linear(**d)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"{spec} is not a fitted cost model (write one with `costmodel fit`): {e}") from None
    parts = spec.split(":")
    if len(parts) not in (2, 3):
        raise ConfigError(f"unknown cost model {spec!r}; give specdecode-bench-h100, <gpu>:<model>[:<overhead ms>] "
                          f"(gpus: {', '.join(GPUS)}; models: {', '.join(SHAPES)}) or a fitted .json")
    g, m = ALIASES.get(parts[0].lower(), parts[0].lower()), parts[1].lower()
    if g not in GPUS:
        raise ConfigError(f"unknown gpu {g};{did_you_mean(g, [*GPUS, *ALIASES])} known: {', '.join(GPUS)}")
    if m not in SHAPES:
        raise ConfigError(f"unknown model shape {m};{did_you_mean(m, SHAPES)} known: {', '.join(SHAPES)}")
    try:
        over = float(parts[2]) / 1e3 if len(parts) == 3 else STEP_OVERHEAD_S
    except ValueError:
        raise ConfigError(f"overhead in {spec!r} must be milliseconds, got {parts[2]!r}") from None
    return Roofline(GPUS[g], SHAPES[m], overhead_s=over)


def step(cost, b: int, n: int, kv: float) -> float:
    """A verify (or AR) step's seconds with the model's overhead."""
    return cost.target(b, n, kv) + cost.overhead_s


def to_curve(cost, bs_list, n_list, ctx: int, model: str, device: str = "cuda", dtype: str = "bfloat16") -> dict:
    """A cost-curve record (``analysis.profile``'s layout) read off the model at ``ctx`` cached
    tokens a row: what the bound and the simulator take in place of a measured curve."""
    target = {str(b): {str(n): step(cost, b, n, b * ctx) for n in n_list} for b in bs_list}
    return {"kind": "cost_curve", "model": model, "device": device, "dtype": dtype, "kernel": "torch", "ctx": ctx,
            "target": target, "cost_model": cost.name, "draft_step": {}}


def fit_linear(curve: dict, name: str = "fitted") -> Linear:
    """The linear form c_kv kv + c_tok b n + c_fixed fitted (least squares) to a profiled curve
    (``analysis.profile`` record: T(b, n) on a ``ctx``-token prefix a row, kv = b ctx). With one
    batch size kv does not vary and c_kv is 0. The step overhead is inside c_fixed."""
    import numpy as np

    ctx = int(curve.get("ctx") or 0)
    pts = [(int(b), int(n), float(t)) for b, row in curve["target"].items() for n, t in row.items()]
    if len(pts) < 3:
        raise ConfigError(f"a fit needs 3 points or more; the curve has {len(pts)}")
    vary_kv = len({b for b, _, _ in pts}) > 1 and ctx > 0
    X = np.array([[b * ctx, b * n, 1.0] if vary_kv else [b * n, 1.0] for b, n, _ in pts])
    y = np.array([t for *_, t in pts])
    coef, *_ = np.linalg.lstsq(X, y, rcond=None)
    c_kv, c_tok, c_fixed = (coef if vary_kv else (0.0, *coef))
    pred = X @ coef
    err = float(np.max(np.abs(pred - y) / y))
    return Linear(name, float(c_kv), float(c_tok), float(c_fixed),
                  source=f"fitted to {curve.get('model')} on {curve.get('device')} "
                         f"({(curve.get('env') or {}).get('device_name', '')}), ctx {ctx}",
                  fit={"points": len(pts), "max_rel_err": err})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specbench.analysis.costmodel", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="the GPUs and model shapes known, with the sources of the GPUs' numbers")
    s = sub.add_parser("show", help="T(b, n) and T(b, n)/T(b, 1) of a cost model")
    s.add_argument("--cost", required=True, help="specdecode-bench-h100, <gpu>:<model>[:<overhead ms>], or a .json")
    s.add_argument("--bs", default="1,8,32,128")
    s.add_argument("--n", default="1,2,4,6,8")
    s.add_argument("--ctx", type=int, default=1024, help="cached tokens a row")
    c = sub.add_parser("curve", help="append the model's cost curve beside records (cost_curves.jsonl): the batch-"
                       "aware bound and the simulator of analysis.report then price those records' jobs with it")
    c.add_argument("--cost", required=True)
    c.add_argument("--model", required=True, help="the records' model (as they name it)")
    c.add_argument("--device", default="cuda")
    c.add_argument("--dtype", default="bfloat16")
    c.add_argument("--kernel", default="torch")
    c.add_argument("--bs", default="1,2,4,8,16,32,64,128")
    c.add_argument("--n", default="1,2,3,4,5,6,7,8,9,12,16")
    c.add_argument("--ctx", type=int, default=1024, help="cached tokens a row")
    c.add_argument("--results-dir", default="results")
    f = sub.add_parser("fit", help="fit the linear form to a profiled curve (analysis.profile's cost_curves.jsonl)")
    f.add_argument("curves")
    f.add_argument("--model", default=None, help="the curve of this model (default: the file's last)")
    f.add_argument("--out", default=None, help="write the fitted model here (a .json usable as --cost)")
    a = ap.parse_args(argv)
    try:
        return _run(a)
    except ConfigError as e:
        ap.error(str(e))


def _run(a) -> int:
    if a.cmd == "list":
        for g in GPUS.values():
            print(f"{g.name:<10} {g.hbm_gbs:>6.0f} GB/s {g.bf16_tflops:>7.1f} TFLOP/s {g.memory_gb:>4.0f} GB  {g.source}")
        for sh in SHAPES.values():
            print(f"{sh.name:<22} {sh.linear_params() / 1e9:6.2f} B weights read a forward, "
                  f"{sh.kv_bytes_per_token() / 1024:.0f} KiB KV a token (bf16)")
        print(f"{SPECDECODE_BENCH_H100.name:<22} {SPECDECODE_BENCH_H100.source}")
        return 0
    if a.cmd == "show":
        cost = resolve(a.cost)
        bs, ns = [int(x) for x in a.bs.split(",")], [int(x) for x in a.n.split(",")]
        print(f"{cost.name}: T(b, n) ms at {a.ctx} cached tokens a row (overhead {cost.overhead_s * 1e3:.2f} ms a step "
              f"included); T(n)/T(1) in brackets")
        for b in bs:
            t1 = step(cost, b, 1, b * a.ctx)
            print(f"bs={b:<4} " + "  ".join(f"n={n}: {step(cost, b, n, b * a.ctx) * 1e3:.2f} "
                                             f"[{step(cost, b, n, b * a.ctx) / t1:.2f}]" for n in ns))
        return 0
    from specbench.run import records as R

    if a.cmd == "curve":
        cost = resolve(a.cost)
        rec = to_curve(cost, [int(x) for x in a.bs.split(",")], [int(x) for x in a.n.split(",")], a.ctx, a.model,
                       a.device, a.dtype)
        rec.update(kernel=a.kernel, cost_model_of=cost.describe())
        out = Path(a.results_dir) / "cost_curves.jsonl"
        R.append(out, rec)
        print(f"{cost.name}'s curve for {a.model} ({a.device}, {a.dtype}, {a.kernel}) appended to {out}")
        return 0
    sk = R.Skipped()
    curves = [c for c in R.parse_lines(Path(a.curves), sk) if "target" in c] if Path(a.curves).exists() else []
    sk.report("cost-curve")
    if a.model:
        curves = [c for c in curves if str(c.get("model")) == a.model]
    if not curves:
        raise ConfigError(f"no cost curve{' of ' + a.model if a.model else ''} in {a.curves} "
                          "(python -m specbench.analysis.profile records one)")
    lin = fit_linear(curves[-1], name=Path(a.out).stem if a.out else "fitted")
    print(f"T = {lin.c_kv:.4g} x kv + {lin.c_tok:.4g} x b n + {lin.c_fixed:.4g} s  ({lin.source}; "
          f"{lin.fit['points']} points, worst {100 * lin.fit['max_rel_err']:.1f}% off)")
    if a.out:
        Path(a.out).write_text(json.dumps(lin.describe(), indent=1) + "\n")
        print(f"written to {a.out}: use it as --cost {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
