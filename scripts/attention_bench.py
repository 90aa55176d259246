"""Does a tree verify pay an attention cost plain AR does not? On ``kernel=torch`` (the GPU path),
time one target forward over a draft tree (a 4D mask: Hugging Face's sdpa then repeats the
cache per query head) against a 1-token AR step (no mask: GQA kept), with Hugging Face's
``sdpa``, with specbench's folded-GQA attention (``kernels.gqa.attention``) and with SDPA's own
``enable_gqa`` on a boolean mask, interleaved.

    python scripts/attention_bench.py --ctx 256,2048 --nodes 8 --reps 30 [--device cpu] [--dtype fp32]

Prints a table (median ms per forward; verify / AR) and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _tree(n: int) -> list[int]:
    """Parents (0 = the root) of an n-node tree: two children per node, breadth first."""
    return [(i - 1) // 2 if i > 1 else 0 for i in range(1, n + 1)]


def _enable_gqa_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kw):
    """The alternative measured against the fold: SDPA's own ``enable_gqa`` with a boolean mask."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is None or query.shape[2] == 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kw)
    ok = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=ok, scale=scaling,
                                                           enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


def main(argv=None) -> int:
    from specbench import kernels
    from specbench.decode.tree import tree_geometry
    from specbench.decode.kv import RaggedCache
    from specbench.models import cached_model, model_cfg, resolve_device, resolve_dtype
    from specbench.decode.timing import sync

    ap = argparse.ArgumentParser(prog="python scripts/attention_bench.py", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--ctx", default="256,2048", help="context lengths (comma list)")
    ap.add_argument("--nodes", type=int, default=8, help="draft nodes of the verified tree (plus the root)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    a = ap.parse_args(argv)
    device = resolve_device(a.device)
    dtype = resolve_dtype(a.dtype, device)
    model, _ = cached_model(model_cfg(a.model), device, dtype, "torch")
    cfgs = [model.config, getattr(model.config, "text_config", None)]
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register("enable_gqa_bool", _enable_gqa_sdpa)
    AttentionMaskInterface.register("enable_gqa_bool", sdpa_mask)
    impls = {"hf_sdpa": "sdpa", "folded_gqa": kernels.gqa.NAME, "enable_gqa": "enable_gqa_bool"}
    parents = torch.tensor([_tree(a.nodes)], device=device)
    depth, anc = tree_geometry(parents)
    g = torch.Generator().manual_seed(0)
    rows = []
    for ctx in [int(x) for x in a.ctx.split(",")]:
        prompt = torch.randint(10, model.config.vocab_size, (ctx,), generator=g).tolist()
        cache = RaggedCache(model, device, dtype)
        with torch.inference_mode():
            cache.prefill([prompt], room=a.nodes + 2)
        tree_toks = torch.randint(10, 1000, (1, a.nodes + 1), generator=g).to(device)
        one = tree_toks[:, :1]
        times = {(i, k): [] for i in impls for k in ("ar", "verify")}

        def timed(impl, kind):
            for c in cfgs:
                if c is not None:
                    c._attn_implementation = impls[impl]
            with torch.inference_mode():
                sync(device)
                t = time.perf_counter()
                if kind == "ar":
                    cache.forward(one, torch.zeros_like(one), None)
                else:
                    cache.forward(tree_toks, depth, anc)
                sync(device)
                dt = time.perf_counter() - t
                cache.commit(torch.zeros(1, 1, dtype=torch.long, device=device), torch.zeros(1, dtype=torch.long))
            return dt

        for _ in range(3):  # warm-up
            for impl in impls:
                timed(impl, "ar"), timed(impl, "verify")
        for r in range(a.reps):
            order = list(impls)[r % len(impls):] + list(impls)[:r % len(impls)]
            for impl in order:
                for kind in ("ar", "verify") if r % 2 == 0 else ("verify", "ar"):
                    times[(impl, kind)].append(timed(impl, kind) * 1e3)
        for impl in impls:
            ar, ver = (statistics.median(times[(impl, k)]) for k in ("ar", "verify"))
            rows.append({"ctx": ctx, "attention": impl, "ar_ms": round(ar, 2), "verify_ms": round(ver, 2),
                         "verify_over_ar": round(ver / ar, 3), "nodes": a.nodes + 1})
    print(f"{'ctx':>6} {'attention':<11} {'AR 1 token':>11} {'verify':>9} {'verify/AR':>10}   "
          f"({device.type}, {str(dtype).replace('torch.', '')}, kernel=torch, median of {a.reps})")
    for r in rows:
        print(f"{r['ctx']:>6} {r['attention']:<11} {r['ar_ms']:>8.2f} ms {r['verify_ms']:>6.2f} ms {r['verify_over_ar']:>9.2f}x")
    print(json.dumps({"bench": "attention", "model": a.model, "device": device.type, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
