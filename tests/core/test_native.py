"""The optional C kernels: the loader's choice of path, and the chained SHA-256 kernel against
the pure-Python chain (the reference), byte for byte, on random inputs.

The kernel tests import `kvreuse.core._native` directly, so they run on both paths (also under
`KVREUSE_PURE=1`); they are skipped when the extension was not built (failed under CI).
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.util
import logging
import os
import random
import subprocess
import sys
from array import array
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from depth import scaled
from kvreuse import MultiModalItem
from kvreuse.core import native
from kvreuse.core.encoding import TOKEN_TYPECODE, enc
from kvreuse.core.hashing.hasher import Hasher
from needs import missing

ROOT = Path(__file__).resolve().parents[2]
NAME = "kvreuse.core._native"


def _ext() -> ModuleType:
    try:
        import kvreuse.core._native as ext
    except ImportError:
        missing("the native kernels' build", "pip install -e . with a C compiler")
    if native._source_digest() != ext.SOURCE_SHA256:
        missing("a native build of the current source", "pip install --no-deps -e .")
    return ext


# ------------------------------------------------------------------ the loader
def test_kvreuse_pure_forces_the_pure_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVREUSE_PURE", "1")
    assert native._load() == (None, "KVREUSE_PURE=1")


def test_a_bad_kvreuse_pure_value_is_one_warning_and_the_pure_path(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("KVREUSE_PURE", "yes")
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        ext, reason = native._load()
    assert ext is None and "KVREUSE_PURE" in reason
    assert len(caplog.records) == 1
    assert "must be 0 or 1, got 'yes'" in caplog.records[0].getMessage()


def test_a_missing_build_is_silent(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("KVREUSE_PURE", raising=False)
    monkeypatch.setitem(sys.modules, NAME, None)  # import raises ModuleNotFoundError(name=NAME)
    with caplog.at_level(logging.DEBUG, logger=native.__name__):
        assert native._load() == (None, "native kernels not built")
    assert caplog.records == []


class _Broken(importlib.abc.MetaPathFinder):
    """A finder that fails the extension's import the way a mismatched ABI does."""

    def find_spec(self, name: str, path: object, target: object = None) -> None:
        if name == NAME:
            raise ImportError(f"{NAME}: undefined symbol: PyFoo_Bar")
        return None


def test_a_build_that_fails_to_import_is_one_warning_and_the_pure_path(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("KVREUSE_PURE", raising=False)
    monkeypatch.delitem(sys.modules, NAME, raising=False)
    monkeypatch.setattr(sys, "meta_path", [_Broken(), *sys.meta_path])
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        ext, reason = native._load()
    assert (ext, reason) == (None, "import failed")
    (rec,) = caplog.records
    assert "undefined symbol" in rec.getMessage() and "pure-Python core" in rec.getMessage()
    assert "pip install --no-deps -e ." in rec.getMessage()


def test_a_stale_build_is_one_warning_and_the_pure_path(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _ext()
    monkeypatch.delenv("KVREUSE_PURE", raising=False)
    monkeypatch.setattr(native, "_source_digest", lambda: "0" * 64)  # a source was edited
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        ext, reason = native._load()
    assert (ext, reason) == (None, "stale build")
    (rec,) = caplog.records
    assert "the C sources changed since it was compiled" in rec.getMessage()


def test_a_current_build_is_the_native_path(monkeypatch: pytest.MonkeyPatch) -> None:
    built = _ext()
    monkeypatch.delenv("KVREUSE_PURE", raising=False)
    ext, reason = native._load()
    assert ext is built and built.SHA256_BACKEND in reason


def test_version_names_the_active_path() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvreuse", "--version"], capture_output=True, text=True, check=True
    ).stdout
    assert out.startswith("kvreuse ") and native.describe() in out
    pure = subprocess.run(
        [sys.executable, "-m", "kvreuse", "--version"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "KVREUSE_PURE": "1"},
    ).stdout
    assert "pure-Python core (KVREUSE_PURE=1)" in pure


def _build(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[list[str], list[Path]]:
    """setup.py's build_ext into tmp_path: (its `kvreuse:` lines, the modules it built)."""
    from setuptools import Distribution

    spec = importlib.util.spec_from_file_location("kvreuse_setup", ROOT / "setup.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    dist = Distribution({"name": "kvreuse", "ext_modules": [mod._extension()]})
    dist.cmdclass["build_ext"] = mod.OptionalBuildExt
    cmd = dist.get_command_obj("build_ext")
    cmd.build_lib, cmd.build_temp = str(tmp_path / "lib"), str(tmp_path / "tmp")
    cmd.force = True
    cmd.ensure_finalized()
    cmd.run()
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("kvreuse:")]
    return lines, list((tmp_path / "lib").rglob("_native*"))


def test_an_install_without_a_compiler_still_succeeds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The build is optional: a compiler that fails gives one line and no module, no error."""
    monkeypatch.setenv("CC", "false")
    monkeypatch.setenv("LDSHARED", "false")
    lines, built = _build(tmp_path, capsys)
    assert built == []
    assert len(lines) == 1, lines
    assert lines[0].startswith("kvreuse: native kernels not built (CompileError: ")
    assert lines[0].endswith("); using the pure-Python core")
    monkeypatch.setenv("KVREUSE_NO_NATIVE", "1")
    assert _build(tmp_path, capsys) == (
        ["kvreuse: native kernels not built (KVREUSE_NO_NATIVE=1); using the pure-Python core"],
        [],
    )


# ------------------------------------------------------------------ the SHA-256 kernel
@given(data=st.binary(max_size=300))
@settings(max_examples=scaled(200))
def test_both_sha256_backends_are_sha256(data: bytes) -> None:
    ext = _ext()
    want = hashlib.sha256(data).digest()
    assert ext.sha256(data) == want and ext.sha256(data, True) == want


def _hasher(monkeypatch: pytest.MonkeyPatch, ext: ModuleType | None, **kw: object) -> Hasher:
    monkeypatch.setattr(native, "ext", ext)
    return Hasher("sha256", **kw)  # type: ignore[arg-type]


@st.composite
def chains(draw: st.DrawFn) -> tuple[dict, list[int], list[int], dict]:
    unit = draw(st.integers(1, 9))
    la = draw(st.sampled_from([0, 0, 1, 3]))
    tokens = draw(st.lists(st.integers(0, 2**32 - 1), max_size=12 * unit + la))
    cuts = [*sorted(draw(st.lists(st.integers(0, len(tokens)), max_size=3))), len(tokens)]
    extra: dict = {}
    if draw(st.booleans()):
        extra["cache_salt"] = draw(st.sampled_from(["s", "salt"]))
    if draw(st.booleans()):
        extra["lora"] = ("name", "path")
    if draw(st.booleans()):
        off = draw(st.integers(0, 4 * unit))
        extra["mm_items"] = (MultiModalItem("img", off, draw(st.integers(0, 3 * unit))),)
    return dict(hash_unit=unit, lookahead=la), tokens, cuts, extra


@given(case=chains(), as_array=st.booleans())
@settings(max_examples=scaled(300))
def test_the_kernel_chain_equals_the_python_chain(
    case: tuple[dict, list[int], list[int], dict], as_array: bool
) -> None:
    """Extended in random steps, with extra keys and lookahead, from a list or an unsigned
    array: every H[k] is byte-identical to the pure path's, which the reference `unit_hash`
    checks unit by unit."""
    ext = _ext()
    kw, tokens, cuts, extra = case
    with pytest.MonkeyPatch.context() as mp:
        fast, ref = _hasher(mp, ext, **kw), _hasher(mp, None, **kw)
    if native.chain_kernel("sha256") is not None:
        assert fast.template.kernel is not None
    assert ref.template.kernel is None
    a, b = fast.chain(**extra), ref.chain(**extra)
    for cut in cuts:
        seq = array(TOKEN_TYPECODE, tokens[:cut]) if as_array else tokens[:cut]
        assert a.extend(seq) == b.extend(list(seq))
        assert a.hashes == b.hashes and a.num_units == b.num_units


@given(
    unit=st.integers(1, 6),
    la=st.integers(0, 3),
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=40),
    portable=st.booleans(),
)
@settings(max_examples=scaled(200))
def test_the_kernel_follows_the_definition(
    unit: int, la: int, tokens: list[int], portable: bool
) -> None:
    """`sha256_units` against `Hasher.unit_hash` (straight from enc), on both backends."""
    ext = _ext()
    h = Hasher("sha256", unit, la)
    t = h.template
    n = max(0, (len(tokens) - la) // unit)
    out = ext.sha256_units(
        t.root, t.pre, t.mid, t.la_hdr, enc(()), tokens, 0, n, unit, la, portable
    )
    parent = t.root
    for k in range(n):
        unit_toks = tokens[k * unit : (k + 1) * unit]
        succ = tokens[(k + 1) * unit : (k + 1) * unit + la]
        parent = h.unit_hash(parent, unit_toks, succ, ())
        assert out[k] == parent


def test_the_kernel_refuses_bad_input_with_one_clear_error() -> None:
    ext = _ext()
    t = Hasher("sha256", 4, 0).template
    args = (t.pre, t.mid, t.la_hdr, enc(()))
    with pytest.raises(ValueError, match="tokens end before the last unit"):
        ext.sha256_units(t.root, *args, [1, 2, 3], 0, 1, 4, 0)
    with pytest.raises(ValueError, match="tokens end before the last unit"):
        ext.sha256_units(t.root, *args, array(TOKEN_TYPECODE, [1, 2, 3]), 0, 1, 4, 0)
    with pytest.raises(ValueError, match="bad parent"):
        ext.sha256_units(b"short", *args, [1, 2, 3, 4], 0, 1, 4, 0)
    with pytest.raises(OverflowError):
        ext.sha256_units(t.root, *args, [1, 2, 3, 2**32], 0, 1, 4, 0)
    with pytest.raises(OverflowError):
        ext.sha256_units(t.root, *args, [1, 2, 3, -1], 0, 1, 4, 0)
    with pytest.raises(TypeError):
        ext.sha256_units(t.root, *args, [1, 2, 3, "4"], 0, 1, 4, 0)
    with pytest.raises(TypeError, match="10 or 11"):
        ext.sha256_units(t.root)


def test_a_long_prompt_hashes_alike_on_both_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """One 20,000-token prompt at unit 16 (the benchmark's shape), long enough for a message
    buffer on the heap at unit 600."""
    ext = _ext()
    rng = random.Random(7)
    tokens = [rng.randrange(2**32) for _ in range(20_000)]
    for unit in (16, 600):
        fast, ref = (
            _hasher(monkeypatch, ext, hash_unit=unit),
            _hasher(monkeypatch, None, hash_unit=unit),
        )
        assert fast.hash_units(tokens) == ref.hash_units(tokens)
