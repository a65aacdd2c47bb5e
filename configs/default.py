"""Default pre-training configuration: every key is defined and commented here.

Variants (`smoke.py`, `bert_base.py`, `bert_large.py`, `lamb_large_batch.py`) import this file
and override. Run:

  bert-jax pretrain --config=configs/default.py --workdir=/tmp/bert_default

Any key can be overridden on the command line, e.g. `--config.train.learning_rate=5e-5`; the
config is locked, so a misspelt key is an error.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  """Returns the base configuration (BERT-base, the paper's recipe)."""
  config = ml_collections.ConfigDict()

  # ---- Model -----------------------------------------------------------------------------
  config.model = ml_collections.ConfigDict()
  # Named size: tiny, mini, small, medium, base, large or L{2..12}_H{128,256,512,768}.
  config.model.size = 'base'
  # Vocabulary size; 0 = take it from the vocabulary file (data.vocab_file).
  config.model.vocab_size = 0
  config.model.max_position_embeddings = 512
  config.model.type_vocab_size = 2
  config.model.hidden_dropout_prob = 0.1
  config.model.attention_probs_dropout_prob = 0.1
  # Compute dtype: 'bfloat16' on accelerators, 'float32' on CPU ('auto' picks by backend).
  config.model.dtype = 'auto'
  # Stack the encoder layers with nn.scan (faster compiles, one set of stacked weights).
  config.model.scan_layers = True
  # Rematerialization: 'none', 'full' or 'dots' (save matmul outputs, recompute the rest).
  config.model.remat_policy = 'none'
  # jax.nn.dot_product_attention implementation: None (XLA), 'xla' or 'cudnn'.
  config.model.attention_impl = ml_collections.config_dict.placeholder(str)

  # ---- Input -----------------------------------------------------------------------------
  config.data = ml_collections.ConfigDict()
  # Paths or globs (comma separated) of text files (one sentence a line, blank line between
  # documents, .gz allowed), TFRecords of create_pretraining_data.py ('*.tfrecord*'),
  # 'tfds:NAME[/CONFIG][:SPLIT]', or 'sample' for the built-in sample corpus.
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
  # WordPiece vocab.txt or SentencePiece .model; '' = train one from the input (smoke runs).
  config.data.vocab_file = ''
  config.data.lower_case = True
  # Size of the vocabulary trained when data.vocab_file is empty.
  config.data.vocab_size = 8000
  config.data.max_seq_length = 128
  config.data.max_predictions_per_seq = 20
  config.data.masked_lm_prob = 0.15
  config.data.short_seq_prob = 0.1
  # Second-sentence objective: 'nsp' (BERT), 'sop' (ALBERT) or 'none' (MLM only, packed).
  config.data.objective = 'nsp'
  config.data.whole_word_masking = False
  config.data.shuffle_buffer = 10_000
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
  config.train.beta1 = 0.9
  config.train.beta2 = 0.999
  config.train.eps = 1e-6
  config.train.weight_decay = 0.01
  config.train.max_grad_norm = 1.0
  # Phases as 'fraction:seq_len:max_predictions' separated by commas; '' = one phase at
  # data.max_seq_length. The paper: 90% of steps at 128, then 10% at 512.
  config.train.phases = '0.9:128:20,0.1:512:80'
  config.train.seed = 0
  # PRNG of dropout: 'rbg' (XLA's RngBitGenerator; keys still derived with threefry) is
  # cheaper than 'threefry2x32' on every backend (about 7% of a CPU step of BERT-mini) and
  # gives the same bits on any mesh; 'threefry2x32' is jax's default.
  config.train.rng_impl = 'rbg'
  # A converted checkpoint to start from when the workdir has none (resume order: latest
  # checkpoint in workdir, then this, then a fresh init).
  config.train.init_checkpoint = ''

  # ---- Mesh and sharding -----------------------------------------------------------------
  config.mesh = ml_collections.ConfigDict()
  # Device mesh axis sizes; -1 means "all remaining devices".
  config.mesh.data = -1
  config.mesh.fsdp = 1
  config.mesh.tensor = 1
  # Logical axis -> mesh axes. Parameters: vocab, embed, mlp, heads, kv, layers.
  # Activations: batch, length, act_embed, act_mlp, act_heads, act_vocab.
  config.mesh.rules = (
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

  # ---- Checkpoints, evaluation, logging ----------------------------------------------------
  config.checkpoint = ml_collections.ConfigDict()
  config.checkpoint.every_steps = 10_000
  config.checkpoint.keep = 3

  config.eval = ml_collections.ConfigDict()
  config.eval.every_steps = 10_000
  # Batches of held-out data per evaluation.
  config.eval.steps = 100
  config.eval.batch_size = 256

  config.log = ml_collections.ConfigDict()
  config.log.every_steps = 100
  # Console progress bar (off when stdout is not a terminal unless forced).
  config.log.progress = True

  # ---- Multi-host ------------------------------------------------------------------------
  config.distributed = ml_collections.ConfigDict()
  # 'auto' initializes jax.distributed on Cloud TPU / SLURM / when a coordinator is given.
  config.distributed.coordinator_address = ''
  config.distributed.num_processes = 0
  config.distributed.process_id = -1

  return config
