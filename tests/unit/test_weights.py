"""serve_app/weights/checkpoint.py (and safetensors_file.py) with real safetensors files under
tmp_path: which paths name one checkpoint,
the header-only check against the served model's checkpoint, and the messages of each refusal
(cause and fix, no absolute path of the server)."""

from __future__ import annotations

import json
import logging
import os
import struct
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from serve_app.weights import checkpoint as weights
from serve_app.weights.checkpoint import (
    check_checkpoint,
    checkpoint_files,
    checkpoint_tensors,
    read_header,
    read_state_dict,
    resolve_weights_path,
    stage_weights,
)
from serve_app.weights.safetensors_file import TensorInfo, WeightsError

STATE = {
    "model.embed_tokens.weight": torch.randn(16, 4),
    "model.layers.0.mlp.weight": torch.randn(4, 4),
    "model.norm.weight": torch.ones(4),
    "lm_head.weight": torch.randn(16, 4),
}


def save(state: dict[str, torch.Tensor], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    return path


def save_sharded(state: dict[str, torch.Tensor], directory: Path, shards: int = 2) -> Path:
    """`state` as a sharded checkpoint with its index, as save_pretrained writes one."""
    names = sorted(state)
    weight_map = {}
    for i in range(shards):
        shard = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        save({k: state[k] for k in part}, directory / shard)
        weight_map.update(dict.fromkeys(part, shard))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return directory


def raw_safetensors(path: Path, header: dict, data: bytes = b"", length: int | None = None) -> Path:
    """A file with `header` as its JSON header, as is (valid or not), then `data`."""
    body = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body) if length is None else length) + body + data)
    return path


@pytest.fixture
def wd(tmp_path: Path) -> Path:
    d = tmp_path / "weights"
    d.mkdir()
    return d


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A served model's directory: its checkpoint beside its config."""
    d = tmp_path / "model"
    save(STATE, d / "model.safetensors")
    (d / "config.json").write_text("{}")
    return d


def refused(tmp_path: Path, fn, *args, naming: tuple[str, ...]) -> str:
    """The message of the WeightsError `fn(*args)` raises: it names every text in `naming` and no
    absolute path of the server."""
    with pytest.raises(WeightsError) as err:
        fn(*args)
    msg = str(err.value)
    for text in naming:
        assert text in msg, (text, msg)
    assert str(tmp_path) not in msg, msg
    assert "Traceback" not in msg, msg
    return msg


# -- accepted: one checkpoint -------------------------------------------------------------------


def test_a_file_relative_or_absolute_inside_weights_dir(wd: Path):
    f = save(STATE, wd / "v1.safetensors")
    assert resolve_weights_path("v1.safetensors", wd) == f.resolve()
    assert resolve_weights_path(str(f), wd) == f.resolve()
    assert resolve_weights_path("./sub/../v1.safetensors", wd) == f.resolve()
    assert checkpoint_files(f) == [f]


def test_a_directory_holding_one_file_and_other_files(wd: Path):
    d = wd / "v1"
    save(STATE, d / "model.safetensors")
    (d / "config.json").write_text("{}")
    (d / ".v2.123.tmp").write_bytes(b"partial")  # not named like a checkpoint: ignored
    assert resolve_weights_path("v1", wd) == d.resolve()
    assert checkpoint_files(d) == [d / "model.safetensors"]
    assert checkpoint_tensors(d)["model.norm.weight"] == TensorInfo("F32", (4,))


def test_a_sharded_directory_with_its_index(wd: Path):
    d = save_sharded(STATE, wd / "v1", shards=3)
    assert resolve_weights_path("v1", wd) == d.resolve()
    assert [f.name for f in checkpoint_files(d)] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert set(checkpoint_tensors(d)) == set(STATE)
    state = read_state_dict(d)
    assert set(state) == set(STATE) and torch.equal(state["lm_head.weight"], STATE["lm_head.weight"])


def test_links_inside_weights_dir_are_followed(wd: Path):
    f = save(STATE, wd / "store" / "v1.safetensors")
    (wd / "v1").mkdir()
    (wd / "v1" / "model.safetensors").symlink_to(f)
    (wd / "latest.safetensors").symlink_to(f)
    assert resolve_weights_path("v1", wd) == (wd / "v1").resolve()
    assert resolve_weights_path("latest.safetensors", wd) == f.resolve()


# -- refused: where the path points -------------------------------------------------------------


def test_outside_weights_dir(tmp_path: Path, wd: Path):
    save(STATE, tmp_path / "elsewhere" / "v1.safetensors")
    msg = refused(tmp_path, resolve_weights_path, "/etc/passwd", wd, naming=("'/etc/passwd'", "outside"))
    assert "relative to weights_dir" in msg
    refused(
        tmp_path,
        resolve_weights_path,
        "../elsewhere/v1.safetensors",
        wd,
        naming=("'../elsewhere/v1.safetensors' is outside the weights directory",),
    )


def test_links_out_of_weights_dir(tmp_path: Path, wd: Path):
    outside = save(STATE, tmp_path / "elsewhere" / "v1.safetensors")
    (wd / "link.safetensors").symlink_to(outside)
    (wd / "linked").mkdir()
    (wd / "linked" / "model.safetensors").symlink_to(outside)
    (wd / "dirlink").symlink_to(outside.parent)
    refused(tmp_path, resolve_weights_path, "link.safetensors", wd, naming=("'link.safetensors' links outside",))
    refused(tmp_path, resolve_weights_path, "dirlink", wd, naming=("'dirlink' links outside",))
    msg = refused(tmp_path, resolve_weights_path, "linked", wd, naming=("linked/model.safetensors links outside",))
    assert "copy the file into weights_dir" in msg


def test_missing_path_is_named_relative_to_weights_dir(tmp_path: Path, wd: Path):
    for path in ("missing.safetensors", str(wd / "missing.safetensors")):
        msg = refused(tmp_path, resolve_weights_path, path, wd, naming=("missing.safetensors does not exist",))
        assert "write the checkpoint there" in msg


def test_a_tilde_path_is_not_expanded(tmp_path: Path, wd: Path, monkeypatch: pytest.MonkeyPatch):
    home = tmp_path / "home"
    save(STATE, home / "v1.safetensors")
    monkeypatch.setenv("HOME", str(home))
    msg = refused(tmp_path, resolve_weights_path, "~/v1.safetensors", wd, naming=("~/v1.safetensors does not exist",))
    assert "'~' is not expanded" in msg
    user = Path("~").expanduser().name  # whichever user runs the tests
    refused(tmp_path, resolve_weights_path, f"~{user}/v1.safetensors", wd, naming=("'~' is not expanded",))
    # Inside weights_dir, a directory named "~" is just a directory.
    f = save(STATE, wd / "~" / "v1.safetensors")
    assert resolve_weights_path("~/v1.safetensors", wd) == f.resolve()


def test_names_the_os_cannot_take(tmp_path: Path, wd: Path):
    refused(tmp_path, resolve_weights_path, "a\0b.safetensors", wd, naming=("cannot be used", "null byte"))
    refused(tmp_path, resolve_weights_path, "a" * 300 + ".safetensors", wd, naming=("cannot be used", "too long"))


# -- refused: not one checkpoint ----------------------------------------------------------------


def test_not_a_safetensors_file(tmp_path: Path, wd: Path):
    (wd / "notes.txt").write_text("hello")
    refused(tmp_path, resolve_weights_path, "notes.txt", wd, naming=("notes.txt is not a .safetensors file",))
    d = save_sharded(STATE, wd / "v1")
    refused(
        tmp_path,
        resolve_weights_path,
        "v1/model.safetensors.index.json",
        wd,
        naming=("is an index", "name the directory"),
    )
    assert d.is_dir()


def fifo_answer(fn, *args) -> BaseException | None:
    """What `fn(*args)` raises within 10 s (a FIFO's open would block it forever)."""
    out: list[BaseException | None] = []

    def run() -> None:
        try:
            fn(*args)
            out.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(10)
    assert out, f"{fn.__name__} blocked on a FIFO"
    return out[0]


def test_a_fifo_named_like_a_checkpoint_does_not_block(tmp_path: Path, wd: Path, model_dir: Path):
    os.mkfifo(wd / "fifo.safetensors")
    err = fifo_answer(resolve_weights_path, "fifo.safetensors", wd)
    assert isinstance(err, WeightsError) and "fifo.safetensors is not a regular file" in str(err), err
    d = wd / "v1"
    save(STATE, d / "model.safetensors")
    os.mkfifo(d / "extra.safetensors")
    err = fifo_answer(resolve_weights_path, "v1", wd)
    assert isinstance(err, WeightsError) and "v1/extra.safetensors is not a regular file" in str(err), err
    err = fifo_answer(check_checkpoint, wd / "fifo.safetensors", model_dir)
    assert isinstance(err, WeightsError) and "not a regular file" in str(err), err
    err = fifo_answer(read_header, wd / "fifo.safetensors")  # the open itself does not block either
    assert isinstance(err, WeightsError) and "not a regular file" in str(err), err


def test_an_empty_directory(tmp_path: Path, wd: Path):
    (wd / "v1").mkdir()
    (wd / "v1" / "config.json").write_text("{}")
    msg = refused(tmp_path, resolve_weights_path, "v1", wd, naming=("v1 holds no .safetensors file",))
    assert "index.json" in msg  # the fix says what to write


def test_two_unrelated_files(tmp_path: Path, wd: Path):
    save(STATE, wd / "v1" / "a.safetensors")
    save(STATE, wd / "v1" / "b.safetensors")
    msg = refused(tmp_path, resolve_weights_path, "v1", wd, naming=("v1 holds 2 .safetensors files", "a.safetensors"))
    assert "keep one checkpoint per directory" in msg and "no .safetensors.index.json" in msg
    refused(tmp_path, checkpoint_files, wd / "v1", naming=("v1 holds 2",))
    refused(tmp_path, read_state_dict, wd / "v1", naming=("v1 holds 2",))
    # weights_dir itself, with versions side by side, is not one checkpoint either
    save(STATE, wd / "v2.safetensors")
    save(STATE, wd / "v3.safetensors")
    refused(tmp_path, resolve_weights_path, ".", wd, naming=("weights_dir itself holds 2",))


def test_shards_the_index_does_not_list(tmp_path: Path, wd: Path):
    d = save_sharded(STATE, wd / "v1")
    save(STATE, d / "consolidated.safetensors")
    msg = refused(
        tmp_path,
        resolve_weights_path,
        "v1",
        wd,
        naming=("v1 holds 1 .safetensors file that model.safetensors.index.json does not list", "consolidated"),
    )
    assert "remove them" in msg


def test_an_index_naming_a_missing_shard(tmp_path: Path, wd: Path):
    d = save_sharded(STATE, wd / "v1")
    (d / "model-00002-of-00002.safetensors").unlink()
    refused(
        tmp_path,
        resolve_weights_path,
        "v1",
        wd,
        naming=("v1/model.safetensors.index.json lists 1 shard missing from v1", "model-00002-of-00002"),
    )


def test_two_indexes(tmp_path: Path, wd: Path):
    d = save_sharded(STATE, wd / "v1")
    (d / "other.safetensors.index.json").write_text((d / "model.safetensors.index.json").read_text())
    refused(tmp_path, resolve_weights_path, "v1", wd, naming=("v1 holds 2 checkpoint indexes",))


@pytest.mark.parametrize(
    "index,naming",
    [
        ("{not json", "is not JSON"),
        (json.dumps({"metadata": {}}), "has no weight_map"),
        (json.dumps({"weight_map": {"a": "../x.safetensors"}}), "not a .safetensors file beside the index"),
        (json.dumps({"weight_map": {"a": 3}}), "not a .safetensors file beside the index"),
    ],
)
def test_a_broken_index(tmp_path: Path, wd: Path, index: str, naming: str):
    d = save_sharded(STATE, wd / "v1")
    (d / "model.safetensors.index.json").write_text(index)
    refused(tmp_path, resolve_weights_path, "v1", wd, naming=("v1/model.safetensors.index.json", naming))


def test_an_index_that_does_not_match_its_shards(tmp_path: Path, wd: Path):
    d = save_sharded(STATE, wd / "v1")
    # A stale second shard: one tensor the index maps to it is not there, one it maps to the first
    # shard is (in both shards: which copy is meant?).
    stale = {k: STATE[k] for k in ("model.norm.weight", "lm_head.weight")}
    save(stale, d / "model-00002-of-00002.safetensors")
    msg = refused(
        tmp_path,
        resolve_weights_path,
        "v1",
        wd,
        naming=(
            "v1/model.safetensors.index.json does not match its shards",
            "1 tensor it maps not in its shard (model.embed_tokens.weight (in model-00002-of-00002",
            "1 tensor in a shard it does not map it to (lm_head.weight (in model-00002-of-00002",
        ),
    )
    assert "write the checkpoint again" in msg
    refused(tmp_path, checkpoint_tensors, d, naming=("does not match its shards",))


# -- refused: not a valid safetensors file ------------------------------------------------------


def test_garbage(tmp_path: Path, wd: Path):
    (wd / "bad.safetensors").write_bytes(b"\x00\x01 this is not a safetensors file \xff" * 10)
    refused(
        tmp_path,
        resolve_weights_path,
        "bad.safetensors",
        wd,
        naming=("bad.safetensors is not a readable safetensors file", "header length"),
    )
    (wd / "tiny.safetensors").write_bytes(b"\x01\x02")
    refused(tmp_path, resolve_weights_path, "tiny.safetensors", wd, naming=("fewer than the 8-byte header length",))


def test_a_truncated_header(tmp_path: Path, wd: Path, model_dir: Path):
    data = save(STATE, wd / "full.safetensors").read_bytes()
    (wd / "cut.safetensors").write_bytes(data[:40])  # the header length, then part of the header
    refused(
        tmp_path,
        resolve_weights_path,
        "cut.safetensors",
        wd,
        naming=("cut.safetensors is not a readable safetensors file", "only 32 follow"),
    )
    refused(tmp_path, check_checkpoint, wd / "cut.safetensors", model_dir, naming=("cut.safetensors", "only 32 follow"))


def test_a_header_length_beyond_the_file_or_any_header(tmp_path: Path, wd: Path):
    raw_safetensors(wd / "long.safetensors", {}, length=10_000)
    refused(tmp_path, read_header, wd / "long.safetensors", naming=("reads 10000 bytes but only 2 follow",))
    raw_safetensors(wd / "huge.safetensors", {}, length=2**63)
    refused(tmp_path, read_header, wd / "huge.safetensors", naming=("more than safetensors allows",))


@pytest.mark.parametrize(
    "header,data,naming",
    [
        ([1, 2], b"", "not a JSON object"),
        ({"a": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4, "unknown dtype 'Q7'"),
        ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4, "invalid shape"),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, b"\0" * 4, "invalid data_offsets"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4, "takes 8 bytes"),
        ({"a": "F32"}, b"", "not an object"),
        (
            {
                "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                "b": {"dtype": "F32", "shape": [1], "data_offsets": [2, 6]},
            },
            b"\0" * 6,
            "overlap or gap",
        ),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 9, "5 bytes after its last tensor"),
        ({"__metadata__": {"format": 1}}, b"", "__metadata__"),
    ],
)
def test_an_invalid_header(tmp_path: Path, wd: Path, header, data: bytes, naming: str):
    raw_safetensors(wd / "x.safetensors", header, data)
    refused(tmp_path, read_header, wd / "x.safetensors", naming=("x.safetensors is not a readable safetensors", naming))


def test_a_header_naming_a_tensor_twice(tmp_path: Path, wd: Path):
    body = b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}'
    (wd / "x.safetensors").write_bytes(struct.pack("<Q", len(body)) + body + b"\0\0")
    refused(tmp_path, read_header, wd / "x.safetensors", naming=("not JSON", "'a' twice"))


def test_a_valid_header_as_safetensors_writes_it(wd: Path):
    state = {"a": torch.zeros(3, dtype=torch.bfloat16), "b": torch.zeros(0), "c": torch.zeros(2, 3, dtype=torch.int64)}
    f = save(state, wd / "x.safetensors")
    assert read_header(f) == {
        "a": TensorInfo("BF16", (3,)),
        "b": TensorInfo("F32", (0,)),
        "c": TensorInfo("I64", (2, 3)),
    }


def test_tensor_data_cut_short(tmp_path: Path, wd: Path):
    """A copy cut short: its header is intact, its size gives it away (no data read)."""
    data = save(STATE, wd / "full.safetensors").read_bytes()
    (wd / "truncated.safetensors").write_bytes(data[:-10])
    msg = refused(
        tmp_path,
        resolve_weights_path,
        "truncated.safetensors",
        wd,
        naming=("truncated.safetensors is not a readable safetensors file", "cut short"),
    )
    assert "copy the whole file" in msg


# -- check_checkpoint: the served model's names, dtypes and shapes, from the headers ------------------


def test_check_accepts_the_served_models_own_tensors(wd: Path, model_dir: Path):
    new = {k: v + 1 for k, v in STATE.items()}
    check_checkpoint(save(new, wd / "v1.safetensors"), model_dir)
    check_checkpoint(save_sharded(new, wd / "v2"), model_dir)
    check_checkpoint(save(new, wd / "v3" / "model.safetensors").parent, model_dir / "model.safetensors")


def test_check_against_a_sharded_reference(wd: Path, tmp_path: Path):
    ref = save_sharded(STATE, tmp_path / "served")
    save(STATE, ref / "consolidated.safetensors")  # a second copy some model repos carry: not the checkpoint
    check_checkpoint(save(STATE, wd / "v1.safetensors"), ref)
    with pytest.raises(WeightsError, match="missing"):
        check_checkpoint(save({"lm_head.weight": STATE["lm_head.weight"]}, wd / "v2.safetensors"), ref)


def test_check_names_each_kind_of_difference(tmp_path: Path, wd: Path, model_dir: Path):
    new = dict(STATE)
    del new["model.norm.weight"]  # missing
    new["transformer.extra"] = torch.zeros(2)  # unexpected
    new["lm_head.weight"] = STATE["lm_head.weight"].to(torch.bfloat16)  # wrong dtype
    new["model.embed_tokens.weight"] = STATE["model.embed_tokens.weight"][:-1]  # wrong shape
    msg = refused(
        tmp_path,
        check_checkpoint,
        save(new, wd / "v2.safetensors"),
        model_dir,
        naming=(
            "v2.safetensors does not fit the served model",
            "1 of the served model's 4 tensors missing (model.norm.weight)",
            "1 unexpected tensor (transformer.extra)",
            "1 tensor of the wrong dtype (lm_head.weight is BF16, served F32)",
            "1 tensor of the wrong shape (model.embed_tokens.weight is [15, 4], served [16, 4])",
            "Fix: publish a checkpoint of the model the app serves",
        ),
    )
    assert "Traceback" not in msg


def test_check_lists_the_first_few_with_counts(tmp_path: Path, wd: Path, model_dir: Path):
    renamed = {f"transformer.{k}": v for k, v in STATE.items()}
    msg = refused(
        tmp_path,
        check_checkpoint,
        save(renamed, wd / "names.safetensors"),
        model_dir,
        naming=("4 of the served model's 4 tensors missing", "4 unexpected tensors", "and 1 more"),
    )
    first = sorted(renamed)[0]
    assert first in msg and sorted(renamed)[-1] not in msg


def test_check_names_a_sharded_checkpoint_by_its_directory(tmp_path: Path, wd: Path, model_dir: Path):
    d = save_sharded({k: v for k, v in STATE.items() if k != "lm_head.weight"}, wd / "v2")
    refused(tmp_path, check_checkpoint, d, model_dir, naming=("v2/ does not fit the served model", "lm_head.weight"))
    d3 = wd / "v3"
    save(STATE, d3 / "a.safetensors")
    save(STATE, d3 / "b.safetensors")
    refused(tmp_path, check_checkpoint, d3, model_dir, naming=("v3 holds 2 .safetensors files",))


def test_check_refuses_an_unreadable_served_checkpoint(tmp_path: Path, wd: Path, model_dir: Path):
    (model_dir / "model.safetensors").write_bytes(b"garbage!" * 4)
    refused(
        tmp_path,
        check_checkpoint,
        save(STATE, wd / "v1.safetensors"),
        model_dir,
        naming=("the served model's checkpoint", "model.safetensors is not a readable safetensors file"),
    )


def test_check_skips_a_served_model_without_safetensors(tmp_path: Path, wd: Path, caplog: pytest.LogCaptureFixture):
    served = tmp_path / "bin-model"
    served.mkdir()
    (served / "pytorch_model.bin").write_bytes(b"\0")
    with caplog.at_level(logging.WARNING, logger="serve_app.weights"):
        check_checkpoint(save(STATE, wd / "v1.safetensors"), served)
    assert "no safetensors checkpoint" in caplog.text


def test_check_logs_full_paths_that_the_message_leaves_out(
    tmp_path: Path, wd: Path, model_dir: Path, caplog: pytest.LogCaptureFixture
):
    f = save({"x": torch.zeros(1)}, wd / "v1.safetensors")
    with caplog.at_level(logging.WARNING, logger="serve_app.weights"), pytest.raises(WeightsError) as err:
        check_checkpoint(f, model_dir)
    assert str(f) in caplog.text and str(f) not in str(err.value)


# -- headers only: no tensor data is read ----------------------------------------------------------


def patch_reads(mp: pytest.MonkeyPatch) -> dict[str, list[tuple[int, int]]]:
    """Record every (offset, length) read through os.pread, per file name; os.read, mmap and the
    safetensors loader fail outright."""
    seen: dict[str, list[tuple[int, int]]] = {}
    real_pread = os.pread

    def pread(fd: int, length: int, offset: int) -> bytes:
        seen.setdefault(Path(os.readlink(f"/proc/self/fd/{fd}")).name, []).append((offset, length))
        return real_pread(fd, length, offset)

    def forbidden(*_a, **_k):
        raise AssertionError("tensor data read")

    mp.setattr(os, "pread", pread)
    mp.setattr(os, "read", forbidden)
    mp.setattr(weights, "load_file", forbidden)
    mp.setattr("mmap.mmap", forbidden)
    return seen


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[tuple[int, int]]]:
    return patch_reads(monkeypatch)


def header_end(path: Path) -> int:
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def test_check_reads_nothing_past_the_headers(wd: Path, model_dir: Path, tmp_path: Path):
    new = save_sharded(STATE, wd / "v1")
    ends = {p.name: header_end(p) for p in [*new.glob("*.safetensors"), model_dir / "model.safetensors"]}
    big = tmp_path / "big"
    big.mkdir()
    # A 4 GiB tensor the file does not really hold (sparse): checking it costs its header only.
    header = json.dumps({"w": {"dtype": "F32", "shape": [2**30], "data_offsets": [0, 2**32]}}).encode()
    with open(big / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + 2**32)
    ends["model.safetensors"] = max(ends["model.safetensors"], 8 + len(header))

    def within_headers(seen: dict[str, list[tuple[int, int]]]) -> None:
        assert seen
        for name, spans in seen.items():
            if name.endswith(".safetensors"):
                assert all(off + n <= ends[name] for off, n in spans), (name, spans, ends[name])

    seen: dict[str, list[tuple[int, int]]] = {}
    for call in (
        lambda: check_checkpoint(new, model_dir),
        lambda: resolve_weights_path("v1", wd),
        lambda: check_checkpoint(big / "model.safetensors", big),
    ):
        with pytest.MonkeyPatch.context() as mp:
            seen = patch_reads(mp)
            call()
        within_headers(seen)


def test_a_cut_short_file_is_refused_from_its_size_before_any_data_is_read(
    tmp_path: Path, wd: Path, model_dir: Path, reads: dict[str, list[tuple[int, int]]]
):
    f = save(STATE, wd / "full.safetensors")
    end = header_end(f)
    data = f.read_bytes()
    (wd / "truncated.safetensors").write_bytes(data[: end + 3])  # the header, then 3 bytes of data
    refused(tmp_path, check_checkpoint, wd / "truncated.safetensors", model_dir, naming=("cut short",))
    assert all(off + n <= end for off, n in reads["truncated.safetensors"]), reads


# -- reading and staging ------------------------------------------------------------------------


def test_read_state_dict_of_a_file(wd: Path):
    state = read_state_dict(save(STATE, wd / "v1.safetensors"))
    assert all(torch.equal(state[k], v) for k, v in STATE.items())


def test_stage_weights(wd: Path, tmp_path: Path):
    f = save(STATE, wd / "v1.safetensors")
    staged = stage_weights(f, tmp_path / "staging")
    assert checkpoint_files(staged) == [staged / "model.safetensors"]
    assert (staged / "model.safetensors").resolve() == f.resolve()
    d = save_sharded(STATE, wd / "v2")
    assert stage_weights(d, tmp_path / "staging") == d
