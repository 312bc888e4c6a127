"""Library versions the modelled training step depends on, and the behaviours keyed on
them.

``--versions transformers=4.48.1,peft=0.13.2,bitsandbytes=0.43.3,torch=2.4.1`` (any
subset) names the versions a user runs; the ones left out are the versions this course
pins (``constraints.txt``). Each behaviour below names the release that changed it.

Standard library only (the in-page calculator runs it in Pyodide)."""

from __future__ import annotations

from .errors import OptionError

LIBRARIES = ("transformers", "peft", "bitsandbytes", "torch")
#: the versions this course pins (constraints.txt; bitsandbytes: the current release,
#: not installed on CPU)
PINNED = {
    "transformers": "5.24.0",
    "peft": "0.21.2",
    "bitsandbytes": "0.48.2",
    "torch": "2.13.0",
}


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
