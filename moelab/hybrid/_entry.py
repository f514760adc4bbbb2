"""The compiled planner's native per-layer entry: one C call from the plan handler to the kernel.

:class:`moelab.hybrid._compiled.CompiledPlanner` plans a layer by calling its numba kernel
(:func:`moelab.hybrid._compiled.run`) through numba's dispatcher, with the routing as numpy views
of the model's tensors. Between a forward's layers each of those Python-level steps is cold: on
the development VM the views and the dispatcher's boxing of ten arguments cost about 35 µs a
layer, the kernel's own work about 10 µs (``moelab bench hybrid``'s planner figure).

This module is the other way in. The kernels extension's ``plan_entry`` (``kernels/fastcall.cpp``,
a ``METH_FASTCALL`` function: about 1 µs a call) reads the tensors' data pointers and shapes
itself, writes them into a block of int64 words and calls a numba **cfunc** compiled here
(:func:`entry_addresses`), which makes array views of those words and runs the same
:func:`~moelab.hybrid._compiled.plan` and :func:`~moelab.hybrid._compiled.pack` as the dispatcher
path: the same decisions by construction (``tests/test_planner_entry.py`` checks it on recorded
and synthetic routings).

The block's words (keep in step with ``kernels/fastcall.cpp``): the planner's handle
(:func:`~moelab.hybrid._compiled.handle`: address and length), the layer, the state mode, the
prefetch target and budget, then per array its address and shape (ids int64 (T, K); weights
float32 or bfloat16 bits (T, K); slot states int8 (T, K); router scores float32 (R, E); the
prefetch proposal int64 (n,)), then seven result words the entry writes (the record's length in
``out.rec``, the error code, skipped slots, prefetched experts, the compacted widths, the
record's address: the C side returns the record as a list of ints, so no numpy runs on this path).

The entry is used when the extension loads (``MOELAB_PLANNER_ENTRY``: ``auto``, the default, or
``native`` (an error if it cannot) or ``numba`` (never)); anything it does not take as is
returns None before the planner's state changed, and the planner takes the dispatcher path.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import numpy as np

from moelab.caches._fast import HAVE_NUMBA, njit
from moelab.errors import MoelabError

log = logging.getLogger(__name__)

#: The environment variable choosing the way in: ``auto`` (default), ``native`` or ``numba``.
ENV = "MOELAB_PLANNER_ENTRY"

# the block's words (kernels/fastcall.cpp)
(W_HANDLE, W_HANDLE_LEN, W_LAYER, W_MODE, W_PF_TARGET, W_BUDGET, W_IDS, W_IDS_T, W_IDS_K, W_W, W_W_T, W_W_K,
 W_ST, W_ST_T, W_ST_K, W_SC, W_SC_R, W_SC_E, W_PF, W_PF_N, W_RESULT) = range(21)
WORDS = W_RESULT + 7


if HAVE_NUMBA:
    from numba import carray, cfunc
    from numba.core import types as _types
    from numba.extending import intrinsic as _intrinsic

    from moelab.hybrid._compiled import ERROR, M_LATE, M_NOW, MOVED, SKIPPED, _views, pack, plan

    @_intrinsic
    def _ptr(typingctx, addr, like):
        """The address ``addr`` (int64) as a pointer to values of ``like``'s type."""
        if not isinstance(addr, _types.Integer) or not isinstance(like, (_types.Integer, _types.Float)):
            return None
        sig = _types.CPointer(like)(addr, like)

        def codegen(context, builder, sig, args):
            return builder.inttoptr(args[0], context.get_value_type(sig.return_type))

        return sig, codegen

    @njit(cache=True)
    def _body(b, w):
        """The dispatcher path's :func:`~moelab.hybrid._compiled.run` on the block's views; the
        weights ``w`` made by the caller (one entry per weights dtype)."""
        cache, s, out = _views(carray(_ptr(b[W_HANDLE], np.int64(0)), (b[W_HANDLE_LEN],)))
        ids = carray(_ptr(b[W_IDS], np.int64(0)), (b[W_IDS_T], b[W_IDS_K]))
        st = carray(_ptr(b[W_ST], np.int8(0)), (b[W_ST_T], b[W_ST_K]))
        sc = carray(_ptr(b[W_SC], np.float32(0)), (b[W_SC_R], b[W_SC_E]))
        pf = carray(_ptr(b[W_PF], np.int64(0)), (b[W_PF_N],))
        plan(cache, s, out, b[W_LAYER], ids, w, st, b[W_MODE], sc, s.place, s.admit_all, pf, b[W_PF_TARGET],
             b[W_BUDGET], s.impact)
        cnt = out.cnt
        b[W_RESULT] = pack(out)
        b[W_RESULT + 1] = cnt[ERROR]
        b[W_RESULT + 2] = cnt[SKIPPED]
        b[W_RESULT + 3] = cnt[MOVED]
        b[W_RESULT + 4] = cnt[M_NOW]
        b[W_RESULT + 5] = cnt[M_LATE]
        b[W_RESULT + 6] = out.rec.ctypes.data  # where the caller reads the record from

    # each returns 1 once its results are written (the C side checks: a cfunc that raised returns
    # without them, having printed the exception)
    def _entry_f32(blk):
        b = carray(blk, (WORDS,))
        _body(b, carray(_ptr(b[W_W], np.float32(0)), (b[W_W_T], b[W_W_K])))
        return 1

    def _entry_u16(blk):
        b = carray(blk, (WORDS,))
        _body(b, carray(_ptr(b[W_W], np.uint16(0)), (b[W_W_T], b[W_W_K])))
        return 1


@functools.cache
def entry_addresses() -> tuple[int, int]:
    """The native addresses of the two entries (float32 and bfloat16-bits weights), compiled on
    first use (cached on disk as numba caches its kernels)."""
    sig = _types.int64(_types.CPointer(_types.int64))
    return (cfunc(sig, cache=True, nopython=True)(_entry_f32).address,
            cfunc(sig, cache=True, nopython=True)(_entry_u16).address)


def native_entry() -> Any | None:
    """The extension's ``plan_entry`` with the entries' addresses bound (a callable), or None
    where :data:`ENV` or the machine rules it out (see the module docstring)."""
    mode = os.environ.get(ENV, "").strip().lower() or "auto"
    if mode not in ("auto", "native", "numba"):
        raise MoelabError(f"{ENV}={mode!r}: expected auto, native or numba (or unset).")
    if mode == "numba" or not HAVE_NUMBA:
        return None
    try:
        from moelab.kernels.build import load_extension

        fn = getattr(load_extension(), "plan_entry", None)
        if fn is None:
            raise MoelabError("the loaded kernels extension predates plan_entry (ABI 7); delete its build "
                              "directory (moelab.kernels.build.cache_dir()) to rebuild it")
        a32, a16 = entry_addresses()
    except (MoelabError, ImportError, OSError) as exc:
        if mode == "native":
            raise MoelabError(f"{ENV}=native, but the native planner entry is unavailable: {exc}") from exc
        log.info("compiled planner: the numba dispatcher path (the native entry is unavailable: %s)", exc)
        return None
    return functools.partial(fn, a32, a16)


__all__ = ["ENV", "WORDS", "entry_addresses", "native_entry"]
