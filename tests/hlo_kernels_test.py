"""Kernels of a compiled step grouped by what they compute, read from the optimized HLO.

On the CPU the fusions are XLA:CPU's, so the test checks the part that does not depend on the
backend: the operations' name scopes (Flax modules, `optimizer`) and opcodes. The H100 part
reads a cut of the BERT-base/128 packed cuDNN step compiled deviceless for an H100
(testdata/h100_bert_base_step_snippet.hlo.txt: 2026-11-26, jax 0.10.2 and its CUDA plugin; a
few launches of each group with their fused computations), whose fusion names are the kernel
names a GPU profile of that jax shows; and a cut of the same step compiled on a GPU by jax
0.11.2, with kernel names from its profile.
"""

import os

import jax
import pytest

from bert_jax import config_files
from bert_jax import hlo_kernels
from bert_jax import pretraining
from bert_jax import sharding as sharding_lib

SNIPPET = os.path.join(os.path.dirname(__file__), 'testdata',
                       'h100_bert_base_step_snippet.hlo.txt')
# The same step compiled on an H200 by jax 0.11.2 (benchmarks/gpu.py --dump_hlo, 2026-11-26,
# before the optimizer had its name scope), whose profile named these kernels.
GPU_SNIPPET = os.path.join(os.path.dirname(__file__), 'testdata',
                           'h200_jax0.11.2_bert_base_step_snippet.hlo.txt')


@pytest.fixture(scope='module')
def cpu_step_hlo():
  """The optimized HLO of the tiny packed pre-training step, compiled for this CPU."""
  config = config_files.load_config('configs/bert_base.py', {
      'model.size': 'tiny', 'model.vocab_size': 512, 'train.batch_size': 8,
      'train.phases': '', 'data.max_seq_length': 32, 'data.max_predictions_per_seq': 5,
      'data.packing': True, 'mesh.data': -1, 'model.dtype': 'float32'})
  mesh = sharding_lib.make_mesh(config.mesh)
  rules = sharding_lib.rules_from_config(config.mesh)
  built = pretraining.build_step(config, mesh, 512)
  bsh = sharding_lib.batch_sharding(mesh)
  spec = lambda shape, dtype='int32': jax.ShapeDtypeStruct(shape, dtype, sharding=bsh)
  rows, seq, slots, per_row = 8, 32, 5 + 8, int(config.data.packing_max_sequences)
  batch = {k: spec((rows, seq)) for k in ('input_ids', 'input_mask', 'segment_ids',
                                          'position_ids', 'sequence_ids')}
  batch.update(masked_lm_positions=spec((rows, slots)), masked_lm_ids=spec((rows, slots)),
               masked_lm_weights=spec((rows, slots), 'float32'),
               next_sentence_positions=spec((rows, per_row)),
               next_sentence_labels=spec((rows, per_row)),
               next_sentence_weights=spec((rows, per_row), 'float32'))
  with sharding_lib.activate(mesh, rules):
    lowered = built.train_step.jitted.lower(built.abstract, batch)
  return lowered.compile().as_text()


def test_every_kernel_of_a_cpu_step_is_grouped_by_its_scope(cpu_step_hlo):
  computations, entry = hlo_kernels.parse(cpu_step_hlo)
  launches = hlo_kernels.launches(computations, entry)
  assert len(launches) > 100
  groups = {}
  for inst in launches:
    group = hlo_kernels.classify(computations, inst)
    assert group in hlo_kernels.GROUPS
    groups.setdefault(group, []).append(inst.op_name)
  # The optimizer runs under its name scope (train_state.step): all of its kernels, and only
  # they, are the optimizer's; the gradient norm too.
  for inst in launches:
    if inst.op_name.startswith('jit(step)/optimizer/'):
      assert hlo_kernels.classify(computations, inst) == 'optimizer', inst.op_name
  assert any('optimizer/reduce_sum' in n or 'optimizer/sqrt' in n for n in groups['optimizer'])
  # Each group's kernels come from its modules: LayerNorm forward and backward, the bias + GELU
  # custom_vjp, the dropout masks' random bits, the MLM/NSP heads' loss.
  assert any('attention_layer_norm' in n for n in groups['layernorm'])
  assert any('transpose(jvp(' in n and 'layer_norm' in n for n in groups['layernorm'])
  assert any('bias_gelu' in n for n in groups['gelu'])
  assert any('bias_gelu_bwd' in n for n in groups['gelu'])
  assert any('Dropout' in n or 'dropout' in n for n in groups['dropout'])
  # objectives.nll: logsumexp minus the label's logit (no log_softmax, no take_along_axis).
  assert any('logsumexp' in n or 'reduce_max' in n for n in groups['embedding_mlm']), groups[
      'embedding_mlm']
  # XLA's attention (softmax over the scores) is attention, not the projections around it.
  assert groups['attention'] and not any(
      f'/attention/{p}/' in n for p in ('query', 'key', 'value') for n in groups['attention'])
  budget = hlo_kernels.step_budget(cpu_step_hlo)
  assert budget['kernels'] == len(launches)
  assert budget['kernels_by_group'] == {g: len(groups.get(g, [])) for g in hlo_kernels.GROUPS}
  assert 0 < budget['non_matmul_bytes'] < sum(budget['bytes_by_group'].values())
  assert budget['erfc_ops'] == 0  # bias_gelu's exact GELU is lax.erf, not jax.nn.gelu's erfc.
  assert budget['attention_projections'] == 1  # One qkv matmul (model.SelfAttention).


def test_h100_kernels_are_grouped_by_what_their_fusion_computes():
  """Fusion names of the deviceless H100 compile, as a GPU profile shows them as kernels."""
  with open(SNIPPET) as f:
    text = f.read()
  info = hlo_kernels.kernel_info(text)
  expected = {
      'gemm_fusion_dot_2': 'matmul',                  # Triton GEMM: attention/query.
      'dot_product_attention_fwd_60': 'attention',    # cuDNN's fused attention, forward...
      'dot_product_attention_bwd_207': 'attention',   # ... and backward.
      'fusion_3343': 'layernorm',                     # attention_layer_norm forward.
      'input_add_reduce_fusion_10': 'layernorm',      # output_layer_norm backward.
      'loop_convert_fusion_13': 'gelu',               # bias_gelu forward.
      'input_convert_reduce_fusion_12': 'gelu',       # bias_gelu_bwd (+ the bias gradient).
      'wrapped_convert_9': 'dropout',                 # Random bits of a dropout mask.
      'input_concatenate_fusion_2': 'dropout',        # The mask's compare.
      'input_reduce_fusion_152': 'optimizer',         # The gradient norm's sums.
      'loop_select_subtract_fusion': 'optimizer',     # An AdamW update.
      'loop_and_fusion_1': 'embedding_mlm',           # The MLM head's gather.
      'wrapped_convert_5': 'other',                   # attention/key's bias cast.
  }
  assert {k: info[k][0] for k in expected} == expected
  assert set(g for g, _ in info.values()) == set(hlo_kernels.GROUPS)
  assert 'attention_layer_norm' in info['fusion_3343'][1]


def test_kernels_of_a_jax_0_11_gpu_profile_are_found_in_its_program():
  """The top kernels of the H200 profile (jax 0.11.2, CUDA-graph command buffers, every
  kernel's op `XlaModule:`): XLA's are found in the program and grouped, cuBLAS's and cuDNN's
  are not (the benchmark groups those by name)."""
  with open(GPU_SNIPPET) as f:
    info = hlo_kernels.kernel_info(f.read())
  assert info['input_convert_reduce_fusion_9'][0] == 'gelu'    # 2.73 ms: bias_gelu_bwd.
  assert info['loop_convert_fusion_11'][0] == 'gelu'           # 1.98 ms: bias_gelu forward.
  # 1.53 ms: the MLP output's bias gradient with the dropout backward before it.
  assert info['input_reduce_select_fusion_16'][0] == 'dropout'
  assert info['custom_call_147'][0] == 'matmul'                # cuBLAS: attention/query.
  assert info['dot_product_attention_fwd_60'][0] == 'attention'
  for library in ('nvjet_sm90_tst_192x192_64x3_1x2_h_bz_coopB_splitK_NTN',
                  'cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26'):
    assert library not in info


def test_the_gelu_passes_of_the_h100_and_h200_programs_before_issue_45():
  """step_budget's GELU passes (issue 45) on the two cuts of main's step before it: the
  deviceless jax 0.10.2 program ran the forward and the backward with the bias gradient's
  partial sums (2 passes over [tokens, intermediate]); the H200's jax 0.11.2 program split the
  bias gradient into a column reduction that reads dy again (3 passes). Every one evaluated
  XLA's float32 erf, instruction-bound on a GPU."""
  for path, passes in ((SNIPPET, 2), (GPU_SNIPPET, 3)):
    with open(path) as f:
      budget = hlo_kernels.step_budget(f.read())
    assert budget['gelu_passes'] == budget['gelu_erf_passes'] == passes, (path, budget)


_PASSES_HLO = '''HloModule step

%fused_add (p0: bf16[4,8], p1: bf16[4,8]) -> bf16[4,8] {
  %p0 = bf16[4,8]{1,0} parameter(0)
  %p1 = bf16[4,8]{1,0} parameter(1)
  ROOT %add.1 = bf16[4,8]{1,0} add(%p0, %p1), metadata={op_name="jit(step)/transpose(jvp(M))/layer_1/mlp/add_any"}
}

%fused_pad (q0: bf16[4,30]) -> bf16[4,64] {
  %q0 = bf16[4,30]{1,0} parameter(0)
  %zero = bf16[] constant(0)
  ROOT %pad.1 = bf16[4,64]{1,0} pad(%q0, %zero), padding=0_0x0_34, metadata={op_name="jit(step)/transpose(jvp(M))/mlm/attend/pad"}
}

ENTRY %main (a: bf16[32], b: bf16[4,8], c: bf16[4,30]) -> ((bf16[32], bf16[32]), bf16[4,64]) {
  %a = bf16[32]{0} parameter(0)
  %b = bf16[4,8]{1,0} parameter(1)
  %c = bf16[4,30]{1,0} parameter(2)
  %ln_bwd.1 = (bf16[32]{0}, bf16[32]{0}) custom-call(%a), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(step)/transpose(jvp(M))/layer_1/output_layer_norm/residual_layer_norm_bwd/pallas_call"}
  %gte = bf16[32]{0} get-tuple-element(%ln_bwd.1), index=1
  %bc = bf16[4,8]{1,0} bitcast(%gte)
  %loop_add_fusion = bf16[4,8]{1,0} fusion(%bc, %b), kind=kLoop, calls=%fused_add, metadata={op_name="jit(step)/transpose(jvp(M))/layer_1/mlp/add_any"}
  %bc2 = bf16[32]{0} bitcast(%loop_add_fusion)
  %ln_bwd.2 = (bf16[32]{0}, bf16[32]{0}) custom-call(%bc2), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(step)/transpose(jvp(M))/layer_1/attention_layer_norm/residual_layer_norm_bwd/pallas_call"}
  %loop_pad_fusion = bf16[4,64]{1,0} fusion(%c), kind=kLoop, calls=%fused_pad
  ROOT %t = ((bf16[32]{0}, bf16[32]{0}), bf16[4,64]{1,0}) tuple(%ln_bwd.2, %loop_pad_fusion)
}
'''


def test_the_adds_between_layernorm_kernels_and_the_vocabulary_pad_are_found():
  """step_budget's residual_grad_adds (an add of activation-sized arrays read from one
  LayerNorm kernel and read by another, through bitcasts and tuple elements) and vocab_pads (a
  pad widening the minor dimension to a multiple of 64) on a handmade program; the same add
  feeding no LayerNorm is not one, nor a pad to a width that is no multiple of 64. Pallas
  kernels' bytes count as non-matmul bytes."""
  budget = hlo_kernels.step_budget(_PASSES_HLO)
  assert (budget['residual_grad_adds'], budget['vocab_pads']) == (1, 1), budget
  assert budget['kernels_by_group']['layernorm'] == 2 and budget['non_matmul_bytes'] > 4 * 64
  other = _PASSES_HLO.replace('custom-call(%bc2)', 'custom-call(%a)').replace(
      '0_0x0_34', '0_0x0_33').replace('bf16[4,64]', 'bf16[4,63]')
  budget = hlo_kernels.step_budget(other)
  assert (budget['residual_grad_adds'], budget['vocab_pads']) == (0, 0), budget


_FP8_HLO = '''HloModule step

%fused_quantize (p0: bf16[8,16]) -> f8e4m3fn[8,16] {
  %p0 = bf16[8,16]{1,0} parameter(0)
  ROOT %convert.1 = f8e4m3fn[8,16]{1,0} convert(%p0), metadata={op_name="jit(step)/jvp(M)/layer_0/mlp/output/convert_element_type"}
}

ENTRY %main (a: bf16[32], b: bf16[8,16]) -> (bf16[32], f8e4m3fn[8,16]) {
  %a = bf16[32]{0} parameter(0)
  %b = bf16[8,16]{1,0} parameter(1)
  %ln = bf16[32]{0} custom-call(%a), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(step)/jvp(M)/layer_0/output_layer_norm/residual_layer_norm/pallas_call"}
  %gelu = bf16[8,16]{1,0} custom-call(%b), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(step)/jvp(M)/layer_0/mlp/intermediate/bias_gelu/pallas_call"}
  %loop_convert_fusion = f8e4m3fn[8,16]{1,0} fusion(%gelu), kind=kLoop, calls=%fused_quantize, metadata={op_name="jit(step)/jvp(M)/layer_0/mlp/output/convert_element_type"}
  ROOT %t = (bf16[32]{0}, f8e4m3fn[8,16]{1,0}) tuple(%ln, %loop_convert_fusion)
}
'''


def test_an_fp8_quantizing_pass_over_the_mlps_intermediate_is_found():
  """step_budget's fp8_mlp_quantize_passes: an XLA fusion of the MLP writing an FP8 array of
  the GELU kernel's [tokens, intermediate] size (here 128 elements, at least twice the
  LayerNorm's 32); not one of another size (a kernel's quantizing), nor under twice the
  hidden states, nor outside the MLP, nor a Pallas kernel's."""
  assert hlo_kernels.step_budget(_FP8_HLO)['fp8_mlp_quantize_passes'] == 1
  for changed in (_FP8_HLO.replace('f8e4m3fn[8,16]', 'f8e4m3fn[8,12]'),
                  _FP8_HLO.replace('[8,16]', '[4,8]'),
                  _FP8_HLO.replace('mlp/output', 'attention/qkv'),
                  _FP8_HLO.replace('kind=kLoop, calls=%fused_quantize',
                                   'custom_call_target="__gpu$xla.gpu.triton"').replace(
                                       'fusion(%gelu)', 'custom-call(%gelu)')):
    assert hlo_kernels.step_budget(changed)['fp8_mlp_quantize_passes'] == 0, changed
