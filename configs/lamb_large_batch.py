"""LAMB large-batch recipe after You et al., "Large Batch Optimization for Deep Learning:
Training BERT in 76 minutes": BERT-large, phase 1 at 64k sequences of 128 tokens, phase 2 at
32k sequences of 512 tokens, started from phase 1's weights.

  bert-jax pretrain --config=configs/lamb_large_batch.py:phase1 --workdir=gs://BUCKET/lamb1 \
      --config.data.input='gs://BUCKET/corpus/*.txt' --config.data.vocab_file=gs://BUCKET/vocab.txt
  bert-jax pretrain --config=configs/lamb_large_batch.py:phase2 --workdir=gs://BUCKET/lamb2 \
      --config.train.init_checkpoint=gs://BUCKET/lamb1 \
      --config.data.input='gs://BUCKET/corpus/*.txt' --config.data.vocab_file=gs://BUCKET/vocab.txt

Raise train.grad_accum_steps when a slice cannot hold the whole batch at once. On a v5e-256
(16 GiB a chip) phase 1 fits with 16 micro-batches of 16 rows per chip; check a slice first:

  bert-jax compile --config=configs/lamb_large_batch.py:phase1 --topology=v5e:16x16 \
      --config.train.grad_accum_steps=16

The speed config: rows are packed (data.packing, README "Packing"), so the batch counts rows
of several sequences and no step is spent on padding. --config.data.packing=false gives the
paper's rows of one sequence each.
"""

from bert_jax import defaults
from bert_jax import errors

# phase: (batch, steps, peak lr, warmup steps, seq_len, max predictions)
_PHASES = {
    'phase1': (65536, 7038, 6e-3, 2000, 128, 20),
    'phase2': (32768, 1563, 4e-3, 200, 512, 80),
}


def get_config(phase: str = 'phase1'):
  if phase not in _PHASES:
    raise errors.UserError(f'--config=lamb_large_batch:{phase}: no such phase; expected one '
                           f'of {", ".join(sorted(_PHASES))}')
  batch, steps, lr, warmup, seq_len, preds = _PHASES[phase]
  config = defaults.pretrain()
  config.model.size = 'large'
  config.data.input = ''  # Required: the pre-training corpus (see the docstring).
  config.train.optimizer = 'lamb'
  config.train.batch_size = batch
  config.train.steps = steps
  config.train.learning_rate = lr
  config.train.warmup_steps = warmup
  config.train.phases = ''
  config.data.max_seq_length = seq_len
  config.data.max_predictions_per_seq = preds
  config.model.remat_policy = 'dots'
  config.data.packing = True
  # Phases are 7,038 and 1,563 (long) steps: the base's every 10,000 would never checkpoint.
  config.checkpoint.every_steps = 500
  config.eval.every_steps = 1000
  return config
