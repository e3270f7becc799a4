"""A plain Hugging Face Trainer LoRA fine-tuning script, run by configs/hf_trainer.yaml.

Nothing here is orchestrate's: run as `kind: script` (or `kind: command`), every Trainer
gets orchestrate's callback from the bootstrap the node agent starts the rank with
(`model.instrument`, on by default). The same script runs under plain `torchrun` too.
`--callback` adds the callback by hand instead (`from train_entry.integrations.hf_trainer
import OrchestrateCallback`: the Trainer then gets it once); `--deepspeed` takes the
DeepSpeed config orchestrate rendered from the spec.

    python configs/hf_trainer_train.py --model MODEL_FOLDER --data train.jsonl [--callback] [--deepspeed]
        [--load-best min|max] [--final FOLDER]
"""

import argparse
import json
import os

import peft
import torch
import transformers

p = argparse.ArgumentParser()
p.add_argument("--model", default="~/.cache/orchestrate/models/SmolLM2-135M-Instruct")
p.add_argument("--data", default="~/.cache/orchestrate/data/orders/train.jsonl", help="JSONL chat records ('messages')")
p.add_argument("--out", default=None, help="the Trainer's output_dir (default: trainer/ in the task folder)")
p.add_argument("--steps", type=int, default=60)
p.add_argument("--save-steps", type=int, default=20)
p.add_argument("--eval-steps", type=int, default=20)
p.add_argument("--eval-records", type=int, default=8)
p.add_argument("--max-length", type=int, default=128)
p.add_argument("--batch", type=int, default=2)
p.add_argument("--lr", type=float, default=2e-3)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--deepspeed", action="store_true", help="the DeepSpeed config orchestrate rendered (engine: deepspeed)")
p.add_argument("--callback", action="store_true", help="add OrchestrateCallback by hand")
p.add_argument("--load-best", choices=["min", "max"], default=None,
               help="load_best_model_at_end by eval_loss, the lowest (min) or, to try it, the highest (max)")
p.add_argument("--final", default=None, help="save the model the Trainer ends with into this folder")
a = p.parse_args()
if a.callback or a.deepspeed:
    from train_entry.integrations.hf_trainer import OrchestrateCallback, deepspeed_config
out = a.out or os.path.join(os.environ.get("ORCHESTRATE_TASK_DIR", "."), "trainer")

model_dir = os.path.expanduser(a.model)
tok = transformers.AutoTokenizer.from_pretrained(model_dir)
with open(os.path.expanduser(a.data)) as fh:
    records = [json.loads(line) for line in fh if line.strip()]


def encode(rec):
    """The whole conversation, padded to max_length; the loss on every real token."""
    ids = tok.apply_chat_template(rec["messages"], tokenize=True, return_dict=True)["input_ids"][: a.max_length]
    pad = a.max_length - len(ids)
    return {"input_ids": torch.tensor(ids + [tok.pad_token_id] * pad),
            "attention_mask": torch.tensor([1] * len(ids) + [0] * pad),
            "labels": torch.tensor(ids + [-100] * pad)}


train = [encode(r) for r in records[: -a.eval_records]]
held_out = [encode(r) for r in records[-a.eval_records:]]

cpu = not torch.cuda.is_available()
args = transformers.TrainingArguments(
    output_dir=out, max_steps=a.steps, per_device_train_batch_size=a.batch, per_device_eval_batch_size=a.batch,
    learning_rate=a.lr, lr_scheduler_type="cosine", warmup_steps=2, seed=a.seed,
    logging_steps=1, save_strategy="steps", save_steps=a.save_steps, eval_strategy="steps", eval_steps=a.eval_steps,
    use_cpu=cpu, ddp_backend="gloo" if cpu else None, ddp_find_unused_parameters=False,
    report_to=[], disable_tqdm=True, dataloader_num_workers=0,
    deepspeed=deepspeed_config() if a.deepspeed else None,
    load_best_model_at_end=a.load_best is not None, metric_for_best_model="eval_loss" if a.load_best else None,
    greater_is_better=(a.load_best == "max") if a.load_best else None,
)
model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
model.config.use_cache = False
transformers.set_seed(a.seed)  # before get_peft_model: the Trainer seeds only after the adapters exist
model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, task_type="CAUSAL_LM",
                                                    target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))

trainer = transformers.Trainer(model=model, args=args, train_dataset=train, eval_dataset=held_out,
                               callbacks=[OrchestrateCallback()] if a.callback else None)
trainer.train()
if a.final:
    trainer.save_model(os.path.expanduser(a.final))
