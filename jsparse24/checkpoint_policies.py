"""Remat policies that treat jsparse24's 2:4 products as the matmuls they are.

JAX's `jax.checkpoint_policies.dots_saveable` and
`dots_with_no_batch_dims_saveable` save the outputs of `dot_general`. On a
GPU the 2:4 products are custom calls (Pallas, cuSPARSELt), which those
policies do not see, so under `nn.remat(Block, policy=jax.checkpoint_policies.
dots_with_no_batch_dims_saveable)` a dense model keeps its matmul outputs
while the 2:4 model recomputes its products in the backward pass: more work
than the dense model does, for the same model. The policies here are JAX's
with the 2:4 products' outputs (checkpoint name `PRODUCT_NAME`) saved too;
on a dense model they save what JAX's save. Use them wherever you would use
JAX's::

    block = nn.remat(Block, policy=jsparse24.checkpoint_policies.dots_with_no_batch_dims_saveable)

Every 2:4 product counts as a dot without batch dimensions (its input's
leading axes are rows of one product). The compressed weights are a separate
choice (`jsparse24.CHECKPOINT_NAME`: weight-sized memory to compress each
weight once per step instead of twice); combine with `saving_products`::

    policy = jsparse24.checkpoint_policies.saving_products(
        jax.checkpoint_policies.save_from_both_policies(
            jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
            jax.checkpoint_policies.save_only_these_names(jsparse24.CHECKPOINT_NAME)))
"""

from __future__ import annotations

from typing import Callable

import jax

from jsparse24.backends._autodiff import PRODUCT as PRODUCT_NAME


# JAX's functions that return a policy (by name: not every JAX has each).
_FACTORIES = tuple(getattr(jax.checkpoint_policies, name) for name in (
    "save_only_these_names", "save_any_names_but_these", "save_anything_except_these_names",
    "save_and_offload_only_these_names", "save_from_both_policies",
    "offload_dot_with_no_batch_dims") if hasattr(jax.checkpoint_policies, name))


def saving_products(policy: Callable[..., bool]) -> Callable[..., bool]:
  """The remat policy that saves what `policy` saves and the output of every
  2:4 product (`sparse_dot`, `SparseDense`, `nnx.SparseLinear`)."""
  if not callable(policy):
    raise TypeError(f"saving_products: `policy` must be a jax.checkpoint policy (a callable),"
                    f" got {type(policy).__name__} {policy!r}.")
  if policy in _FACTORIES:
    # Callable too, so accepted, and then failed inside remat with an
    # unexpected keyword argument.
    raise TypeError(f"saving_products: `policy` is {policy.__name__}, which makes a policy;"
                    f" pass the policy it returns, e.g. saving_products({policy.__name__}(...)).")
  return jax.checkpoint_policies.save_from_both_policies(
      policy, jax.checkpoint_policies.save_only_these_names(PRODUCT_NAME))


dots_saveable = saving_products(jax.checkpoint_policies.dots_saveable)
dots_with_no_batch_dims_saveable = saving_products(
    jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
# JAX's other names of the same two policies.
checkpoint_dots = dots_saveable
checkpoint_dots_with_no_batch_dims = dots_with_no_batch_dims_saveable

__all__ = ["PRODUCT_NAME", "checkpoint_dots", "checkpoint_dots_with_no_batch_dims",
           "dots_saveable", "dots_with_no_batch_dims_saveable", "saving_products"]
