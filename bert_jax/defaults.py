"""The shared defaults of every config file: each key defined and commented once, here.

Config files (the shipped ones in configs/ and a user's own, anywhere on disk) start from these
and override; they import only the installed package, so any of them loads the same way:

  from bert_jax import defaults

  def get_config():
    config = defaults.pretrain()      # or defaults.finetune('mrpc')
    config.train.steps = 1000
    return config

  bert-jax pretrain --config=/path/to/my_config.py --workdir=/tmp/run

Both return a locked ConfigDict: setting a key they lack (`config.train.stepz = 4`) is an
error, as on the command line; a config's own new keys go inside `with config.unlocked():`.
"""

from typing import Any

import ml_collections

from bert_jax.errors import UserError


def _adamw_terms(train: ml_collections.ConfigDict) -> None:
  """The paper's AdamW terms, the same for pre-training and fine-tuning."""
  train.beta1 = 0.9
  train.beta2 = 0.999
  train.eps = 1e-6
  # Decoupled weight decay; never on biases and LayerNorm (optim.py).
  train.weight_decay = 0.01
  # Clipping of the global gradient norm.
  train.max_grad_norm = 1.0


def _mesh() -> ml_collections.ConfigDict:
  """The `mesh` block, the same for pre-training and fine-tuning."""
  mesh = ml_collections.ConfigDict()
  # Device mesh axis sizes; -1 means "all remaining devices".
  mesh.data = -1
  mesh.fsdp = 1
  mesh.tensor = 1
  # Logical axis -> mesh axes. Parameters: vocab, embed, mlp, heads, kv, layers.
  # Activations: batch, length, act_embed, act_mlp, act_heads, act_vocab.
  mesh.rules = (
      ('batch', ('data', 'fsdp')),
      ('vocab', 'tensor'),
      ('embed', 'fsdp'),
      ('mlp', 'tensor'),
      ('heads', 'tensor'),
      ('kv', None),
      ('layers', None),
      ('length', None),
      ('act_embed', None),
      ('act_mlp', 'tensor'),
      ('act_heads', 'tensor'),
      ('act_vocab', 'tensor'),
  )
  return mesh


def _model(from_scratch: bool) -> ml_collections.ConfigDict:
  """The `model` block (model.config_from decodes it). Pre-training from scratch also says what
  the model is; fine-tuning takes that from its checkpoint, so its block lacks those keys."""
  model = ml_collections.ConfigDict()
  if from_scratch:
    # Named size: tiny, mini, small, medium, base, large or L{2..12}_H{128,256,512,768}.
    model.size = 'base'
    # Vocabulary size; 0 = take it from the vocabulary file (data.vocab_file).
    model.vocab_size = 0
    # The learned position table's size: the longest row (with rotary embeddings, only what
    # the model is trained for: no ceiling).
    model.max_position_embeddings = 512
    # Token types (segments A and B); 0 = none (ModernBERT: [SEP] alone separates a pair).
    model.type_vocab_size = 2
    # Feed-forward width; 0 = 4 x hidden (the paper's). A gated MLP has two input matrices: 8/3
    # x hidden keeps the paper's parameter count.
    model.intermediate_size = 0
    # The architecture after the paper (README "Modern recipe"); the defaults are the paper's.
    # Positions: 'absolute' (a learned table) or 'rotary' (RoFormer; ModernBERT), whose bases
    # are rope_theta in global layers and local_rope_theta in local ones (ModernBERT: 160,000
    # and 10,000).
    model.position_embedding_type = 'absolute'
    model.rope_theta = 10_000.0
    model.local_rope_theta = 10_000.0
    # Feed-forward: 'dense' (GELU), 'geglu' or 'swiglu' (gated: act(x W) * (x V); Shazeer 2020,
    # MosaicBERT and ModernBERT use GeGLU).
    model.mlp = 'dense'
    # LayerNorm before each sub-layer and after the last (ModernBERT) instead of after each.
    model.pre_layer_norm = False
    # False: no bias in the encoder's linear layers, LayerNorms and MLM transform (ModernBERT;
    # Cramming). The task heads, pooler and the MLM output bias keep theirs.
    model.use_bias = True
    # Local attention: keys at most W / 2 tokens from the query, W even; 0 = every layer global.
    # Layers 0, N, 2N, ... (N = global_attention_every; 0 = none) stay global (ModernBERT: 128
    # and 3).
    model.local_attention_window = 0
    model.global_attention_every = 3
  model.hidden_dropout_prob = 0.1
  model.attention_probs_dropout_prob = 0.1
  # Compute dtype: 'bfloat16' on accelerators, 'float32' on CPU ('auto' picks by backend).
  # Parameters stay float32.
  model.dtype = 'auto'
  # Stack the encoder layers with nn.scan: faster compiles (23 s instead of 54 s for BERT-base
  # on an H100), but a slower step: 108 ms instead of 72 ms for BERT-base at 256 x 128 on an
  # H100 (the loop's copies; README "Performance"), so layers are unrolled by default.
  model.scan_layers = False
  # Rematerialization: 'none', 'full' or 'dots' (save matmul outputs, recompute the rest; long
  # sequences on small accelerators).
  model.remat_policy = 'none'
  # Attention kernel: 'xla' (any backend; the only one with attention dropout), 'cudnn' (fused,
  # NVIDIA GPUs) or 'splash' (Pallas, TPUs; sequence lengths multiples of 128). The fused ones
  # apply no attention dropout: they need model.attention_probs_dropout_prob=0 (README,
  # "Attention").
  model.attention_impl = 'xla'
  # Each encoder sub-layer's end, LayerNorm(x + dropout(projection + bias)): 'pallas' (one
  # fused Pallas kernel each way, NVIDIA GPUs), 'xla' (plain jnp, any backend) or 'auto'
  # (pallas on GPUs, xla elsewhere). Same float32 numerics (README, "LayerNorm").
  model.layer_norm_impl = 'xla'
  # Bias + exact GELU of the MLP and the MLM transform: 'pallas' (one Pallas kernel each way at
  # the memory floor, the bias gradient's partial sums in the backward's), 'xla' (jnp's erf,
  # any backend) or 'auto' (pallas on GPUs, xla elsewhere); within 7e-7 of the exact GELU
  # both (README, "LayerNorm and dropout").
  model.gelu_impl = 'xla'
  # Q, K and V: 'stacked' (one matmul against the three kernels; the attention reads q, k, v
  # sliced out of its output) or 'separate' (three matmuls, each output read in place). The
  # parameters and checkpoints are the same either way (README, "Attention").
  model.qkv_projection = 'stacked'
  # The encoder's dense matmuls (QKV, attention output, the two MLP projections) in training
  # steps: 'default' (in model.dtype) or 'fp8' (FP8 with delayed scaling, for Hopper GPUs and
  # later; elsewhere emulated, slowly). The embeddings, heads, evaluation and prediction stay in
  # model.dtype. FP8's scales and amax histories are checkpointed, never exported (README,
  # "FP8").
  model.matmul_precision = 'default'
  return model


def pretrain() -> ml_collections.ConfigDict:
  """Every pre-training key, commented, with BERT-base's values (the paper's recipe)."""
  config = ml_collections.ConfigDict()
  # Which job the config is for ('pretrain' or 'finetune'): `bert-jax pretrain` and `finetune`
  # refuse the other's, and a run's config.json says which run it was.
  config.kind = 'pretrain'

  # ---- Model -----------------------------------------------------------------------------
  config.model = _model(from_scratch=True)

  # ---- Input -----------------------------------------------------------------------------
  config.data = ml_collections.ConfigDict()
  # Paths or globs (comma separated) of text files (one sentence a line, blank line between
  # documents, .gz allowed), TFRecords of create_pretraining_data.py ('*.tfrecord*'),
  # 'tfds:NAME[/CONFIG][:SPLIT]', Parquet files ('*.parquet', local, gs:// or
  # 'hf://datasets/ORG/NAME[@REVISION]/GLOB.parquet'), a folder written by
  # `datasets.save_to_disk`, or 'sample' for the built-in sample corpus.
  config.data.input = 'sample'
  # Held-out data for evaluation, same forms as data.input; '' = hold out part of data.input.
  config.data.eval_input = ''
  # Per-phase inputs (see train.phases), one entry per phase separated by ';' ('' entries and
  # '' = data.input / data.eval_input): TFRecords hold one sequence length, so the paper's
  # 128 -> 512 switch needs e.g. 'gs://b/seq128/*.tfrecord;gs://b/seq512/*.tfrecord'.
  config.data.phase_inputs = ''
  config.data.phase_eval_inputs = ''
  # Text feature of a TFDS dataset (for example 'text' for wikipedia).
  config.data.tfds_text_key = 'text'
  # TFDS data_dir of 'tfds:' inputs (prepared datasets; never downloaded); '' = TFDS's default.
  config.data.tfds_data_dir = ''
  # Tables (Parquet files, hf://datasets/ORG/NAME/GLOB.parquet, a folder of
  # `datasets.save_to_disk`): the column that holds each row's document text.
  config.data.text_column = 'text'
  # WordPiece vocab.txt or SentencePiece .model; '' = train.init_checkpoint's vocab.txt, or
  # without one, train one from the input (smoke runs).
  config.data.vocab_file = ''
  config.data.lower_case = True
  # Size of the vocabulary trained when data.vocab_file is empty.
  config.data.vocab_size = 8000
  config.data.max_seq_length = 128
  config.data.max_predictions_per_seq = 20
  config.data.masked_lm_prob = 0.15
  config.data.short_seq_prob = 0.1
  # Second-sentence objective: 'nsp' (BERT), 'sop' (ALBERT) or 'none' (MLM only: sentences
  # fill whole rows, across documents unless data.packing is on).
  config.data.objective = 'nsp'
  config.data.whole_word_masking = False
  # Pack several complete sequences into each row of max_seq_length (README "Packing"): each
  # keeps its own [CLS] A [SEP] B [SEP], segment ids, positions from 0, NSP/SOP label and 15%
  # masking, and attention never crosses from one to another. Off = the paper's rows, one
  # sequence each, padded; on in the speed config (lamb_large_batch.py).
  config.data.packing = False
  # Sequences per packed row at most (the width of the next_sentence_* features); a row is
  # closed rather than exceed it, so nothing is dropped. A packed row also holds at most
  # max_predictions + packing_max_sequences // 2 masked-LM predictions.
  config.data.packing_max_sequences = 16
  # Sequences packed together (first-fit decreasing over this many of the shuffled stream):
  # larger windows leave fewer part-full rows.
  config.data.packing_window = 1000
  # Document pieces (and then examples) shuffled together: up to this many pieces of at most
  # ~12 KB of text each are held.
  config.data.shuffle_buffer = 10_000
  # Documents tokenized and paired together (a longer document comes as pieces of ~8 KB of
  # text, documents.PIECE_BYTES, so this bounds a batch's text): more amortize tf.data's
  # per-op overhead and give NotNext more documents to draw from; changing it changes the
  # example stream.
  config.data.docs_per_batch = 64
  config.data.seed = 0

  # ---- Training --------------------------------------------------------------------------
  config.train = ml_collections.ConfigDict()
  config.train.steps = 1_000_000
  # Stop (with a checkpoint) at this step while the schedule still runs to train.steps, for
  # jobs with a time limit; 0 = run to train.steps.
  config.train.stop_at_step = 0
  # Global batch size in sequences, over all hosts and devices.
  config.train.batch_size = 256
  # Micro-batches accumulated per optimizer step (batch_size must divide by it).
  config.train.grad_accum_steps = 1
  config.train.optimizer = 'adamw'  # 'adamw' or 'lamb'
  config.train.learning_rate = 1e-4
  config.train.warmup_steps = 10_000
  # 'linear' decays to 0 at train.steps; 'constant' keeps the peak after warmup.
  config.train.decay = 'linear'
  _adamw_terms(config.train)
  # Phases as 'fraction:seq_len:max_predictions' separated by commas; '' = one phase at
  # data.max_seq_length. The paper: 90% of steps at 128, then 10% at 512.
  config.train.phases = '0.9:128:20,0.1:512:80'
  config.train.seed = 0
  # PRNG of dropout: 'auto' is 'rbg' (XLA's RngBitGenerator; keys still derived with threefry)
  # on one device, where it is cheaper than 'threefry2x32' (about 7% of a CPU step of
  # BERT-mini), and 'threefry2x32' on several: XLA cannot partition the RngBitGenerator, so with
  # 'rbg' every device generates the bits of the whole batch (`train_state.dropout_rng`). Both
  # give the same bits on any mesh of several devices.
  config.train.rng_impl = 'auto'
  # A checkpoint to start from when the workdir has none (resume order: latest checkpoint in
  # workdir, then this, then a fresh init): any format `bert_jax.load_pretrained` reads, or
  # hf://ORG/NAME[@REVISION] on the Hugging Face Hub.
  config.train.init_checkpoint = ''

  # ---- Mesh and sharding -----------------------------------------------------------------
  config.mesh = _mesh()

  # ---- Checkpoints, evaluation, logging ----------------------------------------------------
  config.checkpoint = ml_collections.ConfigDict()
  config.checkpoint.every_steps = 10_000
  config.checkpoint.keep = 3
  # JAX's persistent compilation cache: a rerun (a preempted run relaunched) loads its compiled
  # train and eval steps instead of compiling them again. A relative path lies inside the
  # workdir; absolute and gs:// paths are taken as given (several runs may share one);
  # '' = none. A cache set outside the config (JAX_COMPILATION_CACHE_DIR) is used instead.
  config.checkpoint.compilation_cache_dir = 'compilation_cache'
  # Push to the Hugging Face Hub while training: ORG/NAME of a model repository ('' = no):
  # every push_every_steps (0 = every checkpoint) and at the run's last step, the checkpoint
  # exported to the Hugging Face layout with a model card, one commit tagged step-N, in the
  # background (a failed push is a warning; the run goes on).
  config.checkpoint.push_to_hub = ''
  config.checkpoint.push_every_steps = 0

  config.eval = ml_collections.ConfigDict()
  config.eval.every_steps = 10_000
  # Batches of held-out data per evaluation.
  config.eval.steps = 100
  config.eval.batch_size = 256

  config.log = ml_collections.ConfigDict()
  config.log.every_steps = 100
  # Console progress bar (off when stdout is not a terminal unless forced).
  config.log.progress = True
  # Where curves go besides metrics.jsonl, comma separated: tensorboard, wandb (Weights &
  # Biases; the run resumes into the same W&B run), MODULE:NAME (a clu MetricWriter).
  config.log.writers = 'tensorboard'
  # The W&B project of log.writers=wandb; '' = WANDB_PROJECT (else wandb's default).
  config.log.wandb_project = ''

  # Multi-host runs are set up by flags of `bert-jax pretrain` (--coordinator_address,
  # --num_processes, --process_id, --distributed), not config keys: they describe the launch,
  # and the same config runs on any number of hosts.

  config.lock()  # A config file that sets a key this lacks (a misspelling) fails.
  return config


def finetune(task: str) -> ml_collections.ConfigDict:
  """The keys every fine-tuning task has, commented, with the GLUE recipe's values; each task's
  config adds its own keys to `config.task`. Settings that pre-training has too are where
  pre-training has them (`data.vocab_file`, `data.max_seq_length`, `train.init_checkpoint`, the
  optimizer's)."""
  config = ml_collections.ConfigDict()
  config.kind = 'finetune'  # See `pretrain`.

  # What to fine-tune on: the task, its files, and the keys of its own, which each task's config
  # adds to this group (finetune_squad.py's windows and decoding, finetune_ner.py's labels).
  config.task = ml_collections.ConfigDict()
  # A task name that a module of task_table.KINDS accepts (each finetune_*.py config sets it).
  config.task.name = task
  # Directory of the task's files (see each config's docstring).
  config.task.data_dir = ''
  config.data = ml_collections.ConfigDict()
  # WordPiece vocab.txt; '' = the checkpoint's own vocab.txt (which it must then have).
  config.data.vocab_file = ''
  # Lower-case the text; None = what the checkpoint records (bert_jax.json, tokenizer_config.json,
  # a training workdir's config.json data.lower_case), else guessed from its word pieces (cased
  # when 1% or more of those with letters change under lower-casing).
  config.data.lower_case = ml_collections.config_dict.placeholder(bool)
  config.data.max_seq_length = 128
  # Sequence-length buckets: each batch is cut to the smallest one that holds its longest
  # example (one compiled step per bucket). () = every batch padded to data.max_seq_length
  # (on the command line: --config.data.buckets=16,32,64,128 or --config.data.buckets='()').
  config.data.buckets = (32, 64, 128)

  # How to run the checkpoint's encoder; its architecture is the checkpoint's own.
  config.model = _model(from_scratch=False)

  config.train = ml_collections.ConfigDict()
  # Pre-trained weights: a bert_jax checkpoint, a pre-training (or fine-tuning) workdir, a
  # Hugging Face directory, an original Google TF checkpoint, or hf://ORG/NAME[@REVISION] on the
  # Hugging Face Hub. Only its encoder is used; the
  # task head starts fresh (truncated normal, stddev 0.02).
  config.train.init_checkpoint = ''
  config.train.epochs = 3
  # Stop (with a checkpoint) at this step, for jobs with a time limit; rerunning the same
  # command resumes. 0 = run to the end.
  config.train.stop_at_step = 0
  # Global batch size in sequences (SQuAD: windows), over all hosts and devices.
  config.train.batch_size = 32
  # Batch composition: 1 = every training batch is a uniform random draw of examples, as in
  # the paper's recipe (run_classifier.py, transformers' Trainer); each batch is still cut to
  # its length bucket. N > 1 = examples sorted by length within windows of N batches
  # (transformers' group_by_length uses 50): about a third fewer tokens on SST-2-like lengths,
  # but each batch then holds one length range -- and whatever correlates with length, often
  # the label.
  config.train.length_sort_window = 1
  # Micro-batches accumulated per optimizer step (train.batch_size must divide by it).
  config.train.grad_accum_steps = 1
  config.train.optimizer = 'adamw'
  config.train.learning_rate = 2e-5
  # Share of all steps spent warming up linearly to the peak rate; then 'linear' decay to 0.
  config.train.warmup_proportion = 0.1
  config.train.decay = 'linear'
  _adamw_terms(config.train)
  # Head initialization, dropout and the order of the examples.
  config.train.seed = 0
  # Dropout's PRNG (see `pretrain`).
  config.train.rng_impl = 'auto'

  config.checkpoint = ml_collections.ConfigDict()
  # Also save the train state every this many steps inside an epoch (it is always saved after
  # each epoch's evaluation and on SIGTERM); 0 = only then. A rerun resumes from the latest.
  config.checkpoint.every_steps = 1000
  # JAX's persistent compilation cache: a rerun (a preempted run relaunched) loads its compiled
  # train and eval steps instead of compiling them again. A relative path lies inside the
  # workdir; absolute and gs:// paths are taken as given (several runs may share one);
  # '' = none. A cache set outside the config (JAX_COMPILATION_CACHE_DIR) is used instead.
  config.checkpoint.compilation_cache_dir = 'compilation_cache'
  # Push to the Hugging Face Hub while training: ORG/NAME of a model repository ('' = no):
  # every push_every_steps (0 = every checkpoint) and at the run's last step, the checkpoint
  # exported to the Hugging Face layout with a model card, one commit tagged step-N, in the
  # background (a failed push is a warning; the run goes on).
  config.checkpoint.push_to_hub = ''
  config.checkpoint.push_every_steps = 0

  config.eval = ml_collections.ConfigDict()
  # Evaluation happens after every epoch, on every dev set.
  config.eval.batch_size = 64
  # The metric that picks the best epoch; '' = the task's headline metric (MRPC/QQP: f1,
  # STS-B: spearman, CoLA: mcc, SQuAD and NER: f1, others: accuracy; each module says its own).
  config.eval.main_metric = ''
  # Also predict the test set(s) with the best epoch's weights (GLUE: the leaderboard's TSV
  # files, MNLI also AX.tsv when diagnostic/diagnostic.tsv exists; tasks with labelled test
  # files: scored).
  config.eval.predict_test = False

  config.mesh = _mesh()

  config.log = ml_collections.ConfigDict()
  config.log.every_steps = 50
  config.log.progress = True
  # Where curves go besides metrics.jsonl, comma separated: tensorboard, wandb (Weights &
  # Biases; the run resumes into the same W&B run), MODULE:NAME (a clu MetricWriter).
  config.log.writers = 'tensorboard'
  # The W&B project of log.writers=wandb; '' = WANDB_PROJECT (else wandb's default).
  config.log.wandb_project = ''
  config.lock()  # A config file that sets a key this lacks (a misspelling) fails.
  return config


# Keys that fine-tuning configs had at the top level before they took the places pre-training
# has them, their task's group, or the group they belong to: a config or override that still
# sets one is an error naming the new key (a config file written for an earlier bert_jax would
# otherwise lose the setting).
MOVED_KEYS = {
    # Where pre-training has them.
    'init_checkpoint': 'train.init_checkpoint', 'vocab_file': 'data.vocab_file',
    'lower_case': 'data.lower_case', 'max_seq_length': 'data.max_seq_length',
    'tfds_data_dir': 'data.tfds_data_dir',
    # The task's group.
    'task': 'task.name', 'data_dir': 'task.data_dir', 'data_source': 'task.data_source',
    'label_list': 'task.label_list', 'train_file': 'task.train_file',
    'predict_file': 'task.predict_file', 'doc_stride': 'task.doc_stride',
    'max_query_length': 'task.max_query_length', 'n_best_size': 'task.n_best_size',
    'max_answer_length': 'task.max_answer_length',
    'null_score_diff_threshold': 'task.null_score_diff_threshold',
    # The group they belong to.
    'buckets': 'data.buckets', 'predict_test': 'eval.predict_test',
}
# Why a key of MOVED_KEYS is where it is now, when not where pre-training has it.
_MOVED_TO_GROUP = {'task': "with the task's other keys", 'buckets': "with the input's other keys",
                   'predict_test': "with evaluation's other keys"}

KINDS = ('pretrain', 'finetune')


def moved_key_message(old: str) -> str:
  """'config.OLD is now config.NEW (why there): set ...' for a key of MOVED_KEYS."""
  new = MOVED_KEYS[old]
  where = _MOVED_TO_GROUP.get(old, _MOVED_TO_GROUP['task'] if new.startswith('task.') else
                              'where pre-training has it')
  return (f'config.{old} is now config.{new} ({where}): set config.{new} instead '
          f'(--config.{new}=... on the command line)')


def check_moved_keys(config: ml_collections.ConfigDict) -> None:
  """Refuses a fine-tuning config that sets a key at its old place (a value where the key was;
  `task` is a group now, which a config of today has there)."""
  for old in MOVED_KEYS:
    if old in config and not isinstance(config[old], ml_collections.ConfigDict):
      raise UserError(moved_key_message(old))


def kind(config: ml_collections.ConfigDict) -> str:
  """config.kind, 'pretrain' or 'finetune'; a config without one (built by hand, not from
  `pretrain()` or `finetune(task)`) is a UserError."""
  value = config.get('kind') if isinstance(config, ml_collections.ConfigDict) else None
  if value is None:
    raise UserError("the config has no key 'kind' ('pretrain' or 'finetune'): start a config "
                    'file from defaults.pretrain() or defaults.finetune(TASK), which set it')
  if value not in KINDS:
    raise UserError(f'--config.kind={value!r}: expected one of {", ".join(KINDS)}')
  return value


def saved_config(record: dict[str, Any]) -> dict[str, Any]:
  """A run's saved config.json as today's keys say it: records written before config.kind and
  the task group (no 'kind'; 'task' a name, its keys at the top level) get both, and
  `buckets` / `predict_test` go to their groups; today's are returned as they are."""
  record = dict(record)
  if 'kind' not in record:
    record['kind'] = 'finetune' if 'task' in record else 'pretrain'
  if record['kind'] == 'finetune' and not isinstance(record.get('task'), dict):
    task = {'name': record.pop('task', '')}
    for old, new in MOVED_KEYS.items():
      if new.startswith('task.') and old in record and old != 'task':
        task[new[len('task.'):]] = record.pop(old)
    record['task'] = task
  for old in ('buckets', 'predict_test'):
    if record['kind'] == 'finetune' and old in record:
      group, key = MOVED_KEYS[old].split('.')
      record[group] = dict(record.get(group) or {}, **{key: record.pop(old)})
  return record
