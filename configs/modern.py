"""The 2025 encoder recipe: ModernBERT's architecture with MosaicBERT's masking and schedule,
MLM only, packed rows of 1,024 then 8,192 tokens.

  bert-jax pretrain --config=configs/modern.py --workdir=gs://BUCKET/modern \
      --config.data.input='gs://BUCKET/corpus/*.txt' --config.data.vocab_file=gs://BUCKET/vocab.txt

On a CPU, the same recipe at the smoke run's size (README "Modern recipe"):

  bert-jax pretrain --config=configs/modern.py:tiny --workdir=/tmp/bert-jax/modern

Ahead-of-time check of the 8,192-token phase, one row per chip, on a TPU slice (splash attention)
and on an H100 (cuDNN attention, the Pallas LayerNorm); README "Modern recipe" has the memory:

  bert-jax compile --config=configs/modern.py --topology=v5e:2x2 --config.train.batch_size=4 \
      --config.train.phases=1:8192:2464 --config.model.attention_impl=splash
  bert-jax compile --config=configs/modern.py --topology=h100 --config.train.batch_size=1 \
      --config.train.phases=1:8192:2464 --config.model.attention_impl=cudnn \
      --config.model.layer_norm_impl=pallas

Where each choice comes from (README "Modern recipe" compares it with the paper's recipe at the
same compute: benchmarks/recipes.py):
- MLM only, no NSP: RoBERTa (Liu et al., 2019); MosaicBERT, Cramming and ModernBERT follow.
- 30% masking: MosaicBERT (Portes et al., 2023) after Wettig et al., "Should You Mask 15% in
  Masked Language Modeling?" (2023); ModernBERT also masks 30%.
- Packed rows, no padding: MosaicBERT's unpadding, ModernBERT's sequence packing.
- Rotary positions, bases 160,000 (global) and 10,000 (local layers): ModernBERT (Warner et al.,
  2024), after RoFormer (Su et al., 2021).
- GeGLU feed-forward: Shazeer (2020), "GLU Variants Improve Transformer"; MosaicBERT,
  ModernBERT. At 2,048 wide (8/3 x hidden) it has the paper's MLP parameters.
- Pre-LayerNorm with a final norm: Cramming (Geiping & Goldstein, 2022), ModernBERT; stable at
  the high learning rate below.
- No biases in the encoder's linear layers and LayerNorms: Cramming, ModernBERT.
- Local attention (128 tokens) in two layers of three, global in every third: ModernBERT.
- No token types: ModernBERT ([SEP] alone separates a pair).
- No dropout: Cramming and ModernBERT pre-train without; no attention dropout also lets the fused
  kernels run (README "Attention").
- 1,024 tokens, then a short phase at 8,192: ModernBERT's context extension.
- AdamW with beta2 0.98, weight decay 1e-5, peak 5e-4 after 6% warmup, linear decay:
  MosaicBERT-base (batch 4,096 x 128 tokens, the 0.5M tokens a step of 512 x 1,024 holds here).
"""

from bert_jax import defaults
from bert_jax import errors

_VARIANTS = ('base', 'tiny')


def get_config(variant: str = 'base'):
  if variant not in _VARIANTS:
    raise errors.UserError(f'--config=modern:{variant}: no such variant; expected one of '
                           f'{", ".join(_VARIANTS)}')
  config = defaults.pretrain()
  model = config.model
  model.size = 'base'
  model.intermediate_size = 2048
  model.position_embedding_type = 'rotary'
  model.rope_theta = 160_000.0
  model.local_rope_theta = 10_000.0
  model.mlp = 'geglu'
  model.pre_layer_norm = True
  model.use_bias = False
  model.local_attention_window = 128
  model.global_attention_every = 3
  model.type_vocab_size = 0
  model.hidden_dropout_prob = 0.0
  model.attention_probs_dropout_prob = 0.0
  # What the model is trained for (rotary has no table, so this is no ceiling).
  model.max_position_embeddings = 8192

  config.data.input = ''  # Required: the pre-training corpus (see the docstring).
  config.data.objective = 'none'
  config.data.masked_lm_prob = 0.3
  config.data.packing = True
  # Rows of 8,192 tokens hold many documents.
  config.data.packing_max_sequences = 64
  config.data.max_seq_length = 1024
  config.data.max_predictions_per_seq = 320  # 30% of 1,024, rounded up.

  # 20,000 steps of 512 rows: 10B tokens at 1,024, 3.4B at 8,192 (a third of the paper's
  # BERT-base tokens; MosaicBERT matched BERT-base's GLUE with a quarter of its compute).
  config.train.steps = 20_000
  config.train.batch_size = 512
  config.train.phases = '0.96:1024:320,0.04:8192:2464'
  config.train.learning_rate = 5e-4
  config.train.warmup_steps = 1200
  config.train.beta2 = 0.98
  config.train.weight_decay = 1e-5
  config.checkpoint.every_steps = 1000
  config.eval.every_steps = 1000

  if variant == 'tiny':
    # The smoke run's size and schedule (configs/smoke.py) on the sample corpus, on a CPU,
    # with a long phase of 256 tokens and a window short enough to matter at 64.
    model.size = 'tiny'
    model.intermediate_size = 344  # 8/3 x 128, rounded to a multiple of 8.
    model.local_attention_window = 32
    model.max_position_embeddings = 256
    config.data.input = 'sample'
    config.data.packing_max_sequences = 16
    config.data.max_seq_length = 64
    config.data.max_predictions_per_seq = 20
    config.data.shuffle_buffer = 1000
    config.train.phases = '0.9:64:20,0.1:256:80'
    config.train.steps = 300
    config.train.batch_size = 32
    config.train.learning_rate = 2e-3
    config.train.warmup_steps = 30
    config.checkpoint.every_steps = 100
    config.eval.every_steps = 100
    config.eval.steps = 10
    config.eval.batch_size = 32
    config.log.every_steps = 20
  return config
