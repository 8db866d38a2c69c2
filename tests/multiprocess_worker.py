"""One process of the runs that tests/test_multiprocess.py launches.

`examples/sharded_train.py`'s `main()` for each of several layouts in a row
(JAX, its compilation and the distributed runtime started once per process,
not once per layout), with `--out` `<checkpoints>/<layout>`. After each
layout, every run's final params and optimizer state are gathered to every
process (`process_allgather`) and process 0 writes them, with the run's
losses and tokens/s and the shardings of its MLP kernels and masks, to
`<results>/<layout>.npz` and `<results>/<layout>.json`.

    python -m tests.multiprocess_worker --results R --checkpoints C \\
        --layouts data,fsdp [--distributed "--coordinator H:P --num-processes N
        --process-id I"] -- <sharded_train flags>
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import sys

import jax
import numpy as np
from jax.experimental import multihost_utils

import jsparse24
from tests.test_examples import load_example


def _spec(a) -> list:
  """A sharding's PartitionSpec as JSON (axis names, lists for several)."""
  return [list(e) if isinstance(e, tuple) else e for e in a.sharding.spec]


def _gathered(out: dict, losses_only: bool) -> tuple[dict, dict]:
  """(arrays, facts) of sharded_train's `main()` result: each run's final
  state gathered whole (every process takes part), its losses, tokens/s and
  the shardings of its MLP kernels and masks."""
  arrays = {}
  meta = {"process_count": jax.process_count(), "device_count": jax.device_count()}
  for run, r in out.items():
    meta[run] = {"losses": r["losses"], "start_step": r["start_step"],
                 "tokens_per_s": r["tokens_per_s"]}
    if losses_only:
      continue
    state = multihost_utils.process_allgather((r["params"], r["opt_state"]), tiled=True)
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
      arrays[f"{run}{jax.tree_util.keystr(path)}"] = np.asarray(leaf)
    mlp = r["params"]["block_0"]["mlp"]
    meta[run]["kernel_specs"] = {name: _spec(mlp[name]["kernel"]) for name in ("up", "down")}
    meta[run]["kernel_devices"] = len(mlp["up"]["kernel"].sharding.device_set)
    if run == "2:4":
      masks = jsparse24.optim.masks(r["opt_state"])["block_0"]["mlp"]
      meta[run]["mask_specs"] = {name: _spec(masks[name]["mask"].packed)
                                 for name in ("up", "down")}
  return arrays, meta


def _cache_writes_from_every_process() -> None:
  """Lets every process, not only process 0, write the persistent
  compilation cache. JAX writes from process 0 only (one writer per shared
  cache folder, e.g. on GCS); here each process compiles programs of its
  own keys, and the restarted pair's process 1 would otherwise compile
  again all that the first pair's process 1 compiled (~30 s on the 2-core
  CPU machine). A hit runs what the compilation would have produced, so the
  bits compared are the same. jax's `_cache_write` checks
  `distributed.global_state.process_id`; it sees 0 during the write."""
  from jax._src import compiler, distributed  # pylint: disable=g-import-not-at-top

  write = compiler._cache_write  # pylint: disable=protected-access

  def every_process(*args, **kwargs):
    process_id = distributed.global_state.process_id
    distributed.global_state.process_id = 0
    try:
      return write(*args, **kwargs)
    finally:
      distributed.global_state.process_id = process_id
  compiler._cache_write = every_process  # pylint: disable=protected-access


def main(argv: list[str]) -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--results", type=pathlib.Path, required=True)
  p.add_argument("--checkpoints", type=pathlib.Path, required=True)
  p.add_argument("--layouts", required=True)
  p.add_argument("--distributed", default="",
                 help="sharded_train's --coordinator, --num-processes and --process-id, as one"
                      " string")
  p.add_argument("--losses-only", action="store_true",
                 help="no params or optimizer state gathered, and each layout's checkpoints"
                      " deleted after it (the GPU preset's are gigabytes)")
  p.add_argument("--cache-every-process", action="store_true",
                 help="every process writes the persistent compilation cache (CPU tests)")
  p.add_argument("flags", nargs=argparse.REMAINDER, help="-- then sharded_train's flags")
  args = p.parse_args(argv)
  flags = [f for f in args.flags if f != "--"]
  if args.cache_every_process:
    _cache_writes_from_every_process()

  example = load_example("sharded_train")
  for layout in args.layouts.split(","):
    # The layout's state is freed before the next one starts (GPU memory).
    arrays, meta = _gathered(
        example.main(args.distributed.split() + flags
                     + ["--layout", layout, "--out", str(args.checkpoints / layout)]),
        args.losses_only)
    multihost_utils.sync_global_devices("multiprocess_worker: layout done")
    if jax.process_index() == 0:
      args.results.mkdir(parents=True, exist_ok=True)
      if arrays:
        np.savez(args.results / f"{layout}.npz", **arrays)
      (args.results / f"{layout}.json").write_text(json.dumps(meta))
      if args.losses_only:
        shutil.rmtree(args.checkpoints / layout)


if __name__ == "__main__":
  main(sys.argv[1:])
