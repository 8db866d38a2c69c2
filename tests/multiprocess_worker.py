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
  p.add_argument("flags", nargs=argparse.REMAINDER, help="-- then sharded_train's flags")
  args = p.parse_args(argv)
  flags = [f for f in args.flags if f != "--"]

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
