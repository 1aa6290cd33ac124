"""The CLI's in-process sandbox isolates per context (thread / asyncio task), as the patch scopes do: while a command
runs in-process in one thread, every other thread sees its registries as they were (issue 24, item 5)."""

from __future__ import annotations

import json
import sys
import textwrap
import threading
import types

from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention

from modelpatch import get_patch_mapping, is_strict_patching, register_patch_mapping, set_strict_patching
from modelpatch.cli import main
from modelpatch.conversion import (
    Concatenate,
    WeightConverter,
    clear_checkpoint_conversion_mappings,
    register_checkpoint_conversion_mapping,
)
from modelpatch.conversion.registry import registered_conversion_mappings

CALLERS_RULE = WeightConverter(["q_proj", "k_proj", "v_proj"], ["qkv_proj"], [Concatenate(dim=0)])


class CallersAttention(LlamaAttention):
    """What the calling process registered before running the command (never used to build here)."""


# what the command imports: it reads the registries from inside the sandbox, registers its own, then holds the
# command inside the sandbox until the other thread has read its registries
PATCHES = """
from transformers.models.llama.modeling_llama import LlamaMLP
from modelpatch import get_patch_mapping, is_strict_patching, register_patch_mapping
from modelpatch.conversion import WeightRenaming, register_checkpoint_conversion_mapping
from modelpatch.conversion.registry import registered_conversion_mappings
import _sandbox_sync as sync

sync.seen_by_command = (get_patch_mapping(), registered_conversion_mappings(), is_strict_patching())

class CommandMLP(LlamaMLP):
    pass

register_patch_mapping({"LlamaMLP": CommandMLP})
register_checkpoint_conversion_mapping("llama", [WeightRenaming("mlp.up", "mlp.up_proj")])
sync.barrier.wait()  # 1: the command is inside its sandbox, with its own registrations
sync.barrier.wait()  # 2: the other thread has read its registries
"""


def test_other_threads_see_their_registries_while_a_command_runs_in_process(tmp_path, capsys, monkeypatch):
    sync = types.ModuleType("_sandbox_sync")
    sync.barrier = threading.Barrier(2, timeout=120)
    monkeypatch.setitem(sys.modules, "_sandbox_sync", sync)
    patches = tmp_path / "command_patches.py"
    patches.write_text(textwrap.dedent(PATCHES))

    register_patch_mapping({"LlamaAttention": CallersAttention})
    register_checkpoint_conversion_mapping("llama", [CALLERS_RULE])
    set_strict_patching(True)
    try:
        before = (get_patch_mapping(), registered_conversion_mappings())
        codes = []
        command = threading.Thread(
            target=lambda: codes.append(main(["explain", "--model-type", "llama", "--patches", str(patches), "--json"]))
        )
        command.start()
        try:
            sync.barrier.wait()  # 1
            during = (get_patch_mapping(), registered_conversion_mappings(), is_strict_patching())
        finally:
            sync.barrier.wait()  # 2
            command.join(timeout=300)
        after = (get_patch_mapping(), registered_conversion_mappings(), is_strict_patching())
    finally:
        set_strict_patching(False)
        clear_checkpoint_conversion_mappings()

    # the other thread, while the command was inside its sandbox: exactly what it had registered, strict mode on
    assert during == (*before, True)
    assert during[0] == {"LlamaAttention": CallersAttention}
    assert list(during[1]) == ["llama"] and during[1]["llama"].rules == (CALLERS_RULE,)
    # the command: none of the caller's registrations, strict mode off; its own registrations were in force
    assert sync.seen_by_command == ({}, {}, False)
    assert codes == [0]
    report = json.loads(capsys.readouterr().out)
    layers = LlamaConfig().num_hidden_layers  # --model-type: the default config
    assert report["replaced"] == {"LlamaMLP": {"LlamaMLP -> CommandMLP": layers}}
    # and gone afterwards: the caller's registries are as before
    assert after == (*before, True)


def test_a_sandbox_in_one_asyncio_task_leaves_the_other_tasks_registries_alone():
    """The same per context: a sandbox entered in one asyncio task (where a command's registrations go) is invisible
    to another task of the same thread, and the caller's registrations are back in the task after it."""
    import asyncio

    from modelpatch.cli.sandbox import CommandSandbox

    register_patch_mapping({"LlamaAttention": CallersAttention})
    register_checkpoint_conversion_mapping("llama", [CALLERS_RULE])
    before = (get_patch_mapping(), registered_conversion_mappings())

    async def command(inside: asyncio.Event, done: asyncio.Event) -> tuple:
        with CommandSandbox():
            seen = (get_patch_mapping(), registered_conversion_mappings())
            register_patch_mapping({"LlamaMLP": CallersAttention})
            inside.set()
            await done.wait()
        return seen, (get_patch_mapping(), registered_conversion_mappings())

    async def other(inside: asyncio.Event, done: asyncio.Event) -> tuple:
        await inside.wait()
        try:
            return get_patch_mapping(), registered_conversion_mappings()
        finally:
            done.set()

    async def both() -> tuple:
        inside, done = asyncio.Event(), asyncio.Event()
        return await asyncio.gather(command(inside, done), other(inside, done))

    try:
        (seen_inside, after_in_task), seen_by_other = asyncio.run(both())
    finally:
        clear_checkpoint_conversion_mappings()
    assert seen_inside == ({}, {})
    assert seen_by_other == before
    assert after_in_task == before
