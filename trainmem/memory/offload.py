"""Activation offloading replayed: the saved-tensor hooks of TRL's
``activation_offloading=True`` (``trl.models.activation_offloading.OffloadActivations``,
after torchtune's), with one stream.

When autograd saves a tensor for backward (``pack``) the hooks copy it to the host,
and the device copy is freed once the forward drops its own references, except:

* parameters (``nn.Parameter``, or a model parameter's storage) stay;
* tensors under ``min_offload_size`` (1,024 bytes) stay;
* a storage already offloaded in this forward stays on the device (the second pack
  keeps the tensor itself);
* everything saved inside ``lm_head`` stays (a no-op context around the output layer:
  its input is needed first in backward).

In backward each node's offloaded tensors are copied back to the device when the node
runs (``unpack``) and freed when it is done. Not modelled: the stream version's stash
(the device copies of the last ``max_fwd_stash_size`` = 5 offloaded tensors kept until
their copy is known complete, and the prefetch of the next node's tensors in
backward)."""

from __future__ import annotations

#: TRL's / torchtune's ``min_offload_size``: smaller saved tensors stay on the device
MIN_OFFLOAD_BYTES = 1024


class Offload:
    """The state of one forward's hooks: the storages offloaded so far."""

    def __init__(self):
        self.packed: set[int] = set()

    def pack(self, sim, buffers: list) -> tuple[list, tuple[int, ...]]:
        """Split a node's saved ``buffers`` into those that stay on the device and the
        sizes of those offloaded (restored for the node's backward)."""
        kept, restore = [], []
        for b in buffers:
            if (
                b.uid in sim.param_buffers
                or b.nbytes < MIN_OFFLOAD_BYTES
                or b.uid in self.packed
            ):
                kept.append(b)
            else:
                self.packed.add(b.uid)
                restore.append(b.nbytes)
        return kept, tuple(restore)
