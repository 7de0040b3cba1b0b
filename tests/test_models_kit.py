"""The model kit under a row of sibling stages (issue 44): the package graph, the moved modules.

What two stages share lives in ``privcode.models`` (or data, artifacts): no stage imports
another, the kit and the formats import no stage, and the packages form no cycle
(function-level imports count: grimp reads them). The junior release's format checks
(``privcode.artifacts.junior``) run without torch.
"""

from __future__ import annotations

import importlib.util
import json
import struct
import subprocess
import sys
from pathlib import Path

import grimp
import pytest
import torch
from conftest import privacy_record
from safetensors.torch import save_file

STAGES = ("train", "synth", "premium", "eval", "audit", "pac")
#: Layers below the stages: none of them may import a stage.
KIT = ("models", "data", "artifacts", "privacy", "dp", "cluster", "config", "sandbox")


@pytest.fixture(scope="module")
def package_edges() -> set[tuple[str, str]]:
    """(importer, imported) between privcode's subpackages, function-level imports included."""
    graph = grimp.build_graph("privcode", cache_dir=None)
    edges = set()
    for module in graph.modules:
        for imported in graph.find_modules_directly_imported_by(module):
            a, b = module.split(".")[1:2], imported.split(".")[1:2]
            if a and b and a != b:
                edges.add((a[0], b[0]))
    return edges


def test_no_stage_imports_another_stage(package_edges):
    sideways = sorted((a, b) for a, b in package_edges if a in STAGES and b in STAGES)
    assert sideways == []


def test_the_kit_and_the_layers_below_it_import_no_stage(package_edges):
    upward = sorted((a, b) for a, b in package_edges if a in KIT and b in STAGES)
    assert upward == []


def test_the_packages_form_no_cycle(package_edges):
    reach: dict[str, set[str]] = {}
    for a, b in package_edges:
        reach.setdefault(a, set()).add(b)

    def reachable(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in reach.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    cyclic = sorted(p for p in reach if p in reachable(p))
    assert cyclic == []


def test_the_moved_modules_are_gone():
    for old in (
        "privcode.release",
        "privcode.train.data",
        "privcode.train.ray_train",
        "privcode.audit.nondp",
        "privcode.synth.rowint8",
    ):
        assert importlib.util.find_spec(old) is None, old


def _tiny_release(tmp_path: Path) -> Path:
    from privcode.train.release import write_release

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    save_file(
        {"m.lora_A.weight": torch.zeros(2, 3), "m.lora_B.weight": torch.ones(3, 2)},
        str(adapter / "adapter_model.safetensors"),
    )
    meta = {"method": "privcode", "conditioning": "prompt", "dp": True, "base_model": "b"}
    return write_release(tmp_path / "rel", adapter_dir=adapter, meta=meta, privacy=privacy_record())


def test_release_json_is_a_typed_record_checked_without_torch(tmp_path):
    rel = _tiny_release(tmp_path)
    code = (
        "import sys\n"
        "from privcode.artifacts.junior import ReleaseRecord, verify_release\n"
        f"meta = verify_release({str(rel)!r})\n"
        f"rec = ReleaseRecord.read({str(rel)!r})\n"
        "assert rec.to_json() == meta and rec.conditioning == 'prompt' and rec.dp is True\n"
        "assert sorted(rec.files) == ['adapter/adapter_config.json',"
        " 'adapter/adapter_model.safetensors', 'privacy.json']\n"
        "print('torch' in sys.modules, 'numpy' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "False"]


def test_tensor_shapes_read_the_header_and_refuse_a_torn_file(tmp_path):
    from safetensors import safe_open

    from privcode.artifacts.junior import tensor_shapes

    path = tmp_path / "t.safetensors"
    save_file({"a": torch.zeros(4, 5), "b": torch.zeros(7), "c": torch.zeros(0, 2)}, str(path))
    with safe_open(str(path), framework="pt") as fh:
        want = {k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()}
    assert tensor_shapes(path) == want == {"a": (4, 5), "b": (7,), "c": (0, 2)}
    data = path.read_bytes()
    (tmp_path / "short.safetensors").write_bytes(data[:-4])
    with pytest.raises(ValueError, match="does not fill the file"):
        tensor_shapes(tmp_path / "short.safetensors")
    (tmp_path / "huge.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(ValueError, match="does not fit the file"):
        tensor_shapes(tmp_path / "huge.safetensors")


def test_a_bad_release_json_names_the_key(tmp_path):
    from privcode.artifacts.junior import ReleaseError, verify_release

    rel = _tiny_release(tmp_path)
    meta = json.loads((rel / "release.json").read_text())
    (rel / "release.json").write_text(json.dumps({**meta, "dp": "yes"}))
    with pytest.raises(ReleaseError, match="release.json: dp: 'yes' is not bool"):
        verify_release(rel)
    (rel / "release.json").write_text(json.dumps({**meta, "prefix": {"dz": 2}}))
    with pytest.raises(ReleaseError, match="has no prefix decoder: prefix must be null"):
        verify_release(rel)


def test_lazy_packages_import_nothing_heavy_and_every_export_resolves():
    """privcode.models, eval, audit and audit.probe re-export lazily (utils.lazy_exports):
    importing them loads no torch; each name in __all__ then resolves to its module's."""
    packages = ("privcode.models", "privcode.eval", "privcode.audit", "privcode.audit.probe")
    code = (
        "import importlib, sys\n"
        f"mods = [importlib.import_module(p) for p in {packages!r}]\n"
        "print('torch' in sys.modules)\n"
        "for mod in mods:\n"
        "    assert mod.__all__ == sorted(mod.__all__) and set(mod.__all__) <= set(dir(mod))\n"
        "    for name in mod.__all__:\n"
        "        value = getattr(mod, name)\n"
        "        assert vars(mod)[name] is value  # kept: the next access costs nothing\n"
        "    try:\n"
        "        mod.no_such_name\n"
        "    except AttributeError as exc:\n"
        "        assert mod.__name__ in str(exc)\n"
        "    else:\n"
        "        raise AssertionError(mod.__name__)\n"
        "print(sum(len(m.__all__) for m in mods))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "81"]
