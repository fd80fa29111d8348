"""
gpuipc's C++ core, bound with nanobind. Use the gpuipc package, not this module.
"""

from collections.abc import Sequence


class ArrayView:
    """
    A window on mapped gpuipc memory that keeps the mapping alive while it (or anything made
    from it) lives. Host memory: the buffer protocol (``numpy.asarray(view)``), with the
    view's element type, shape and strides. GPU memory: DLPack (``torch.from_dlpack(view)``,
    ``cupy.from_dlpack(view)``, ``jax.dlpack.from_dlpack``) and ``__cuda_array_interface__``
    (CuPy, Numba). C-contiguous unless made by as_strided; read-only when the memory was opened
    read-only.
    """

    @property
    def address(self) -> int:
        """
        Host address (host memory) or device address (GPU memory) of the first byte.
        """

    @property
    def nbytes(self) -> int:
        """Size in bytes."""

    @property
    def readonly(self) -> bool:
        """Whether writes are refused."""

    @property
    def shape(self) -> tuple:
        """Dimensions (C order)."""

    @property
    def dlpack_dtype(self) -> tuple[int, int, int]:
        """DLPack element type (code, bits, lanes)."""

    @property
    def typestr(self) -> str:
        """Array-interface type string."""

    @property
    def is_cuda(self) -> bool:
        """Whether the memory is GPU memory."""

    def typed(self, dtype: tuple[int, int, int], typestr: str, shape: Sequence[int], offset: int) -> ArrayView:
        """
        A view of ``shape`` elements of ``dtype`` starting ``offset`` bytes in. Raises InvalidArgument when it
        does not fit or ``offset`` is not a multiple of the element size.
        """

    def as_strided(self, dtype: tuple[int, int, int], typestr: str, shape: Sequence[int], strides: Sequence[int], offset: int) -> ArrayView:
        """
        A view of ``shape`` elements of ``dtype`` with ``strides`` (in elements, >= 0) starting ``offset`` bytes
        in. Raises InvalidArgument when an element falls outside this view.
        """

    @property
    def strides(self) -> object:
        """Strides in elements, or None when C-contiguous."""

    def __dlpack__(self, *, stream: object | None = None, max_version: tuple[int, int] | None = None, dl_device: tuple[int, int] | None = None, copy: bool | None = None) -> object:
        """
        Exports the view as a DLPack capsule (versioned, with the read-only flag, when the consumer passes
        ``max_version >= (1, 0)``). ``stream`` is accepted and not waited on: the data is ordered by the
        stream given to the gpuipc call that produced the view.
        """

    def __dlpack_device__(self) -> tuple[int, int]:
        """
        (device type, device ordinal) as DLPack numbers: (1, 0) host, (2, n) CUDA device n.
        """

    @property
    def __cuda_array_interface__(self) -> dict:
        """
        The CUDA array interface (version 3) of GPU views; AttributeError for host views.
        """

    def __repr__(self) -> str: ...

def _dlpack_info(capsule: object) -> tuple:
    """
    What a DLPack capsule describes, without consuming it: (address, device type, device id, (code, bits,
    lanes), shape, strides in elements or None, read-only).
    """

def _copy_to_view(dst: ArrayView, offset: int, src: int, src_device_type: int, src_device_id: int, nbytes: int, stream: int) -> None:
    """
    Copies ``nbytes`` at ``src`` (DLPack device type and id) to byte ``offset`` of ``dst``, after
    synchronizing ``stream`` (GPU copies are synchronous).
    """

def _copy_from_dlpack(dst: ArrayView, capsule: object, stream: int) -> object:
    """
    Copies a C-contiguous DLPack tensor into ``dst`` (after synchronizing ``stream``). Returns
    (code, bits, lanes, shape, nbytes), or None when the tensor is strided.
    """

class Segment:
    """A mapped gpuipc segment (low level; see gpuipc.Segment)."""

    @staticmethod
    def create(name: str, size: int, *, kind: str = 'host', device: int = 0, mode: int = 384) -> Segment:
        """
        Creates segment ``name`` of at least ``size`` bytes and maps it read-write.
        """

    @staticmethod
    def open(name: str, *, readonly: bool = False, wait: float | None = None, device: int | None = None) -> Segment:
        """
        Opens segment ``name``; ``wait`` seconds for it to be created (None: not at all).
        """

    @staticmethod
    def unlink(name: str) -> None:
        """Removes the name; mappings stay valid until closed."""

    @staticmethod
    def stat(name: str) -> dict:
        """The broker's record of segment ``name`` as a dict."""

    @staticmethod
    def list() -> list:
        """Every segment the broker knows, as dicts."""

    @property
    def name(self) -> str: ...

    @property
    def size(self) -> int: ...

    @property
    def kind(self) -> str: ...

    @property
    def readonly(self) -> bool: ...

    @property
    def device(self) -> int: ...

    @property
    def id(self) -> int: ...

    @property
    def owner_uid(self) -> int: ...

    @property
    def owner_gid(self) -> int: ...

    @property
    def mode(self) -> int: ...

    @property
    def address(self) -> int: ...

    @property
    def device_pointer(self) -> int: ...

    @property
    def closed(self) -> bool: ...

    def view(self) -> ArrayView:
        """
        The whole segment as bytes (GPU memory for device segments, host memory otherwise).
        """

    def close(self) -> None:
        """Drops this handle; views keep the mapping until they go."""

def share(name: str, ptr: int, nbytes: int, *, mode: int = 384, device: int = -1) -> Segment:
    """
    Shares ``nbytes`` of device memory at ``ptr`` as segment ``name``; returns the exporter's handle.
    """

class Semaphore:
    """A cross-process timeline semaphore (low level; see gpuipc.Semaphore)."""

    @staticmethod
    def create(name: str, *, initial: int = 0, kind: str = 'host_pinned', device: int = 0, mode: int = 384) -> Semaphore: ...

    @staticmethod
    def open(name: str, *, role: str = 'waiter', wait: float | None = None, device: int = 0) -> Semaphore: ...

    @staticmethod
    def unlink(name: str) -> None: ...

    def signal(self, value: int, stream: int, wake_host: bool) -> None: ...

    def wait(self, value: int, stream: int) -> None: ...

    def signal_host(self, value: int) -> None: ...

    def wait_host(self, value: int, timeout: float | None = None, spin: float | None = None) -> int: ...

    @property
    def value(self) -> int: ...

    @property
    def status(self) -> str: ...

    @property
    def name(self) -> str: ...

    @property
    def role(self) -> str: ...

    @property
    def closed(self) -> bool: ...

    def close(self) -> None: ...

array_header_layout: dict = ...

class Channel:
    """A joined producer/consumer channel (low level; see gpuipc.Channel)."""

    @staticmethod
    def create(name: str, *, slots: int = 4, slot_bytes: int = 1048576, header_bytes: int = 256, kind: str = 'device', device: int = 0, mode: int = 384, role: str = 'producer', pacing: float | None = None, pacing_ahead: int | None = None) -> Channel: ...

    @staticmethod
    def open(name: str, *, role: str, wait: float | None = None, device: int | None = None, pacing: float | None = None, pacing_ahead: int | None = None) -> Channel: ...

    @staticmethod
    def stat(name: str) -> dict:
        """
        The counters of channel ``name`` without joining it (read permission needed).
        """

    @staticmethod
    def unlink(name: str) -> None: ...

    def acquire(self, stream: int, timeout: float | None = None) -> tuple[ArrayView, int]:
        """Claims the next free slot: (bytes view of its capacity, sequence)."""

    def publish(self, header: bytes, nbytes: int, stream: int, slot: int | None = None) -> int:
        """
        Publishes the oldest acquired slot; returns its sequence. ``slot``: the one to publish: on a host channel, one behind older acquired slots is published once they are; InvalidState when already published, or, on a device channel, when older slots are still acquired.
        """

    def send_copy(self, source: int, nbytes: int, header: bytes, stream: int, timeout: float | None = None) -> int:
        """
        Copies ``nbytes`` at address ``source`` (device channels: GPU or host memory, copied in ``stream`` order; host channels: host memory) into the next free slot and publishes it with ``header``.
        """

    def receive(self, stream: int, timeout: float | None = None) -> tuple[ArrayView, bytes, int]:
        """
        Takes the next message: (read-only bytes view of its payload, header bytes, sequence).
        """

    def release(self, stream: int, message: int | None = None, skipped: bool = False) -> int | None:
        """
        Releases the oldest received message; returns its sequence. ``message``: the one to release: None when it is no longer held (released, or this handle closed); on a host channel (or ``skipped``: an aborted message recv skips), one behind older held messages is released once they are; on a device channel InvalidState.
        """

    def incomplete(self, sequence: int) -> bool:
        """
        Whether message ``sequence`` may be partial (its producer died while writing), held or released.
        """

    @property
    def name(self) -> str: ...

    @property
    def role(self) -> str: ...

    @property
    def kind(self) -> str: ...

    @property
    def slots(self) -> int: ...

    @property
    def slot_bytes(self) -> int: ...

    @property
    def header_bytes(self) -> int: ...

    @property
    def device(self) -> int: ...

    @property
    def closed(self) -> bool: ...

    def holds(self, sequence: int) -> bool:
        """
        Whether this handle holds ``sequence`` (an acquired slot, a received message); False once closed.
        """

    @property
    def held(self) -> list[int]:
        """
        Sequences of the slots this producer acquired and has not published, or of the messages this consumer received and has not released, oldest first.
        """

    @property
    def held_back(self) -> int:
        """
        How many slots published, or messages released, ahead of older ones wait for those (host channels).
        """

    @property
    def stats(self) -> dict: ...

    @property
    def pacing(self) -> float:
        """
        Seconds acquire and receive watch a peer's GPU progress on the host before a stream wait.
        """

    @pacing.setter
    def pacing(self, arg: float, /) -> None: ...

    @property
    def pacing_ahead(self) -> int:
        """
        How many messages a pacing producer may run ahead of the consumers' streams (1..slots).
        """

    @pacing_ahead.setter
    def pacing_ahead(self, arg: int, /) -> None: ...

    def close(self) -> None: ...

def _torch_pool_attach(name: str, device: int, create: bool, chunk_bytes: int, max_bytes: int, max_blocks: int, mode: int) -> None:
    """
    Makes pool `name` (created, or opened) the one torch allocations on `device` come from.
    """

def _torch_pool_detach(device: int) -> int:
    """
    Drops the device's active pool when torch holds nothing in it; returns the live blocks.
    """

def _torch_block_view(address: int) -> ArrayView | None:
    """
    The block torch holds at `address` (its first byte) as bytes, where the allocator mapped it; None when there is none (torch gave it back).
    """

def _torch_block_of(address: int) -> tuple[bytes, int, str] | None:
    """
    (encoded BlockRef, block address, pool name) of the torch block containing `address`, or None.
    """

def _torch_frees() -> int:
    """
    How many blocks torch has freed through the pluggable allocator in this process (it only grows).
    """

def _torch_pool_pause(device: int, keep_contents: bool, keep_buffer: bool = False) -> None:
    """
    Pauses the device's active pool (Pool::pause): its GPU memory is released, tensor addresses kept.
    """

def _torch_pool_resume(device: int) -> None:
    """Resumes the device's active pool (Pool::resume) at the same addresses."""

def _torch_pool_paused(device: int) -> bool:
    """Whether the device's active pool is paused."""

def _torch_pool_stats(device: int) -> tuple[int, int, int] | None:
    """
    (blocks torch holds, used bytes of the pool, refused allocations) of the device's pool.
    """

class Block:
    """An allocated block of a pool (low level; see gpuipc.Block)."""

    @property
    def ref(self) -> tuple[int, int, int, int, int, int]:
        """(pool, generation, offset, size, chunk, index)."""

    @property
    def address(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def freed(self) -> bool: ...

    @property
    def pool_name(self) -> str: ...

    def free(self, stream: int = 0) -> None:
        """
        Frees the block through its own handle on its pool (stream-ordered for device and host_pinned pools).
        """

    def view(self) -> ArrayView:
        """
        The block as bytes; keeps the block (and its pool) until the view goes, unless free() frees it first.
        """

class Pool:
    """A joined gpuipc pool (low level; see gpuipc.Pool)."""

    @staticmethod
    def create(name: str, *, kind: str = 'host', device: int = 0, mode: int = 384, chunk_bytes: int = 67108864, max_bytes: int = 1073741824, max_blocks: int = 16384, block_bytes: int = 0, block_count: int = 0) -> Pool:
        """
        Creates and joins pool ``name``; block_bytes/block_count make a fixed-block pool.
        """

    @staticmethod
    def open(name: str, *, readonly: bool = False, wait: float | None = None, device: int | None = None) -> Pool:
        """
        Opens and joins pool ``name``; chunks are mapped read-only when ``readonly``.
        """

    @staticmethod
    def unlink(name: str) -> None:
        """Removes the names of the pool's control segment and chunks."""

    @staticmethod
    def stat(name: str) -> dict:
        """Statistics of pool ``name`` without joining it, as a dict."""

    def allocate(self, nbytes: int, alignment: int = 256) -> Block:
        """Allocates a block of ``nbytes``."""

    def free(self, block: Block, stream: int = 0) -> None:
        """Frees ``block`` (stream-ordered for device and host_pinned pools)."""

    def resolve(self, ref: tuple[int, int, int, int, int, int]) -> int:
        """
        The address of the block ``ref`` names (maps its chunk the first time).
        """

    def view(self, ref: tuple[int, int, int, int, int, int], readonly: bool, hold: bool = False) -> ArrayView:
        """
        The block ``ref`` names as bytes (resolving it). ``hold``: take a hold that the view (and every array
        or DLPack export made from it) keeps, given back when the last of them goes.
        """

    def views_of(self, raw: bytes, readonly: bool, hold: bool, dlpack: bool) -> list:
        """
        Views of the blocks that ``raw`` (concatenated 40-byte BlockRefs) names, in order, each with a hold when
        ``hold`` (given back when the view and everything made from it go); with ``dlpack``, a DLPack capsule
        of each instead of a view. Raises InvalidArgument at the first stale or forged ref (holds taken so far
        are given back).
        """

    def map_chunks(self, raw: bytes) -> None:
        """
        Maps the chunks that the blocks ``raw`` (concatenated 40-byte BlockRefs) lie in, one broker round trip
        for all (Pool::map_chunks). Raises the first chunk's error after mapping the others.
        """

    def tensors_of_index(self, raw: bytes, first: int, flat: bytes, sflat: bytes, dtypes: Sequence[tuple[tuple[int, int, int], str] | None], readonly: bool, hold: bool) -> list:
        """
        The tensors of a tensor index (gpuipc/_index.py) that lie alone at the start of a storage named in
        ``raw`` (the 40-byte refs of storages ``first``, ``first + 1``, ...): [(tensor position, DLPack capsule)].
        flat, sflat: the index's tensor and storage columns (little-endian int64); dtypes[i]: ((code, bits, lanes), typestr) of the
        index's dtype i, or None (those tensors are left out). Raises InvalidArgument for a malformed index or a
        stale ref (holds taken so far are given back).
        """

    def spans_of(self, raw: bytes, readonly: bool, hold: bool, dlpack: bool) -> tuple:
        """
        Like views_of, but one view per chunk: returns (views, span, offset), where block i lies at byte
        offset[i] of views[span[i]]. Holds (with ``hold``) are given back when the chunk's view and everything
        made from it go. Raises InvalidArgument at the first stale or forged ref (holds taken so far are given
        back).
        """

    def hold(self, ref: tuple[int, int, int, int, int, int]) -> None:
        """Takes a hold on the block: its memory is not reused until released."""

    def release(self, ref: tuple[int, int, int, int, int, int]) -> None:
        """Gives back one hold."""

    def pause(self, *, keep_contents: bool = False, keep_buffer: bool = False) -> None:
        """
        Releases the memory of every chunk, keeping names, blocks and addresses (see gpuipc.Pool.pause).
        """

    def resume(self) -> None:
        """
        Backs the chunks with memory again at the same addresses, restoring kept contents.
        """

    def refresh(self) -> None:
        """
        Drops mappings of memory a pause released; maps the new memory at the same addresses once resumed.
        """

    @property
    def paused(self) -> bool: ...

    def stats(self) -> dict:
        """Current statistics as a dict."""

    @property
    def name(self) -> str: ...

    @property
    def kind(self) -> str: ...

    @property
    def id(self) -> int: ...

    @property
    def owner_uid(self) -> int: ...

    @property
    def owner_gid(self) -> int: ...

    @property
    def mode(self) -> int: ...

    @property
    def fixed(self) -> bool: ...

    @property
    def chunk_bytes(self) -> int: ...

    @property
    def block_bytes(self) -> int: ...

    @property
    def closed(self) -> bool: ...

    def close(self) -> None:
        """
        Drops this handle; blocks and views keep the pool joined until they go.
        """

def _encode_block_ref(ref: tuple[int, int, int, int, int, int]) -> bytes:
    """The 40-byte little-endian encoding of a BlockRef tuple."""

def _decode_block_ref(data: bytes) -> tuple[int, int, int, int, int, int]:
    """
    Decodes 40 bytes into a BlockRef tuple; InvalidArgument naming what is wrong.
    """

class CountingSemaphore:
    """A named counting semaphore (low level; see gpuipc.CountingSemaphore)."""

    @staticmethod
    def create(name: str, *, initial: int, max_count: int, mode: int = 384) -> CountingSemaphore: ...

    @staticmethod
    def open(name: str, *, wait: float | None = None) -> CountingSemaphore: ...

    @staticmethod
    def unlink(name: str) -> None: ...

    @staticmethod
    def stat(name: str) -> dict: ...

    def acquire(self, n: int, timeout: float | None = None) -> bool:
        """
        Takes n permits; False when the timeout passed (0: only try). Raises InvalidArgument for n > max_count.
        """

    def release(self, n: int) -> None: ...

    @property
    def held(self) -> int: ...

    @property
    def available(self) -> int: ...

    @property
    def waiting(self) -> int: ...

    @property
    def max_count(self) -> int: ...

    @property
    def name(self) -> str: ...

    @property
    def closed(self) -> bool: ...

    def close(self) -> None: ...

def holders(name: str) -> list:
    """The processes that hold `name` open (see gpuipc.holders)."""

def heartbeat(name: str, deadline: float) -> None:
    """
    Promises the next heartbeat for `name` within `deadline` seconds (see gpuipc.heartbeat).
    """

def _live_objects() -> dict:
    """Live C++ objects by kind (for leak tests)."""

def _doctor() -> dict:
    """
    Driver, runtime directory and broker socket as python -m gpuipc doctor reports them (starts nothing).
    """

def _broker_pid() -> int:
    """
    The broker's pid (connects, starting a broker when none runs and autostart is allowed).
    """

def version() -> str:
    """
    The release version of the C++ library inside this module (gpuipc.__version__).
    """

def _exiting() -> None:
    """
    Internal: gpuipc's atexit hook. Threads waiting in gpuipc from now on park instead of taking the GIL back.
    """

def build_commit() -> str:
    """
    The git commit this module was built from, '-dirty' appended when the tree had changes; 'unknown' when it was built outside git (gpuipc.__commit__).
    """

def protocol_version() -> int:
    """The broker wire protocol version this module speaks."""

def device_ordinal(uuid: str) -> int:
    """
    The ordinal, in this process, of the GPU with this UUID ("GPU-..."), or -1 when this process does not see it (CUDA_VISIBLE_DEVICES). Raises InvalidArgument (malformed UUID), NoDriver.
    """

def _daemon_path() -> str:
    """The gpuipcd the library would start (empty when none is found)."""
