"""fp8.fp8_gelu_mlp: the FP8 feed-forward block whose GELU kernels write the quantized tensors.

It must compute what the unfused layers compute (`fp8_dot_general`, the Pallas `bias_gelu`,
`fp8_dot_general`): output, every gradient and every amax, bit for bit. The Pallas kernels run
in interpret mode here (CPU): the kernel code a GPU lowers through Triton, masked rows and
columns included.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bert_jax import activations
from bert_jax import fp8

_AXES = ('batch', 'length', 'act_mlp')
_DIMS = (((2,), (0,)), ((), ()))


def _inputs(shape, dtype=jnp.bfloat16, seed=0):
  b, t, h, i = shape
  rng = np.random.RandomState(seed)
  as_ = lambda a: jnp.asarray(a.astype(np.float32), dtype)
  x = as_(rng.randn(b, t, h))
  k1 = as_(rng.randn(h, i) * 0.2)
  b1 = jnp.asarray(rng.randn(i).astype(np.float32) * 0.5)
  k2 = as_(rng.randn(i, h) * 0.05)
  g = as_(rng.randn(b, t, h))
  # Scales that put each tensor's values across the FP8 range and clip the largest few.
  s1 = jnp.asarray([0.008, 0.0015, 0.00005], jnp.float32)
  s2 = jnp.asarray([0.004, 0.0003, 0.00005], jnp.float32)
  return (x, k1, b1, k2, s1, s2), g


def _fused(x, k1, b1, k2, s1, s2, slots1, slots2, axes=_AXES):
  return fp8.fp8_gelu_mlp(x, k1, b1, k2, (s1, slots1), (s2, slots2), axes=axes,
                          interpret=True)


def _unfused(x, k1, b1, k2, s1, s2, slots1, slots2, axes=None):
  y = fp8.fp8_dot_general(x, k1, _DIMS, s1, slots1)
  h = activations.bias_gelu(y, b1, impl='pallas', axes=axes)
  return fp8.fp8_dot_general(h, k2, _DIMS, s2, slots2)


def _run(f, args, g, with_slots):
  """f's output and the gradients of every argument; each slot's amaxes reduced (the rows of
  a slot are any partition of its tensor: `fp8_amaxes` takes their largest)."""
  slots = (jnp.zeros((3, fp8.FP8_AMAX_ROWS)),) * 2 if with_slots else (None, None)
  if with_slots:
    y, vjp = jax.vjp(f, *args, *slots)
    grads = vjp(g)
    return (y,) + grads[:6] + tuple(s.max(axis=-1) for s in grads[6:])
  y, vjp = jax.vjp(lambda *a: f(*a, None, None), *args)
  return (y,) + vjp(g)


_NAMES = ('output', 'dx', 'd kernel_in', 'd bias_in', 'd kernel_out', 'd scales_in',
          'd scales_out', 'amaxes_in', 'amaxes_out')


def _assert_identical(got, want):
  assert len(got) == len(want)
  for name, a, b in zip(_NAMES, got, want):
    assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, b.shape, a.dtype, b.dtype)
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                  err_msg=name)


@pytest.mark.parametrize('shape,with_slots', [
    ((2, 8, 32, 64), True),
    # Rows (4 x 6 = 24) not a multiple of the backward's 64 and columns (1,100) not of the
    # tiles' 1,024: the masked rows and columns; slots None: the scales' "gradients" are the
    # amaxes (a matmul given no slots).
    ((4, 6, 24, 1100), False),
])
def test_fused_mlp_is_the_unfused_layers_bit_for_bit(shape, with_slots):
  args, g = _inputs(shape)
  got = _run(_fused, args, g, with_slots)
  want = _run(_unfused, args, g, with_slots)
  _assert_identical(got, want)
  if with_slots:  # The scales' "gradients" are zero, the slots' this step's amaxes.
    assert not np.any(np.asarray(got[5])) and not np.any(np.asarray(got[6]))
    amaxes = got[7:]
  else:  # A matmul given no slots: its scales' "gradients" are the amaxes.
    amaxes = got[5:]
  assert all(np.all(np.asarray(a) > 0) for a in amaxes), amaxes


def test_fused_mlp_takes_the_gelu_kernels_and_no_separate_quantizing_of_its_tensors():
  """The jaxpr: two Pallas calls (the GELU's forward and backward), and no convert to FP8 of an
  [tokens, intermediate] array outside them (the unfused layers have two)."""
  args, g = _inputs((2, 8, 32, 64))
  slots = (jnp.zeros((3, fp8.FP8_AMAX_ROWS)),) * 2

  def fwd_bwd(f):
    return jax.make_jaxpr(lambda *a: jax.vjp(f, *a)[1](g))(*args, *slots)

  def all_eqns(jaxpr):
    for e in jaxpr.eqns:
      yield e
      for p in e.params.values():
        for sub in (p if isinstance(p, (list, tuple)) else [p]):
          inner = getattr(sub, 'jaxpr', None)
          if inner is not None:
            yield from all_eqns(getattr(inner, 'jaxpr', inner))

  fused, unfused = fwd_bwd(_fused), fwd_bwd(_unfused)
  calls = lambda j: sum(1 for e in all_eqns(j.jaxpr) if e.primitive.name == 'pallas_call')
  assert calls(fused) == calls(unfused) == 2
  converts = lambda j: sum(
      1 for e in all_eqns(j.jaxpr) if e.primitive.name == 'convert_element_type' and
      e.params['new_dtype'] in (jnp.float8_e4m3fn, jnp.float8_e5m2) and
      e.invars[0].aval.ndim == 3 and e.invars[0].aval.shape[-1] == 64)
  assert (converts(fused), converts(unfused)) == (0, 2)


def test_fused_mlp_on_a_mesh_runs_per_device_as_the_unfused_layers():
  """Under a data x fsdp x tensor mesh the GELU kernels run per device (shard_map): rows over
  data and fsdp, columns over tensor; their amaxes by blocks come back side by side and the
  bias gradient summed; what the step computes is the unfused layers' on the same mesh."""
  from bert_jax import config_files  # pylint: disable=g-import-not-at-top
  from bert_jax import sharding as sharding_lib  # pylint: disable=g-import-not-at-top
  args, g = _inputs((4, 6, 24, 80), seed=1)
  config = config_files.load_config('configs/smoke.py', {'mesh.data': 2, 'mesh.fsdp': 2,
                                                         'mesh.tensor': 2})
  mesh = sharding_lib.make_mesh(config.mesh, jax.devices()[:8])
  with sharding_lib.activate(mesh, sharding_lib.rules_from_config(config.mesh)):
    jaxpr = str(jax.make_jaxpr(lambda: _run(_fused, args, g, True))())
    got = jax.jit(lambda: _run(_fused, args, g, True))()
    want = jax.jit(lambda: _run(lambda *a: _unfused(*a, axes=_AXES), args, g, True))()
  assert 'shard_map' in jaxpr and 'pallas_call' in jaxpr
  _assert_identical(got, want)


def _bert_fp8_step(**settings):
  """A bf16 BERT-tiny with matmul_precision='fp8' and `settings`, and a function that runs
  one jitted training step with dropout: (loss, (parameter gradients, FP8 scales' gradients:
  the amax slots))."""
  from bert_jax import model as model_lib  # pylint: disable=g-import-not-at-top
  config = model_lib.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2,
                                num_attention_heads=4, intermediate_size=37,
                                max_position_embeddings=40, dtype='bfloat16',
                                matmul_precision='fp8', **settings)
  rng = np.random.RandomState(0)
  ids = jnp.asarray(rng.randint(5, 99, size=(3, 12)), jnp.int32)
  mask = jnp.ones((3, 12), jnp.int32).at[2, 7:].set(0)
  segments = jnp.zeros((3, 12), jnp.int32).at[:, 6:].set(1) * mask
  positions = jnp.asarray([[1, 4, 9], [0, 2, 3], [1, 5, 6]], jnp.int32)
  module = model_lib.BertForPreTraining(config)
  variables = module.init(jax.random.key(4), ids, mask, segments, positions)
  params = variables['params']
  scales = fp8.fp8_step_scales(model_lib.initial_fp8_meta(variables[fp8.FP8_COLLECTION]))
  weights = jax.random.normal(jax.random.key(1), (3, 3, 99))

  def step():
    def loss(p, s):
      logits = module.apply({'params': p, fp8.FP8_COLLECTION: s}, ids, mask, segments,
                            positions, deterministic=False,
                            rngs={'dropout': jax.random.key(0)})[0]
      return jnp.sum(logits.astype(jnp.float32) * weights)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, scales)

  return config, step


def _assert_same_step(got, want):
  """The two steps' loss, gradients and amaxes are the same bit for bit (the amax slots' rows
  compared by their max), and every amax was measured."""
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for path, a in jax.tree_util.tree_leaves_with_path(got):
    b = dict(jax.tree_util.tree_leaves_with_path(want))[path]
    if path[-1] == jax.tree_util.DictKey(fp8.FP8_AMAX_SLOTS):
      a, b = a.max(axis=-1), b.max(axis=-1)  # Rows are any partition of each tensor.
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                  err_msg=jax.tree_util.keystr(path))
  amaxes = fp8.fp8_amaxes(got[1][1])['bert']['encoder']['fp8_scale']
  assert np.all(np.asarray(amaxes) > 0), amaxes


def test_an_fp8_training_step_with_pallas_gelu_is_the_unfused_layers_bit_for_bit(monkeypatch):
  """BERT with matmul_precision='fp8' and gelu_impl='pallas' (bf16, dropout on): every MLP
  runs as fp8_gelu_mlp, on the parameters the unfused layers use (the same tree and names),
  and a training step's loss, parameter gradients and amaxes (each slot row of each layer's
  MLP matmuls) are the unfused layers', bit for bit."""
  from bert_jax import layers  # pylint: disable=g-import-not-at-top
  config, step = _bert_fp8_step(gelu_impl='pallas')
  calls = []
  fused = layers._fp8_gelu_mlp  # pylint: disable=protected-access
  monkeypatch.setattr(layers, '_fp8_gelu_mlp', lambda *a: calls.append(1) or fused(*a))
  got = step()
  assert len(calls) == config.num_hidden_layers
  monkeypatch.setattr(layers, '_fused_fp8_gelu', lambda module, c: False)
  want = step()
  _assert_same_step(got, want)


def test_an_output_gradients_amax_is_reduced_as_its_bias_gradient():
  """amax_in(feature_axes=k) holds one amax per element of the tensor's last k axes, the max
  over the others, as a dense layer's bias gradient reduces its output gradient (XLA then
  computes both in one pass: tests/aot_gpu_test.py), zeros after them; the largest is the one
  by rows. Features that the slot cannot hold are reduced by rows. fp8_dot_general's output
  gradient comes back so, per feature of the kernel's free axes."""
  t = jax.random.normal(jax.random.key(3), (4, 6, 3, 5), jnp.float32).at[2, 1, 0, 3].set(-9.0)
  got = np.asarray(fp8.amax_in(t, (1, 32), feature_axes=2))
  assert got.shape == (1, 32)
  np.testing.assert_array_equal(got[0, :15], np.abs(np.asarray(t)).max(axis=(0, 1)).ravel())
  assert not got[0, 15:].any()
  by_rows = np.asarray(fp8.amax_in(t, (1, 32)))
  assert got.max() == by_rows.max() == 9.0
  assert not np.array_equal(got, by_rows)
  np.testing.assert_array_equal(fp8.amax_in(t, (1, 8), feature_axes=2), fp8.amax_in(t, (1, 8)))
  # The matmul: x [2, 3, 8] . kernel [8, 4, 5] -> y [2, 3, 4, 5]; g's amax per (4, 5) feature.
  x = jax.random.normal(jax.random.key(4), (2, 3, 8), jnp.float32)
  k = jax.random.normal(jax.random.key(5), (8, 4, 5), jnp.float32)
  g = jax.random.normal(jax.random.key(6), (2, 3, 4, 5), jnp.float32)
  slots = jnp.zeros((3, 32), jnp.float32)
  amaxes = jax.grad(lambda s: jnp.sum(fp8.fp8_dot_general(
      x, k, (((2,), (0,)), ((), ())), jnp.ones((3,)), s) * g))(slots)
  np.testing.assert_array_equal(np.asarray(amaxes[2, :20]),
                                np.abs(np.asarray(g)).max(axis=(0, 1)).ravel())
  assert not np.asarray(amaxes[2, 20:]).any()


def test_nans_and_overflows_are_quantized_and_counted_as_xla_quantizes_them():
  """The kernels' own outputs: a NaN stays NaN in FP8 and makes its block's amax NaN (Triton's
  min and max drop NaNs: the kernels use selects and a NaN flag); a value past the format's
  largest is clipped to it, its amax the value's own."""
  x = jnp.zeros((2, 4, 40), jnp.bfloat16).at[0, 1, 3].set(jnp.nan).at[1, 2, 5].set(1e4)
  bias = jnp.zeros((40,), jnp.float32)
  scale = jnp.ones((1,), jnp.float32)
  e4m3, e5m2 = jnp.float8_e4m3fn, jnp.float8_e5m2
  q, amax = activations.bias_gelu_fp8(x, bias, scale, e4m3, axes=_AXES, interpret=True)
  q = np.asarray(q, np.float32)
  assert np.isnan(q[0, 1, 3]) and q[1, 2, 5] == float(jnp.finfo(e4m3).max)
  assert np.isnan(np.asarray(amax)).sum() == 1
  assert np.nanmax(np.asarray(amax)) == float(jnp.bfloat16(1e4))  # GELU(y) = y there.
  g = jnp.ones_like(x).at[1, 0, 0].set(jnp.nan).at[0, 3, 7].set(1e5)
  q, dbias, amax = activations.bias_gelu_fp8_grad(jnp.ones_like(x), bias, g, scale, e5m2,
                                                  axes=_AXES, interpret=True)
  q = np.asarray(q, np.float32)
  assert np.isnan(q[1, 0, 0]) and q[0, 3, 7] == float(jnp.finfo(e5m2).max)
  assert np.isnan(np.asarray(amax)).any() and np.isnan(np.asarray(dbias)[0])
  # The unfused layers' quantizing of the same values, for comparison.
  want = np.asarray(fp8.fp8_ops.quantize(jnp.asarray([jnp.nan, 1e5], jnp.bfloat16), e5m2,
                                         scale, jnp.bfloat16), np.float32)
  assert np.isnan(want[0]) and want[1] == q[0, 3, 7]


def test_gpus_before_hopper_run_the_unfused_layers():
  """Pallas' Triton lowering cannot convert to FP8 before compute capability 8.9, nor XLA run
  FP8 GEMMs before Hopper: lowered for an A100 (8.0) the MLP takes the unfused layers (XLA
  emulates FP8 there), for an H100 (9.0) or a GPU that names none the fused one."""
  from bert_jax import attention  # pylint: disable=g-import-not-at-top
  from bert_jax import model as model_lib  # pylint: disable=g-import-not-at-top
  config = model_lib.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=1,
                                num_attention_heads=4, intermediate_size=37,
                                max_position_embeddings=40, dtype='bfloat16',
                                matmul_precision='fp8', gelu_impl='pallas',
                                layer_norm_impl='xla')
  ids = jnp.ones((2, 8), jnp.int32)
  module = model_lib.BertForPreTraining(config)
  variables = module.init(jax.random.key(0), ids, ids, ids * 0, ids[:, :2])
  scales = fp8.fp8_step_scales(model_lib.initial_fp8_meta(variables[fp8.FP8_COLLECTION]))

  def kernels(capability):
    with attention.lowering_for('gpu', capability):
      assert fp8.gelu_kernels_can_quantize() == (capability is None or capability >= (9, 0))
      jaxpr = jax.make_jaxpr(lambda p, s: jax.grad(lambda p: jnp.sum(module.apply(
          {'params': p, fp8.FP8_COLLECTION: s}, ids, ids, ids * 0, ids[:, :2],
          deterministic=False, rngs={'dropout': jax.random.key(1)})[0]))(p))(
              variables['params'], scales)
    text = str(jaxpr)
    return text.count('name=bias_gelu_fp8_fwd'), text.count('name=bias_gelu_fwd')

  assert kernels((8, 0)) == (0, 2)  # The unfused GELU: the MLP's and the MLM transform's.
  assert kernels((9, 0)) == kernels(None) == (1, 1)


@pytest.mark.parametrize('gelu_impl,remat_policy,other', [
    ('pallas', 'none', {}), ('xla', 'none', {}), ('pallas', 'full', {}),
    # Three QKV matmuls (6 a layer: other indices into the scales), scanned layers (each
    # reads its own scales); a gated MLP without biases.
    ('pallas', 'none', dict(qkv_projection='separate', scan_layers=True)),
    ('xla', 'none', dict(mlp_type='gated', use_bias=False))])
def test_layer_norm_kernels_quantizing_for_the_matmuls_change_no_bit(
    monkeypatch, gelu_impl, remat_policy, other):
  """BERT with matmul_precision='fp8' and the Pallas LayerNorm (bf16, dropout on): each
  post-LN sub-layer's projection (the attention output; the MLP output, fused with the GELU
  kernels or not) takes its output gradient quantized, with its amax, from the LayerNorm
  backward kernel (fp8_dot_general's grad_channel), and the MLP's input and the next layer's
  QKV input come quantized from the LayerNorm forward kernel (x_quantized); a training step's
  loss, parameter gradients and amaxes are those of the matmuls quantizing themselves, bit
  for bit; rematerialized and scanned layers, three QKV matmuls and a gated MLP too."""
  from bert_jax import layers  # pylint: disable=g-import-not-at-top
  from bert_jax import layer_norm  # pylint: disable=g-import-not-at-top
  config, step = _bert_fp8_step(gelu_impl=gelu_impl, layer_norm_impl='pallas',
                                remat_policy=remat_policy, **other)

  quantizing = {'_pallas_forward': [], '_pallas_backward': []}
  for name, kernel in [(n, getattr(layer_norm, n)) for n in quantizing]:
    monkeypatch.setattr(layer_norm, name, lambda *a, name=name, kernel=kernel, **k: (
        quantizing[name].append(k['q_dtype']) or kernel(*a, **k)))
  got = step()
  # Forward: every LayerNorm of the encoder but the last quantizes for the matmul after it
  # (the MLP's input, the next layer's QKV); backward: every one for the projection before.
  layers_ = config.num_hidden_layers
  if remat_policy == 'none' and not other:  # (Rematerialized layers run their forward
    # kernels again, and quantize for no next layer: the carry would be saved.)
    assert quantizing == {'_pallas_forward': [jnp.float8_e4m3fn] * (2 * layers_ - 1) + [None],
                          '_pallas_backward': [jnp.float8_e5m2] * 2 * layers_}, quantizing
  assert set(quantizing['_pallas_backward']) == {jnp.dtype(jnp.float8_e5m2)}, quantizing
  monkeypatch.setattr(layers, '_grad_channels', lambda *a: False)
  for calls in quantizing.values():
    calls.clear()
  want = step()
  assert set(quantizing['_pallas_forward'] + quantizing['_pallas_backward']) == {None}
  _assert_same_step(got, want)
