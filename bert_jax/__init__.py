"""bert_jax: BERT pre-training and fine-tuning in JAX and Flax, from a laptop CPU to a TPU pod.

  config, params = bert_jax.load_pretrained(path)   # Hugging Face, Google TF or bert_jax
  sequence_output, pooled_output = bert_jax.encode(config, params, input_ids, input_mask,
                                                   segment_ids)
"""

from bert_jax.convert import load_pretrained
from bert_jax.model import BertConfig, config_for_size, encode

__version__ = '0.1.0'
__all__ = ['BertConfig', 'config_for_size', 'encode', 'load_pretrained']
