"""Checks that real torch reads what the torch_dcp writers produce (ctest torch_dcp_torch_reads).

Usage: python torch_reads_check.py FIXTURE_TOOL WORK_DIR
Runs FIXTURE_TOOL (torch_dcp_write_fixture) to write archives and DCP checkpoints into WORK_DIR,
then loads them with torch: torch.load(weights_only=True) for the archives (and compares them
byte for byte with torch.save's output up to its optional serialization id record), and
FileSystemReader.read_metadata / dcp.load for the checkpoints. Exits 77 (skipped) without torch.
"""
import io
import os
import shutil
import subprocess
import sys
import warnings
import zipfile

try:
    import torch
    import torch.distributed.checkpoint as dcp
except Exception as e:  # noqa: BLE001
    print(f"torch is not importable ({e}); skipping")
    sys.exit(77)

warnings.filterwarnings("ignore")
DTYPES = ["bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64", "float16",
          "bfloat16", "float32", "float64", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2",
          "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"]


def pattern(dtype, nbytes, seed):
    if dtype == torch.bool:
        return bytes(k % 2 for k in range(nbytes))
    return bytes((k * 31 + seed * 7 + 1) % 256 for k in range(nbytes))


def raw(t):
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def torch_save_bytes(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def same_as_torch_save(ours, obj, what):
    theirs = torch_save_bytes(obj)
    info = zipfile.ZipFile(io.BytesIO(theirs)).getinfo("archive/.data/serialization_id")
    common = info.header_offset
    assert ours[:common] == theirs[:common], f"{what}: differs from torch.save before byte {common}"


def check_tensors(out):
    for seed, name in enumerate(DTYPES):
        path = os.path.join(out, f"tensor_{name}.pt")
        t = torch.load(path, weights_only=True)
        dtype = getattr(torch, name)
        assert t.dtype == dtype and tuple(t.shape) == (2, 3), (name, t.dtype, t.shape)
        assert raw(t) == pattern(dtype, 6 * t.element_size(), seed), name
        with open(path, "rb") as f:
            ours = f.read()
        same_as_torch_save(ours, t, name)
        assert zipfile.ZipFile(path).testzip() is None, f"{name}: CRC-32 mismatch"
    sd = torch.load(os.path.join(out, "state_dict.bin"), weights_only=True)
    expected = [("model.weight", torch.bfloat16, (3, 4)), ("model.bias", torch.float32, (3,)),
                ("scale", torch.float8_e4m3fn, ()), ("count", torch.int64, (2,))]
    assert list(sd) == [e[0] for e in expected], list(sd)
    for i, (key, dtype, shape) in enumerate(expected):
        t = sd[key]
        assert t.dtype == dtype and tuple(t.shape) == shape, key
        assert raw(t) == pattern(dtype, t.numel() * t.element_size(), 100 + i), key
    with open(os.path.join(out, "state_dict.bin"), "rb") as f:
        same_as_torch_save(f.read(), sd, "state_dict.bin")
    obj = torch.load(os.path.join(out, "object.pt"), weights_only=True)
    want = {"lr": 0.25, "steps": [1, -2, 2**40], "betas": (0.9, 0.95), "name": "café",
            "flags": {"on": True, "none": None}, "raw": b"\x00\x01\xff"}
    assert obj == want, obj


def check_checkpoint(path):
    md = dcp.FileSystemReader(path).read_metadata()
    assert md.version == "1.0.0" and md.planner_data["w"] == ("w",), md
    state = {"w": torch.zeros(4, 3), "b": torch.zeros(5, dtype=torch.bfloat16), "step": 0, "name": ""}
    dcp.load(state, checkpoint_id=path)
    want_w = torch.arange(12, dtype=torch.float32).reshape(4, 3) + 0.5
    assert torch.equal(state["w"], want_w), state["w"]
    assert raw(state["b"]) == pattern(torch.bfloat16, 10, 7), state["b"]
    assert state["step"] == 42 and state["name"] == "shardpoint", state
    # A partial load: only 'w', with the other keys left in the checkpoint.
    part = {"w": torch.zeros(4, 3)}
    dcp.load(part, checkpoint_id=path, planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    assert torch.equal(part["w"], want_w)


def main():
    tool, out = sys.argv[1], sys.argv[2]
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    subprocess.run([tool, out], check=True)
    check_tensors(out)
    check_checkpoint(os.path.join(out, "dcp"))
    check_checkpoint(os.path.join(out, "dcp_zstd"))
    print("torch", torch.__version__, "read every archive and checkpoint")


if __name__ == "__main__":
    main()
