"""The tiny random target the audit (``specbench.audit``) and the unit tests decode with: a Llama of a
few layers, hidden 64, and a word-level tokenizer with a chat template, saved as an HF folder."""

from __future__ import annotations

from pathlib import Path

import torch


def tiny_llama(seed: int = 0, vocab: int = 96, layers: int = 2, hidden: int = 64, scale: float = 1.0,
               device: torch.device = torch.device("cpu")):
    """A random Llama (seed ``seed``); ``scale`` sharpens its logits (more repetitive, more predictable text)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    m = LlamaForCausalLM(cfg).eval()
    if scale != 1.0:
        with torch.no_grad():
            m.lm_head.weight.mul_(scale)
    m.generation_config.eos_token_id = None  # no EOS unless a caller sets one
    return m.to(device)


def save_tiny_hf(folder: Path, seed: int = 0, words: int = 93, shift: int = 0, layers: int = 2) -> Path:
    """A tiny Llama (``layers`` decoder layers, logits sharpened 4x) + word-level tokenizer (words
    ``w<shift>``.., with a chat template) saved as an HF folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for i in range(words):
        vocab[f"w{i + shift}"] = i + 3
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                         "{% if add_generation_prompt %}assistant {% endif %}")
    model = tiny_llama(seed=seed, vocab=len(vocab), layers=layers, scale=4.0)
    model.generation_config.eos_token_id = 2
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder
