"""The FAKE SGLang server's weight-update group (tests/fakes/fake_sglang_server.py): NOT SGLang.

SGLang 0.5.23 joins a trainer's weight broadcast as its model runner's `WeightUpdater` does
(`sglang/srt/model_executor/model_runner_components/weight_updater.py`):

* `init_weights_update_group`: `init_custom_process_group(backend, init_method="tcp://<address>:
  <port>", world_size, rank=rank_offset + tp_rank, group_name)` (`sglang/srt/utils/common.py`,
  copied here statement for statement: a TCP rendezvous hosted by rank 0, a store under the
  group's prefix, a process group apart from torch's default one, its ranks its own);
* `receive`: one `torch.distributed.broadcast(src=0)` per tensor, in the order of `names`, each
  into an empty tensor of its dtype and shape (`receive_weights_from_distributed`), or one flat
  byte buffer for `load_format: flattened_bucket` (`FlattenedTensorBucket.empty`: each tensor's
  bytes in turn, at an offset aligned to its dtype);
* `destroy_weights_update_group`: `torch.distributed.destroy_process_group` of the named group.

tests/unit/engines/sglang/test_package.py holds `init_custom_process_group` to SGLang's own source. The
fake is TP 1 (tp_rank 0) on CPU, so its groups run gloo whatever `backend` says "nccl" would need.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed
from packaging import version as pkg_version

log = logging.getLogger("fake_sglang")

torch_release = pkg_version.parse(torch.__version__).release


# Copy from pytorch and OpenRLHF to allow creating multiple main groups.
# https://github.com/pytorch/pytorch/blob/main/torch/distributed/distributed_c10d.py
# https://github.com/OpenRLHF/OpenRLHF/blob/main/openrlhf/utils/distributed_util.py
def init_custom_process_group(
    backend=None,
    init_method=None,
    timeout=None,
    world_size=-1,
    rank=-1,
    store=None,
    group_name=None,
    pg_options=None,
    device_id=None,
):
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        default_pg_timeout,
        rendezvous,
    )

    assert (store is None) or (init_method is None), (
        "Cannot specify both init_method and store."
    )

    if store is not None:
        assert world_size > 0, "world_size must be positive if using store"
        assert rank >= 0, "rank must be non-negative if using store"
    elif init_method is None:
        init_method = "env://"

    if backend:  # noqa: SIM108 - SGLang's statement, copied as it is (tests/unit/engines/sglang/test_package.py)
        backend = Backend(backend)
    else:
        backend = Backend("undefined")

    if timeout is None:
        timeout = default_pg_timeout

    # backward compatible API
    if store is None:
        rendezvous_iterator = rendezvous(init_method, rank, world_size, timeout=timeout)
        store, rank, world_size = next(rendezvous_iterator)
        store.set_timeout(timeout)

        # Use a PrefixStore to avoid accidental overrides of keys used by
        # different systems (e.g. RPC) in case the store is multi-tenant.
        store = PrefixStore(group_name, store)

    # NOTE: The pg_options parameter was renamed into backend_options in PyTorch 2.6.0
    # https://github.com/pytorch/pytorch/commit/a0c7029a75628cd5fa8df83c0de0ea98ee7fd844
    # We need to determine the appropriate parameter name based on PyTorch version
    pg_options_param_name = (
        "backend_options" if torch_release >= (2, 6) else "pg_options"
    )
    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        backend,
        store,
        group_name=group_name,
        **{pg_options_param_name: pg_options},
        timeout=timeout,
        device_id=device_id,
    )

    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}

    return pg


class WeightGroups:
    """The named weight-update groups of one model runner (SGLang's `_model_update_group`)."""

    def __init__(self, tp_rank: int = 0):
        self.tp_rank = tp_rank
        self._groups: dict[str, Any] = {}

    def init(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> tuple[bool, str]:
        """SGLang's `init_weights_update_group`: blocks until every member has joined."""
        if group_name == "":
            return False, "Failed to initialize custom process group: Group name cannot be empty."
        rank = rank_offset + self.tp_rank
        log.info(
            "init custom process group: master_address=%s, master_port=%s, rank_offset=%s, rank=%s, "
            "world_size=%s, group_name=%s, backend=%s",
            master_address, master_port, rank_offset, rank, world_size, group_name, backend,
        )  # fmt: skip
        if backend == "nccl" and not torch.cuda.is_available():
            backend = "gloo"  # fake-only: a CPU server cannot join an NCCL group
        try:
            host = master_address.strip("[]")
            init_method = f"tcp://[{host}]:{master_port}" if ":" in host else f"tcp://{host}:{master_port}"
            self._groups[group_name] = init_custom_process_group(
                backend=backend, init_method=init_method, world_size=world_size, rank=rank, group_name=group_name
            )
            return True, "Succeeded to initialize custom process group."
        except Exception as e:  # noqa: BLE001 - SGLang reports any failure in its answer
            message = f"Failed to initialize custom process group: {e}."
            log.error(message)
            return False, message

    def destroy(self, group_name: str) -> tuple[bool, str]:
        """SGLang's `destroy_weights_update_group`."""
        try:
            if group_name in self._groups:
                torch.distributed.destroy_process_group(self._groups.pop(group_name))
                return True, "Succeeded to destroy custom process group."
            return False, "The group to be destroyed does not exist."
        except Exception as e:  # noqa: BLE001
            message = f"Failed to destroy custom process group: {e}."
            log.error(message)
            return False, message

    def receive(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str, load_format: str | None
    ) -> list[tuple[str, torch.Tensor]]:
        """SGLang's `receive_weights_from_distributed` (raises what SGLang's raises: the caller
        answers "Failed to receive weights: <error>")."""
        assert group_name in self._groups, (
            f"Group {group_name} not in {list(self._groups.keys())}. Please call `init_weights_update_group` first."
        )
        group = self._groups[group_name]
        if load_format == "flattened_bucket":
            return _receive_bucket(names, dtypes, shapes, group)
        weights = []
        handles = []
        for name, dtype, shape in zip(names, dtypes, shapes):  # noqa: B905 - as SGLang's
            weight = torch.empty(shape, dtype=getattr(torch, dtype))
            handles.append(torch.distributed.broadcast(weight, src=0, group=group, async_op=True))
            weights.append((name, weight))
        for handle in handles:
            handle.wait()
        return weights


def _receive_bucket(
    names: list[str], dtypes: list[str], shapes: list[list[int]], group: Any
) -> list[tuple[str, torch.Tensor]]:
    """`FlattenedTensorBucket.empty(...)`, one broadcast, then `reconstruct_tensors()`."""
    layout = []
    offset = 0
    for name, dtype_name, shape in zip(names, dtypes, shapes, strict=True):
        dtype = getattr(torch, dtype_name)
        size = torch.Size(shape)
        if any(dim < 0 for dim in size):
            raise ValueError(f"Negative dimension in received tensor {name}: {size}")
        if offset % dtype.itemsize:
            raise ValueError(f"Unaligned received tensor {name}: byte offset {offset}, dtype {dtype}")
        nbytes = size.numel() * dtype.itemsize
        layout.append((name, dtype, size, offset, nbytes))
        offset += nbytes
    if not layout:
        raise ValueError("Cannot create empty tensor bucket")
    flat = torch.empty(offset, dtype=torch.uint8)
    torch.distributed.broadcast(flat, src=0, group=group)
    return [(name, flat[o : o + n].view(dtype).reshape(size)) for name, dtype, size, o, n in layout]
