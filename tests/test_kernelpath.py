"""The kernel path make test validates on: parsing, the candidates per CPU level, the
AMX bug rule, a real probe, and the fallback when a path is broken."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from coursekit import kernelpath as kp


def test_forced_paths_parse_by_name_and_by_pairs():
    assert kp.parse_forced("generic") is kp.GENERIC
    assert kp.parse_forced(" native ") is kp.NATIVE
    old = kp.parse_forced("ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE")
    assert old.env == {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"}
    assert old.level == "DEFAULT"
    assert old.kernel_env_args() == [
        "--kernel-env",
        "ATEN_CPU_CAPABILITY=default",
        "--kernel-env",
        "MKL_CBWR=COMPATIBLE",
    ]


@pytest.mark.parametrize("bad", ["FOO=1", "ATEN_CPU_CAPABILITY", "fastest"])
def test_a_bad_forced_path_names_the_problem(bad):
    with pytest.raises(ValueError, match="expected one of avx2, generic, native"):
        kp.parse_forced(bad)


def test_every_candidate_caps_every_library_consistently():
    for path in kp.CANDIDATES:
        assert set(path.env) == set(kp.PATH_VARIABLES)
        assert not kp.amx_bug_applies(path.env), path.name


def test_the_amx_rule_matches_the_reported_combinations():
    # Reported broken: ATen capped to default or avx2, oneDNN free.
    assert kp.amx_bug_applies({"ATEN_CPU_CAPABILITY": "default"})
    assert kp.amx_bug_applies({"ATEN_CPU_CAPABILITY": "avx2"})
    # Reported working: native ATen, or oneDNN capped as well.
    assert not kp.amx_bug_applies({})
    assert not kp.amx_bug_applies({"ATEN_CPU_CAPABILITY": "avx512"})
    for isa in ("AVX2", "AVX512_CORE"):
        env = {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": isa}
        assert not kp.amx_bug_applies(env)


def test_candidates_are_the_paths_below_the_native_level():
    assert kp.candidates_below("AVX512") == [kp.AVX2, kp.GENERIC]
    assert kp.candidates_below("AVX2") == [kp.GENERIC]
    assert kp.candidates_below("DEFAULT") == []
    other = kp.candidates_below("SVE256")  # aarch64: ATen's generic kernels only
    assert [p.env for p in other] == [{"ATEN_CPU_CAPABILITY": "default"}]


def test_tolerances_flag_large_errors_and_nan():
    errors = {"sdpa_fp32": 3e-7, "sdpa_bf16": 0.2, "conv_fp32": float("nan")}
    assert set(kp.out_of_tolerance(errors)) == {"sdpa_bf16", "conv_fp32"}


def test_a_broken_path_is_reported_and_the_next_one_is_used():
    """The combination that crashes on AMX CPUs, forced by hand, with the probe told
    to behave as on an AMX CPU: the probe names the torch bug, falls back to the
    first candidate below the native level (avx2 on an AVX-512 CPU, else generic),
    and that path really runs the workload here."""
    env = dict(os.environ, COURSE_SIMULATE_AMX="1")
    said = []
    path, results, native = kp.choose(
        "ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE", base_env=env, log=said.append
    )
    if native == "DEFAULT":
        pytest.skip("this CPU has no level below the generic kernels")
    assert path is kp.candidates_below(native)[0]
    assert [r.ok for r in results] == [False, True]
    assert "pack_vnni2" in said[0] and "known torch bug" in said[0]
    assert results[1].capability == path.level


def test_the_cli_writes_the_arguments_and_says_the_path(tmp_path):
    out = tmp_path / "args"
    proc = subprocess.run(
        [sys.executable, "-m", "coursekit.kernelpath", "--force", "native"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert proc.stdout.startswith("cpu: ")
    assert "kernel path: notebooks validated on native" in proc.stdout
    proc = subprocess.run(
        [sys.executable, "-m", "coursekit.kernelpath", "--force", "X=1"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "error: kernel path" in proc.stderr
    assert not out.exists()


def test_ci_turns_a_missing_tool_skip_into_a_failure(tmp_path):
    (tmp_path / "conftest.py").write_text(
        (kp.Path(__file__).parent / "conftest.py").read_text()
    )
    (tmp_path / "test_x.py").write_text(
        textwrap.dedent(
            """
            import pytest
            def test_browser():
                pytest.skip("chromium not installed; run `make browser-deps`")
            def test_other():
                pytest.skip("needs a GPU")
            """
        )
    )
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "."]
    for ci, rc, word in (("true", 1, "1 failed"), ("", 0, "2 skipped")):
        # the conftest needs pytest alone: without autoloading every installed plugin
        # (nbval, xdist, playwright ...) the run takes a second, not ten
        # (and it imports tests.schedule: the repository goes on the path)
        env = dict(
            os.environ,
            CI=ci,
            PYTEST_DISABLE_PLUGIN_AUTOLOAD="1",
            PYTHONPATH=str(kp.Path(__file__).resolve().parents[1]),
        )
        proc = subprocess.run(
            args, cwd=tmp_path, env=env, capture_output=True, text=True
        )
        assert proc.returncode == rc, proc.stdout
        assert word in proc.stdout
