"""`torchrun --nproc-per-node N -m orthoptim.train [flags]`: one rank of `orthoptim train`.

A stop signal (SIGTERM, --save-on-signal's) ends every rank once the step is saved, with exit
status `Preempted.EXIT_CODE` and, from rank 0, one line."""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch.distributed as dist

from orthoptim.train.cli import add_train_arguments, train_args_from
from orthoptim.train.launcher import run
from orthoptim.train.loop import Preempted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m orthoptim.train")
    add_train_arguments(parser)
    args = train_args_from(parser.parse_args(argv))
    try:
        result = run(args)
    except Preempted as stop:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"orthoptim: {stop}", file=sys.stderr)
        return stop.exit_code
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0 and "nothing_to_do" in result:
        print(result["nothing_to_do"])
    elif int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({k: result.get(k) for k in ("last_step", "final_val_loss")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
