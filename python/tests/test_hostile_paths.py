"""Hostile inputs of issue 13 seen from Python: malformed JSON objects and attributes of a native
checkpoint (defect 10), FIFOs in place of checkpoint files (defect 5) and symbolic links out of a
checkpoint (defect 6). Each hostile checkpoint is written here through the core's own save, with
the bad payload or attribute given verbatim."""

import os
import subprocess
import sys

import numpy as np
import pytest

import shardpoint as sp
from shardpoint import _core

PATHS_KEY = "python.state_dict_paths"


def _save(path, objects=(), attributes=None):
    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    options = _core.SaveOptions() if attributes is None else _core.SaveOptions(attributes=attributes)
    _core.save(str(path), [("w", "float32", (3, 4), [((0, 0), (3, 4), array)])], list(objects), options)
    return array


@pytest.mark.parametrize("payload, raw_error", [
    (b"{not json", "JSONDecodeError"),
    (b"\"\xff\xfe\"", "UnicodeDecodeError"),
    (b"[" * 200000 + b"]" * 200000, "nested too deeply"),
])
def test_bad_json_object_is_a_corrupt_error_naming_checkpoint_and_key(tmp_path, payload, raw_error):
    path = tmp_path / "ckpt"
    _save(path, [("opt.step", "json", payload)])
    with pytest.raises(sp.CheckpointCorruptError) as info:
        sp.load_full(path)
    message = str(info.value)
    assert message.startswith(f"{path}: object 'opt.step' (encoding 'json')"), message
    assert raw_error in message
    state = {"w": np.zeros((3, 4), np.float32), "opt": {"step": 0}}
    with pytest.raises(sp.CheckpointCorruptError, match=r"object 'opt.step' \(encoding 'json'\)"):
        sp.load(state, path)


@pytest.mark.parametrize("encoded, problem", [
    ("[[\"w\", [\"w\"]", "is not valid: JSONDecodeError"),
    ("[[\"w\"]]", "is not valid: ValueError"),
    ("[1]", "does not list [key, [path components]] pairs: TypeError"),
    ("[" * 200000 + "]" * 200000, "is nested too deeply to decode"),
])
def test_bad_paths_attribute_is_a_corrupt_error_naming_the_key(tmp_path, encoded, problem):
    path = tmp_path / "ckpt"
    _save(path, attributes={PATHS_KEY: encoded})
    with pytest.raises(sp.CheckpointCorruptError) as info:
        sp.load_full(path)
    assert str(info.value) == f"{path}: attribute {PATHS_KEY!r} {problem}" or \
        str(info.value).startswith(f"{path}: attribute {PATHS_KEY!r} {problem}"), str(info.value)


def _data_file(path):
    return next(n for n in sorted(os.listdir(path)) if n.endswith(".safetensors"))


def test_fifo_data_file_is_refused_not_waited_on(tmp_path):
    path = tmp_path / "ckpt"
    _save(path)
    name = _data_file(path)
    os.remove(path / name)
    os.mkfifo(path / name)
    # In a child with a time limit: a reader that blocks on the FIFO fails the test, not hangs it.
    script = ("import sys, shardpoint as sp\n"
              "try:\n    sp.load_full(sys.argv[1])\n"
              "except sp.CheckpointCorruptError as e:\n    print(e)\n")
    child = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True,
                           timeout=60, env=dict(os.environ))
    assert child.returncode == 0, child.stderr
    assert f"{path / name}: it is a FIFO (named pipe), not a regular file" in child.stdout


def test_failed_allocation_is_a_checkpoint_error(tmp_path):
    # A 64 GiB sparse native metadata file read under a 4 GB address-space limit: the allocation
    # for it fails inside the core, which must surface as a CheckpointError naming the cause, not
    # as a bare MemoryError or an abort.
    path = tmp_path / "huge"
    path.mkdir()
    with open(path / "shardpoint.metadata", "wb") as f:
        f.truncate(64 << 30)
    script = ("import resource, sys, shardpoint as sp\n"
              "resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))\n"
              "try:\n    sp.inspect(sys.argv[1])\n"
              "except sp.CheckpointError as e:\n    print(type(e).__name__, e.code, e)\n")
    child = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True,
                           timeout=120, env=dict(os.environ))
    assert child.returncode == 0, child.stderr
    assert child.stdout.startswith("CheckpointError RESOURCE_EXHAUSTED out of memory"), child.stdout


def test_links_out_of_the_checkpoint_need_the_opt_in(tmp_path):
    path = tmp_path / "ckpt"
    array = _save(path)
    name = _data_file(path)
    (tmp_path / "elsewhere").mkdir()
    os.rename(path / name, tmp_path / "elsewhere" / name)
    os.symlink(tmp_path / "elsewhere" / name, path / name)
    with pytest.raises(sp.CheckpointVersionError) as info:
        sp.load_full(path)
    assert f"{path / name}: it is a symbolic link" in str(info.value)
    assert f"to {tmp_path / 'elsewhere' / name}, outside the checkpoint directory" in str(info.value)
    loaded = sp.load_full(path, allow_external_links=True)
    assert np.asarray(loaded["w"]).tobytes() == array.tobytes()
    report = sp.verify(path)
    assert not report.ok and report.defects[0].startswith(f"{name} is a symbolic link to ")
    allowed = sp.verify(path, allow_external_links=True)
    assert allowed.ok and allowed.notes[0].startswith(f"{name} is a symbolic link to ")
    # The same opt-in reaches consolidate (plain and through a key mapping) and mapped loads.
    with pytest.raises(sp.CheckpointVersionError, match="it is a symbolic link"):
        sp.consolidate(path, tmp_path / "hf")
    sp.consolidate(path, tmp_path / "hf", allow_external_links=True)
    mapping = sp.KeyMapping(renames=[("w", "weight")])
    sp.consolidate(path, tmp_path / "hf_mapped", mapping=mapping, allow_external_links=True)
    for out in ("hf", "hf_mapped"):
        exported = sp.load_full(tmp_path / out)
        assert np.asarray(next(iter(exported.values()))).tobytes() == array.tobytes()
    import torch
    target = {"weight": torch.zeros(3, 4)}
    with pytest.raises(sp.CheckpointVersionError, match="it is a symbolic link"):
        sp.load(target, path, mapping=mapping)
    sp.load(target, path, mapping=mapping, allow_external_links=True)
    assert target["weight"].numpy().tobytes() == array.tobytes()


def test_linked_checkpoint_directory_and_links_inside_keep_working(tmp_path):
    path = tmp_path / "step_100"
    array = _save(path)
    name = _data_file(path)
    (path / "blobs").mkdir()
    os.rename(path / name, path / "blobs" / name)
    os.symlink(os.path.join("blobs", name), path / name)
    os.symlink(path, tmp_path / "latest")
    loaded = sp.load_full(tmp_path / "latest")
    assert np.asarray(loaded["w"]).tobytes() == array.tobytes()
    report = sp.verify(tmp_path / "latest")
    assert report.ok and report.notes == [f"{name} is a symbolic link to {path / 'blobs' / name} (inside the checkpoint)"]
