"""A tiny random Llama-architecture model folder with a byte-level tokenizer and a chat
template, built offline in about a second: what most fine-tuning tests train.

    python tests/hf/tiny.py OUT_DIR          (also used by the benchmarks)
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

# SmolLM2's template, shortened: no default system prompt
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for b in sorted(pre_tokenizers.ByteLevel.alphabet()):  # a set: its order changes with each process
        vocab.setdefault(b, len(vocab))
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token="<|im_start|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_model(out: str | Path, layers: int = 2, hidden: int = 64, seed: int = 0, tie: bool = True) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out)
    tok = tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=tie,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    return out


def make_chat_data(path: str | Path, n: int = 64, seed: int = 0, fmt: str = "chat") -> Path:
    """Records of a learnable mapping: the answer is the question's word, reversed."""
    rng = random.Random(seed)
    letters = "abcdefghij"
    with open(path, "w") as fh:
        for _ in range(n):
            word = "".join(rng.choice(letters) for _ in range(rng.randint(3, 8)))
            if fmt == "chat":
                rec = {"messages": [{"role": "system", "content": "Reverse it."}, {"role": "user", "content": word},
                                    {"role": "assistant", "content": word[::-1]}]}
            else:
                rec = {"prompt": word, "completion": word[::-1]}
            fh.write(json.dumps(rec) + "\n")
    return Path(path)


if __name__ == "__main__":
    print(make_model(sys.argv[1]))
