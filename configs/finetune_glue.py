"""Fine-tuning on a GLUE task with the paper's recipe; `common()` is shared by the SQuAD and NER
configs, which import it and override.

  bert-jax finetune --config=configs/finetune_glue.py:mrpc \
      --config.init_checkpoint=/ckpt/uncased_L-12_H-768_A-12 --config.data_dir=/data/glue \
      --workdir=/tmp/mrpc

  # The paper's learning-rate search (5e-5, 4e-5, 3e-5, 2e-5; --learning_rates=... for
  # others), one workdir per rate; prints the best dev score and its rate (also sweep.json):
  bert-jax finetune --config=configs/finetune_glue.py:rte ... --sweep

Tasks: cola, sst2, mrpc, stsb (regression), qqp, mnli (dev: matched and mismatched), qnli, rte,
wnli. The recipe (Devlin et al. 2018, section 4.1): batch 32, 3 epochs, AdamW with 10% linear
warmup then linear decay to 0, weight decay 0.01, dropout 0.1, max_seq_length 128, the best of
{5e-5, 4e-5, 3e-5, 2e-5} on dev. The paper leaves WNLI out (always predicts the majority class).
"""

import ml_collections

from configs import default


def common(task: str) -> ml_collections.ConfigDict:
  """Keys every fine-tuning task has, with the GLUE recipe's values."""
  config = ml_collections.ConfigDict()
  # GLUE task name, 'squad_v1' / 'squad_v2', or 'ner'.
  config.task = task
  # Pre-trained weights: a bert_jax checkpoint, a pre-training (or fine-tuning) workdir, a
  # Hugging Face directory or an original Google TF checkpoint. Only its encoder is used; the
  # task head starts fresh (truncated normal, stddev 0.02).
  config.init_checkpoint = ''
  # WordPiece vocab.txt; '' = the checkpoint's own vocab.txt (which it must then have).
  config.vocab_file = ''
  # Lower-case the text; None = what the checkpoint says (bert_jax.json, tokenizer_config.json,
  # or guessed from its vocabulary: an uncased one has no upper-case letters).
  config.lower_case = ml_collections.config_dict.placeholder(bool)
  # Directory of the task's files (see each config's docstring).
  config.data_dir = ''
  config.max_seq_length = 128
  # Sequence-length buckets: each batch is cut to the smallest one that holds its longest
  # example (one compiled step per bucket). () = every batch padded to max_seq_length
  # (on the command line: --config.buckets=16,32,64,128 or --config.buckets='()').
  config.buckets = (32, 64, 128)

  config.model = ml_collections.ConfigDict()
  # Compute dtype: 'auto' = bfloat16 on GPU/TPU, float32 on CPU. Parameters stay float32.
  config.model.dtype = 'auto'
  config.model.hidden_dropout_prob = 0.1
  config.model.attention_probs_dropout_prob = 0.1
  config.model.scan_layers = False
  # Rematerialization: 'none', 'full' or 'dots' (long sequences on small accelerators).
  config.model.remat_policy = 'none'
  config.model.attention_impl = ml_collections.config_dict.placeholder(str)

  config.train = ml_collections.ConfigDict()
  config.train.epochs = 3
  # Global batch size in sequences (SQuAD: windows), over all hosts and devices.
  config.train.batch_size = 32
  config.train.optimizer = 'adamw'
  config.train.learning_rate = 2e-5
  # Share of all steps spent warming up linearly to the peak rate; then 'linear' decay to 0.
  config.train.warmup_proportion = 0.1
  config.train.decay = 'linear'
  config.train.beta1 = 0.9
  config.train.beta2 = 0.999
  config.train.eps = 1e-6
  config.train.weight_decay = 0.01
  config.train.max_grad_norm = 1.0
  # Head initialization, dropout and the order of the examples.
  config.train.seed = 0
  # Dropout's PRNG (see configs/default.py).
  config.train.rng_impl = 'rbg'

  config.eval = ml_collections.ConfigDict()
  # Evaluation happens after every epoch, on every dev set.
  config.eval.batch_size = 64
  # The metric that picks the best epoch; '' = the task's headline metric (MRPC/QQP: f1,
  # STS-B: spearman, CoLA: mcc, SQuAD and NER: f1, others: accuracy).
  config.eval.main_metric = ''

  # Also predict the test set(s) with the best epoch's weights (GLUE: the leaderboard's TSV
  # files, MNLI also AX.tsv when diagnostic/diagnostic.tsv exists; NER: test.txt is scored).
  config.predict_test = False

  config.mesh = default.get_config().mesh

  config.log = ml_collections.ConfigDict()
  config.log.every_steps = 50
  config.log.progress = True
  return config


def get_config(task: str = 'mrpc') -> ml_collections.ConfigDict:
  config = common(task)
  # 'tsv': the files of download_glue_data.py under data_dir (<data_dir>/MRPC/train.tsv, ...);
  # 'tfds': the prepared TFDS datasets glue/<task> (never downloaded here).
  config.data_source = 'tsv'
  # TFDS data directory; '' = TFDS's default.
  config.tfds_data_dir = ''
  return config
