"""Library versions the modelled training step depends on, and the behaviours keyed on
them.

``--versions transformers=4.48.1,peft=0.13.2,bitsandbytes=0.43.3,torch=2.4.1`` (any
subset) names the versions a user runs; the ones left out are the versions this course
pins (``constraints.txt``). Each behaviour below names the release that changed it.

``litgpt=`` takes a release (0.3.1 or later) or a commit of Lightning-AI/litgpt
(:data:`LITGPT_COMMITS`): the ``lit_gpt`` package stayed at ``0.1.0`` from October
2023 to April 2024 while its training step changed, so LitGPT's version is kept as the
date of its code, ``(year, month, day)``.

Standard library only (the in-page calculator runs it in Pyodide)."""

from __future__ import annotations

from .errors import OptionError

LIBRARIES = ("transformers", "peft", "bitsandbytes", "torch", "litgpt")
#: the versions this course pins (constraints.txt; bitsandbytes: the current release,
#: not installed on CPU; litgpt: not installed, the commit :mod:`trainmem.memory.litgpt`
#: was read at — the config hub's benchmark table)
PINNED = {
    "transformers": "5.24.0",
    "peft": "0.21.2",
    "bitsandbytes": "0.48.2",
    "torch": "2.13.0",
    "litgpt": "5895df10",
}
#: Lightning-AI/litgpt commits by the date of their code (``git log -1 --format=%ad``)
LITGPT_COMMITS = {
    "8641822": (2023, 10, 16),  # lit_gpt 0.1.0, the resource tables' version
    "6178c7cc": (2023, 10, 24),  # "Half precision fixes (#606)"
    "50b1974b": (2023, 10, 24),  # "Add SDPA backend test (#667)"
    "bbf982aa": (2024, 1, 21),  # "Updates to full-finetune script (#893)"
    "5895df10": (2024, 4, 26),  # the config hub's benchmark table
    "26857050": (2026, 6, 29),
}
#: the first tagged release (v0.3.1, b7f77316, 2024-05-08): every LitGPT behaviour
#: below changed before it, so any release from it on is dated by it
LITGPT_FIRST_RELEASE = ((0, 3, 1), (2024, 5, 8))


def _litgpt_date(text: str) -> tuple[int, ...]:
    """A LitGPT release or commit → the date of its code."""
    key = text.strip().lower()
    for commit, date in LITGPT_COMMITS.items():
        if len(key) >= 7 and (commit.startswith(key) or key.startswith(commit)):
            return date
    if all(c in "0123456789abcdef" for c in key) and len(key) >= 7:
        raise OptionError(
            "versions",
            f"versions: litgpt commit {text!r} is not one the replay knows; known: "
            f"{', '.join(LITGPT_COMMITS)}, or a release >= 0.3.1",
        )
    try:
        release = _parse_version(key)
    except ValueError:
        raise OptionError(
            "versions", f"versions: litgpt={text!r} is not a release or a commit"
        ) from None
    first, date = LITGPT_FIRST_RELEASE
    if release < first:
        raise OptionError(
            "versions",
            f"versions: litgpt={text!r}: lit_gpt 0.1.0 covers code from 2023-10 to "
            f"2024-04 whose training step changed; name a commit instead "
            f"({', '.join(LITGPT_COMMITS)})",
        )
    return date


def version_text(lib: str, version: tuple[int, ...]) -> str:
    """How a parsed version is shown (LitGPT's: the date of its code)."""
    if lib == "litgpt":
        return "code of " + "-".join(f"{n:02d}" for n in version)
    return ".".join(map(str, version))


def _parse_version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("."):
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
    if not parts:
        raise ValueError(text)
    return tuple(parts)


def parse_versions(spec) -> dict[str, tuple[int, ...]]:
    """``"transformers=4.48.1,peft=0.13.2"`` (or a dict) → the four libraries' versions
    as tuples, the pinned ones filling in what is not named. A bad entry raises
    :class:`OptionError` for ``versions``."""
    named: dict[str, str] = {}
    if spec is None or spec == "":
        pass
    elif isinstance(spec, dict):
        named = {str(k): str(v) for k, v in spec.items()}
    elif isinstance(spec, str):
        for item in spec.split(","):
            item = item.strip()
            if not item:
                continue
            if "=" not in item:
                raise OptionError(
                    "versions",
                    f"versions: {item!r} must be library=version "
                    f"(libraries: {', '.join(LIBRARIES)})",
                )
            lib, _, ver = item.partition("=")
            named[lib.strip()] = ver.strip()
    else:
        raise OptionError(
            "versions",
            f"versions must be a string or a dict, got {type(spec).__name__}",
        )
    out = {}
    for lib in named:
        if lib not in LIBRARIES:
            raise OptionError(
                "versions",
                f"versions: unknown library {lib!r}; allowed: {', '.join(LIBRARIES)}",
            )
    for lib in LIBRARIES:
        text = named.get(lib, PINNED[lib])
        if lib == "litgpt":
            out[lib] = _litgpt_date(text)
            continue
        try:
            out[lib] = _parse_version(text)
        except ValueError:
            raise OptionError(
                "versions", f"versions: {lib}={text!r} is not a version number"
            ) from None
    return out


def loss_form(v: dict) -> str:
    """How the causal-LM loss holds the logits (transformers).

    * ``"per-model"`` (< 4.46): ``LlamaForCausalLM.forward`` rebinds
      ``logits = logits.float()`` (the 16-bit logits are dropped) and cross-entropies
      ``logits[..., :-1, :].contiguous()``: the fp32 logits and a second fp32 copy of
      the shifted logits are alive with the log-softmax.
    * ``"shift"`` (4.46 .. 4.48): ``loss_utils.ForCausalLMLoss`` (added in 4.46.0)
      upcasts its own copy (the caller keeps the 16-bit logits for the output) and
      makes the same shifted fp32 copy.
    * ``"pad"`` (>= 4.49.0): ``ForCausalLMLoss`` pads the labels by one and shifts
      *them* (``nn.functional.pad(labels, (0, 1))``), so the fp32 logits are only
      viewed, not copied again."""
    t = v["transformers"]
    if t < (4, 46):
        return "per-model"
    if t < (4, 49):
        return "shift"
    return "pad"


def bnb_saves_input(v: dict) -> bool:
    """bitsandbytes' ``MatMul4Bit.forward`` kept ``ctx.tensors = (A, B)`` — the 4-bit
    Linear's input — for backward up to 0.43.1; 0.43.2 stores ``(None, B)`` (the input
    is needed only for a weight gradient, which a frozen 4-bit weight never has)."""
    return v["bitsandbytes"] < (0, 43, 2)


def cache_copies_kv(v: dict) -> bool:
    """With ``use_cache`` on, ``DynamicCache.update`` (transformers 4.56's
    ``DynamicLayer``, lazily initialised to an empty tensor and ``torch.cat``-ed)
    returns a new K and V per layer, which the cache holds until the model output is
    dropped; before 4.56 the first update stored the tensors themselves."""
    return v["transformers"] >= (4, 56)


def rope_buffers(v: dict) -> int:
    """Storages of a transformers rotary embedding's ``inv_freq``: up to 4.57
    ``LlamaRotaryEmbedding.__init__`` keeps ``self.original_inv_freq = self.inv_freq``
    (one storage); 5.0.0 registers ``original_inv_freq`` as a buffer of its own,
    ``inv_freq.clone()`` (two)."""
    return 2 if v["transformers"] >= (5, 0) else 1


def cache_values_in_key_dtype(v: dict) -> bool:
    """Whether the KV cache's value copies take the keys' dtype: ``DynamicLayer.
    lazy_initialization`` makes both empty tensors in ``key_states.dtype`` from 4.56
    to 5.23 (``self.values = torch.tensor([], dtype=self.dtype)``), so ``torch.cat``
    promotes 16-bit values to the fp32 of keys that RoPE computed in fp32 (fp32
    weights under autocast), and SDPA's autocast casts them back to 16 bit; 5.24.0
    makes the values' empty tensor in ``value_states.dtype``."""
    return (4, 56) <= v["transformers"] < (5, 24)


def hf_materializes_causal_mask(v: dict) -> bool:
    """Whether a training forward with no KV cache and no attention mask (TRL's DPO and
    GRPO pass ``use_cache=False``; gradient checkpointing turns the cache off) builds
    a ``batch x seq x seq`` bool causal mask for SDPA instead of passing
    ``is_causal=True``. From 4.53.1 ``_preprocess_mask_arguments`` (masking_utils.py)
    calls ``find_packed_sequence_indices(position_ids)`` whenever there is no cache and
    no attention mask, and that function returns its tensor even when nothing is packed
    ("it would be nice to return None ... but it causes issues with export", 4.57.1);
    ``create_causal_mask`` then sets ``allow_is_causal_skip = False`` (with torch 2.6
    or newer) and materialises the mask. 5.0.0 returns ``None`` when no sequence is
    packed (huggingface/transformers#42367), and the mask is skipped again."""
    return (4, 53, 1) <= v["transformers"] < (5, 0) and v["torch"][:2] >= (2, 6)


def installed(libraries=LIBRARIES) -> dict[str, str]:
    """The versions of ``libraries`` installed here (``importlib.metadata``), for
    ``versions=``: a cell that compares an estimate with a measurement estimates the
    libraries it measured with. Libraries not installed are left out (their pinned
    versions fill in)."""
    from importlib import metadata

    out = {}
    for lib in libraries:
        try:
            text = metadata.version(lib)
        except metadata.PackageNotFoundError:
            continue
        out[lib] = text.split("+")[0]
    return out


def hf_checkpointing_reentrant(v: dict) -> bool:
    """What ``gradient_checkpointing=True`` without ``use_reentrant`` runs:
    ``gradient_checkpointing_enable`` fills ``{"use_reentrant": True}`` up to
    transformers 4.x (huggingface/transformers#28538, and torch's own default before
    it); 5.0.0 switched it to ``False`` (huggingface/transformers#43203)."""
    return v["transformers"] < (5, 0)


def hf_loads_stored_dtype(v: dict) -> bool:
    """What ``from_pretrained`` loads a checkpoint in when no ``dtype`` is given:
    from transformers 5.0.0 the dtype it was stored in (``if dtype is None: dtype =
    "auto"`` in ``PreTrainedModel.from_pretrained``, modeling_utils.py; ``"auto"``
    reads the config's ``dtype``, else the checkpoint's first floating weight); up
    to 4.x fp32 (``_get_dtype``'s ``else`` branch: "set fp32 as the default dtype
    for BC", ``torch.get_default_dtype()``, in 4.57.1's modeling_utils.py)."""
    return v["transformers"] >= (5, 0)


def hf_default_optim(v: dict) -> str:
    """``TrainingArguments.optim``'s default: ``"adamw_torch_fused"`` when torch is
    2.8 or newer, from transformers 4.54.0 (``default_optim`` in training_args.py);
    ``"adamw_torch"`` otherwise."""
    if v["transformers"] >= (4, 54) and v["torch"] >= (2, 8):
        return "adamw_torch_fused"
    return "adamw_torch"


def litgpt_rmsnorm_fp32(v: dict) -> bool:
    """LitGPT's ``RMSNorm.forward`` upcasts (``x = x.float()``, the norm in fp32,
    ``.to(dtype)`` before ``* weight``) since 6178c7cc (2023-10-24, "Half precision
    fixes"); before, ``lit_gpt/rmsnorm.py`` computes ``x * x``, the mean, ``x *
    rsqrt`` and ``weight * x_normed`` in the module's dtype."""
    return v["litgpt"] >= LITGPT_COMMITS["6178c7cc"]


def litgpt_rope_fp32(v: dict) -> bool:
    """``build_rope_cache`` returns fp32 ``cos``/``sin`` since 6178c7cc; before,
    ``rope_cache()`` passes ``torch.get_default_dtype()`` (bf16 under
    ``fabric.init_module``) and it returns ``cos.half(), sin.half()`` — fp16 buffers,
    whose product with a bf16 ``x`` promotes to fp32 all the same."""
    return v["litgpt"] >= LITGPT_COMMITS["6178c7cc"]


def litgpt_mqa_expanded(v: dict) -> bool:
    """``CausalSelfAttention.forward`` expands the single key/value head of
    multi-query attention (``n_query_groups == 1``) to every query head in training
    since 50b1974b (2023-10-24, "Add SDPA backend test"); before, it skipped the
    ``expand`` whenever ``n_query_groups == 1``, and SDPA got one k/v head for all
    query heads."""
    return v["litgpt"] >= LITGPT_COMMITS["50b1974b"]


def litgpt_loss_holds_graph(v: dict) -> bool:
    """finetune/lora.py's loop variable ``loss`` (the graph's output) is rebound by
    the next micro-batch's ``chunked_cross_entropy`` until bbf982aa (2024-01-21), which
    logs ``running_loss.update(loss.detach())`` and rebinds ``loss`` to a float each
    log interval: before, the previous graph — and what its nodes keep outside
    ``save_for_backward`` — lives through the next forward and its cross-entropy."""
    return v["litgpt"] < LITGPT_COMMITS["bbf982aa"]
