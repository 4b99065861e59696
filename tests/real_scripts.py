"""The scripts users run, shaped as theirs: transformers' ``examples/pytorch/language-modeling/run_clm.py``,
accelerate's ``examples/complete_nlp_example.py`` and TRL's trainer quickstarts, their calls in their order, each
with tpflow's documented lines only (``tpf.parallelize`` after the model is built, ``fully_shard`` over the data axis
on a 2 x 2 placement, ``tpf.adopt`` after the trainer or accelerator) where ``layout`` is given, and as one plain
process where it is None.

What they download is made here instead: a word-level tokenizer and its texts (``tests.models``), the model from a
tiny config (random weights, fp64), and the accuracy that ``evaluate.load("accuracy")`` would compute. Each returns
what a test compares with one process: the numbers the script logs, the trained parameters, and the files it wrote.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import math
import os
from itertools import chain

import numpy as np
import torch
import torch.distributed as dist

import tpflow as tpf

LAYOUTS = {"1d": None, "2x2": ("dp", "tp")}  # a layout's axis names: 1-D tensor parallel, or 2 x 2 data x tensor


def texts(n: int, seed: int = 0) -> list[str]:
    """``n`` lines of words ``w0``..``w89`` of 3 to 11 words each (the corpus the scripts read)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 12, (n,), generator=g).tolist()
    return [" ".join(f"w{j}" for j in torch.randint(0, 90, (k,), generator=g).tolist()) for k in lengths]


def split(model, layout: str | None, plan="auto"):
    """The documented lines: ``tpf.parallelize`` over every rank (1-D), or over a named 2 x 2 placement with FSDP2
    over its data axis; ``layout`` None leaves the model as it is (one plain process)."""
    if layout is None:
        return model
    world = dist.get_world_size()
    if layout == "1d":
        return tpf.parallelize(model, placement=tpf.placement("cpu", list(range(world))), plan=plan)
    from torch.distributed.fsdp import fully_shard

    placement = tpf.placement("cpu", [[0, 1], [2, 3]], names=LAYOUTS[layout])
    tpf.parallelize(model, placement=placement, plan=plan)
    inner = model.base_model.model if hasattr(model, "peft_config") else model
    for layer in inner.model.layers:
        fully_shard(layer, mesh=placement.mesh["dp"])
    fully_shard(model, mesh=placement.mesh["dp"])
    return model


def whole(model) -> dict[str, torch.Tensor]:
    """Every parameter's whole value (a global one gathered: every rank calls it)."""
    return {n.removeprefix("_forward_module."): (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}


def held(model) -> float:
    """The share of the model's parameter values this rank holds (1 for a model left whole)."""
    params = list(model.parameters())
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in params)
    return local / sum(p.numel() for p in params)


def digests(folder: str) -> dict[str, str]:
    """Every file under ``folder`` (relative path -> sha256), subfolders included."""
    found = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
    return found


def accuracy(predictions: np.ndarray, references: np.ndarray) -> dict[str, float]:
    """What ``evaluate.load("accuracy").compute`` gives."""
    return {"accuracy": float((predictions == references).mean())}


def run_clm(argv: list[str], layout: str | None = None, lora: bool = False) -> dict:
    """run_clm.py's ``main()`` (from_config, the texts as its dataset), its calls in its order; ``lora``: PEFT's
    LoRA on the model before the documented lines (the user's own lines). Returns its log history, its final
    metrics, the trained parameters and what its output folder held before and after the final ``save_model()``."""
    import datasets
    import transformers
    from transformers import HfArgumentParser, Trainer, TrainingArguments, default_data_collator, set_seed

    from tests.models import tiny_lm, tiny_tokenizer

    parser = HfArgumentParser((TrainingArguments,))
    (training_args,) = parser.parse_args_into_dataclasses(args=argv)
    if training_args.should_log:
        transformers.utils.logging.set_verbosity_info()
    log_level = training_args.get_process_log_level()
    datasets.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.set_verbosity(log_level)
    set_seed(training_args.seed)
    raw_datasets = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": texts(48)}),
                                         "validation": datasets.Dataset.from_dict({"text": texts(30, seed=1)})})
    tokenizer = tiny_tokenizer()
    model = tiny_lm("llama")
    if lora:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8,
                                                           target_modules=["q_proj", "v_proj", "down_proj"]))
    model = split(model, layout)  # the documented line
    embedding_size = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > embedding_size:
        model.resize_token_embeddings(len(tokenizer))
    column_names = list(raw_datasets["train"].features)
    text_column_name = "text" if "text" in column_names else column_names[0]

    def tokenize_function(examples):
        return tokenizer(examples[text_column_name])

    with training_args.main_process_first(desc="dataset map tokenization"):
        tokenized_datasets = raw_datasets.map(tokenize_function, batched=True, remove_columns=column_names)
    block_size = 8

    def group_texts(examples):
        concatenated_examples = {k: list(chain(*examples[k])) for k in examples}
        total_length = len(concatenated_examples[next(iter(examples.keys()))])
        total_length = (total_length // block_size) * block_size
        result = {k: [t[i: i + block_size] for i in range(0, total_length, block_size)]
                  for k, t in concatenated_examples.items()}
        result["labels"] = result["input_ids"].copy()
        return result

    with training_args.main_process_first(desc="grouping texts together"):
        lm_datasets = tokenized_datasets.map(group_texts, batched=True)
    train_dataset, eval_dataset = lm_datasets["train"], lm_datasets["validation"].select(range(16))

    def preprocess_logits_for_metrics(logits, labels):
        if isinstance(logits, tuple):
            logits = logits[0]
        return logits.argmax(dim=-1)

    def compute_metrics(eval_preds):
        preds, labels = eval_preds
        labels = labels[:, 1:].reshape(-1)
        preds = preds[:, :-1].reshape(-1)
        return accuracy(predictions=preds, references=labels)

    trainer = Trainer(model=model, args=training_args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                      processing_class=tokenizer, data_collator=default_data_collator, compute_metrics=compute_metrics,
                      preprocess_logits_for_metrics=preprocess_logits_for_metrics)
    if layout is not None:
        tpf.adopt(trainer)  # the documented line
    output = {}
    with contextlib.redirect_stdout(io.StringIO()):
        train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        output["before_save"] = digests(training_args.output_dir)
        trainer.save_model()  # saves the tokenizer too for easy upload
        metrics = train_result.metrics
        metrics["train_samples"] = len(train_dataset)
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()
        metrics = trainer.evaluate()
        metrics["eval_samples"] = len(eval_dataset)
        metrics["perplexity"] = math.exp(metrics["eval_loss"])
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
        trainer.create_model_card(finetuned_from=None, tasks="text-generation")
    output.update(history=[{k: v for k, v in h.items() if not k.endswith(("runtime", "per_second"))}
                           for h in trainer.state.log_history],
                  eval={k: v for k, v in metrics.items() if not k.endswith(("runtime", "per_second"))},
                  params=whole(model), held=held(model), after_save=digests(training_args.output_dir))
    return output


def complete_nlp_example(output_dir: str, layout: str | None = None, resume_from_checkpoint: str | None = None,
                         checkpointing_steps: int = 4, num_epochs: int = 2, batch_size: int = 4) -> dict:
    """accelerate's complete_nlp_example.py (``training_function``) on a causal LM: the texts in blocks of 8 tokens as
    its dataset, ``evaluate``'s accuracy over the predicted next tokens, its calls in its order (a scheduler prepared
    with the rest, ``save_state`` every ``checkpointing_steps`` steps, ``load_state`` and ``skip_first_batches`` on a
    resume, ``gather_for_metrics`` of the argmax). Returns each step's loss and learning rate, each epoch's accuracy,
    the trained parameters and the files of ``output_dir``."""
    import datasets
    from accelerate import Accelerator
    from torch.utils.data import DataLoader
    from transformers import get_linear_schedule_with_warmup, set_seed

    from tests.models import tiny_lm, tiny_tokenizer

    accelerator = Accelerator(cpu=True, mixed_precision="no")
    lr, seed = 1e-2, 42
    tokenizer = tiny_tokenizer()
    raw = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": texts(36)}),
                                "validation": datasets.Dataset.from_dict({"text": texts(12, seed=1)})})

    def tokenize_function(examples):
        ids = tokenizer(examples["text"])["input_ids"]
        blocks = [row[:8] for row in ids if len(row) >= 8]
        return {"input_ids": blocks, "attention_mask": [[1] * 8 for _ in blocks], "labels": blocks}

    with accelerator.main_process_first():
        tokenized_datasets = raw.map(tokenize_function, batched=True, remove_columns=["text"])
    gradient_accumulation_steps = 1

    def collate_fn(examples):
        return tokenizer.pad(examples, padding="longest", return_tensors="pt")

    train_dataloader = DataLoader(tokenized_datasets["train"], shuffle=True, collate_fn=collate_fn,
                                  batch_size=batch_size)
    eval_dataloader = DataLoader(tokenized_datasets["validation"], shuffle=False, collate_fn=collate_fn, batch_size=4)
    set_seed(seed)
    model = tiny_lm("llama")
    model = model.to(accelerator.device)
    if layout is not None:  # the documented lines
        model = split(model, layout, plan="auto")
        tpf.adopt(accelerator, model)
    optimizer = torch.optim.AdamW(params=model.parameters(), lr=lr, eps=1e-4)
    lr_scheduler = get_linear_schedule_with_warmup(
        optimizer=optimizer, num_warmup_steps=3,
        num_training_steps=(len(train_dataloader) * num_epochs) // gradient_accumulation_steps)
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)
    overall_step, starting_epoch, resume_step = 0, 0, None
    if resume_from_checkpoint:
        accelerator.load_state(resume_from_checkpoint)
        training_difference = os.path.splitext(os.path.basename(resume_from_checkpoint))[0]
        resume_step = int(training_difference.replace("step_", ""))
        starting_epoch = resume_step // len(train_dataloader)
        resume_step -= starting_epoch * len(train_dataloader)
    losses, rates, evals = [], [], []
    for epoch in range(starting_epoch, num_epochs):
        model.train()
        if resume_from_checkpoint and epoch == starting_epoch and resume_step is not None:
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
            overall_step += resume_step
        else:
            active_dataloader = train_dataloader
        for step, batch in enumerate(active_dataloader):
            batch.to(accelerator.device)
            outputs = model(**batch)
            loss = outputs.loss
            loss = loss / gradient_accumulation_steps
            accelerator.backward(loss)
            if step % gradient_accumulation_steps == 0:
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            overall_step += 1
            losses.append(loss.item())
            rates.append(lr_scheduler.get_last_lr()[0])
            if overall_step % checkpointing_steps == 0:
                accelerator.save_state(os.path.join(output_dir, f"step_{overall_step}"))
        model.eval()
        predicted, expected = [], []
        for batch in eval_dataloader:
            batch.to(accelerator.device)
            with torch.no_grad():
                outputs = model(**batch)
            predictions = outputs.logits.argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
            predicted.append(predictions[:, :-1].reshape(-1).numpy())
            expected.append(references[:, 1:].reshape(-1).numpy())
        eval_metric = accuracy(np.concatenate(predicted), np.concatenate(expected))
        with contextlib.redirect_stdout(io.StringIO()):
            accelerator.print(f"epoch {epoch}:", eval_metric)
        evals.append(eval_metric["accuracy"])
    accelerator.end_training()
    return {"losses": losses, "rates": rates, "evals": evals, "params": whole(accelerator.unwrap_model(model)),
            "held": held(model), "files": digests(output_dir)}


def saved_model(folder: str, reward: bool = False) -> str:
    """The tiny model and its tokenizer saved as a hub checkpoint is (what TRL's quickstarts name by id; TRL builds
    its reference model from that path). Returns the folder."""
    import transformers

    from tests.models import tiny_lm, tiny_tokenizer

    model = tiny_lm("llama")
    if reward:
        model.config.num_labels, model.config.pad_token_id = 1, 0
        torch.manual_seed(0)
        model = transformers.AutoModelForSequenceClassification.from_config(model.config).double()
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def _prompts(n: int) -> list[str]:
    return [" ".join(t.split()[:3]) for t in texts(n, seed=2)]


def reward_unique_words(completions, **kwargs) -> list[float]:
    """TRL's quickstart reward (``len(set(completion))``), over words: a tiny tokenizer's completions are words."""
    return [float(len(set(c.split()))) for c in completions]


def trl_trainer(kind: str, model_path: str, output_dir: str, layout: str | None = None, batch: int = 4,
                **config) -> dict:
    """A TRL quickstart: the model from its folder, the config, the trainer, ``train()``; ``kind`` is ``"grpo"``,
    ``"dpo"``, ``"reward"`` or ``"sft"``. The config is TRL's defaults (``bf16=True``: autocast, which leaves the
    fp64 model fp64) but the run's length, logging, the lr and ``config``. Returns its log history and the trained
    parameters."""
    import datasets
    import transformers
    import trl

    model_class = transformers.AutoModelForSequenceClassification if kind == "reward" else \
        transformers.AutoModelForCausalLM
    model = model_class.from_pretrained(model_path, dtype=torch.float64)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
    model = split(model, layout)  # the documented line (before the config: TRL's GRPO counts processes there)
    prompts = _prompts(16)
    words = texts(32, seed=3)
    common = {"output_dir": output_dir, "max_steps": 2, "logging_steps": 1, "learning_rate": 1e-3,
              "per_device_train_batch_size": batch, "save_strategy": "no", "report_to": [], "use_cpu": True,
              "seed": 0, "disable_tqdm": True, **config}
    if kind == "grpo":
        args = trl.GRPOConfig(max_completion_length=6, **common)
        trainer = trl.GRPOTrainer(model=model, reward_funcs=reward_unique_words, args=args, processing_class=tokenizer,
                                  train_dataset=datasets.Dataset.from_dict({"prompt": prompts}))
    elif kind == "dpo":
        data = {"prompt": prompts, "chosen": words[:16], "rejected": words[16:]}
        trainer = trl.DPOTrainer(model=model, args=trl.DPOConfig(**common), processing_class=tokenizer,
                                 train_dataset=datasets.Dataset.from_dict(data))
    elif kind == "reward":
        data = {"chosen": [f"{p} {w}" for p, w in zip(prompts, words)],
                "rejected": [f"{p} {w}" for p, w in zip(prompts, words[16:])]}
        trainer = trl.RewardTrainer(model=model, args=trl.RewardConfig(**common), processing_class=tokenizer,
                                    train_dataset=datasets.Dataset.from_dict(data))
    else:
        trainer = trl.SFTTrainer(model=model, args=trl.SFTConfig(max_length=16, **common), processing_class=tokenizer,
                                 train_dataset=datasets.Dataset.from_dict({"text": words}))
    if layout is not None:
        tpf.adopt(trainer)  # the documented line
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    reference = getattr(trainer, "ref_model", None)  # GRPO's with beta > 0, DPO's: TRL builds it whole
    return {"history": [{k: v for k, v in h.items() if not k.endswith(("runtime", "per_second", "total_flos"))}
                        for h in trainer.state.log_history], "params": whole(model), "held": held(model),
            "held_reference": None if reference is None else held(reference)}
