"""GPUs: what the card holds, and what ``nvidia-smi`` shows beyond PyTorch's tensors.

``--gpu NAME`` picks a preset of :data:`GPUS`. For one training step the estimate then
reports three numbers (bytes):

* ``total_bytes``: the peak of the step's tensors (what the replay counts; unchanged);
* ``reserved_bytes``: ``torch.cuda.max_memory_reserved()`` — the step's allocations and
  frees replayed through :mod:`trainmem.memory.allocator` (512 B rounding, 2 MiB /
  20 MiB segments, splitting, no release between steps), plus the cuBLAS workspaces,
  which torch takes from the same allocator;
* ``device_bytes``: what ``nvidia-smi`` shows for the process — ``reserved_bytes`` plus
  the CUDA context, plus NCCL's communication buffers when the step runs on N > 1 GPUs;

and ``fits`` (``device_bytes`` within the card's memory, and the allocator replay never
fails under that limit) with ``headroom_bytes``.

Sources of the figures (each cited where it is used):

* cuBLAS workspace: ATen's ``CublasHandlePool.cpp`` ``parseChosenWorkspaceSize``: by
  default ``4096 * 1024 * 2 + 16 * 1024 * 8`` = 8,519,680 B, and ``4096 * 8 * 1024`` =
  32 MiB on compute capability 9.x (Hopper; newer torch also 10.x and 12.x), taken from
  the caching allocator per (handle, stream). A training step uses two handles: the
  forward runs on the Python thread and the backward on autograd's device thread.
* CUDA context (published measurements of a process that has only touched CUDA):
  PyTorch PR pytorch/pytorch#86509 (torch 1.13, which turned on ``CUDA_MODULE_LOADING=
  LAZY``): 287,047,680 B with lazy loading vs 666,632,192 B without, each holding one
  6,400,000 B tensor in a 20 MiB segment, so 266,076,160 B and 645,660,672 B of
  context; invoke-ai/InvokeAI#9413: 256 MiB on an RTX 3090 (torch 2.7.1+cu128);
  unslothai/unsloth-zoo#1053: 426 MiB on an RTX 6000 Ada (torch 2.10.0+cu130); the
  Ampere figure is used for other sm_8.6 cards, the Ada figure for sm_8.9 cards, and
  the torch 1.13 lazy figure for the rest. Kernels a training step loads lazily on top
  of that (cuBLAS, attention, bitsandbytes) are not in these figures, so
  ``device_bytes`` is a lower bound of what ``nvidia-smi`` shows.
* Card memory: ``memory.total`` as ``nvidia-smi`` reports it for the card (MiB);
  ``torch.cuda.get_device_properties().total_memory`` is the same number in bytes.
* NCCL buffers (N > 1 GPUs; NCCL allocates them with ``cudaMalloc``/``cuMem``, outside
  PyTorch's caching allocator, so they are in ``nvidia-smi`` but not in reserved): every
  ring channel connects each rank to its next peer (a send connection) and its
  previous one (a receive connection), and each connection is one allocation in the
  rank's own memory (``src/transport/p2p.cc``, the P2P transport of NVLink and PCIe
  peer access; NCCL 2.18-2.27). The receive side holds an ``ncclRecvMem`` header and a
  buffer per protocol, the send side an ``ncclSendMem`` header, and under P2P read
  (both GPUs sm_80 on NVLink, ``ncclTopoCheckP2p`` in ``src/graph/paths.cc``) the
  Simple buffer moves from the receive side to the send side. Each side is rounded up
  to ``CUDA_IPC_MIN`` = 2 MiB (``ALIGN_SIZE(sendSize, CUDA_IPC_MIN)``, the same for
  ``recvSize``; ``src/include/comm.h``; the headers are ``MEM_ALIGN`` = 4096 B). The
  buffers (``src/init.cc``): ``DEFAULT_BUFFSIZE`` = 4 MiB (Simple, ``NCCL_BUFFSIZE``),
  ``DEFAULT_LL_BUFFSIZE`` = ``NCCL_LL_LINES_PER_THREAD`` 8 x ``NCCL_LL_MAX_NTHREADS``
  512 x ``NCCL_STEPS`` 8 x 16 B ``ncclLLFifoLine``, ``DEFAULT_LL128_BUFFSIZE`` =
  ``NCCL_LL128_ELEMS_PER_THREAD`` 120 x ``NCCL_LL128_MAX_NTHREADS`` 640 x 8 steps x 8 B
  (constants of ``src/include/device.h``): 12 MiB per channel with or without P2P
  read. Without peer access NCCL uses its SHM transport, whose buffers sit in host
  memory; the estimate counts the P2P transport's.

  Channels: the topology search's result (``src/graph/search.cc``, ``connect.cc``, read
  at NCCL 2.21.5). The ring search takes the fastest per-channel bandwidth of its
  speed array that the links carry and adds channels until they fill the GPU's
  bandwidth; ``ncclTopoDupChannels`` doubles them when that bandwidth is 25 GB/s or
  more, and ``ncclTopoPostset`` doubles them again (``nChannels =
  std::min(MAXCHANNELS, nChannels*2)``). SXM boards on NVSwitch: an A100 has 12
  NVLinks of ``SM80_NVLINK_BW`` 20 GB/s (240), filled by 6 channels of 40; an H100 18
  of 20.6 (370.8), best filled by 6 of 60; either way 6 x 2 x 2 = 24 channels, what
  NCCL prints on these machines ("for dgxA100, 12 nvlink and 24 cta for allreduce",
  NVIDIA/nccl#1225, a CTA per channel; ``Channel 00/24`` on H100s in NVIDIA/nccl#1259
  and pytorch/torchtitan#1570). Over PCIe (24 GB/s) one channel of 20 is found, not
  duplicated in the search: 2. The A100 and H100 presets are the SXM boards
  (``nvlink``); their PCIe versions get 2.

  Communicators: each process group that runs a collective has its own NCCL
  communicator with its own buffers ("more communicators = more memory used", NCCL's
  maintainer in NVIDIA/nccl#864). torch's FSDP (and DDP) runs on the default group,
  as the Trainer's barriers and loss gathering do: one communicator. DeepSpeed adds a
  second one: ``zero.Init`` partitions and all-gathers the parameters on the world
  group (``partition_parameters.py``: ``ds_process_group = dist.get_world_group()``),
  while the engine hands its optimizer ``groups._get_data_parallel_group()``, a
  ``dist.new_group`` clone of the world group (``utils/groups.py``
  ``_clone_world_group``), for the gradients' reduce-scatter.

  Not counted: tree connections of all-reduce to other peers than the ring's,
  send/receive channels, NCCL's kernels, and NVLS (NVLink SHARP). NCCL sets NVLS up
  on more than 2 GPUs with multicast support (sm_90 on NVSwitch;
  ``src/transport/nvls.cc``, ``gpuCount <= 2`` returns early): each GPU maps
  ``nChannels * 2 * buffSize * nHeads`` (one head per local GPU) for each
  communicator. Its size depends on the NCCL version — through 2.20 ``buffSize`` is
  the 4 MiB Simple buffer plus a 2 MiB header and ``nChannels`` the collective
  channels, so 8 GPUs map 2.25 GiB each (the ``nvlsTotalSize 2415919104`` that
  vllm-project/vllm#9699 logs); 2.21 uses 1 MiB + 2 MiB; from 2.22 16 NVLS channels
  of 1 MiB, set up only when an NVLS algorithm first runs, which NCCL's tuner
  decides —, so the estimate names it in a note (``nvls-not-modelled``) instead of
  counting it.
* Not modelled: other processes on the card.

Standard library only (the in-page calculator runs it in Pyodide)."""

from __future__ import annotations

from dataclasses import dataclass

from .dtypes import MiB
from .errors import OptionError


#: CUDA context bytes by source (see the module docstring)
CONTEXT_LAZY = 287_047_680 - 20 * MiB  # pytorch/pytorch#86509, lazy loading
CONTEXT_EAGER = 666_632_192 - 20 * MiB  # same PR, CUDA_MODULE_LOADING=DEFAULT
CONTEXT_AMPERE_86 = 256 * MiB  # invoke-ai/InvokeAI#9413, RTX 3090
CONTEXT_ADA_89 = 426 * MiB  # unslothai/unsloth-zoo#1053, RTX 6000 Ada

#: NCCL's per-connection buffers by protocol (src/init.cc, src/include/device.h; see
#: the module docstring)
NCCL_STEPS = 8
NCCL_LL_BUFFSIZE = 8 * 512 * NCCL_STEPS * 16
NCCL_LL128_BUFFSIZE = 120 * 640 * NCCL_STEPS * 8
NCCL_SIMPLE_BUFFSIZE = 1 << 22
#: the headers of a connection's two sides (MEM_ALIGN) and the rounding of each side
#: (CUDA_IPC_MIN), src/include/comm.h
NCCL_MEM_ALIGN = 4096
NCCL_CUDA_IPC_MIN = 2 * MiB
#: the fewest ring channels NCCL builds (one ring, doubled by ncclTopoPostset)
NCCL_MIN_RING_CHANNELS = 2
#: collective channels between GPUs on NVSwitch (A100/H100 SXM; module docstring)
NCCL_NVLINK_CHANNELS = 24


#: compute capability 8.0 (Ampere): native bf16 (below it torch emulates bf16;
#: ``coursekit.gpu.bf16_supported``), TF32 matmuls and FlashAttention-2. Which SDPA
#: kernel a card runs is :mod:`trainmem.sdpa`'s (torch's checks, per version)
SM80 = (8, 0)


@dataclass(frozen=True)
class GPU:
    name: str
    memory_mib: int  # nvidia-smi memory.total
    capability: tuple[int, int]
    #: the SXM board, every GPU on NVSwitch (NCCL's channel count, module docstring)
    nvlink: bool = False

    @property
    def bf16(self) -> bool:
        """bf16 units (native bf16): from :data:`SM80` on."""
        return self.capability >= SM80

    @property
    def capacity_bytes(self) -> int:
        return self.memory_mib * MiB


GPUS = {
    g.name: g
    for g in (
        GPU("T4", 15360, (7, 5)),
        GPU("V100-16GB", 16384, (7, 0)),
        GPU("A10G", 23028, (8, 6)),
        GPU("L4", 23034, (8, 9)),
        GPU("L40S", 46068, (8, 9)),
        GPU("RTX3090", 24576, (8, 6)),
        GPU("RTX4090", 24564, (8, 9)),
        GPU("A100-40GB", 40960, (8, 0), nvlink=True),
        GPU("A100-80GB", 81920, (8, 0), nvlink=True),
        GPU("H100-80GB", 81559, (9, 0), nvlink=True),
        GPU("H200", 143771, (9, 0), nvlink=True),
    )
}


def get_gpu(name: str) -> GPU:
    if isinstance(name, GPU):
        return name
    for key, gpu in GPUS.items():
        if key.lower() == str(name).lower():
            return gpu
    raise OptionError("gpu", f"gpu must be one of {', '.join(GPUS)}, got {name!r}")


def cublas_workspace_bytes(gpu: GPU, torch_version: tuple) -> int:
    """One cuBLAS workspace (``parseChosenWorkspaceSize``): 32 MiB on Hopper (and,
    from torch 2.8, on 10.x/12.x), else 8,519,680 B."""
    major = gpu.capability[0]
    if major == 9 or (major in (10, 12) and torch_version >= (2, 8)):
        return 4096 * 8 * 1024
    return 4096 * 1024 * 2 + 16 * 1024 * 8


def context_bytes(gpu: GPU, torch_version: tuple) -> int:
    """The CUDA context of a PyTorch process on ``gpu`` (module docstring)."""
    if torch_version < (1, 13):
        return CONTEXT_EAGER
    if gpu.capability == (8, 6):
        return CONTEXT_AMPERE_86
    if gpu.capability == (8, 9):
        return CONTEXT_ADA_89
    return CONTEXT_LAZY


def nccl_channels(gpu: GPU) -> int:
    """NCCL's collective channels between ``gpu`` cards (module docstring)."""
    return NCCL_NVLINK_CHANNELS if gpu.nvlink else NCCL_MIN_RING_CHANNELS


def nccl_channel_bytes(read: bool = False) -> int:
    """One ring channel's buffers on a rank: its send and its receive side, each
    rounded up to ``CUDA_IPC_MIN``; under P2P read the Simple buffer is on the send
    side (module docstring)."""

    def side(nbytes: int) -> int:
        return -(-(NCCL_MEM_ALIGN + nbytes) // NCCL_CUDA_IPC_MIN) * NCCL_CUDA_IPC_MIN

    simple = NCCL_SIMPLE_BUFFSIZE
    low_latency = NCCL_LL_BUFFSIZE + NCCL_LL128_BUFFSIZE
    if read:
        return side(simple) + side(low_latency)
    return side(0) + side(low_latency + simple)


def p2p_read(gpu: GPU) -> bool:
    """Whether NCCL reads from its peer's buffer (P2P read): sm_80 GPUs on NVLink."""
    return gpu.nvlink and gpu.capability == (8, 0)


def nccl_bytes(
    gpus: int,
    channels: int = NCCL_MIN_RING_CHANNELS,
    communicators: int = 1,
    read: bool = False,
) -> int:
    """NCCL's ring buffers on each of ``gpus`` ranks (0 on one GPU): a channel's send
    and receive sides, per channel, per communicator; ``read``: P2P read
    (:func:`p2p_read`) (module docstring)."""
    if gpus <= 1:
        return 0
    return communicators * channels * nccl_channel_bytes(read)


def _overheads(gpu_name: str, versions: dict, gpus: int, communicators: int):
    """The card and what sits on it besides the step's tensors: one cuBLAS
    workspace, the CUDA context, NCCL's buffers."""
    gpu = get_gpu(gpu_name)
    torch_version = versions["torch"]
    return (
        gpu,
        cublas_workspace_bytes(gpu, torch_version),
        context_bytes(gpu, torch_version),
        nccl_bytes(gpus, nccl_channels(gpu), communicators, p2p_read(gpu)),
    )


def replay_setup(gpu_name: str, versions: dict, gpus: int = 1, communicators: int = 1):
    """What the step's events are replayed after and under on ``gpu_name``: the two
    cuBLAS workspaces (allocated at the first matmul, they persist), and the bytes the
    caching allocator may reserve (the card's memory less the CUDA context and NCCL's
    buffers)."""
    return _setup_of(*_overheads(gpu_name, versions, gpus, communicators))


def _setup_of(gpu, workspace: int, context: int, nccl: int):
    prelude = [("alloc", -1 - i, workspace, "temporaries", "idle") for i in range(2)]
    return prelude, gpu.capacity_bytes - context - nccl


def device_report(
    events: list,
    gpu_name: str,
    versions: dict,
    timeline_points=0,
    gpus: int = 1,
    replays: dict | None = None,
    communicators: int = 1,
):
    """Reserved and device bytes of a replayed step on ``gpu_name`` (one of ``gpus``
    ranks): the cuBLAS workspaces are allocated first (they persist from the first
    matmul), then the step's events; ``fits`` needs the replay to succeed under the
    card's memory less the context and NCCL's buffers. ``replays``: allocator
    replays already fed the first events (``simulate_step``'s), keyed by
    ``(prelude, capacity)``; one that matches is fed the rest instead of replaying
    from the start (not when a timeline is asked for)."""
    from .memory.allocator import replay

    overheads = _overheads(gpu_name, versions, gpus, communicators)
    gpu, workspace, context, nccl = overheads
    prelude, capacity = _setup_of(*overheads)

    def run(limit):
        started = (
            None if timeline_points else (replays or {}).get((tuple(prelude), limit))
        )
        if started is None:
            return replay(prelude + events, limit, timeline_points)
        fed_replay, fed = started
        fed_replay.feed(events[fed:])
        return fed_replay.result()

    # under the card's limit the allocator releases its free cached segments before
    # it gives up, so a step can fit although its unlimited reserved peak does not
    limited = run(capacity)
    unlimited = limited
    if limited["oom"] is not None or limited["released"]:
        unlimited = run(None)
    fits = limited["oom"] is None
    reserved = limited["peak_reserved"] if fits else unlimited["peak_reserved"]
    device = reserved + context + nccl
    return {
        "gpu": gpu.name,
        "capacity_bytes": gpu.capacity_bytes,
        "reserved_bytes": reserved,
        "gpu_allocated_bytes": unlimited["peak_allocated"],
        "device_bytes": device,
        "context_bytes": context,
        "nccl_bytes": nccl,
        "nccl_communicators": communicators if gpus > 1 else 0,
        "nccl_channels": nccl_channels(gpu) if gpus > 1 else 0,
        "cublas_workspace_bytes": 2 * workspace,
        "fits": fits,
        "headroom_bytes": gpu.capacity_bytes - device,
        "timeline": unlimited["timeline"],
    }
