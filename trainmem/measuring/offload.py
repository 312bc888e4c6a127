"""Activation offloading for the CPU measurement: saved-tensor hooks with the rules of
TRL's ``activation_offloading=True`` (``OffloadActivations``, one stream), where the
"host" is memory the tensor tracker does not see (its replay, and the rules:
:mod:`trainmem.memory.offload`).

``pack`` keeps parameters, tensors under 1,024 bytes, a storage already offloaded in
this forward, and everything saved while ``lm_head`` runs; every other saved tensor is
copied into a NumPy array (outside torch, so outside the tracked device memory) and
its device storage is left to be freed. ``unpack`` copies it back into a new tensor
(tracked: the device copy of backward)."""

from __future__ import annotations

import contextlib
import weakref

import torch

from ..memory.offload import MIN_OFFLOAD_BYTES


class HostOffload:
    """The hooks of one forward (``with offload.hooks(model):``)."""

    def __init__(self):
        # the storages offloaded in this forward, by id (a weak reference tells a
        # live one from a new storage at a reused address)
        self.packed: dict[int, weakref.ref] = {}
        self.paused = 0
        self.param_ptrs: set[int] = set()

    def _stays(self, t: torch.Tensor) -> bool:
        if self.paused or isinstance(t, torch.nn.Parameter):
            return True
        if t.numel() * t.element_size() < MIN_OFFLOAD_BYTES:
            return True
        storage = t.untyped_storage()
        if storage.data_ptr() in self.param_ptrs:
            return True
        seen = self.packed.get(id(storage))
        if seen is not None and seen() is storage:
            return True
        self.packed[id(storage)] = weakref.ref(storage)
        return False

    def pack(self, t: torch.Tensor):
        if self._stays(t):
            return t
        with torch._C._DisableTorchDispatch():
            flat = t.detach().contiguous().view(-1)
            host = flat.view(torch.uint8).numpy().copy()
        return (host, t.dtype, t.shape)

    @staticmethod
    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        host, dtype, shape = packed
        with torch._C._DisableTorchDispatch():
            staged = torch.from_numpy(host).view(dtype).view(shape)
        return staged.clone()

    @contextlib.contextmanager
    def hooks(self, model):
        """Offload during ``model``'s forward (and the loss computed inside it),
        except inside its ``lm_head``."""
        self.packed = {}
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
        head = model.get_output_embeddings()

        def enter(*_):
            self.paused += 1

        def leave(*_):
            self.paused -= 1

        handles = [
            head.register_forward_pre_hook(enter),
            head.register_forward_hook(leave, always_call=True),
        ]
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield
        finally:
            for h in handles:
                h.remove()
