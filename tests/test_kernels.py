"""The kernels' packed linear paths (``kernel=onednn``, ``kernel=native``): same numbers as torch's within
fp32 rounding, greedy identity of the engine on them, training untouched; the native kernel's
rows independent of each other bit for bit."""

import copy
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from helpers import CPU, cfg_for, greedy_cases, reference_greedy, run_engine, tiny_llama
from specbench.methods.pld import PromptLookup
from specbench.methods.reject import Reject
from specbench import accel, kernels
from specbench.kernels import extension, gqa, native, packing
from specbench.errors import ConfigError

pytestmark = pytest.mark.skipif(not kernels.onednn.available(), reason="torch built without oneDNN")
needs_native = pytest.mark.skipif(extension.unavailable() is not None, reason=f"native kernels: {extension.unavailable()}")
PACKED = ["onednn", pytest.param("native", marks=needs_native)]
_AVX512 = extension.unavailable() is None and extension.load().has_avx512()
# the packing widths the kernel runs here: 8 (AVX2 tiles) everywhere, 48 (AVX-512 tiles) where the CPU has AVX-512F
COLS = [8, pytest.param(48, marks=pytest.mark.skipif(not _AVX512, reason="this CPU has no AVX-512F"))]


@pytest.fixture(scope="module", params=PACKED)
def packed(request):
    m = tiny_llama(seed=0, scale=4.0)
    ref = tiny_llama(seed=0, scale=4.0)
    assert kernels.apply(m, request.param) == 2 * 7 + 1  # q k v o gate up down per layer + the head
    assert kernels.apply(m, request.param) == 0  # idempotent
    return m, ref


def test_same_logits_as_torch(packed):
    m, ref = packed
    x = torch.randint(3, 96, (3, 17))
    with torch.inference_mode():
        a, b = m(x).logits, ref(x).logits
    assert (a - b).abs().max() < 1e-4
    assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("bs", [1, 4])
def test_greedy_identity_on_the_packed_path(packed, bs):
    m, _ = packed
    prompts, _ = greedy_cases(m, 1)[bs]
    refs = [reference_greedy(m, p, 20) for p in prompts]  # recomputation through the same kernels
    for prop in (None, PromptLookup(cfg_for(K=3), m, None, CPU, torch.float32),
                 Reject(cfg_for(K=2, method={"name": "reject", "token": 5}), m, None, CPU, torch.float32)):
        assert [r.tokens for r in run_engine(m, prop, prompts, 20)] == refs


def test_training_and_other_dtypes_keep_torchs_path(packed):
    m, _ = packed
    lin = m.model.layers[0].mlp.up_proj
    x = torch.randn(2, 64, requires_grad=True)
    lin(x).sum().backward()  # autograd through the layer as loaded
    assert x.grad is not None and lin.weight.grad is not None
    bf = tiny_llama(seed=1).to(torch.bfloat16)
    assert kernels.apply(bf, "onednn") == 0


def test_resolve():
    assert kernels.resolve("torch", CPU) == "torch"
    assert kernels.resolve("auto", CPU) == ("native" if extension.unavailable() is None else "onednn")
    assert kernels.resolve("auto", torch.device("cuda")) == "torch"
    for k in ("onednn", "native"):
        with pytest.raises(ConfigError, match=f"kernel={k} is a CPU path"):
            kernels.resolve(k, torch.device("cuda"))
    with pytest.raises(ConfigError, match="unknown kernel"):
        kernels.resolve("fast", CPU)
    with pytest.raises(ConfigError, match="unknown kernel 'avx2'; choices: auto, torch, onednn, native"):
        kernels.resolve("avx2", CPU)  # the native path's name before AVX-512 tiles: in records only
    assert kernels.kernel_isa("native") == extension.isa() and kernels.kernel_isa("onednn") is None


@pytest.mark.parametrize("kernel", PACKED)
def test_a_copied_or_reloaded_layer_computes_with_its_own_weights(kernel):
    """Drafts are built by deep-copying the target's layers and loading trained weights into
    them: the packed weight must follow (a stale one cost Leviathan its acceptance)."""
    import copy

    m = tiny_llama(seed=0)
    kernels.apply(m, kernel)
    layer = m.model.layers[0].mlp.up_proj
    x = torch.randn(3, 64)
    twin = copy.deepcopy(layer)
    with torch.no_grad():
        twin.weight.mul_(2.0)  # in place, as load_state_dict does
    with torch.inference_mode():
        assert torch.allclose(twin(x), 2 * layer(x), atol=1e-5)
        other = tiny_llama(seed=5).model.layers[0].mlp.up_proj
        twin.load_state_dict(other.state_dict())
        assert torch.allclose(twin(x), torch.nn.functional.linear(x, other.weight), atol=1e-5)
        assert torch.allclose(layer(x), torch.nn.functional.linear(x, layer.weight), atol=1e-5)



@needs_native
@pytest.mark.parametrize("cols", COLS)
@pytest.mark.parametrize("out_features,in_features", [(16, 8), (200, 576), (37, 129), (1, 5), (12, 7)])
def test_native_kernel_matches_torch_at_every_row_count(out_features, in_features, cols):
    g = torch.Generator().manual_seed(out_features)
    w = torch.randn(out_features, in_features, generator=g)
    wp = extension.pack(w, cols)
    assert wp.shape == (-(-out_features // cols), in_features, cols)
    for n in range(36):
        x = torch.randn(n, in_features, generator=g)
        y = extension.few_rows_linear(x, wp, out_features)
        assert y.shape == (n, out_features)
        assert torch.allclose(y, torch.nn.functional.linear(x, w), atol=1e-4, rtol=1e-5), n


@needs_native
@pytest.mark.parametrize("cols", COLS)
def test_native_rows_do_not_depend_on_each_other(cols):
    """Each output is one fixed-order sum whatever tile, pass or chunk its row lands in: a row
    alone and the same row among 1..40 others agree bit for bit (a verify forward computes the
    linears of a committed token exactly as the decode step would). 100 outputs: groups of
    blocks, single blocks and a partial last block; 200 inputs: several k chunks and a partial one."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(100, 200, generator=g)
    wp = extension.pack(w, cols)
    x = torch.randn(40, 200, generator=g)
    alone = torch.cat([extension.few_rows_linear(x[i:i + 1], wp, 100) for i in range(len(x))])
    for n in range(1, len(x) + 1):
        assert torch.equal(extension.few_rows_linear(x[:n], wp, 100), alone[:n]), n


@needs_native
@pytest.mark.skipif(not _AVX512, reason="this CPU has no AVX-512F")
def test_avx512_tiles_give_the_bits_of_the_avx2_tiles():
    """The 48-column panels (AVX-512 tiles: up to 8 rows in one pass of 24 accumulators) and the
    8-column blocks (AVX2: passes of 4 rows) compute every output as the same FMA chain: equal bits
    at 1..40 rows (one and several passes and groups), whole panels and a last panel with 1, 2 or
    3 blocks of columns (some partial), a pack_cols() default."""
    g = torch.Generator().manual_seed(3)
    for out_features, in_features in ((100, 200), (49, 576), (96, 33), (16, 7), (3, 64), (130, 9)):
        w = torch.randn(out_features, in_features, generator=g)
        narrow, wide = extension.pack(w, 8), extension.pack(w, 48)
        for n in range(1, 41):
            x = torch.randn(n, in_features, generator=g)
            assert torch.equal(extension.few_rows_linear(x, wide, out_features),
                               extension.few_rows_linear(x, narrow, out_features)), (out_features, in_features, n)
    want = os.environ.get("SPECBENCH_AVX512")
    avx512 = want != "0" and (want == "1" or not extension.load().is_intel())  # Intel's default: the AVX2 tiles
    assert extension.pack_cols() == (48 if avx512 else 8)


_GUARDED = r"""
import ctypes, mmap, torch
from specbench.kernels import extension

PAGE = mmap.PAGESIZE
libc = ctypes.CDLL(None, use_errno=True)
libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
keep = []


def before_a_guard_page(t):
    # a copy of t that ends where an unreadable page begins: any load past its end faults
    size = t.numel() * t.element_size()
    pages = -(-size // PAGE)
    buf = mmap.mmap(-1, (pages + 1) * PAGE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    assert libc.mprotect(base + pages * PAGE, PAGE, 0) == 0, ctypes.get_errno()  # PROT_NONE
    out = torch.frombuffer(buf, dtype=t.dtype, count=t.numel(), offset=pages * PAGE - size).view(t.shape)
    out.copy_(t)
    keep.append(buf)
    return out


g = torch.Generator().manual_seed(0)
for out_features, in_features, cols in ((37, 129, 8), (48, 576, 8), (37, 129, 48), (48, 576, 48), (100, 64, 48)):
    if cols == 48 and not extension.load().has_avx512():
        continue
    w = torch.randn(out_features, in_features, generator=g)
    wp = before_a_guard_page(extension.pack(w, cols))
    for n in (1, 2, 3, 4, 5, 8, 9, 17):
        x = before_a_guard_page(torch.randn(n, in_features, generator=g))
        y = extension.few_rows_linear(x, wp, out_features)
        assert torch.allclose(y, torch.nn.functional.linear(x, w), atol=1e-4, rtol=1e-5), (out_features, n)
print("ok")
"""


@needs_native
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mprotect through libc")
def test_native_kernel_reads_nothing_past_the_packing_or_the_rows():
    """The tiles prefetch past a block's end without a clamp (a prefetch never faults); their loads
    must stay inside. With the packing and the rows each ending where an unreadable page begins,
    a load past either end kills the process (run apart, so that it fails only this test)."""
    built = Path(extension.load().__file__).parents[2]  # this process's cache: no second build
    run = subprocess.run([sys.executable, "-c", _GUARDED], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "SPECBENCH_CACHE": str(built)})
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), (run.returncode, run.stderr[-2000:])


@needs_native
def test_a_kernel_build_killed_midway_does_not_hang_the_next_load(tmp_path):
    """A process killed while torch's extension loader held its lock leaves the file ``lock`` in
    the build directory, and torch's loader waits on it forever; ours removes it under a lock the
    system releases when its holder dies. On a copy of this process's build, with such a file."""
    import shutil

    built = Path(extension.load().__file__).parent
    copy = tmp_path / "kernels" / built.name
    shutil.copytree(built, copy)  # timestamps kept: up to date, nothing rebuilt
    (copy / "lock").touch()
    run = subprocess.run([sys.executable, "-c", "from specbench.kernels import extension; extension.load(); print('ok')"],
                         capture_output=True, text=True, timeout=240, env={**os.environ, "SPECBENCH_CACHE": str(tmp_path)})
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), (run.returncode, run.stderr[-2000:])
    assert not (copy / "lock").exists()


@needs_native
def test_move_slots_moves_what_torch_indexing_moves():
    """The cache's slot moves (a tree's accepted path behind each row's prefix) on views of a
    larger buffer, as the slab cache holds them: the same result as torch's per-tensor indexing,
    and out-of-range slots refused."""
    g = torch.Generator().manual_seed(0)
    bufs = [torch.randn(3, 2, 20, 8, generator=g) for _ in range(4)]
    views = [b.narrow(2, 3, 12) for b in bufs]
    rows = torch.tensor([0, 0, 2, 2, 2])
    src = torch.tensor([7, 9, 5, 8, 11])
    dst = torch.tensor([5, 6, 4, 5, 6])
    want = [v.clone() for v in views]
    for w in want:
        w[rows, :, dst] = w[rows, :, src]
    extension.load().move_slots(views, rows, src, dst)
    assert all(torch.equal(v, w) for v, w in zip(views, want))
    with pytest.raises(RuntimeError, match="out of range"):
        extension.load().move_slots(views, rows, src + 5, dst)


@needs_native
def test_argmax_rows_is_numpys_argmax_and_greedy_pick_takes_it(monkeypatch):
    """The extension's argmax: numpy's index on random rows of every length around its
    thread shares and vector widths, on ties (the first index), on NaN (the first NaN), on -inf
    rows, on rows with a stride; greedy_pick goes through it once the extension is loaded (and
    through numpy otherwise) with the same answers on 1-3 dimensional logits."""
    import numpy as np

    from specbench.decode import verify

    ext = extension.load()
    g = torch.Generator().manual_seed(0)
    for R, V in [(1, 1), (1, 7), (3, 8), (2, 33), (5, 4095), (4, 8193), (3, 49152), (2, 100003)]:
        x = torch.randn(R, V, generator=g)
        cases = [x, x.clone().fill_(float("-inf")), x.round()]  # round(): many ties at the top
        tied = x.clone()
        tied[:, V // 3:] = x.max() + 1  # the same largest value in every thread's share
        nan = x.clone()
        nan[:, (2 * V) // 3:] = float("nan")  # the first NaN of a row wins, as in numpy
        nan[0, V - 1] = float("nan")
        wide = torch.randn(R, V + 5, generator=g)[:, 2:V + 2]  # rows with a stride
        for c in cases + [tied, nan, wide]:
            assert torch.equal(ext.argmax_rows(c), torch.from_numpy(np.argmax(c.numpy(), -1))), (R, V)
    with pytest.raises(RuntimeError, match="unit stride"):
        ext.argmax_rows(torch.randn(4, 6).t())
    logits = [torch.randn(9, generator=g), torch.randn(3, 9, generator=g), torch.randn(2, 4, 49152, generator=g),
              torch.randn(2, 4, 49152, generator=g)[:, -1], torch.randn(4, 2, 300, generator=g).transpose(0, 1)]
    calls = []
    real = ext.argmax_rows
    monkeypatch.setattr(accel, "argmax_rows", lambda x: calls.append(1) or real(x))
    for lg in logits:
        assert torch.equal(verify.greedy_pick(lg), lg.argmax(-1))
    assert len(calls) == 4  # the transposed 3-d logits are not contiguous: numpy takes them
    monkeypatch.setattr(accel, "argmax_rows", None)
    for lg in logits:
        assert torch.equal(verify.greedy_pick(lg), lg.argmax(-1))


@needs_native
def test_native_layer_takes_any_row_count_and_adds_its_bias():
    lin = torch.nn.Linear(40, 24, bias=True)
    kernels.apply(lin, "native")
    for rows in (1, 16, 17, 300):  # 300: more than one sweep over the weight (256 rows each)
        x = torch.randn(rows, 2, 40).transpose(0, 1)  # [2, rows, 40], not contiguous
        with torch.inference_mode():
            y = lin(x)
        assert torch.allclose(y, torch.nn.functional.linear(x, lin.weight, lin.bias), atol=1e-5), rows


@needs_native
def test_native_kernel_refuses_a_wrong_packing():
    w = torch.randn(32, 8)
    with pytest.raises(RuntimeError, match="packing"):  # 40 outputs from 4 blocks of 8
        extension.few_rows_linear(torch.randn(2, 8), extension.pack(w, 8), 40)
    with pytest.raises(RuntimeError, match="packing"):
        extension.few_rows_linear(torch.randn(2, 9), extension.pack(w), 32)
    if _AVX512:
        with pytest.raises(RuntimeError, match="packing"):  # 60 outputs from one 48-column panel
            extension.few_rows_linear(torch.randn(2, 8), extension.pack(w, 48), 60)
    with pytest.raises(RuntimeError, match="packing"):  # a width the kernel has no tiles for
        extension.few_rows_linear(torch.randn(2, 8), extension.pack(w, 16), 32)
    if not _AVX512:
        with pytest.raises(RuntimeError, match="AVX-512F"):
            extension.few_rows_linear(torch.randn(2, 8), extension.pack(w, 48), 32)


@pytest.mark.parametrize("kernel", ["torch", *PACKED])
def test_gqa_attention_folds_queries_without_changing_the_forward(kernel, monkeypatch):
    """A tree verify forward on ragged rows (4D mask, several queries, 4 heads on 2 KV heads):
    every path, torch's (the GPU default) included, folds each KV group's queries into one
    instead of repeating the cache per head (Hugging Face's sdpa with a mask), so SD verifies
    pay no attention cost plain AR does not; logits as Hugging Face's."""
    import transformers.integrations.sdpa_attention as hf_sdpa

    from specbench.decode.tree import tree_geometry
    from specbench.decode.kv import RaggedCache

    repeats = []
    real_repeat = hf_sdpa.repeat_kv
    monkeypatch.setattr(hf_sdpa, "repeat_kv", lambda h, n: repeats.append(n) or real_repeat(h, n))

    m, ref = tiny_llama(seed=2), tiny_llama(seed=2)
    kernels.apply(m, kernel)
    assert m.config._attn_implementation == gqa.NAME and ref.config._attn_implementation == "sdpa"
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
    parents = torch.tensor([[0, 1, 1], [0, 0, 2]])  # a tree per row over the root and 3 drafts
    depth, anc = tree_geometry(parents)
    toks = torch.tensor([[20, 21, 22, 23], [30, 31, 32, 33]])
    outs, repeated = [], []
    with torch.inference_mode():
        for model in (m, ref):
            cache = RaggedCache(model, CPU, torch.float32)
            cache.prefill(prompts)
            repeats.clear()
            outs.append(cache.forward(toks, depth, anc).logits)
            repeated.append(len(repeats))
    assert (outs[0] - outs[1]).abs().max() < 1e-4
    assert repeated[0] == 0 and repeated[1] > 0  # ours never repeats K/V; Hugging Face's sdpa did


@needs_native
def test_rope_and_rms_norm_of_the_extension_match_hugging_face():
    """RoPE in place: the same products and sums as apply_rotary_pos_emb, bit for bit (on a
    strided view, as the fused layer calls it); RMSNorm: LlamaRMSNorm up to the order of the
    sum of squares."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

    m = tiny_llama(seed=3)
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(2, 5, 8, 16, generator=g)  # [B, n, 4 q + 2 k + 2 v heads, d]
    pos = torch.tensor([[3, 4, 5, 6, 7], [0, 1, 1, 2, 9]])
    cos, sin = LlamaRotaryEmbedding(m.config)(qkv, pos)
    q, k = apply_rotary_pos_emb(qkv[:, :, :4].transpose(1, 2), qkv[:, :, 4:6].transpose(1, 2), cos, sin)
    mine = qkv.clone()
    extension.load().rope_(mine, cos, sin, 6)
    assert torch.equal(mine[:, :, :4].transpose(1, 2), q) and torch.equal(mine[:, :, 4:6].transpose(1, 2), k)
    assert torch.equal(mine[:, :, 6:], qkv[:, :, 6:])  # v untouched
    norm = LlamaRMSNorm(37, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(37, generator=g))
    x = 3 * torch.randn(4, 2, 37, generator=g)
    assert torch.allclose(extension.load().rms_norm(x, norm.weight, 1e-5), norm(x), rtol=1e-5, atol=1e-6)


@needs_native
def test_llama_layers_take_the_fused_forward_and_keep_the_layer_semantics():
    """With kernel=native each Llama layer runs the fused forward (q|k|v and gate|up in one kernel call
    each, RMSNorm and RoPE in the extension): a ragged tree verify forward gives torch's logits
    within fp32 rounding; a deep copy with other weights loaded in place computes with its own;
    a layer under autograd keeps Hugging Face's forward."""
    import copy

    from specbench.decode.tree import tree_geometry
    from specbench.decode.kv import RaggedCache

    m, ref = tiny_llama(seed=2), tiny_llama(seed=2)
    kernels.apply(m, "native")
    assert all(layer.forward.__func__ is native._fused_llama_forward for layer in m.model.layers)
    assert m.model.norm.forward.__func__ is native._fused_rms_forward  # the final norm too
    parents = torch.tensor([[0, 1, 1], [0, 0, 2]])
    depth, anc = tree_geometry(parents)
    toks = torch.tensor([[20, 21, 22, 23], [30, 31, 32, 33]])

    def verify(model):
        cache = RaggedCache(model, CPU, torch.float32)
        with torch.inference_mode():
            first = cache.prefill([[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]).logits
            return torch.cat([first, cache.forward(toks, depth, anc).logits], dim=1)

    assert (verify(m) - verify(ref)).abs().max() < 1e-4
    twin, other = copy.deepcopy(m), tiny_llama(seed=7)
    twin.load_state_dict(other.state_dict())  # in place: the fused packing must follow
    assert (verify(twin) - verify(other)).abs().max() < 1e-4
    assert (verify(m) - verify(ref)).abs().max() < 1e-4  # the original kept its own
    x = torch.randn(1, 3, 64, requires_grad=True)
    pe = m.model.rotary_emb(x, torch.arange(3)[None])
    m.model.norm(m.model.layers[0](x, position_embeddings=pe)).sum().backward()
    assert x.grad is not None and m.model.layers[0].mlp.up_proj.weight.grad is not None
    assert m.model.norm.weight.grad is not None


@needs_native
def test_fused_blocks_give_the_bits_of_the_per_op_layer(monkeypatch):
    """On the decode and verify path a fused layer is two extension calls that also write the
    KV cache (``attn_block``, ``mlp_block``), and the model runs them from one loop of its own
    (``_fused_model_forward``): the same logits, bit for bit, as the per-op composition under
    Hugging Face's loop (taken when the cache's layer gives no room), and as the blocks under
    Hugging Face's loop (taken when a layer has a hook: a tap on its output), on a ragged batch,
    through tree and chain forwards, rejected nodes and buffer growth past its first 64 slots."""
    from specbench.decode.tree import tree_geometry
    from specbench.decode.hidden import Tap
    from specbench.decode.kv import RaggedCache
    from specbench.decode.slab import SlabLayer

    m = tiny_llama(seed=4)
    kernels.apply(m, "native")
    assert m.model.forward.__func__ is native._fused_model_forward
    depth, anc = tree_geometry(torch.tensor([[0, 1, 1], [0, 0, 2]]))
    append, lean_slabs, stack, taken, lean = SlabLayer.append, native._lean_slabs, native._stack, [], []

    def counted(self, n):
        room = append(self, n)
        taken.append(room is not None)
        return room

    def counted_lean(*a):  # the cache cannot take the lean loop
        slabs = lean_slabs(*a)
        if slabs is None:
            lean.append(False)
        return slabs

    def counted_stack(model):  # the layers can (or have a hook)
        s = stack(model)
        lean.append(s is not None)
        return s

    monkeypatch.setattr(native, "_lean_slabs", counted_lean)
    monkeypatch.setattr(native, "_stack", counted_stack)

    def run(path: str):
        monkeypatch.setattr(SlabLayer, "append", (lambda self, n: None) if path == "per-op" else counted)
        tap = Tap(m, [0]) if path != "lean" else None  # a hook on layer 0: Hugging Face's loop
        cache, g, out = RaggedCache(m, CPU, torch.float32), torch.Generator().manual_seed(0), []
        with torch.inference_mode():
            out.append(cache.prefill([[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]).logits)
            for step in range(30):
                toks = torch.randint(3, 96, (2, 4), generator=g)
                if step % 3 == 0:  # a tree: keep a root-to-leaf path of it
                    out.append(cache.forward(toks, depth, anc).logits)
                    cache.commit(torch.tensor([[0, 1, 3], [0, 2, 3]]), torch.tensor([3, 2]))
                else:  # a chain, kept in part
                    out.append(cache.forward(toks, torch.arange(4)[None].expand(2, 4), None).logits)
                    cache.commit(torch.tensor([[0, 1, 2, 3]] * 2), torch.tensor([4, 1 + step % 4]))
            assert cache.cache.layers[0]._k.shape[2] > 64  # the buffer grew on the way
            solo = RaggedCache(m, CPU, torch.float32)  # one row: dense, no mask given to the model
            out.append(solo.prefill([[5, 6, 7, 8, 9]]).logits)
            for _ in range(3):
                assert solo.is_dense()
                out.append(solo.forward(torch.randint(3, 96, (1, 3), generator=g), torch.arange(3)[None], None).logits)
                solo.commit_all()
        if tap is not None:
            tap.close()
        return out

    per_op = run("per-op")
    assert not any(lean)
    blocks = run("blocks")
    assert taken and all(taken[2:]) and not any(lean), "the block path was not taken"
    taken.clear()
    lean.clear()
    fused = run("lean")
    assert lean == [False] + [True] * 30 + [False] + [True] * 3, "the model's own loop was not taken (or at a prefill)"
    for other in (blocks, fused):
        assert len(per_op) == len(other) and all(torch.equal(a, b) for a, b in zip(per_op, other))


@needs_native
def test_drafts_of_a_native_kernel_target_run_their_own_loop_over_the_fused_layers(monkeypatch):
    """A self_layers draft and a trained draft LM of a native-kernel target run their decode steps
    through the extension's loop over their fused layers (``_stack``), as the target does, with
    the logits of Hugging Face's loop over the same layers, bit for bit; a drafter whose embed()
    is its own (SpecDec's queries) keeps Hugging Face's loop."""
    from specbench.drafters.draft_lm import DraftLM
    from specbench.drafters.specdec import SpecDrafter
    from specbench.decode.kv import RaggedCache
    from specbench.models import self_layers_draft

    m = tiny_llama(seed=5, layers=3)
    kernels.apply(m, "native")
    sl = self_layers_draft(m, 2)
    dl = DraftLM(m, 2, torch.arange(0, 96, 2))
    sd = SpecDrafter(m, 1, torch.arange(96), 2)
    for d in (dl, sd):
        kernels.apply(d, "native")
    stack, lean = native._stack, []
    monkeypatch.setattr(native, "_stack", lambda model: lean.append(model) or stack(model))

    def decode(d):
        cache, g, out = RaggedCache(d, CPU, torch.float32), torch.Generator().manual_seed(1), []
        with torch.inference_mode():
            cache.prefill([[5, 6, 7, 8, 9, 10], [11, 12, 13]])
            for _ in range(4):
                out.append(cache.forward(torch.randint(3, 96, (2, 3), generator=g), torch.arange(3)[None].expand(2, 3),
                                         None).logits)
                cache.commit(torch.tensor([[0, 1, 2]] * 2), torch.tensor([3, 1]))
        return out

    for d, body in ((sl, sl.model), (dl, dl.body)):
        lean.clear()
        own = decode(d)
        assert lean.count(body) == 4, "the draft's decode steps did not take its own loop"
        patched = body.forward
        body.forward = types.MethodType(type(body).forward, body)  # Hugging Face's loop over the same layers
        try:
            lean.clear()
            hf = decode(d)
        finally:
            body.forward = patched
        assert not lean and all(torch.equal(a, b) for a, b in zip(own, hf))
    lean.clear()
    decode(sd)
    assert sd.body not in lean  # its query embeddings go in as inputs_embeds: Hugging Face's loop


@needs_native
def test_fused_stack_follows_every_change_to_the_layers():
    """The extension's loop over the layers (``_stack``) checks, on every forward, the links
    through which the modules reach their weights: a weight changed in place, a parameter or a
    submodule or a layer replaced gives a rebuilt stack whose logits follow the change (those of
    Hugging Face's loop on an unpacked twin with the same change); a hook on a layer gives
    Hugging Face's loop until it is removed."""
    from specbench.decode.kv import RaggedCache

    m, ref = tiny_llama(seed=3), tiny_llama(seed=3)
    kernels.apply(m, "native")

    def step(model):
        cache = RaggedCache(model, CPU, torch.float32)
        with torch.inference_mode():
            cache.prefill([[5, 6, 7, 8, 9]])
            return cache.forward(torch.tensor([[20, 21, 22]]), torch.arange(3)[None], None).logits

    assert (step(m) - step(ref)).abs().max() < 1e-4
    packs = [packing.PACKED["fused"][layer][1] for layer in m.model.layers]  # one buffer, read in order
    ptrs = [t.data_ptr() for w in packs for t in (w[0], w[6], w[1], w[7])]
    assert ptrs == sorted(ptrs) and len({t.untyped_storage().data_ptr() for w in packs for t in w[:2]}) == 1
    assert packing.PACKED["native"][m.model.layers[1].mlp.down_proj][1] is packs[1][7]
    first = native._STACKS[m.model]
    assert native._stack(m.model) is first and first.state() == 0

    def twin_of(layer, idx):  # a copy of a layer to stand at index idx
        twin = copy.deepcopy(layer)
        twin.self_attn.layer_idx = idx
        twin.mlp.gate_proj.weight.mul_(0.5)
        return twin

    changes = [
        lambda mod: mod.model.layers[1].mlp.up_proj.weight.mul_(-1.5),  # in place
        lambda mod: setattr(mod.model.layers[0].self_attn.o_proj, "weight",
                            torch.nn.Parameter(mod.model.layers[0].self_attn.o_proj.weight.flip(0).clone())),
        lambda mod: mod.model.layers[1].post_attention_layernorm.weight.add_(0.5),
        lambda mod: setattr(mod.model.layers[0].mlp, "down_proj", copy.deepcopy(mod.model.layers[1].mlp.down_proj)),
        lambda mod: mod.model.layers.__setitem__(1, twin_of(mod.model.layers[0], 1)),
    ]
    for change in changes:
        before, old = native._STACKS[m.model], step(m)
        with torch.no_grad():
            change(m)
            change(ref)
        assert before.state() == 1
        new = step(m)
        assert (new - step(ref)).abs().max() < 1e-4 and (new - old).abs().max() > 1e-3  # a stale stack would fail
        assert native._STACKS[m.model] is not before and native._stack(m.model).state() == 0
        assert native._stack(m.model) is native._STACKS[m.model]  # the lean loop ran on it
    hook = m.model.layers[0].register_forward_hook(lambda *a: None)
    assert native._stack(m.model) is None and native._STACKS[m.model].state() == 2
    assert (step(m) - step(ref)).abs().max() < 1e-4
    hook.remove()
    assert native._stack(m.model) is not None
    layer = m.model.layers[1]
    fused = layer.forward
    layer.forward = types.MethodType(type(layer).forward, layer)  # a layer off the fused path: HF's loop
    assert native._stack(m.model) is None and m.model not in native._STACKS
    assert (step(m) - step(ref)).abs().max() < 1e-4
    layer.forward = fused
    assert native._stack(m.model) is native._STACKS[m.model] is not None


@needs_native
def test_heads_like_is_the_batched_matmul_and_follows_the_weights():
    """Medusa's residual heads as one kernel call (``heads_like``): torch's batched matmul within
    fp32 rounding on the native path, its packing redone when the heads change in place, and
    torch's own einsum under autograd or beside a layer on another path."""
    g = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(3, 40, 24, generator=g))
    x = torch.randn(5, 24, generator=g)
    like = torch.nn.Linear(24, 8)
    kernels.apply(torch.nn.Sequential(like), "native")
    owner = torch.nn.Module()
    with torch.no_grad():
        got = kernels.heads_like(x, w, like, owner)
        assert got.shape == (3, 5, 40) and (got - torch.einsum("ni,hoi->hno", x, w)).abs().max() < 1e-4
        assert packing.PACKED["heads"][owner][0] == [(id(w), w.data_ptr(), w._version)]  # packed for the owner
        w.mul_(-2.0)
        assert (kernels.heads_like(x, w, like, owner) + 2 * got).abs().max() < 1e-3
    y = kernels.heads_like(x, w, like, owner)  # autograd: torch's own
    assert y.requires_grad and torch.equal(y, torch.einsum("ni,hoi->hno", x, w))
    with torch.no_grad():
        assert torch.equal(kernels.heads_like(x, w, torch.nn.Linear(24, 8), owner), torch.einsum("ni,hoi->hno", x, w))


@needs_native
def test_fused_layer_takes_the_cache_under_either_name():
    """transformers 5.24 passes a layer its KV cache as ``cache``, earlier versions as
    ``past_key_values``: the fused forward appends to it under either name (attending over the
    cached keys too), and ``cache_kwarg`` reads the name a forward takes from its signature."""
    from transformers import DynamicCache

    from specbench.hf import cache_kwarg

    class Old:
        def forward(self, x, past_key_values=None): ...

    class New:
        def forward(self, x, cache=None, **kw): ...

    assert (cache_kwarg(Old), cache_kwarg(New()), cache_kwarg(Old())) == ("past_key_values", "cache", "past_key_values")
    m = tiny_llama(seed=3)
    kernels.apply(m, "native")
    layer = m.model.layers[0]
    outs = []
    with torch.inference_mode():
        for name in ("past_key_values", "cache"):
            kv = DynamicCache()
            for lo, hi in ((0, 5), (5, 7)):
                x = torch.randn(1, hi - lo, 64, generator=torch.Generator().manual_seed(lo))
                pe = m.model.rotary_emb(x, torch.arange(lo, hi)[None])
                y = layer(x, position_embeddings=pe, use_cache=True, **{name: kv})
            assert kv.get_seq_length(0) == 7, name
            outs.append(y)
    assert torch.equal(outs[0], outs[1])


@needs_native
@pytest.mark.parametrize("d", [64, 16])
def test_extension_attention_matches_sdpa(d):
    """The fused layer's attention: queries as strided views, keys and values as views of a
    larger buffer (the slab cache), 6 query heads on 2 KV heads; an additive tree mask per row,
    one shared by the batch, and none (causal: the last n of L positions, a prefill when n = L)."""
    F = torch.nn.functional
    g = torch.Generator().manual_seed(d)
    B, H, Hkv, n, L = 2, 6, 2, 5, 37
    q = torch.randn(B, n, H, d, generator=g).transpose(1, 2)
    buf = torch.randn(2, B, Hkv, 64, d, generator=g)
    k, v = buf[0, :, :, 3:3 + L], buf[1, :, :, 3:3 + L]
    ok = torch.rand(B, 1, n, L, generator=g) < 0.6
    ok[..., 0] = True
    add = torch.where(ok, 0.0, torch.finfo(torch.float32).min)
    ext = extension.load()

    def ref(q, k, v, mask=None, causal=False):
        if causal:
            mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril(k.shape[2] - q.shape[2])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True).transpose(1, 2)

    for mask in (add, add[:1]):
        assert torch.allclose(ext.attention(q, k, v, mask, 0.3), ref(q, k, v, mask), atol=1e-5)
    assert torch.allclose(ext.attention(q, k, v, torch.empty(0), 0.3), ref(q, k, v, causal=True), atol=1e-5)
    q1 = q[:, :, -1:]
    assert torch.allclose(ext.attention(q1, k, v, torch.empty(0), 0.3), ref(q1, k, v), atol=1e-5)
    qL = torch.randn(B, H, L, d, generator=g)
    assert torch.allclose(ext.attention(qL, k, v, torch.empty(0), 0.3), ref(qL, k, v, causal=True), atol=1e-5)
    with pytest.raises(RuntimeError, match="mask must be additive"):
        ext.attention(q, k, v, add[..., :-1], 0.3)


@needs_native
@pytest.mark.parametrize("d", [64, 20])
def test_extension_attention_query_is_independent_of_the_others(d):
    """Keys in several blocks (the last one partial), 9 query heads on 3 KV heads, 8 queries a
    row split into tasks: every query's output is bit for bit what it gets on its own (as an AR
    step computes it), whatever n, the mask's other rows or the thread count."""
    F = torch.nn.functional
    g = torch.Generator().manual_seed(d)
    B, H, Hkv, n, L = 2, 9, 3, 8, 150
    q = torch.randn(B, n, H, d, generator=g).transpose(1, 2)
    k, v = torch.randn(2, B, Hkv, L, d, generator=g)
    ok = torch.rand(B, 1, n, L, generator=g) < 0.7
    ok[1, ..., :9] = False  # a left-padded row
    ok[..., 9] = True
    add = torch.where(ok, 0.0, torch.finfo(torch.float32).min)
    ext = extension.load()
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=ok, scale=0.125, enable_gqa=True).transpose(1, 2)
    out = ext.attention(q, k, v, add, 0.125)
    causal = ext.attention(q, k, v, torch.empty(0), 0.125)
    assert torch.allclose(out, ref, atol=1e-5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(ext.attention(q, k, v, add, 0.125), out)
    finally:
        torch.set_num_threads(threads)
    for i in range(n):
        qi = q[:, :, i:i + 1]
        assert torch.equal(ext.attention(qi, k, v, add[:, :, i:i + 1], 0.125), out[:, i:i + 1])
        seen = L - n + i + 1  # causal: query i of n sees the keys up to its own
        assert torch.equal(ext.attention(qi, k[:, :, :seen], v[:, :, :seen], torch.empty(0), 0.125),
                           causal[:, i:i + 1])


@needs_native
def test_extension_silu_mul_matches_torch():
    g = torch.Generator().manual_seed(0)
    gu = 6 * torch.randn(3, 2, 2 * 37, generator=g)  # 37: a tail after the vectors
    gu[0, 0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])
    gate, up = gu.chunk(2, dim=-1)
    assert torch.allclose(extension.load().silu_mul(gu), torch.nn.functional.silu(gate) * up, rtol=1e-5, atol=1e-6)


def test_grouped_query_attention_folds_the_query_heads_and_copies_no_key():
    """A GPU's drafter attention (``native.grouped``): each KV head's query heads as query rows of
    that head, the mask tiled; the same as SDPA's grouped-query attention, for any rep."""
    from specbench.kernels.native import grouped

    g = torch.Generator().manual_seed(0)
    for B, H, Hk, n, S in [(2, 8, 2, 3, 17), (3, 12, 4, 10, 40), (1, 4, 4, 1, 5)]:
        q, k, v = (torch.randn(*shape, 16, generator=g) for shape in ((B, H, n), (B, Hk, S), (B, Hk, S)))
        visible = torch.rand(B, n, S, generator=g) > 0.3
        visible[..., 0] = True
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None],
                                                               enable_gqa=H != Hk).transpose(1, 2)
        torch.testing.assert_close(grouped(q, k, v, visible), ref)
