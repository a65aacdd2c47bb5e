"""Continued pre-training: BERT-base from the Hugging Face Hub, trained further on your domain.

  bert-jax pretrain --config=continue_pretraining --workdir=/tmp/domain_bert \
      --config.data.input='domain/*.parquet' --config.checkpoint.push_to_hub=ORG/domain-bert

Domain-adaptive pre-training (Gururangan et al., 2020; BioBERT, SciBERT's continued variant):
the weights, heads and vocabulary of `train.init_checkpoint` (google-bert/bert-base-uncased,
fetched into the Hub cache once), then MLM + NSP on the domain corpus (text files, Parquet,
hf://datasets/...: README "Bringing your data"). A smaller peak learning rate than pre-training
from scratch (5e-5, 10% warmup, linear decay) keeps what the model knows; 100k steps of 256
sequences at 128 tokens, the last 10% at 512. `model.size` must be the checkpoint's ('base';
'large' for bert-large-*), and the vocabulary is the checkpoint's (data.vocab_file = '').
With checkpoint.push_to_hub set, every checkpoint is pushed as a revision `step-N`.
"""

from bert_jax import defaults


def get_config():
  config = defaults.pretrain()
  config.model.size = 'base'
  config.train.init_checkpoint = 'hf://google-bert/bert-base-uncased'
  config.data.input = ''  # Required: the domain corpus (see the docstring).
  config.data.vocab_file = ''  # The checkpoint's vocab.txt.
  config.data.lower_case = True  # bert-base-uncased; False for a cased checkpoint.
  config.data.max_seq_length = 128
  config.data.max_predictions_per_seq = 20
  config.train.phases = '0.9:128:20,0.1:512:80'
  config.train.steps = 100_000
  config.train.batch_size = 256
  config.train.learning_rate = 5e-5
  config.train.warmup_steps = 10_000
  config.checkpoint.every_steps = 5_000
  config.checkpoint.push_every_steps = 0  # With every checkpoint, when push_to_hub is set.
  return config
