"""Worker of tests/test_routing_distributed.py: one of 2 CPU processes (gloo), DDP or FSDP2 ``fully_shard``."""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist


def run(rank: int, world: int, init_file: str, out_file: str) -> None:
    sys.path.insert(0, __file__.rsplit("/", 1)[0])  # when started as a script
    from modelpatch.routing import find_router_sites, record_routing, replay_routing
    from routing_models import perturb_routers, tiny_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = tiny_model("qwen3_moe")
        ids = torch.randint(3, 128, (4, 8), generator=torch.Generator().manual_seed(0))
        with torch.no_grad(), record_routing(model) as trace:
            model(ids)
        perturb_routers(model)  # replayed indices now differ from what the live routers would pick
        model.train()

        # single-process reference: the whole batch
        ref = copy.deepcopy(model)
        with replay_routing(ref, trace):
            ref_loss = ref(ids, labels=ids).loss
        ref_loss.backward()
        ref_grads = [s.module.weight.grad.clone() for s in find_router_sites(ref)[0]]

        mine = list(range(rank * 2, rank * 2 + 2))
        results = {}
        for wrapper in ("ddp", "fsdp2"):
            local = copy.deepcopy(model)
            if wrapper == "ddp":
                from torch.nn.parallel import DistributedDataParallel

                wrapped = DistributedDataParallel(local)
            else:
                from torch.distributed.fsdp import fully_shard

                for layer in local.model.layers:
                    fully_shard(layer)
                fully_shard(local)
                wrapped = local
            with replay_routing(wrapped, trace.select(mine)):
                loss = wrapped(ids[mine], labels=ids[mine]).loss
            loss.backward()
            avg = loss.detach().clone()
            dist.all_reduce(avg)
            avg /= world
            grads = []
            for s in find_router_sites(wrapped)[0]:
                g = s.module.weight.grad
                grads.append(g.full_tensor() if hasattr(g, "full_tensor") else g)
            results[wrapper] = {
                "loss_diff": float((avg - ref_loss.detach()).abs()),
                "grad_diff": max(float((g - r).abs().max()) for g, r in zip(grads, ref_grads)),
                "grad_norm": min(float(r.abs().sum()) for r in ref_grads),
            }
        if rank == 0:
            torch.save(results, out_file)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    run(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
