"""The second CPU kernel path that ``make test`` validates the stored outputs on.

``make nb`` stores every notebook's outputs from the host's native kernels.
``make test`` re-runs the notebooks on *another* CPU code path, so a number that only
holds for one set of kernels fails. That path must exist on the host and work there:
every library that dispatches on the CPU's features is capped to the same level —

* ATen (``ATEN_CPU_CAPABILITY``: ``default`` / ``avx2`` / ``avx512``),
* oneDNN (``ONEDNN_MAX_CPU_ISA``), which ATen's CPU flash attention consults on its
  own to decide whether to pack bf16 operands for AMX,
* MKL (``MKL_ENABLE_INSTRUCTIONS`` and the conditional-numerical-reproducibility
  branch ``MKL_CBWR``).

Capping ATen alone is not enough. On a CPU with AMX (``amx_bf16``), torch 2.13's
bf16 ``scaled_dot_product_attention`` (forward + backward, sequence >= 64) asks oneDNN
whether to pack, oneDNN says yes (AMX is there), and the packing routine
``at::vec::pack_vnni2`` only exists in ATen's AVX-512 kernels: under
``ATEN_CPU_CAPABILITY=default`` or ``avx2`` it raises ``RuntimeError: pack_vnni2 is only
supported when avx512 is supported``. Capping oneDNN with it keeps the two libraries
consistent.

:func:`choose` probes each candidate path once, in a subprocess, with a tiny workload
(fp32 and bf16 SDPA forward and backward at sequence 128, matmul, conv2d forward and
backward, bf16 autocast linear) checked against a float64 reference. A path that
crashes or computes wrong numbers is never used: the probe says why (naming the torch
bug when it recognises it) and falls back to the next path, and finally to the native
one. ``python -m coursekit kernel-path`` prints one line naming the chosen path and
writes nbval's ``--kernel-env`` arguments to a file for the Makefile.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

# Environment variables through which the libraries choose their CPU code path. A
# path sets each of them (or leaves it unset: the library's native choice).
PATH_VARIABLES = (
    "ATEN_CPU_CAPABILITY",
    "ONEDNN_MAX_CPU_ISA",
    "MKL_ENABLE_INSTRUCTIONS",
    "MKL_CBWR",
)

# ATen's capability names, lowest first (torch.backends.cpu.get_cpu_capability()).
X86_LEVELS = ("DEFAULT", "AVX2", "AVX512")

# Errors the probe recognises, and what they mean.
KNOWN_BUGS = {
    "pack_vnni2": (
        "torch's CPU bf16 scaled_dot_product_attention packs operands for AMX when "
        "oneDNN reports AMX, but the packing exists only in ATen's AVX-512 kernels "
        "(ATen capped below AVX-512 while oneDNN is not)"
    ),
}


@dataclass(frozen=True)
class KernelPath:
    """One consistent set of library caps. ``env`` maps variable -> value; a
    variable missing from it is left to the library."""

    name: str
    level: str  # the ATen capability this path runs, or "native"
    env: dict = field(default_factory=dict)

    def describe(self) -> str:
        if not self.env:
            return f"{self.name} (no caps: every library's own choice)"
        caps = " ".join(f"{k}={v}" for k, v in self.env.items())
        return f"{self.name} ({caps})"

    def kernel_env_args(self) -> list[str]:
        """nbval's ``--kernel-env`` arguments for this path. A variable the path does
        not set is inherited from the caller (who may cap the libraries to simulate
        an older CPU)."""
        out = []
        for var, value in self.env.items():
            out += ["--kernel-env", f"{var}={value}"]
        return out


# The candidate second paths. The nearest level below the native one first: other
# vector widths, so other reduction orders and rounding (what a number that holds for
# one set of kernels trips on), the kernels of the commonest other x86 class (AVX2-only
# CPUs), and about as fast as native where the generic kernels take about 1.3 times as
# long (the chapters' fp32 matmuls). Then the generic kernels.
GENERIC = KernelPath(
    "generic",
    "DEFAULT",
    {
        "ATEN_CPU_CAPABILITY": "default",
        "ONEDNN_MAX_CPU_ISA": "SSE41",
        "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
        "MKL_CBWR": "COMPATIBLE",
    },
)
AVX2 = KernelPath(
    "avx2",
    "AVX2",
    {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "MKL_CBWR": "AVX2",
    },
)
NATIVE = KernelPath("native", "native", {})
CANDIDATES = (AVX2, GENERIC)

# The probe's workload, run in a fresh interpreter with the path's environment. It
# prints one JSON line: the capability ATen runs and the worst relative error of each
# check against float64.
_WORKLOAD = r"""
import json, torch
import torch.nn.functional as F
torch.manual_seed(0)
torch.set_num_threads(1)
errs = {}
def rel(a, b):
    a = a.double(); b = b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
def sdpa(dtype):
    q, k, v = (torch.randn(2, 2, 128, 32) for _ in range(3))
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    low = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    outs = []
    for ts in (ref, low):
        o = F.scaled_dot_product_attention(*ts, is_causal=True)
        o.square().sum().backward()
        outs.append([o] + [t.grad for t in ts])
    return max(rel(a, b) for a, b in zip(outs[1], outs[0]))
def mm(dtype):
    a, b = torch.randn(96, 80), torch.randn(80, 72)
    return rel(a.to(dtype) @ b.to(dtype), a.double() @ b.double())
def conv(dtype):
    x, w = torch.randn(2, 3, 12, 12), torch.randn(4, 3, 3, 3)
    res = []
    for d in (torch.float64, dtype):
        xs, ws = x.to(d).requires_grad_(), w.to(d).requires_grad_()
        o = F.conv2d(xs, ws, padding=1)
        o.square().sum().backward()
        res.append([o, xs.grad, ws.grad])
    return max(rel(a, b) for a, b in zip(res[1], res[0]))
def amp_linear():
    lin = torch.nn.Linear(64, 48)
    x = torch.randn(16, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x)
    y.float().sum().backward()
    ref = x.double() @ lin.weight.double().T + lin.bias.double()
    return rel(y, ref)
for dt, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
    errs[f"sdpa_{name}"] = sdpa(dt)
    errs[f"matmul_{name}"] = mm(dt)
    errs[f"conv_{name}"] = conv(dt)
errs["autocast_bf16"] = amp_linear()
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(),
                  "errors": errs}))
"""

# Largest relative error each check may show (bf16 keeps 8 significant bits; the
# reference is float64 of the same inputs).
TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2}


@dataclass
class ProbeResult:
    path: KernelPath
    ok: bool
    capability: str = ""
    seconds: float = 0.0
    reason: str = ""


def out_of_tolerance(errors: dict) -> dict:
    """The checks whose relative error exceeds their dtype's tolerance (NaN too)."""
    return {
        k: e
        for k, e in errors.items()
        if not e <= TOLERANCE["bf16" if "bf16" in k else "fp32"]
    }


def probe(path: KernelPath, base_env: dict | None = None, timeout: float = 120):
    """Run the workload under ``path``; a :class:`ProbeResult` says whether it works.

    ``COURSE_SIMULATE_AMX=1`` makes the probe behave as on a CPU with AMX: a path
    that caps ATen below AVX-512 but leaves oneDNN free to use AMX raises torch's
    ``pack_vnni2`` error, so the fallback can be exercised on a CPU without AMX.
    """
    env = dict(os.environ if base_env is None else base_env)
    env.update(path.env)
    env["OMP_NUM_THREADS"] = "1"
    code = _WORKLOAD
    if env.get("COURSE_SIMULATE_AMX") == "1" and amx_bug_applies(path.env):
        code = (
            "raise RuntimeError('pack_vnni2 is only supported when avx512 is "
            "supported (simulated: COURSE_SIMULATE_AMX=1)')\n" + code
        )
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return ProbeResult(path, False, reason=f"hung for more than {timeout:.0f} s")
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        last = lines[-1] if lines else f"exit status {proc.returncode}"
        if proc.returncode < 0:
            last = f"killed by signal {-proc.returncode} ({last})"
        for key, meaning in KNOWN_BUGS.items():
            if key in proc.stderr:
                last = f"{last} — known torch bug: {meaning}"
        return ProbeResult(path, False, seconds=seconds, reason=last)
    try:
        report = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return ProbeResult(path, False, seconds=seconds, reason="no probe report")
    bad = out_of_tolerance(report["errors"])
    if bad:
        worst = ", ".join(f"{k} rel.err {e:.2g}" for k, e in bad.items())
        return ProbeResult(
            path, False, report["capability"], seconds, f"wrong results: {worst}"
        )
    return ProbeResult(path, True, report["capability"], seconds)


def amx_bug_applies(env: dict) -> bool:
    """Whether caps ``env`` hit the AMX ``pack_vnni2`` bug on a CPU with AMX: ATen
    below AVX-512 while oneDNN may still choose AMX."""
    aten = env.get("ATEN_CPU_CAPABILITY", "").upper()
    onednn = env.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    return aten in ("DEFAULT", "AVX2") and ("AMX" in onednn or onednn == "ALL")


def native_capability(base_env: dict | None = None) -> str:
    """The capability ATen runs here with the caller's environment (a caller may cap
    it to simulate an older CPU: ``ATEN_CPU_CAPABILITY=avx2 make test``)."""
    if base_env is None:
        import torch

        return torch.backends.cpu.get_cpu_capability()
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import torch; print(torch.backends.cpu.get_cpu_capability())",
        ],
        env=dict(base_env),
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip().splitlines()[-1]


def parse_forced(text: str) -> KernelPath:
    """A path given by hand: a candidate's name (``generic``, ``avx2``, ``native``)
    or ``VAR=value`` pairs (the old ``NBVAL_ENV`` form)."""
    text = text.strip()
    for path in (*CANDIDATES, NATIVE):
        if text == path.name:
            return path
    env = {}
    for item in text.split():
        var, sep, value = item.partition("=")
        if not sep or var not in PATH_VARIABLES:
            raise ValueError(
                f"kernel path {text!r}: expected one of "
                f"{', '.join(p.name for p in (*CANDIDATES, NATIVE))} or VAR=value "
                f"pairs with VAR in {', '.join(PATH_VARIABLES)}; got {item!r}"
            )
        env[var] = value
    level = env.get("ATEN_CPU_CAPABILITY", "native").upper()
    return KernelPath("forced", level, env)


def candidates_below(native: str) -> list[KernelPath]:
    """The candidate paths that run below the native capability (on aarch64 and
    other architectures: the generic path only)."""
    if native not in X86_LEVELS:
        return [KernelPath("generic", "DEFAULT", {"ATEN_CPU_CAPABILITY": "default"})]
    rank = X86_LEVELS.index(native)
    return [p for p in CANDIDATES if X86_LEVELS.index(p.level) < rank]


def choose(forced: str | None = None, base_env: dict | None = None, log=print):
    """The first working path: ``forced`` (if given), else the candidates below the
    native capability, else the native path. Returns ``(path, results)``."""
    native = native_capability(base_env)
    order = [parse_forced(forced)] if forced else []
    order += [p for p in candidates_below(native) if p not in order]
    results = []
    for path in order:
        result = probe(path, base_env)
        results.append(result)
        if result.ok:
            return path, results, native
        log(
            f"kernel path {path.describe()} is broken on this CPU: {result.reason}; "
            "trying the next one"
        )
    log("no second kernel path works here: the notebooks are validated natively")
    return NATIVE, results, native


def cpu_summary() -> str:
    """CPU model, the flags that decide the kernel paths, and the torch build."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "CPU part", "Model") and model in ("", "x86_64"):
                model = value.strip()
            if key in ("flags", "Features") and not flags:
                flags = set(value.split())
    except OSError:
        pass
    wanted = (
        "avx2",
        "fma",
        "avx512f",
        "avx512_vnni",
        "avx512_bf16",
        "amx_tile",
        "amx_bf16",
        "asimd",
        "sve",
        "bf16",
    )
    shown = " ".join(f for f in wanted if f in flags) or "none of interest"
    import torch

    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU"
    return (
        f"cpu: {model} ({platform.machine()}, {os.cpu_count()} cores); "
        f"flags: {shown}; torch {torch.__version__} ({build} build), "
        f"Python {platform.python_version()}"
    )


def main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m coursekit kernel-path",
        description="Choose and probe the CPU kernel path nbval validates on.",
    )
    ap.add_argument(
        "--force",
        default="",
        help="a path to try first: generic, avx2, native, or VAR=value pairs",
    )
    ap.add_argument("--args-file", help="write nbval's --kernel-env arguments here")
    args = ap.parse_args(argv)
    print(cpu_summary())
    forced = args.force.strip() or None
    if forced == "auto":
        forced = None
    try:
        path, results, native = choose(forced)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    secs = sum(r.seconds for r in results)
    print(
        f"kernel path: notebooks validated on {path.describe()}; native kernels: "
        f"{native}; probe (SDPA fwd/bwd, matmul, conv in fp32 and bf16) "
        f"{'passed' if results and results[-1].ok else 'not run'} in {secs:.1f} s"
    )
    if args.args_file:
        Path(args.args_file).write_text(" ".join(path.kernel_env_args()) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
