"""What each kernel of a compiled XLA step does, read from its optimized HLO text.

A GPU profile names XLA's kernels after the fusions that emit them (the kernel
`loop_add_fusion_113` runs the fusion `%loop_add_fusion.113`; identical fusions share the first
one's kernel), cuBLAS's and cuDNN's after themselves (`nvjet_*`, `cudnn_*`). On jax 0.11+ a GPU
trace carries nothing else (the step runs as CUDA-graph command buffers: every kernel's op is
`XlaModule:`), so what a kernel computes comes from the program: the operations inside its fused
computation and the `op_name` metadata they carry, which holds the jax name scope and the Flax
module path (`.../layer_3/attention_layer_norm/rsqrt`; the optimizer runs under
`jax.named_scope('optimizer')` in `train_state.step`).

`kernel_info(text)` maps every kernel-launching instruction (a fusion or custom call the program
executes, not one nested in a fused computation) to one of GROUPS and its op_name;
`step_budget(text)` counts them, the bytes the non-matmul ones read and write, and the patterns
the GPU step budget keeps out (tests/aot_gpu_test.py). Used by benchmarks/gpu.py's profile
summary and `bert-jax compile`'s GPU report; plain text parsing, no jax.
"""

import dataclasses
import math
import re

GROUPS = ('matmul', 'attention', 'layernorm', 'gelu', 'dropout', 'optimizer', 'embedding_mlm',
          'other')

_DTYPE_BYTES = {'pred': 1, 's4': 0.5, 'u4': 0.5, 's8': 1, 'u8': 1, 'f8e4m3fn': 1, 'f8e5m2': 1,
                'bf16': 2, 'f16': 2, 's16': 2, 'u16': 2, 'f32': 4, 's32': 4, 'u32': 4, 'f64': 8,
                's64': 8, 'u64': 8}
_ARRAY = re.compile(r'\b(' + '|'.join(_DTYPE_BYTES) + r')\[([0-9,]*)\]')
_COMPUTATION = re.compile(r'^(ENTRY )?%?([\w.\-]+) [(].*[{]\s*$')
_INSTRUCTION = re.compile(r'^\s*(?:ROOT )?%?([\w.\-]+) = (.*?) ([a-z][\w\-]*)\(')
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_CALLED = re.compile(r'\b(calls|to_apply|body|condition|branch_computations|'
                     r'async_execution_thread_computation)=(\{[^}]*\}|%?[\w.\-]+)')
_BACKEND_KIND = re.compile(r'"kind":"([^"]*)"')
# Instructions that compute nothing: their op_name says nothing about the kernel's work.
_PLUMBING = frozenset({'parameter', 'constant', 'tuple', 'get-tuple-element', 'bitcast',
                       'reshape', 'broadcast', 'transpose', 'copy', 'convert', 'slice',
                       'concatenate', 'iota'})
# What a fused operation does, by its name scope (op_name) or opcode, in priority order: the
# first tag that any operation of a fusion carries names its group. LayerNorm's fusions take in
# the residual add and dropout before them; dropout's mask generation is its own fusion.
_TAGS = (
    # XLA's own attention (softmax, mask): operations of the attention module that are not its
    # projections; cuDNN's attention is a custom call, so the layout ops around it are not.
    ('attention', re.compile(r'/attention/(?!(query|key|value|qkv|output)\b|'
                             r'dot_product_attention|dropout)', re.I), frozenset()),
    ('layernorm', re.compile(r'layer_?norm', re.I), frozenset({'rsqrt'})),
    ('gelu', re.compile(r'gelu', re.I), frozenset({'erf'})),
    ('dropout', re.compile(r'dropout|threefry|random_bits|_bernoulli|_uniform|rng_bit', re.I),
     frozenset({'rng-bit-generator', 'rng', 'rng-get-and-update-state'})),
    ('optimizer', re.compile(r'(^|/)optimizer(/|$)'), frozenset()),
    ('embedding_mlm', re.compile(r'/embeddings/|/mlm/|/nsp/|/sop/|/cls/|log_softmax|'
                                 r'take_along_axis', re.I), frozenset()),
)


@dataclasses.dataclass
class Instruction:
  name: str
  opcode: str
  shape: str
  operands: list[str]
  called: list[str]
  attributes: str
  op_name: str


def parse(text: str) -> tuple[dict[str, list[Instruction]], str]:
  """An HLO module's computations (name -> instructions) and its entry computation's name."""
  computations, entry, current = {}, '', None
  for line in text.split('\n'):
    if current is None:
      m = _COMPUTATION.match(line)
      if m:
        current = computations.setdefault(m.group(2), [])
        entry = m.group(2) if m.group(1) else entry
      continue
    if line.rstrip() == '}':  # (An instruction's attributes may span lines starting '}}'.)
      current = None
      continue
    m = _INSTRUCTION.match(line)
    if not m:
      continue
    name, shape, opcode = m.groups()
    rest = line[m.end():]
    depth, end = 1, len(rest)
    for i, ch in enumerate(rest):
      depth += {'(': 1, ')': -1}.get(ch, 0)
      if depth == 0:
        end = i
        break
    operands = re.findall(r'%([\w.\-]+)', rest[:end])
    attributes = rest[end + 1:]
    called = [c for _, v in _CALLED.findall(attributes) for c in re.findall(r'%?([\w.\-]+)', v)]
    op_name = _OP_NAME.search(attributes)
    current.append(Instruction(name, opcode, shape, operands, called, attributes,
                               op_name.group(1) if op_name else ''))
  return computations, entry


def launches(computations: dict[str, list[Instruction]], entry: str) -> list[Instruction]:
  """The instructions that launch kernels: fusions and custom calls of the computations the
  program executes (the entry and what it calls, loops and branches included), not those
  nested in fused computations or reducers."""
  out, seen, todo = [], set(), [entry]
  while todo:
    name = todo.pop()
    if name in seen or name not in computations:
      continue
    seen.add(name)
    for inst in computations[name]:
      if inst.opcode in ('fusion', 'custom-call'):
        out.append(inst)
      elif inst.opcode in ('call', 'while', 'conditional', 'async-start'):
        todo.extend(inst.called)
  return out


def _fused(computations, inst: Instruction) -> list[Instruction]:
  """Every instruction inside a fusion, nested fusions included (not reducers: one reducer
  computation serves many reductions and carries the op_name of the first)."""
  out, todo, seen = [], list(inst.called), set()
  while todo:
    name = todo.pop()
    if name in seen:
      continue
    seen.add(name)
    for i in computations.get(name, []):
      out.append(i)
      if i.opcode == 'fusion':
        todo.extend(i.called)
  return out


def classify(computations: dict[str, list[Instruction]], inst: Instruction) -> str:
  """The group (one of GROUPS) of one kernel-launching instruction."""
  if inst.opcode == 'custom-call':
    target = _TARGET.search(inst.attributes)
    target = target.group(1).lower() if target else ''
    if 'fmha' in target or 'attention' in target:
      return 'attention'
    if 'gemm' in target or 'matmul' in target or 'cudnn' in target or 'conv' in target:
      return 'matmul'
    return _tagged([inst])
  kinds = _BACKEND_KIND.findall(inst.attributes)
  if any('gemm' in k or 'cudnn' in k or 'cublas' in k for k in kinds):
    return 'matmul'
  body = _fused(computations, inst)
  if any(i.opcode in ('dot', 'convolution') for i in body):
    return 'matmul'
  return _tagged(body + [inst])


def _tagged(instructions: list[Instruction]) -> str:
  """The group of the first tag (in _TAGS' order) that the instructions' computing operations
  carry; when none of them carries one, that of any instruction (a fusion of data movement
  only, such as a random-bits reshuffle, is named by what it moves)."""
  def tags(insts):
    found = set()
    for i in insts:
      for group, pattern, opcodes in _TAGS:
        if i.opcode in opcodes or pattern.search(i.op_name):
          found.add(group)
    return found
  found = (tags([i for i in instructions if i.opcode not in _PLUMBING]) or
           tags([i for i in instructions if i.opcode != 'parameter']))
  return next((g for g, _, _ in _TAGS if g in found), 'other')


def kernel_name(instruction_name: str) -> str:
  """The name of the kernel XLA's GPU backend emits for an instruction."""
  return re.sub(r'[.\-]', '_', instruction_name)


def kernel_info(text: str) -> dict[str, tuple[str, str]]:
  """Kernel name -> (group, op_name) for every kernel-launching instruction of an optimized
  HLO module."""
  computations, entry = parse(text)
  return {kernel_name(i.name): (classify(computations, i), i.op_name)
          for i in launches(computations, entry)}


def _bytes(shape: str) -> float:
  total = 0.0
  for dtype, dims in _ARRAY.findall(shape):
    size = _DTYPE_BYTES[dtype]
    for d in filter(None, dims.split(',')):
      size *= int(d)
    total += size
  return total


def step_budget(text: str, scatter_min_bytes: float = 16 * 2**20) -> dict:
  """The figures of one compiled step that tests/aot_gpu_test.py budgets, from its optimized
  HLO.

  kernels: kernel-launching instructions (fusions and custom calls the program executes; a
    cuBLAS call may launch two, a split-K reduction say, so a profile can count a few more);
    also by group.
  non_matmul_bytes: for every launching instruction but the matmuls (cuBLAS and Triton GEMM
    kernels) and the library calls (cuDNN's fused attention; Pallas kernels count), the bytes
    of its operands plus those of its results, at their full shapes: what those kernels
    would move if each read every operand once (more where a fusion reads part of an operand, less where it re-reads
    one). On a profile of jax 0.11.2, the kernels also number more than the launching
    instructions (1,716 against 1,515 for BERT-base/128): cuBLAS launches several per call.
  erfc_ops: operations from an `erfc` (XLA's expansion of jax.nn.gelu's exact form).
  large_scatters: `dtype[dims] (op_name)` of each scatter whose result has scatter_min_bytes
    or more (a gradient scattered into a zeros tensor).
  attention_projections: per encoder layer, the forward projections (query, key, value or one
    fused qkv) that have a dot of their own; its most over the layers.
  fp8_matmuls: matmuls (dots in GEMM fusions, cuBLAS calls) whose two inputs are FP8
    (f8e4m3fn, f8e5m2): model.matmul_precision='fp8' makes three per encoder matmul (forward,
    input gradient, kernel gradient).

  The passes issue 45 keeps out, counted over arrays of at least the hidden states' size
  (`hidden_elements`: the largest array a LayerNorm kernel writes, tokens x hidden):
  gelu_per_layer: GELU kernels of one encoder layer, the most over the layers (forward,
    backward with the bias gradient's partial sums, their final sum: 3).
  gelu_passes: GELU kernels that read or write an [tokens, intermediate] array (at least
    twice the hidden states), all layers: 2 per layer at the memory floor (forward, backward).
  gelu_erf_passes: of those, XLA fusions that evaluate `erf`: the float32 rational
    polynomial with a divide, instruction-bound on a GPU.
  qkv_copies: XLA kernels of the attention that slice, concatenate or pad an
    activation-sized array: q, k and v cut out of the fused QKV projection's output, and
    dq, dk, dv put back together.
  residual_grad_adds: kernels that only add activation-sized arrays, between two LayerNorm
    kernels (an input from one, the result read by another): the two gradients of a
    LayerNorm output (the residual path's and the next sub-layer's) summed on their own.
  fp8_mlp_quantize_passes: XLA fusions of the MLP, not GELU kernels, that write an FP8 array
    of the GELU's [tokens, intermediate] size (the largest array a GELU kernel reads or writes,
    at least twice the hidden states'): GELU's output or the first matmul's output gradient
    quantized in a pass of its own, not by the GELU kernels that compute them
    (fp8.fp8_gelu_mlp). The kernels' own quantizing ([hidden, intermediate]) is not one.
  vocab_pads: pads that widen the minor dimension of an activation-sized array to a multiple
    of 64 (the MLM logits' gradient padded back to the decoder matmul's padded vocabulary).
  """
  computations, entry = parse(text)
  shapes = {i.name: i.shape for insts in computations.values() for i in insts}
  counts = {g: 0 for g in GROUPS}
  moved = {g: 0.0 for g in GROUPS}
  non_matmul = 0.0
  for inst in launches(computations, entry):
    group = classify(computations, inst)
    counts[group] += 1
    size = _bytes(inst.shape) + sum(_bytes(shapes.get(o, '')) for o in inst.operands)
    moved[group] += size
    if group != 'matmul' and not _library_call(inst):
      non_matmul += size
  everything = [i for insts in computations.values() for i in insts]
  projections = {}
  for i in everything:
    m = re.search(r'jvp\(\w+\)/.*?(layer_\d+)/attention/(query|key|value|qkv\w*)/', i.op_name)
    if _is_matmul(i) and m and 'transpose(' not in i.op_name:
      projections.setdefault(m.group(1), set()).add(m.group(2))
  fp8 = [i for i in everything if _is_matmul(i) and len(i.operands) >= 2 and
         all(shapes.get(o, '').startswith('f8') for o in i.operands[:2])]
  return dict(
      **_pass_counts(computations, entry, shapes),
      kernels=sum(counts.values()), kernels_by_group=counts,
      non_matmul_bytes=non_matmul,
      bytes_by_group=moved,
      erfc_ops=sum(1 for i in everything if re.search(r'(^|/)erfc(/|$)', i.op_name)),
      large_scatters=[f'{i.shape.split("{")[0]} ({i.op_name})' for i in everything
                      if i.opcode == 'scatter' and _bytes(i.shape) >= scatter_min_bytes],
      attention_projections=max((len(v) for v in projections.values()), default=0),
      fp8_matmuls=len(fp8))


def _library_call(i: Instruction) -> bool:
  """A custom call into a library (cuDNN, cuBLAS), not a Pallas kernel (a Triton call)."""
  target = _TARGET.search(i.attributes)
  return i.opcode == 'custom-call' and not (target and 'xla.gpu.triton' in target.group(1))


def _is_matmul(i: Instruction) -> bool:
  # A Triton GEMM fusion holds a `dot`; a cuBLAS call (jax 0.11+ on a GPU) is a custom call.
  return i.opcode == 'dot' or (i.opcode == 'custom-call' and 'gemm' in i.attributes)


def _elements(shape: str) -> list[int]:
  """The element count of each array of an HLO shape."""
  out = []
  for _, dims in _ARRAY.findall(shape):
    n = 1
    for d in filter(None, dims.split(',')):
      n *= int(d)
    out.append(n)
  return out


def _dims(shape: str) -> list[int]:
  m = _ARRAY.search(shape)
  return [int(d) for d in m.group(2).split(',') if d] if m else []


# model.VOCAB_MULTIPLE (not imported: this module reads text only).
_VOCAB_MULTIPLE = 64
_LAYER = re.compile(r'/(layer_\d+)/')
# Entry-computation instructions that pass a buffer on without a kernel of their own.
_PASS_THROUGH = frozenset({'bitcast', 'get-tuple-element', 'reshape', 'copy', 'tuple'})


def _pass_counts(computations, entry: str, shapes: dict[str, str]) -> dict:
  """step_budget's issue-45 figures (see its docstring)."""
  kernels = launches(computations, entry)
  group = {i.name: classify(computations, i) for i in kernels}
  layernorm = {i.name for i in kernels if group[i.name] == 'layernorm'}
  hidden = max((n for i in kernels if i.name in layernorm for n in _elements(i.shape)),
               default=0)
  if not hidden:
    return dict(gelu_per_layer=0, gelu_passes=0, gelu_erf_passes=0, qkv_copies=0,
                residual_grad_adds=0, vocab_pads=0, fp8_mlp_quantize_passes=0)
  sizes = lambda i: _elements(i.shape) + [n for o in i.operands
                                          for n in _elements(shapes.get(o, ''))]
  by_name = {i.name: i for insts in computations.values() for i in insts}
  users = {}
  for i in computations.get(entry, []):
    for o in i.operands:
      users.setdefault(o, []).append(i)

  def producers(inst):  # The kernels whose results `inst` reads, through pass-throughs.
    out, todo, seen = set(), list(inst.operands), set()
    while todo:
      name = todo.pop()
      if name in seen or name not in by_name:
        continue
      seen.add(name)
      if name in group:
        out.add(name)
      elif by_name[name].opcode in _PASS_THROUGH:
        todo.extend(by_name[name].operands)
    return out

  def consumers(inst):  # The kernels that read `inst`'s result, through pass-throughs.
    out, todo, seen = set(), [inst.name], set()
    while todo:
      name = todo.pop()
      for u in users.get(name, []):
        if u.name in seen:
          continue
        seen.add(u.name)
        if u.name in group:
          out.add(u.name)
        elif u.opcode in _PASS_THROUGH:
          todo.append(u.name)
    return out

  # The MLP's [tokens, intermediate] tensor: the largest array a GELU kernel reads or writes.
  intermediate = max((n for i in kernels if group[i.name] == 'gelu' for n in sizes(i)),
                     default=0)
  per_layer, gelu_passes, erf_passes, qkv, adds, pads, quantizes = {}, 0, 0, 0, 0, 0, 0
  for inst in kernels:
    if (inst.opcode == 'fusion' and group[inst.name] != 'gelu' and '/mlp/' in inst.op_name and
        any(dtype.startswith('f8') and
            math.prod(int(d) for d in dims.split(',') if d) == intermediate >= 2 * hidden
            for dtype, dims in _ARRAY.findall(inst.shape))):
      quantizes += 1
    body = _fused(computations, inst) if inst.opcode == 'fusion' else []
    opcodes = {i.opcode for i in body} or {inst.opcode}
    big = max(sizes(inst), default=0)
    if group[inst.name] == 'gelu':
      layer = next((m.group(1) for i in [inst] + body for m in [_LAYER.search(i.op_name)] if m),
                   None)
      if layer:
        per_layer[layer] = per_layer.get(layer, 0) + 1
      if big >= 2 * hidden:
        gelu_passes += 1
        erf_passes += 'erf' in opcodes
    if (group[inst.name] == 'attention' and inst.opcode == 'fusion' and big >= hidden and
        opcodes & {'slice', 'concatenate', 'pad', 'dynamic-slice', 'dynamic-update-slice'}):
      qkv += 1
    computing = opcodes - _PLUMBING - {'parameter'}
    if (inst.opcode == 'fusion' and computing == {'add'} and max(_elements(inst.shape)) >= hidden
        and producers(inst) & layernorm and consumers(inst) & layernorm):
      adds += 1
    for i in body + ([inst] if inst.opcode == 'pad' else []):
      if i.opcode == 'pad' and i.operands:
        out_dims, in_dims = _dims(i.shape), _dims(shapes.get(i.operands[0], ''))
        # (XLA's reductions pad their reduced dimension by a few elements: not a multiple.)
        if (out_dims and len(in_dims) == len(out_dims) and out_dims[-1] > in_dims[-1] and
            out_dims[-1] % _VOCAB_MULTIPLE == 0 and max(_elements(i.shape)) >= hidden):
          pads += 1
  return dict(gelu_per_layer=max(per_layer.values(), default=0), gelu_passes=gelu_passes,
              gelu_erf_passes=erf_passes, qkv_copies=qkv, residual_grad_adds=adds,
              vocab_pads=pads, fp8_mlp_quantize_passes=quantizes)
