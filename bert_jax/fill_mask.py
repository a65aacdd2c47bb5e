"""Fill-mask: the most probable tokens, with probabilities, for each [MASK] of a text.

Any checkpoint with an MLM head works (a pre-training workdir, Hugging Face, Google TF, bert_jax).
`[MASK]` is not in the text vocabulary the tokenizer splits on (it would become `[`, `mask`,
`]`), so the text around each `[MASK]` is tokenized piece by piece and the mask token put
between. All texts run as one padded batch; the MLM head runs at the masked positions only.
"""

from typing import Any, Sequence

import jax
import numpy as np

from bert_jax import errors
from bert_jax import fileio
from bert_jax import model as model_lib
from bert_jax import pretrained
from bert_jax.errors import UserError

MASK = '[MASK]'


def encode_masked(tok, text: str, max_seq_length: int) -> tuple[list[int], list[int]]:
  """Ids of '[CLS] text [SEP]' with each '[MASK]' as the mask token, and the masked positions."""
  parts = text.split(MASK)
  if len(parts) == 1:
    raise UserError(f'fill-mask: {errors.excerpt(text)} has no {MASK}')
  pieces = tok.encode(parts)
  ids, positions = [tok.cls_id], []
  for i, piece in enumerate(pieces):
    ids += piece
    if i < len(parts) - 1:
      positions.append(len(ids))
      ids.append(tok.mask_id)
  ids.append(tok.sep_id)
  if len(ids) > max_seq_length:
    raise UserError(f'fill-mask: {errors.excerpt(text)} is {len(ids)} tokens with [CLS] and '
                    '[SEP]; the model '
                    f'takes at most {max_seq_length} (max_position_embeddings)')
  return ids, positions


def fill_mask(checkpoint: str, texts: Sequence[str], top_k: int = 5, vocab_file: str = '',
              lower_case: bool | None = None) -> list[dict[str, Any]]:
  """For each text: {'text', 'masks': [{'position', 'predictions': [{'token', 'token_id',
  'probability'}, ... top_k, most probable first]}, ... one per [MASK], left to right]}.

  Probabilities are the softmax of the MLM head's logits over the whole vocabulary (as
  transformers' BertForMaskedLM / fill-mask pipeline), computed in float32.
  """
  fileio.hide_accelerators_from_tf()
  if not texts:
    raise UserError('fill-mask: no text given')
  if top_k < 1:
    raise UserError(f'fill-mask: --top_k={top_k} must be at least 1')
  config, params, tok, _, _ = pretrained.load_checkpoint(checkpoint, vocab_file, lower_case,
                                                         flag='--checkpoint')
  if 'mlm' not in params:
    raise UserError(f'--checkpoint={checkpoint} has no MLM head (cls.predictions): a '
                    'fine-tuned model cannot fill in masks; use a pre-trained checkpoint')
  config = config.replace(dtype='float32', scan_layers=False)
  params = model_lib.with_nsp_head(params, config.hidden_size)  # Its output is not used here.
  # Rotary models have no position table: no ceiling but memory.
  packed = [encode_masked(tok, t, config.max_length or 2**31) for t in texts]
  length = max(len(ids) for ids, _ in packed)
  num_masks = max(len(p) for _, p in packed)
  input_ids = np.zeros((len(texts), length), np.int32)
  input_mask = np.zeros_like(input_ids)
  positions = np.zeros((len(texts), num_masks), np.int32)
  for row, (ids, pos) in enumerate(packed):
    input_ids[row, :len(ids)], input_mask[row, :len(ids)] = ids, 1
    positions[row, :len(pos)] = pos
  model = model_lib.BertForPreTraining(config)
  mlm_logits, _ = jax.jit(model.apply)({'params': params}, input_ids, input_mask,
                                       np.zeros_like(input_ids), positions)
  # Rows past the vocabulary (an embedding padded to a round size) are no token to show.
  k = min(top_k, tok.vocab_size)
  probs = jax.nn.softmax(mlm_logits, axis=-1)[..., :tok.vocab_size]
  top_probs, top_ids = jax.device_get(jax.lax.top_k(probs, k))
  results = []
  for row, (text, (_, pos)) in enumerate(zip(texts, packed)):
    masks = []
    for m, position in enumerate(pos):
      ids = [int(i) for i in top_ids[row, m]]
      masks.append({'position': position, 'predictions': [
          {'token': token, 'token_id': i, 'probability': float(p)}
          for token, i, p in zip(tok.convert_ids_to_tokens(ids), ids, top_probs[row, m])]})
    results.append({'text': text, 'masks': masks})
  return results


def format_table(results: Sequence[dict[str, Any]]) -> str:
  """A human-readable table: each text, then one line per [MASK] of 'token (probability)'."""
  lines = []
  for result in results:
    lines.append(result['text'])
    for i, mask in enumerate(result['masks'], 1):
      lines.append(f'  [MASK] {i}: ' + '  '.join(
          f'{p["token"]} ({p["probability"]:.4f})' for p in mask['predictions']))
  return '\n'.join(lines)
