"""Key names users bring from other tools (HF TrainingArguments and Trainer scripts, PyTorch
loops, Lightning, nanoGPT, Megatron, Axolotl) and the unmask key each one means.

Used only to word the error for an unknown key (`optim.lr` -> "did you mean
'optim.learning_rate'?"): a foreign name is never accepted in place of unmask's. A name is
matched wherever it appears (a key of any section, or a section of its own), since users
also put it in the wrong section (`train.lr`).
"""

_NAMES_OF: dict[str, str] = {
    # unmask key: the names other tools give it, space-separated
    "optim.learning_rate": "lr base_lr peak_lr max_lr",
    "optim.weight_decay": "wd weight_decay_rate",
    "optim.adam_beta1": "beta1 adam_b1",
    "optim.adam_beta2": "beta2 adam_b2",
    "optim.adam_epsilon": "eps epsilon adam_eps",
    "optim.max_grad_norm": "grad_clip clip_grad clip_grad_norm max_norm gradient_clipping "
    "gradient_clip_val",
    "optim.lr_scheduler_type": "scheduler lr_scheduler lr_schedule lr_decay_style",
    "optim.warmup_steps": "warmup num_warmup_steps warmup_iters lr_warmup_steps",
    "optim.name": "optimizer optim optimizer_type",
    "train.num_train_epochs": "epochs num_epochs max_epochs n_epochs train_epochs",
    "train.max_steps": "steps num_steps total_steps max_iters train_steps train_iters "
    "num_training_steps max_train_steps",
    "train.per_device_train_batch_size": "batch_size train_batch_size micro_batch_size "
    "per_device_batch_size micro_batch_size_per_gpu train_micro_batch_size_per_gpu",
    "train.per_device_eval_batch_size": "eval_batch_size",
    "train.gradient_accumulation_steps": "grad_accum grad_accum_steps gradient_accumulation "
    "accumulate_grad_batches accum_steps gradient_accumulation_iters",
    "train.logging_steps": "log_every log_interval logging_interval log_steps",
    "train.eval_steps": "eval_every eval_interval evaluation_steps",
    "train.eval_max_batches": "eval_iters",
    "train.save_steps": "save_every save_interval checkpoint_every checkpointing_steps "
    "ckpt_interval",
    "train.output_dir": "out_dir output save_dir checkpoint_dir ckpt_dir",
    "train.resume_from_checkpoint": "resume resume_from",
    "train.seed": "random_seed manual_seed",
    "train.dataloader_num_workers": "num_workers dataloader_workers",
    "train.torch_compile": "compile use_compile",
    "train.bf16": "mixed_precision use_bf16",
    "train.report_to": "log_with logger wandb",
    "data.packing_length": "max_seq_length max_seq_len seq_len seq_length max_length "
    "sequence_length context_length cutoff_len",
    "data.dataset": "dataset_name dataset_path data_path train_file train_data",
    "data.eval_dataset": "validation_file eval_file eval_data val_data",
    "data.tokenizer": "tokenizer_name tokenizer_name_or_path tokenizer_path",
    "model.pretrained": "model_name_or_path pretrained_model_name_or_path model_name "
    "model_path base_model",
    "model.num_hidden_layers": "n_layer n_layers num_layers",
    "model.hidden_size": "n_embd d_model hidden_dim dim",
    "model.num_attention_heads": "n_head n_heads num_heads",
    "model.num_key_value_heads": "n_kv_heads num_kv_heads n_kv_head",
    "model.intermediate_size": "ffn_dim ffn_hidden_size intermediate_dim",
}

FOREIGN_KEYS: dict[str, str] = {
    name: key for key, names in _NAMES_OF.items() for name in names.split()
}
"""A foreign key name -> the unmask key ('section.key') it means."""
