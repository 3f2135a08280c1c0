"""A plain PyTorch program (nothing meshrun-specific): gloo all_reduce over env:// init.
With --fail-first, rank 1 exits 1 on attempt 0 (TORCHELASTIC_RESTART_COUNT: failure restarts,
as under torchrun), after the group formed, so the restart must re-form it on a fresh
MASTER_PORT."""
import os
import sys

import torch
import torch.distributed as dist


def main():
    out_dir = sys.argv[1]
    fail_first = "--fail-first" in sys.argv
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    if fail_first and rank == 1 and attempt == 0:
        sys.exit(1)
    expect = world * (world + 1) / 2
    with open(os.path.join(out_dir, "r%d.a%d" % (rank, attempt)), "w") as f:
        f.write("%g %g" % (t.item(), expect))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
