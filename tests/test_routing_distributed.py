"""Replay under torch.distributed: 2 CPU processes (gloo), DDP and FSDP2 ``fully_shard``, give the same loss and
router gradients as one process on the whole batch. The test starts the processes itself (forkserver with
torch / transformers preloaded, so the two workers do not each pay the import)."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from routing_dist_worker import run


@pytest.mark.slow
def test_replay_two_processes_ddp_and_fsdp2_match_single_process(tmp_path):
    init_file, out_file = tmp_path / "init", tmp_path / "out.pt"
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "transformers", "routing_models", "modelpatch.routing", "routing_dist_worker"])
    procs = [ctx.Process(target=run, args=(rank, 2, str(init_file), str(out_file))) for rank in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0, 0], "a worker failed (its traceback is in the captured stderr)"
    results = torch.load(out_file)
    assert set(results) == {"ddp", "fsdp2"}
    for wrapper, result in results.items():
        assert result["grad_norm"] > 0, wrapper
        assert result["loss_diff"] < 1e-6, (wrapper, result)
        assert result["grad_diff"] < 1e-6, (wrapper, result)
