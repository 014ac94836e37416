"""Build and load the C kernels of this folder (`cpu_*.c`) for this CPU.

Each source is compiled once per machine with the system C compiler for this CPU
(`-march=native`) into the cache directory ($PDDGW_CACHE_DIR, else ~/.cache/pddgw; a
directory of this user's under the system's temporary directory where neither is writable),
named by a hash of the source, the flags, the compiler and the CPU's features, installed
atomically (concurrent builders each install a whole file), and loaded with ctypes (which
releases the GIL during a call).  torch's extension builder is not used: it needs ninja and
compiles against torch's headers (tens of seconds); these are plain C files that build in
about a second.

`load` raises (OSError, RuntimeError, SubprocessError) where no compiler builds a source;
`load_or_log` logs that once instead, and the callers keep their torch fallback.  `Once`
holds what a caller binds from its library, made on first use.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sysconfig
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar, cast

import structlog

__all__ = ["BuildFailed", "Once", "build", "compiler", "load", "load_or_log"]

T = TypeVar("T")
log = structlog.get_logger(__name__)

COMPILE = ("-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp", "-fPIC", "-std=gnu11")
# -ffast-math at compile time only (vectorized expf): linking with it would add crtfastmath,
# which turns on flush-to-zero for the whole process.
LINK = ("-shared", "-fopenmp", "-lmvec", "-lm")
BuildFailed = (OSError, RuntimeError, subprocess.SubprocessError)
_LOCAL_INCLUDE = re.compile(r'^#include "([\w.]+)"', re.MULTILINE)


def cache_dir() -> Path:
    """$PDDGW_CACHE_DIR (else ~/.cache/pddgw) /kernels, created; where it cannot be (a read-only
    home), a directory of this user's in the system's temporary directory."""
    root = os.environ.get("PDDGW_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pddgw")
    for path in (Path(root) / "kernels", Path(tempfile.gettempdir()) / f"pddgw-{os.getuid()}" / "kernels"):
        try:
            path.mkdir(parents=True, exist_ok=True)
            if os.access(path, os.W_OK):
                return path
        except OSError:
            continue
    raise RuntimeError(f"no writable directory for the CPU kernels ({root} nor the temporary directory)")


def compiler() -> str | None:
    for cc in (os.environ.get("CC"), (sysconfig.get_config_var("CC") or "").split(" ")[0], "cc", "gcc"):
        if cc and shutil.which(cc):
            return cc
    return None


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def _texts(source: Path) -> list[str]:
    """The source's text and that of the headers of this folder it includes (`#include "x.h"`)."""
    text = source.read_text()
    return [text, *(source.with_name(name).read_text() for name in _LOCAL_INCLUDE.findall(text))]


def build(source: Path, cc: str) -> Path:
    """The library of `source`, compiled now unless a build for this source (and the headers it
    includes), compiler and CPU exists."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\0".join([*_texts(source), *COMPILE, *LINK, version, _cpu_features(),
                                    platform.machine()]).encode()).hexdigest()[:16]
    out = cache_dir() / f"{source.stem}-{key}.so"
    if out.exists():
        return out
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        obj, lib = Path(tmp, "a.o"), Path(tmp, "a.so")
        for cmd in ([cc, *COMPILE, "-c", str(source), "-o", str(obj)], [cc, str(obj), "-o", str(lib), *LINK]):
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-500:]}")
        os.replace(lib, out)                  # atomic: concurrent builders each install a whole file
    return out


def load(source: Path) -> ctypes.CDLL:
    """`source` built (`build`) and loaded; raises one of `BuildFailed` saying why not."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC)")
    return ctypes.CDLL(str(build(source, cc)))


def load_or_log(source: Path, instead: str) -> ctypes.CDLL | None:
    """`load(source)`, or None after one warning saying why and what runs `instead`."""
    try:
        return load(source)
    except BuildFailed as e:
        log.warning("a CPU kernel is not available", kernel=source.name, instead=instead, reason=str(e))
        return None


class Once(Generic[T]):
    """`make()`'s result, made on the first call under a lock and read without it after (every
    kernel call asks: no lock on that path); `make` handles its own failures."""

    def __init__(self, make: Callable[[], T]) -> None:
        self._make = make
        self._lock = threading.Lock()
        self._made = False
        self._value: T | None = None

    def __call__(self) -> T:
        if not self._made:
            with self._lock:
                if not self._made:
                    self._value = self._make()
                    self._made = True        # after the value: a reader without the lock sees it whole
        return cast(T, self._value)
