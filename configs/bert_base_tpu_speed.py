"""BERT-base for speed on TPUs: the paper's recipe with fused splash attention.

  bert-jax pretrain --config=configs/bert_base_tpu_speed.py --workdir=gs://BUCKET/bert_base \
      --config.data.input='gs://BUCKET/corpus/*.txt' --config.data.vocab_file=gs://BUCKET/vocab.txt

Ahead-of-time check of the compiled step for a slice (on any machine):

  bert-jax compile --config=configs/bert_base_tpu_speed.py --topology=v5e:4x4

Differs from bert_base.py in two choices: rows packed with whole sequences instead of padding
(data.packing), and no attention dropout (model.attention_probs_dropout_prob=0, as RoBERTa-era
recipes and MosaicBERT train), because the fused kernel has none; hidden dropout stays 0.1.
Attention then runs as Pallas splash attention (model.attention_impl='splash'), each packed
sequence its own segment, never materializing the [batch, heads, T, T] scores.
"""

from bert_jax import defaults


def get_config():
  config = defaults.pretrain()
  # bert_base.py's schedule: 1M steps of 256 sequences, 90% at 128 tokens, 10% at 512.
  config.model.size = 'base'
  config.data.input = ''  # Required: the pre-training corpus (see the docstring).
  config.data.max_seq_length = 128
  config.data.max_predictions_per_seq = 20
  config.train.steps = 1_000_000
  config.train.batch_size = 256
  config.train.learning_rate = 1e-4
  config.train.warmup_steps = 10_000
  config.train.phases = '0.9:128:20,0.1:512:80'
  # Several whole sequences per row instead of padding (README, "Packing").
  config.data.packing = True
  # The fused kernel has no attention dropout (README, "Attention").
  config.model.attention_probs_dropout_prob = 0.0
  config.model.attention_impl = 'splash'
  return config
