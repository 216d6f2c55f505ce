"""One prefill/decode pair's KV link: a two-rank process group, a handshake, block transfers.

The link is a gloo process group of its own (rank 0 the prefill instance, rank 1 the decode
one), not torch.distributed's default group, so one process can hold a link per peer beside a
tensor-parallel group. A prefill instance listens with one TCP store at its KV address; each
decode instance that connects takes the next pair number from it and the two make their group
over the store's keys of that pair, so one prefill instance serves any number of decode
instances, each over its own link, without a port per pair. On pairing both sides
exchange their KV layout (model, dtypes, block size, layers, KV heads, head size, the cache's
block shape) and refuse a mismatch, naming what differs, before any block moves: bytes of one
layout read as another would be wrong tokens, not an error.

A transfer sends the listed blocks of every layer's K and V cache as one tensor, after a
header (the block count and the tokens they hold); the receiver writes them into blocks of its
own pool, which need not have the same ids. Every wait is bounded by the link's timeout.
Headers and requests always go over gloo. When the two caches are on two different CUDA
devices the blocks themselves go device to device over a second, NCCL group of the pair
(gathered on the device, never staged through host memory); otherwise (CPU, or both on one
GPU, where NCCL refuses two ranks) through host memory over gloo.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

PREFILL, DECODE = 0, 1
_FOREVER_S = 365 * 24 * 3600.0  # a paired decode instance may ask whenever it likes


class TransferError(RuntimeError):
    """The link failed (the peer is gone or timed out) or was refused at the handshake."""


class LeaseGoneError(TransferError):
    """The prefill side no longer holds the lease asked for; the link itself is sound."""


@dataclass(frozen=True)
class KVLayout:
    """What must agree for one side's KV blocks to mean the same on the other."""

    model: str
    dtype: str
    kv_cache_dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    k_block_shape: tuple[int, ...]  # one block of one layer's K cache
    v_block_shape: tuple[int, ...]
    # Where the cache lives ("cpu", or "cuda:" and the GPU's UUID): not compared (any two
    # pair); it decides how the blocks move.
    device: str = "cpu"

    @staticmethod
    def of(runner, model_name: str) -> KVLayout:
        """The layout of a ModelRunner's allocated cache."""
        k, v = runner.kv_caches[0]
        c = runner.config
        return KVLayout(
            model_name,
            str(runner.dtype).removeprefix("torch."),
            runner.kv_format.name,
            runner.block_size,
            c.num_layers,
            c.num_kv_heads,
            c.head_dim,
            tuple(k.shape[1:]),
            tuple(v.shape[1:]),
            _device_name(k.device),
        )

    def differences(self, other: KVLayout) -> list[str]:
        mine, theirs = asdict(self), asdict(other)
        del mine["device"], theirs["device"]
        return [f"{k}: {mine[k]!r} here, {theirs[k]!r} there" for k in mine if mine[k] != theirs[k]]


def _device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    return f"cuda:{torch.cuda.get_device_properties(device).uuid}"


class KVListener:
    """A prefill instance's KV address: decode instances pair with it there, one link each."""

    def __init__(self, host: str, port: int, layout: KVLayout, timeout_s: float) -> None:
        self.layout = layout
        self.timeout_s = timeout_s
        try:
            self.store = dist.TCPStore(
                host, port, None, True, timedelta(seconds=timeout_s), wait_for_workers=False
            )
        except Exception as e:  # noqa: BLE001 - the port is taken: say which
            raise TransferError(f"cannot listen for KV links at {host}:{port}: {e}") from e
        self.num_accepted = 0

    def accept(self, wait_s: float) -> KVLink | None:
        """The next decode instance's link, once it pairs; None if none came within `wait_s`."""
        key = f"pair/{self.num_accepted}"
        try:
            self.store.wait([key], timedelta(seconds=wait_s))
        except Exception:  # noqa: BLE001 - nobody yet
            return None
        pair = self.num_accepted
        self.num_accepted += 1
        return KVLink(PREFILL, self.store, pair, self.layout, self.timeout_s, _FOREVER_S)


def connect(host: str, port: int, layout: KVLayout, timeout_s: float) -> KVLink:
    """Pair with the prefill instance listening at `host:port` (the decode side)."""
    try:
        store = dist.TCPStore(host, port, None, False, timedelta(seconds=timeout_s))
        pair = store.add("num_pairs", 1) - 1
        store.set(f"pair/{pair}", "1")
    except Exception as e:  # noqa: BLE001 - nobody listens there: a clear error, no hang
        raise TransferError(f"no KV link with the prefill instance at {host}:{port}: {e}") from e
    return KVLink(DECODE, store, pair, layout, timeout_s)


class KVLink:
    """The two-rank group of a prefill instance (`role` PREFILL) and a decode instance, over
    pair `pair`'s keys of the prefill side's store; made once both have joined and agreed."""

    def __init__(
        self,
        role: int,
        store: dist.Store,
        pair: int,
        layout: KVLayout,
        timeout_s: float,
        request_timeout_s: float | None = None,
    ) -> None:
        """`timeout_s` bounds pairing and every transfer; `request_timeout_s` (default the
        same) how long the prefill side waits for the decode side's next request."""
        self.role = role
        self.peer = DECODE if role == PREFILL else PREFILL
        self.layout = layout
        self.timeout = timedelta(seconds=timeout_s)
        self.request_timeout = timedelta(seconds=request_timeout_s or timeout_s)
        try:
            pair_store = dist.PrefixStore(f"pair{pair}/", store)
            self.group = dist.ProcessGroupGloo(pair_store, role, 2, self.timeout)
        except Exception as e:  # noqa: BLE001 - the peer never joined: a clear error, no hang
            raise TransferError(f"the KV link's peer did not join: {e}") from e
        self._store = store  # the group reads it while it lives
        self.data_group = None  # the NCCL group for the blocks, when both sides are on CUDA
        peer_layout = self._handshake()
        mine, theirs = layout.device, peer_layout.device
        if mine.startswith("cuda:") and theirs.startswith("cuda:") and mine != theirs:
            self.data_group = self._nccl_group(store, pair)

    def _nccl_group(self, store: dist.Store, pair: int):
        """The pair's NCCL group for device-to-device block transfers."""
        if not dist.is_nccl_available():
            return None  # a CPU-only build of torch: the blocks go through host memory
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = self.timeout
        try:
            nccl_store = dist.PrefixStore(f"pair{pair}/nccl/", store)
            return dist.ProcessGroupNCCL(nccl_store, self.role, 2, options)
        except Exception as e:  # noqa: BLE001
            raise TransferError(f"the KV link's NCCL group failed: {e}") from e

    def _handshake(self) -> KVLayout:
        mine = json.dumps(asdict(self.layout)).encode()
        theirs = self._exchange(mine)
        other = json.loads(theirs)
        other = KVLayout(**{**other, "k_block_shape": tuple(other["k_block_shape"]),
                            "v_block_shape": tuple(other["v_block_shape"])})  # fmt: skip
        differ = self.layout.differences(other)
        if differ:
            raise TransferError(f"the peer's KV cache differs: {'; '.join(differ)}")
        return other

    def _exchange(self, data: bytes) -> bytes:
        """Send `data` to the peer and receive its own (prefill sends first)."""
        if self.role == PREFILL:
            self._send_bytes(data)
            return self._recv_bytes()
        theirs = self._recv_bytes()
        self._send_bytes(data)
        return theirs

    def _send_bytes(self, data: bytes) -> None:
        self._send(torch.tensor([len(data)], dtype=torch.long))
        self._send(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def _recv_bytes(self, timeout: timedelta | None = None) -> bytes:
        size = torch.empty(1, dtype=torch.long)
        self._recv(size, timeout)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        self._recv(data)
        return data.numpy().tobytes()

    def _send(self, t: torch.Tensor, group=None) -> None:
        try:
            (group or self.group).send([t], self.peer, 0).wait(self.timeout)
        except Exception as e:  # noqa: BLE001
            raise TransferError(f"sending to the peer failed: {e}") from e

    def _recv(self, t: torch.Tensor, timeout: timedelta | None = None, group=None) -> None:
        try:
            (group or self.group).recv([t], self.peer, 0).wait(timeout or self.timeout)
        except Exception as e:  # noqa: BLE001
            raise TransferError(f"receiving from the peer failed: {e}") from e

    # -- the exchange: the decode side asks for a request's lease, the prefill side answers --
    def request_blocks(self, request_id: str, skip: int = 0) -> None:
        """Ask for a lease's blocks but its first `skip` (which this side holds already)."""
        self._send_bytes(json.dumps({"request_id": request_id, "skip": skip}).encode())

    def recv_request(self) -> str:
        """The next request the decode side asks for (waits up to the request timeout)."""
        return self._recv_bytes(self.request_timeout).decode()

    def send_missing(self) -> None:
        """The answer for a lease this side no longer holds (expired, aborted)."""
        self._send(torch.tensor([-1, 0], dtype=torch.long))

    # -- blocks ----------------------------------------------------------------------------
    def gather_blocks(self, kv_caches: list, block_ids: list[int]) -> torch.Tensor:
        """A copy of these blocks of every layer, as one transfer sends them: on the device
        for the NCCL group, else in host memory (gloo moves host tensors; a CUDA cache is
        staged through it)."""
        ids = torch.tensor(block_ids, dtype=torch.long, device=kv_caches[0][0].device)
        n = len(block_ids)  # K and V blocks are laid out differently but hold as many values
        per_block = kv_caches[0][0][0].numel()
        payload = torch.stack(
            [
                torch.stack([k[ids].reshape(n, per_block), v[ids].reshape(n, per_block)])
                for k, v in kv_caches
            ]
        )
        return payload if self.data_group is not None else payload.cpu()

    def send_blocks(self, payload: torch.Tensor, num_tokens: int) -> int:
        """Send gathered blocks (holding the prompt's first `num_tokens` tokens); returns the
        bytes sent."""
        self._send(torch.tensor([payload.shape[2], num_tokens], dtype=torch.long))
        if payload.numel():  # none when the decode side held every block already
            self._send(payload.contiguous(), self.data_group)
        return payload.numel() * payload.element_size()

    def recv_blocks(self, kv_caches: list, block_ids: list[int]) -> int:
        """Receive a transfer into these blocks of every layer; returns the tokens they hold."""
        header = torch.empty(2, dtype=torch.long)
        self._recv(header)
        count, num_tokens = int(header[0]), int(header[1])
        if count < 0:
            raise LeaseGoneError("the prefill instance no longer holds this prompt's KV (its "
                                 "lease expired or was given up)")  # fmt: skip
        if count != len(block_ids):
            raise TransferError(f"the peer sent {count} blocks for {len(block_ids)} places")
        if count == 0:
            return num_tokens
        k0 = kv_caches[0][0]
        per_block = k0[0].numel()
        on = k0.device if self.data_group is not None else "cpu"
        payload = torch.empty((len(kv_caches), 2, count, per_block), dtype=k0.dtype, device=on)
        self._recv(payload, group=self.data_group)
        payload = payload.to(k0.device)
        ids = torch.tensor(block_ids, dtype=torch.long, device=k0.device)
        for layer, (k, v) in enumerate(kv_caches):
            k[ids] = payload[layer, 0].view(count, *k.shape[1:])
            v[ids] = payload[layer, 1].view(count, *v.shape[1:])
        return num_tokens

    def close(self) -> None:
        self.group = self.data_group = None
        self._store = None
