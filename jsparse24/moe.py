"""Flax Linen: `SparseMoE`, a mixture-of-experts feed-forward layer whose
expert kernels are 2:4 sparse, each expert with masks of its own.

The experts are one `SparseDense` pair (`up`, `down`) stacked over the
experts with `nn.vmap`, so their parameters are `[E, K, N]` kernels and
their masks `[E, ...]` packed `Mask24`s: the same stacked layout as
`nn.scan` stacks of layers. Everything that handles stacks therefore
handles the experts unchanged and per expert: `init` prunes each expert's
kernels from its own weights, `jsparse24.optim.mask_update` rebuilds each
expert's masks from that expert's weights (its ramp counts each expert as
a layer), `rebuild_masks` likewise, and `compress_params` gives one stacked
`Sparse24` per expert kernel. The expert products are `sparse_dot` under
`jax.vmap` over the weights, with the backend chosen as for any product.

Routing is the "tokens choose" top-k routing of Switch Transformer (k=1)
and GShard (k=2), with flaxformer's order of slots: router logits ->
softmax -> the k largest probabilities per token -> a slot in each chosen
expert's buffer of `capacity` tokens. Where flaxformer multiplies by
one-hot dispatch and combine tensors, `dispatch` and `combine` gather rows
by index (`Routing`); every shape is still static and the experts'
products are one batched product per kernel.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import initializers
from jaxtyping import Array, Bool, Float, Int

from jsparse24 import _checks
from jsparse24._options import SparsityOptions
from jsparse24.linen import COLLECTION, MVUE_RNG, SparseDense


class _Expert(nn.Module):
  """One expert, `down(activation(up(x)))`; `SparseMoE` stacks it over the
  experts with `nn.vmap`. `up` and `down` are `SparseDense`, or `nn.Dense`
  (same fields and params) when not `sparse`."""

  hidden: int
  features: int
  activation: Callable[[jax.Array], jax.Array]
  use_bias: bool
  dtype: Any
  param_dtype: Any
  precision: Any
  kernel_init: Any
  bias_init: Any
  options: SparsityOptions  # both kernels'
  sparse: bool

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    kw = dict(use_bias=self.use_bias, dtype=self.dtype, param_dtype=self.param_dtype,
              precision=self.precision, kernel_init=self.kernel_init, bias_init=self.bias_init)
    linear = nn.Dense
    if self.sparse:
      kw.update({f.name: getattr(self.options, f.name) for f in dataclasses.fields(self.options)})
      linear = SparseDense
    h = linear(self.hidden, name="up", **kw)(x)
    return linear(self.features, name="down", **kw)(self.activation(h))


def expert_capacity(tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
  """Slots per expert for a group of `tokens` tokens: `capacity_factor`
  times an even share of the group's `top_k * tokens` assignments, rounded
  up, at least 1, at most `tokens` (an expert takes each token at most once,
  so more slots would stay empty). With `capacity_factor >= num_experts /
  top_k` no token is ever dropped."""
  check_routing("expert_capacity", num_experts, top_k, capacity_factor)
  _checks.check_count("expert_capacity", "tokens", tokens)
  return min(tokens, max(1, math.ceil(capacity_factor * top_k * tokens / num_experts)))


class Routing(NamedTuple):
  """Where top-k routing sends each token, as indices (`route`).

  With G groups of S tokens, E experts, k choices per token and C slots per
  expert and group:

  Attributes:
    gates: `[G, S, k]` the router probability of each choice, best first
      (differentiable: `combine` passes its gradient to the router).
    experts: `[G, S, k]` the chosen experts, best first.
    slot: `[G, S, k]` where each choice sits in its group's `[E, C]` slots,
      `e * C + c`; `E * C` for a choice dropped for capacity.
    choice: `[G, E, C]` which choice holds each slot, `s * k + rank`;
      `S * k` for an empty slot. The inverse of `slot`.
  """
  gates: Float[Array, "G S k"]
  experts: Int[Array, "G S k"]
  slot: Int[Array, "G S k"]
  choice: Int[Array, "G E C"]

  @property
  def kept(self) -> Bool[Array, "G S k"]:
    """Which choices found a slot."""
    return self.slot < self.choice.shape[1] * self.choice.shape[2]


def route(probs: Float[Array, "G S E"], top_k: int, capacity: int) -> Routing:
  """Top-k routing with `capacity` slots per expert and group.

  Slots are given out by rank, then by token: every token's first choice
  gets a slot before any token's second choice (GShard; flaxformer), so
  that a tight capacity drops second choices first. A choice that finds its
  expert's buffer full is dropped: it contributes nothing to its token's
  output (and no gradient), and a token whose choices are all dropped
  comes out as zeros (a residual connection around the layer carries it).

  Args:
    probs: the router's probabilities, float `[G, S, E]` (groups, tokens,
      experts), e.g. `jax.nn.softmax(logits)`: the chosen ones become the
      gates that scale the experts' outputs, so logits passed here would
      scale them by unbounded values (unchecked: values are not read at
      trace time).
    top_k: experts per token.
    capacity: slots per expert in each group.

  Returns:
    The `Routing`, for `dispatch` and `combine`.
  """
  if jnp.ndim(probs) != 3:
    raise ValueError(f"route: `probs` must be [G, S, E] (groups, tokens, experts), got shape"
                     f" {jnp.shape(probs)}.")
  # Integer or bool "probabilities" became integer or bool gates, scaling
  # the experts' outputs by them without a word.
  _checks.check_float("route", "probs", probs)
  g, s, num_experts = probs.shape
  _check_choices("route", num_experts, top_k)
  _checks.check_count("route", "capacity", capacity)
  gates, experts = jax.lax.top_k(probs, top_k)  # [G, S, k]
  # Rank-major order [G, k*S]: a running count per expert over the group's
  # choices is each choice's position in its expert's buffer.
  by_rank = jnp.swapaxes(experts, 1, 2).reshape(g, top_k * s)
  chosen = jax.nn.one_hot(by_rank, num_experts, dtype=jnp.int32)  # [G, k*S, E]
  position = jnp.sum((jnp.cumsum(chosen, axis=1) - 1) * chosen, axis=-1)
  position = jnp.swapaxes(position.reshape(g, top_k, s), 1, 2)  # [G, S, k]
  slots = num_experts * capacity
  slot = jnp.where(position < capacity, experts * capacity + position, slots)
  # The inverse: each kept choice's number written at its slot (the slots
  # of a group are distinct; a dropped choice's index is out of range).
  # (The numbers are the same in every group: only the slots are mapped, so
  # that vmap meets no two arguments sharded differently over the groups.)
  numbers = jnp.arange(s * top_k, dtype=slot.dtype)
  choice = jax.vmap(lambda at: jnp.full(slots, s * top_k, at.dtype).at[at].set(
      numbers, mode="drop", unique_indices=True))(slot.reshape(g, s * top_k))
  return Routing(gates, experts, slot, choice.reshape(g, num_experts, capacity))


def _rows(a: jax.Array, index: jax.Array) -> jax.Array:
  """`a[index]` along `a`'s first axis, zeros where `index` is out of range
  (the empty slots' and dropped choices' indices)."""
  return jnp.take(a, index, axis=0, mode="fill", fill_value=0)


def _chosen_rows(h, slot):
  """`[G, S, k, d]`: the rows of `h [E, G, C, d]` at each choice's slot."""
  e, _, c, d = h.shape
  return jax.vmap(lambda h, slot: _rows(h.reshape(e * c, d), slot), in_axes=(1, 0))(h, slot)


def _token_rows(a, choice, k):
  """`[E, G, C, d]`: the rows of `a [G, S, d]` of each slot's token (the
  slots' `choice`s, of `k` per token)."""
  return jax.vmap(_rows, in_axes=(0, 0), out_axes=1)(a, choice // k)


# Dispatch and combine move rows between the tokens [G, S] and the slots
# [E, G, C]: gathers of d-wide rows, memory-bound, where the one-hot einsums
# of flaxformer's layer multiply by [G, S, E, C] tensors (at E = 8, top-2,
# d_model 4096 and 2,048-token groups routing took 7.2 ms of a 63 ms dense
# step with them, 1.2 ms of 57 as gathers: nvidia-h200.md, "MoE dispatch and
# combine by index ...", H200 2026-12-02). Each
# backward pass is the other direction's gather, summed over the k choices:
# autodiff would transpose a gather into a scatter-add, whose atomic adds
# make the gradient's rounding depend on the order they land in.
@jax.custom_vjp
def _dispatch(x, slot, choice):
  return _token_rows(x, choice, slot.shape[-1])


def _dispatch_fwd(x, slot, choice):
  return _dispatch(x, slot, choice), slot


def _dispatch_bwd(slot, d_out):
  rows = _chosen_rows(d_out, slot)
  return jnp.sum(rows, axis=2, dtype=jnp.float32).astype(d_out.dtype), None, None


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


@jax.custom_vjp
def _combine(h, gates, slot, choice):
  rows = _chosen_rows(h, slot)
  return jnp.einsum("gskd,gsk->gsd", rows, gates,
                    preferred_element_type=jnp.float32).astype(h.dtype)


def _combine_fwd(h, gates, slot, choice):
  return _combine(h, gates, slot, choice), (h, gates, slot, choice)


def _combine_bwd(res, dy):
  h, gates, slot, choice = res
  g, s, k = gates.shape
  # Each slot's row is its choice's gate times its token's output gradient.
  slot_gates = jax.vmap(_rows)(gates.reshape(g, s * k), choice)  # [G, E, C]
  dh = _token_rows(dy, choice, k)
  dh = (dh * jnp.swapaxes(slot_gates, 0, 1)[..., None]).astype(h.dtype)
  d_gates = jnp.einsum("gskd,gsd->gsk", _chosen_rows(h, slot), dy,
                       preferred_element_type=jnp.float32).astype(gates.dtype)
  return dh, d_gates, None, None


_combine.defvjp(_combine_fwd, _combine_bwd)


def dispatch(x: Float[Array, "G S d"], routing: Routing) -> Float[Array, "E G C d"]:
  """Each expert's buffer of tokens: `out[e, g, c]` is the token of group g
  in slot c of expert e (`routing.choice`), zeros for an empty slot."""
  _check_routed("dispatch", "x", x, routing, "G, S", lambda r: r.slot.shape[:2])
  return _dispatch(x, routing.slot, routing.choice)


def combine(expert_out: Float[Array, "E G C d"], routing: Routing) -> Float[Array, "G S d"]:
  """Each token's output: the sum over its kept choices of the gate times
  the chosen expert's output in the choice's slot (zeros for a token whose
  choices were all dropped), summed in float32 and returned in
  `expert_out`'s dtype. Differentiable in `expert_out` and in
  `routing.gates`."""
  _check_routed("combine", "expert_out", expert_out, routing, "E, G, C",  # choice: [G, E, C]
                lambda r: (r.choice.shape[1], r.choice.shape[0], r.choice.shape[2]))
  return _combine(expert_out, routing.gates, routing.slot, routing.choice)


def _check_routed(fn: str, name: str, a: Any, routing: Any, axes: str,
                  lead_of: Callable[[Routing], tuple[int, ...]]) -> None:
  """`a` must be `[<axes>, d]`, its leading axes `lead_of(routing)`: gathers
  by index take any shape and would return rows of the wrong tokens, or
  zeros, silently."""
  if not isinstance(routing, Routing):
    raise TypeError(f"{fn}: `routing` must be the Routing that route returned, got"
                    f" {type(routing).__name__} (arguments: {fn}({name}, routing)).")
  lead = tuple(int(size) for size in lead_of(routing))
  if jnp.ndim(a) != len(lead) + 1 or tuple(jnp.shape(a)[:-1]) != tuple(lead):
    raise ValueError(f"{fn}: `{name}` must be [{axes}, d] with ({axes}) = {tuple(lead)} as"
                     f" routed, got shape {jnp.shape(a)}.")


def load_balancing_loss(probs: Float[Array, "G S E"], experts: jax.Array) -> jax.Array:
  """Switch Transformer's auxiliary loss, `E * sum_e f_e * P_e` averaged over
  groups, with `f_e` the share of the group's tokens that chose expert e
  (among their top k) and `P_e` the mean router probability of e.
  It is 1 (k for top-k) when both are uniform, the balance it pushes the
  router towards; its gradient reaches the router through `P_e` only
  (`f_e` is a count)."""
  num_experts = probs.shape[-1]
  chose = jnp.max(jax.nn.one_hot(experts, num_experts, dtype=jnp.float32), axis=-2)
  share = jnp.mean(chose, axis=-2)  # [G, E]
  prob = jnp.mean(probs.astype(jnp.float32), axis=-2)
  return num_experts * jnp.mean(jnp.sum(share * prob, axis=-1))


def check_experts(fn: str, hidden: Any, activation: Any, sparse: bool = True) -> None:
  """The Linen and NNX `SparseMoE`'s refusal of experts that cannot be built
  (a width of 0 or 32.0 failed inside JAX's initializer, a string
  activation at the first call; 2:4 experts (`sparse`) whose `hidden` is
  not a multiple of 4, where the down-projection's error asked to pad the
  inputs)."""
  _checks.check_count(fn, "hidden", hidden)
  if sparse and hidden % 4:
    raise ValueError(f"{fn}: hidden={hidden} must be a multiple of 4 for 2:4 experts (the"
                     f" down-projection is 2:4 along it); pass hidden={hidden + 4 - hidden % 4}.")
  if not callable(activation):
    raise TypeError(f"{fn}: activation must be a function (e.g. jax.nn.gelu), got"
                    f" {type(activation).__name__} {activation!r}.")


def _check_choices(fn: str, num_experts: int, top_k: int) -> None:
  """The refusal of `top_k` choices among `num_experts` that cannot be made
  (`route`, which is given its capacity; `check_routing`)."""
  _checks.check_count(fn, "num_experts", num_experts)
  _checks.check_count(fn, "top_k", top_k)
  if not top_k <= num_experts:
    raise ValueError(f"{fn}: top_k={top_k} must lie in [1, num_experts={num_experts}].")


def check_routing(fn: str, num_experts: int, top_k: int, capacity_factor: float) -> None:
  """The refusal of a routing that cannot run (`SparseMoE`, Linen and NNX;
  `expert_capacity`)."""
  _check_choices(fn, num_experts, top_k)
  if isinstance(capacity_factor, jax.Array):
    raise TypeError(f"{fn}: capacity_factor must be a Python or NumPy number (it sizes the"
                    f" experts' buffers when the program is traced), got a jax.Array;"
                    f" pass float(capacity_factor).")
  if (isinstance(capacity_factor, bool)
      or not isinstance(capacity_factor, (int, float, np.integer, np.floating))
      or not 0 < capacity_factor < math.inf):
    raise ValueError(f"{fn}: capacity_factor={capacity_factor!r} must be a finite number > 0"
                     f" (1.0: an even share of the tokens per expert; num_experts / top_k or"
                     f" more: no token is ever dropped).")


def check_groups(fn: str, inputs: Any, features: int | None = None) -> None:
  """The `SparseMoE` layers' refusal of inputs without routing groups, with
  no tokens (a reshape divided by zero), or, where the layer knows its
  width (`features`: NNX's `in_features`), of another width (JAX's
  dot_general error named neither)."""
  shape = jnp.shape(inputs)
  if len(shape) < 2:
    raise ValueError(
        f"{fn}: `inputs` must be [..., S, d] (tokens S in routing groups), got shape"
        f" {shape}; add a leading axis for a single group.")
  if shape[-2] < 1:
    raise ValueError(f"{fn}: `inputs` {shape} has no tokens (S = 0) in its routing groups.")
  if features is not None and shape[-1] != features:
    raise ValueError(f"{fn}: `inputs` {shape} has width {shape[-1]}, and the layer was built"
                     f" with in_features={features}.")


def moe_forward(inputs: Float[Array, "... S d"], router: Callable[[jax.Array], jax.Array],
                experts: Callable[[jax.Array], jax.Array], num_experts: int, top_k: int,
                capacity_factor: float, dtype: Any):
  """The MoE layer's forward pass, shared by the Linen and NNX `SparseMoE`:
  `router(x [G, S, d]) -> logits [G, S, E]`, `route`, `dispatch` to
  `[E, G * capacity, d]`, `experts` (stacked over E) and `combine`.
  Returns `(y, load_balancing_loss, dropped)` (the share of the top-k
  choices dropped for capacity)."""
  *lead, s, d = jnp.shape(inputs)
  x = jnp.reshape(inputs, (-1, s, d))
  groups = x.shape[0]
  capacity = expert_capacity(s, num_experts, top_k, capacity_factor)
  probs = jax.nn.softmax(router(x).astype(jnp.float32), axis=-1)
  routing = route(probs, top_k, capacity)
  aux = load_balancing_loss(probs, routing.experts)
  dropped = 1.0 - jnp.mean(routing.kept.astype(jnp.float32))
  # [E, groups * capacity, d]: each expert's tokens of every group in one product.
  expert_in = dispatch(x.astype(dtype), routing)
  expert_out = experts(jnp.reshape(expert_in, (num_experts, groups * capacity, d)))
  y = combine(jnp.reshape(expert_out, (num_experts, groups, capacity, d)), routing)
  return jnp.reshape(y, (*lead, s, d)), aux, dropped


class SparseMoE(nn.Module):
  """A mixture-of-experts feed-forward layer with 2:4 sparse experts.

  `y = sum over the token's kept choices e of p_e(x) * down_e(act(up_e(x)))`,
  `p = softmax(x @ router)`, with each expert's `up [d, hidden]` and
  `down [hidden, d]` kernels 2:4 along their input axis (stored as
  `params["experts"]["up"]["kernel"] [E, d, hidden]`, masks in the
  `"sparsity"` collection at the same path; see the module docstring for
  how the stack is trained and compressed). The router is a dense
  `nn.Dense` (`params["router"]`) computed in float32, as Switch
  Transformer does for stable routing.

  Inputs are `[..., S, d]`: each slice over the leading axes is one routing
  group (GShard's groups) of S tokens, whose experts each take
  `expert_capacity(S, num_experts, top_k, capacity_factor)` tokens; the
  choices past it are dropped (`route`). `dispatch` and `combine` move the
  tokens to the experts' buffers and back by index: gathers of rows, no
  `[groups, S, E, capacity]` tensors.

  Two intermediates are sown (`apply(..., mutable=["intermediates"])`):
  `load_balancing_loss` (`load_balancing_loss`), which the training loss
  should add (Switch uses 0.01 times it) or the router may send every
  token to a few experts, and `dropped`, the share of the top-k choices
  dropped for capacity.

  The sparsity fields are `SparseDense`'s, applied to both expert kernels;
  `kernel_sharding` (tensor parallelism of a single kernel) has no
  counterpart here: sharding the experts is expert parallelism.
  `sparse=False` makes the experts `nn.Dense` (no masks, no `"sparsity"`
  collection): the dense baseline, with the same params tree, the same
  initial values for the same key and the same routing code, as `nn.Dense`
  is `SparseDense`'s.

  Example:
    >>> import jax, jax.numpy as jnp, jsparse24
    >>> moe = jsparse24.SparseMoE(num_experts=4, hidden=32, top_k=2)
    >>> x = jnp.ones((2, 6, 16))  # 2 groups of 6 tokens
    >>> variables = moe.init(jax.random.key(0), x)
    >>> variables["params"]["experts"]["up"]["kernel"].shape
    (4, 16, 32)
    >>> y, state = moe.apply(variables, x, mutable=["intermediates"])
    >>> y.shape, sorted(state["intermediates"])
    ((2, 6, 16), ['dropped', 'load_balancing_loss'])
  """

  num_experts: int
  hidden: int
  top_k: int = 2
  capacity_factor: float = 1.25
  activation: Callable[[jax.Array], jax.Array] = nn.gelu
  use_bias: bool = False
  dtype: Any = None
  param_dtype: Any = jnp.float32
  precision: Any = None
  kernel_init: Any = nn.linear.default_kernel_init
  bias_init: Any = initializers.zeros_init()
  router_init: Any = nn.linear.default_kernel_init
  # sparsity: SparseDense's (SparsityOptions's) fields but kernel_sharding and the
  # 2:4-activation ones (input_sparsity, grad_output)
  gradient: Literal["ste", "masked"] = "ste"
  transposable: bool | None = None
  implementation: str | None = None
  mask_source: Literal["collection", "dynamic"] = "collection"
  weight_grad: Literal["dense", "mvue"] = "dense"
  sparse: bool = True  # False: nn.Dense experts (the dense baseline)

  @nn.compact
  def __call__(self, inputs: Float[Array, "... S d"]) -> Float[Array, "... S d"]:
    fn = f"SparseMoE {'/'.join(self.path)!r}" if self.path else "SparseMoE"
    check_groups(fn, inputs)
    check_routing(fn, self.num_experts, self.top_k, self.capacity_factor)
    check_experts(fn, self.hidden, self.activation, self.sparse)
    options = SparsityOptions.checked(
        fn, gradient=self.gradient, transposable=self.transposable,
        implementation=self.implementation, mask_source=self.mask_source,
        weight_grad=self.weight_grad)
    router = nn.Dense(self.num_experts, use_bias=False, dtype=jnp.float32,
                      param_dtype=self.param_dtype, kernel_init=self.router_init,
                      precision=self.precision, name="router")
    stack = nn.vmap(_Expert, variable_axes={"params": 0, COLLECTION: 0},
                    split_rngs={"params": True, MVUE_RNG: True}, in_axes=0, out_axes=0,
                    axis_size=self.num_experts)
    experts = stack(self.hidden, jnp.shape(inputs)[-1], self.activation, self.use_bias,
                    self.dtype, self.param_dtype, self.precision, self.kernel_init,
                    self.bias_init, options, self.sparse, name="experts")
    dtype = self.dtype or jnp.result_type(inputs.dtype, self.param_dtype)
    y, aux, dropped = moe_forward(inputs, router, experts, self.num_experts, self.top_k,
                                  self.capacity_factor, dtype)
    self.sow("intermediates", "load_balancing_loss", aux)
    self.sow("intermediates", "dropped", dropped)
    return y
