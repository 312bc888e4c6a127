"""The memory engine: a symbolic replay of one training step, behind
:mod:`trainmem.estimate`.

No tensor is created here.  A :class:`~.accounting.SimTensor` is a (shape, dtype) with a
reference-counted :class:`~.accounting.Buffer` of ``numel * itemsize`` **bytes**; the
Llama/Qwen2 forward pass is written out op by op exactly as ``transformers`` runs it
(RMSNorm's fp32 upcast, RoPE's ``rotate_half``, eager vs SDPA attention, peft's LoRA
``Linear``, the causal-LM loss with its ``logits.float()``), and every op follows
PyTorch's autograd rule for *what it saves for backward* (``derivatives.yaml``): ``mm``
saves its input only if the weight needs a gradient, ``mul`` saves the *other* operand,
``pow`` saves its input, ``softmax``/``log_softmax`` save their output, SDPA saves q, k,
v, the output and the log-sum-exp, and so on.  ``torch.autocast`` is modelled the way it
works: every lower-precision op casts its inputs (casts of activations are *not* cached,
so the input of q/k/v is cast three times).  Backward walks the recorded graph in
reverse creation order like the autograd engine, allocating each gradient, accumulating
gradients of tensors used twice, and freeing the saved tensors of each node after it
ran. Non-reentrant activation checkpointing keeps only each layer's inputs and
recomputes the layer's forward when its backward starts (with PyTorch's early stop once
the last saved tensor is recomputed).  The optimizer step allocates what the chosen
torch implementation allocates (``optimizer_step.SCRATCH_RULES``, named by the optimizer
registry :mod:`trainmem.optimizers`).

The running total of live bytes, split into the six categories of the estimator, gives
the peak (:class:`~.accounting.Simulator`). Python's reference counting frees a buffer
exactly when the last tensor (or saved slot) that uses it goes away, as for real
tensors.

Parts (imports go one way): :mod:`.accounting` (tensors, buffers, bytes by category) <-
:mod:`.autograd` (nodes, backward, checkpointing) <- :mod:`.ops` (the ops and their
autograd rules) <- :mod:`.sharded` (what sharding does to the step, behind hooks) <-
:mod:`.llama`, :mod:`.litgpt` (the decoder layouts and their parameters) <-
:mod:`.shard_plan` (what every ZeRO sharding does alike) <- :mod:`.shard_fsdp`,
:mod:`.shard_deepspeed` (each sharding's gathers and gradient buffers: the ``replay``
of its :mod:`trainmem.sharding` entry); :mod:`.step` (one training step: the decoder
table ``DECODERS``, sharding, optimizer). The entry
point is ``step.simulate_step(shape, decisions)``: a :class:`trainmem.config.Shape` and
the step's :class:`trainmem.decisions.Decisions` (:func:`trainmem.decisions.decide`),
which say every dtype, the attention backend, the sharding plan and the layout.
:mod:`.allocator` replays the step's recorded allocations through a model of PyTorch's
CUDA caching allocator. Standard library only."""
