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
and GShard (k=2), written as flaxformer's MoE layer writes it: router
logits -> softmax -> the k largest probabilities per token -> a slot in
each chosen expert's buffer of `capacity` tokens -> one-hot dispatch and
combine tensors (einsum), so that every shape is static and the experts'
products are one batched product per kernel.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen import initializers
from jaxtyping import Array, Float

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
  up, at least 1. With `capacity_factor >= num_experts / top_k` no token is
  ever dropped."""
  return max(1, math.ceil(capacity_factor * top_k * tokens / num_experts))


def route(probs: Float[Array, "G S E"], top_k: int, capacity: int):
  """The dispatch and combine tensors of top-k routing with `capacity` slots
  per expert and group.

  Slots are given out by rank, then by token: every token's first choice
  gets a slot before any token's second choice (GShard; flaxformer), so
  that a tight capacity drops second choices first. A choice that finds its
  expert's buffer full is dropped: it contributes nothing to its token's
  output (and no gradient), and a token whose choices are all dropped
  comes out as zeros (a residual connection around the layer carries it).

  Args:
    probs: the router's probabilities, `[G, S, E]` (groups, tokens, experts).
    top_k: experts per token.
    capacity: slots per expert in each group.

  Returns:
    `(dispatch, combine, experts)`: `dispatch [G, S, E, C]` is 1 where token
    s takes slot c of expert e (at most one slot per token and expert);
    `combine [G, S, E, C]` is `dispatch` times the token's router
    probability for that expert (differentiable in `probs`); `experts
    [G, S, k]` the chosen experts, best first.
  """
  num_experts = probs.shape[-1]
  gates, experts = jax.lax.top_k(probs, top_k)  # [G, S, k]
  chosen = jax.nn.one_hot(experts, num_experts, dtype=jnp.int32)  # [G, S, k, E]
  g, s, k, e = chosen.shape
  # Rank-major order: [G, k*S, E]; the running count is each choice's slot.
  by_rank = jnp.swapaxes(chosen, 1, 2).reshape(g, k * s, e)
  slot = jnp.cumsum(by_rank, axis=1) * by_rank - 1  # -1 where not chosen
  slot = jnp.swapaxes(slot.reshape(g, k, s, e), 1, 2)  # [G, S, k, E]
  # one_hot of -1 (not chosen) or of a slot >= capacity (dropped) is all zeros.
  slots = jax.nn.one_hot(slot, capacity, dtype=probs.dtype)  # [G, S, k, E, C]
  dispatch = jnp.sum(slots, axis=2)
  combine = jnp.einsum("gskec,gsk->gsec", slots, gates)
  return dispatch, combine, experts


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


def moe_forward(inputs: Float[Array, "... S d"], router: Callable[[jax.Array], jax.Array],
                experts: Callable[[jax.Array], jax.Array], num_experts: int, top_k: int,
                capacity_factor: float, dtype: Any):
  """The MoE layer's forward pass, shared by the Linen and NNX `SparseMoE`:
  `router(x [G, S, d]) -> logits [G, S, E]`, `route`, the dispatch einsum to
  `[E, G * capacity, d]`, `experts` (stacked over E) and the combine einsum.
  Returns `(y, load_balancing_loss, dropped)` (the share of the top-k
  choices dropped for capacity)."""
  *lead, s, d = jnp.shape(inputs)
  x = jnp.reshape(inputs, (-1, s, d))
  groups = x.shape[0]
  capacity = expert_capacity(s, num_experts, top_k, capacity_factor)
  probs = jax.nn.softmax(router(x).astype(jnp.float32), axis=-1)
  dispatch, combine, chosen = route(probs, top_k, capacity)
  aux = load_balancing_loss(probs, chosen)
  dropped = 1.0 - jnp.sum(dispatch) / (groups * s * top_k)
  # [E, groups * capacity, d]: each expert's tokens of every group in one product.
  expert_in = jnp.einsum("gsec,gsd->egcd", dispatch.astype(dtype), x.astype(dtype))
  expert_out = experts(jnp.reshape(expert_in, (num_experts, groups * capacity, d)))
  expert_out = jnp.reshape(expert_out, (num_experts, groups, capacity, d))
  y = jnp.einsum("gsec,egcd->gsd", combine.astype(expert_out.dtype), expert_out)
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
  choices past it are dropped (`route`). The dispatch and combine tensors
  are `[groups, S, E, capacity]`, quadratic in S: reshape long inputs into
  more, shorter groups.

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
  # sparsity: SparseDense's (SparsityOptions's) fields but kernel_sharding
  gradient: Literal["ste", "masked"] = "ste"
  transposable: bool | None = None
  implementation: str | None = None
  mask_source: Literal["collection", "dynamic"] = "collection"
  weight_grad: Literal["dense", "mvue"] = "dense"
  sparse: bool = True  # False: nn.Dense experts (the dense baseline)

  @nn.compact
  def __call__(self, inputs: Float[Array, "... S d"]) -> Float[Array, "... S d"]:
    fn = f"SparseMoE {'/'.join(self.path)!r}" if self.path else "SparseMoE"
    if jnp.ndim(inputs) < 2:
      raise ValueError(
          f"{fn}: `inputs` must be [..., S, d] (tokens S in routing groups), got shape"
          f" {jnp.shape(inputs)}; add a leading axis for a single group.")
    if not 1 <= self.top_k <= self.num_experts:
      raise ValueError(f"{fn}: top_k={self.top_k} must lie in [1, num_experts="
                       f"{self.num_experts}].")
    if not self.capacity_factor > 0:
      raise ValueError(f"{fn}: capacity_factor={self.capacity_factor} must be > 0"
                       f" (1.0: an even share of the tokens per expert).")
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
