"""Remote-code modules (trust_remote_code, ``transformers_modules.*``) are patched too."""

import json
import logging
import os
import sys

import torch
import torch.nn as nn
from transformers import AutoConfig, AutoModel

from helpers import modelpatch_records
from modelpatch import patch_report, register_patch_mapping

CONFIGURATION = """
from transformers import PretrainedConfig

class TinyRemoteConfig(PretrainedConfig):
    model_type = "tiny_remote"

    def __init__(self, hidden_size=16, num_blocks=2, **kwargs):
        self.hidden_size = hidden_size
        self.num_blocks = num_blocks
        super().__init__(**kwargs)
"""

MODELING = """
import torch.nn as nn
from transformers import PreTrainedModel
from .configuration_tiny_remote import TinyRemoteConfig

class TinyRemoteBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x):
        return self.proj(x)

class TinyRemoteModel(PreTrainedModel):
    config_class = TinyRemoteConfig

    def __init__(self, config):
        super().__init__(config)
        self.blocks = nn.ModuleList(TinyRemoteBlock(config) for _ in range(config.num_blocks))
        self.post_init()

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x
"""


class DoubledBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x):
        return 2 * self.proj(x)


def write_remote_repo(path):
    (path / "configuration_tiny_remote.py").write_text(CONFIGURATION)
    (path / "modeling_tiny_remote.py").write_text(MODELING)
    (path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "tiny_remote",
                "hidden_size": 16,
                "num_blocks": 2,
                "auto_map": {
                    "AutoConfig": "configuration_tiny_remote.TinyRemoteConfig",
                    "AutoModel": "modeling_tiny_remote.TinyRemoteModel",
                },
            }
        )
    )


def test_remote_code_class_is_replaced(tmp_path):
    write_remote_repo(tmp_path)
    config = AutoConfig.from_pretrained(tmp_path, trust_remote_code=True)
    vanilla = AutoModel.from_config(config, trust_remote_code=True)
    assert [type(b).__name__ for b in vanilla.blocks] == ["TinyRemoteBlock"] * 2
    assert type(vanilla.blocks[0]).__module__.startswith("transformers_modules.")
    vanilla.save_pretrained(tmp_path)

    register_patch_mapping({"TinyRemoteBlock": DoubledBlock})
    patched = AutoModel.from_pretrained(tmp_path, trust_remote_code=True)
    assert [type(b) for b in patched.blocks] == [DoubledBlock] * 2
    assert [r.path for r in patch_report(patched).rows] == ["blocks.0", "blocks.1"]
    x = torch.randn(3, 16)
    with torch.no_grad():
        # weights loaded from the checkpoint into the replacement: output is exactly the vanilla path x2 per block
        expected = vanilla.blocks[1](vanilla.blocks[0](x) * 2) * 2
        assert torch.allclose(patched(x), expected, atol=1e-6)


def test_cli_runs_remote_code_only_with_the_flag_and_never_prompts(tmp_path, capsys, monkeypatch):
    """Without --trust-remote-code a remote-code checkpoint is one line naming the flag (exit 2; it prompted on
    stdin, then blamed config.json); with it, the command runs the checkpoint's code."""
    from modelpatch.cli import main

    write_remote_repo(tmp_path)
    config = AutoConfig.from_pretrained(tmp_path, trust_remote_code=True)
    AutoModel.from_config(config, trust_remote_code=True).save_pretrained(tmp_path)
    patches = tmp_path / "patches.py"
    patches.write_text(
        "import torch.nn as nn\n"
        "class SameBlock(nn.Module):\n"
        "    def __init__(self, config):\n"
        "        super().__init__()\n"
        "        self.proj = nn.Linear(config.hidden_size, config.hidden_size)\n"
        "    def forward(self, x):\n"
        "        return self.proj(x)\n"
        "PATCH_MAPPING = {'TinyRemoteBlock': SameBlock}\n"
    )

    def no_prompt(*args, **kwargs):
        raise AssertionError("the command read stdin")

    monkeypatch.setattr("builtins.input", no_prompt)
    base = ["explain", "--model", str(tmp_path), "--patches", str(patches)]
    for argv in (base, ["verify", "--model", str(tmp_path), "--patches", str(patches)]):
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "pass --trust-remote-code" in err and "auto_map" in err, err
    assert main([*base, "--trust-remote-code", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["replaced"] == {"TinyRemoteBlock": {"TinyRemoteBlock -> SameBlock": 2}}


# -- remote code executed again ---------------------------------------------------------------------------------------


def _remote_checkpoint(path):
    write_remote_repo(path)
    config = AutoConfig.from_pretrained(path, trust_remote_code=True)
    AutoModel.from_config(config, trust_remote_code=True).save_pretrained(path)


def test_remote_code_loaded_again_with_force_download_is_patched(tmp_path, caplog):
    """``force_download=True`` makes Transformers execute the remote module again as a new module object under the
    same name (``sys.modules`` keeps its size); its new classes must be targeted on every such load."""
    _remote_checkpoint(tmp_path)
    register_patch_mapping({"TinyRemoteBlock": DoubledBlock})
    first = AutoModel.from_pretrained(tmp_path, trust_remote_code=True)
    models = [first]
    with caplog.at_level(logging.WARNING, logger="modelpatch"):
        for _ in range(2):
            models.append(AutoModel.from_pretrained(tmp_path, trust_remote_code=True, force_download=True))
    classes = [type(m) for m in models]
    assert len(set(classes)) == 3 and len({c.__module__ for c in classes}) == 1  # new classes, same module name
    for model in models:
        assert [type(b) for b in model.blocks] == [DoubledBlock, DoubledBlock]
        assert [r.path for r in patch_report(model).rows] == ["blocks.0", "blocks.1"]
    assert modelpatch_records(caplog, logging.WARNING) == []


def test_remote_code_module_executed_again_in_place_is_patched(tmp_path, caplog):
    """A new download whose code changed: Transformers executes the cached module file again in the same module
    object (``get_class_in_module`` sees a new hash)."""
    from transformers.dynamic_module_utils import get_class_in_module
    from transformers.utils import HF_MODULES_CACHE

    _remote_checkpoint(tmp_path)
    register_patch_mapping({"TinyRemoteBlock": DoubledBlock})
    first = AutoModel.from_pretrained(tmp_path, trust_remote_code=True)
    assert [type(b) for b in first.blocks] == [DoubledBlock, DoubledBlock]
    module = sys.modules[type(first).__module__]
    with open(module.__file__, "a") as handle:  # the "new download"
        handle.write("\n# revised upstream\n")
    relative = os.path.relpath(module.__file__, HF_MODULES_CACHE)
    model_cls = get_class_in_module("TinyRemoteModel", relative)
    assert sys.modules[type(first).__module__] is module and model_cls is not type(first)
    with caplog.at_level(logging.WARNING, logger="modelpatch"):
        again = model_cls.from_pretrained(tmp_path)
    assert [type(b) for b in again.blocks] == [DoubledBlock, DoubledBlock]
    assert modelpatch_records(caplog, logging.WARNING) == []
