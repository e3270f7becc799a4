"""A chat task a pretrained model gets wrong and a short LoRA fine-tune fixes, so that
"it learned" is a number: filing a customer's order message as a ticket line in a house
format, ``ORDER-<number> / <Customer Name> / <item>``.

The training records use some phrasings; the held-out prompts use other phrasings with
new names, numbers and items, so the score is of the format learned, not of memorised
answers. Nothing is downloaded: the records are generated from a seed.

    python -m train_entry.examples.chat_task write DIR          # DIR/train.jsonl, DIR/heldout.jsonl
    python -m train_entry.examples.chat_task score MODEL [--adapter ADAPTER] [--data DIR/heldout.jsonl]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

SYSTEM = "You file customer orders as ticket lines."
FIRST = ["Alice", "Bruno", "Chiara", "Dmitri", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kemal", "Lucia",
         "Marta", "Nils", "Olga", "Pavel", "Quinn", "Rosa", "Sven", "Tomas", "Uma", "Viktor", "Wanda", "Yusuf"]
LAST = ["Smith", "Rossi", "Novak", "Garcia", "Weber", "Tanaka", "Silva", "Kowalski", "Dubois", "Jensen", "Moreau",
        "Costa", "Fischer", "Larsen", "Petrov", "Okafor"]
ITEMS = ["desk lamp", "blue kettle", "garden hose", "wool scarf", "chess set", "road bike", "coffee grinder",
         "rain jacket", "table fan", "yoga mat", "toaster", "backpack", "wall clock", "bookshelf", "teapot", "drill"]
# phrasings seen in training, and others kept for the held-out prompts
TRAIN_PHRASES = [
    "Hi, this is {name}. I'd like to order a {item}. My order number is {num}.",
    "Order {num}: {name} wants a {item}.",
    "{name} here, ordering one {item} (order no. {num}).",
    "Please file this: customer {name}, item {item}, number {num}.",
    "New order {num} from {name} for a {item}.",
    "Can you log my order? I'm {name}, order {num}, a {item} please.",
]
HELDOUT_PHRASES = [
    "Good morning! {name} would like to buy a {item}; reference {num}.",
    "File order number {num}, placed by {name}: one {item}.",
    "I am {name} and I ordered a {item} with order id {num}.",
]
HELDOUT_FIRST, HELDOUT_LAST = ["Zoe", "Xavier", "Noor", "Iker"], ["Lindqvist", "Haddad", "Bauer", "Moretti"]


def answer(num: int, name: str, item: str) -> str:
    return f"ORDER-{num} / {name} / {item}"


def records(n: int, seed: int, heldout: bool) -> list[dict]:
    rng = random.Random(seed)
    phrases = HELDOUT_PHRASES if heldout else TRAIN_PHRASES
    first, last = (FIRST + HELDOUT_FIRST, LAST + HELDOUT_LAST) if heldout else (FIRST, LAST)
    out = []
    for _ in range(n):
        name, item, num = f"{rng.choice(first)} {rng.choice(last)}", rng.choice(ITEMS), rng.randint(1000, 9999)
        out.append({"messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": rng.choice(phrases).format(name=name, item=item, num=num)},
            {"role": "assistant", "content": answer(num, name, item)},
        ]})
    return out


def write(folder: str | Path, n_train: int = 400, n_heldout: int = 40, seed: int = 0) -> tuple[Path, Path]:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = folder / "train.jsonl", folder / "heldout.jsonl"
    for path, recs in zip(paths, (records(n_train, seed, False), records(n_heldout, seed + 1, True))):
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in recs))
        tmp.replace(path)
    return paths


def answers(model, tokenizer, prompts: list[list[dict]], max_new_tokens: int = 32, batch: int = 8) -> list[str]:
    """Greedy answers to chats (``checkpoint_eval.generate.answers``: batched, padded on the left)."""
    from train_entry.checkpoint_eval import Prompt
    from train_entry.checkpoint_eval.generate import answers as generated

    return generated(model, tokenizer, [Prompt(tuple(m), None, "") for m in prompts], max_new_tokens, batch)


def read(data: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(data).read_text().splitlines() if line.strip()]


def score(model, tokenizer, data: str | Path) -> tuple[float, list[str]]:
    """Exact-match accuracy on the held-out records, and the answers given."""
    recs = read(data)
    prompts, expected = [r["messages"][:-1] for r in recs], [r["messages"][-1]["content"] for r in recs]
    # a few tokens past the longest right answer: enough to tell it from a longer wrong one
    longest = max(len(tokenizer(e, add_special_tokens=False)["input_ids"]) for e in expected)
    got = answers(model, tokenizer, prompts, max_new_tokens=longest + 4)
    right = sum(g == e for g, e in zip(got, expected))
    return right / len(recs), got


def load(model_dir: str, adapter: str | None = None):
    from train_entry.hf import quiet

    quiet.drop_bitsandbytes_kernel_warning()  # peft imports bitsandbytes; nothing here is 4-bit
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.logging.disable_progress_bar()  # a bar for a load of a second
    tok = AutoTokenizer.from_pretrained(adapter or model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    if adapter:
        from peft import PeftModel

        with quiet.peft_deprecation_off():
            model = PeftModel.from_pretrained(model, adapter)
    return model, tok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m train_entry.examples.chat_task", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write", help="write train.jsonl and heldout.jsonl into a folder")
    w.add_argument("folder")
    w.add_argument("--train", type=int, default=400)
    w.add_argument("--heldout", type=int, default=40)
    w.add_argument("--seed", type=int, default=0)
    s = sub.add_parser("score", help="exact-match accuracy of a model folder on the held-out prompts")
    s.add_argument("model")
    s.add_argument("--adapter", default=None, help="a PEFT adapter folder to put on the model")
    s.add_argument("--data", required=True, help="heldout.jsonl")
    s.add_argument("--show", type=int, default=3, help="print this many answers")
    args = ap.parse_args(argv)
    if args.cmd == "write":
        for p in write(args.folder, args.train, args.heldout, args.seed):
            print(p)
        return 0
    model, tok = load(args.model, args.adapter)
    acc, got = score(model, tok, args.data)
    for g in got[: args.show]:
        print(f"  {g!r}")
    print(json.dumps({"exact_match": acc, "n": len(got)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
