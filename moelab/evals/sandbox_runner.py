"""The program that runs inside the sandbox (see :mod:`moelab.evals.sandbox`).

It is executed as ``python -I -B -c <this file's source>`` and imports nothing from
moelab. It reads its job (JSON) from stdin, sets its resource limits (hard limits: the
code it runs cannot raise them again) and plays one of three roles:

``program``
    run one whole program; print the run's nonce after it returned (``run_program``).
``candidate``
    run the candidate's source (prompt + completion), then answer calls of its
    top-level functions that arrive over a pipe (``run_tests``). Values cross the pipe
    as tagged JSON of plain data only: None, bool, int, float, complex, str, bytes, bytearray,
    list, tuple, dict, set, frozenset, and references to the candidate's own functions.
``check``
    run the trusted test code in a process of its own, where each name the tests take
    from the candidate's module is a proxy that calls into the candidate process.
    Its exit status 0 (after the tests ran to their end) is the verdict.
"""

import builtins
import contextlib
import json
import numbers
import os
import resource
import sys
import traceback

MAX_DEPTH = 100
MAX_LINE = 64 * 1024 * 1024
#: Module-level values of the candidate larger than this (as JSON) are not sent to the tests.
MAX_VALUE_CHARS = 1024 * 1024
#: Integers wider than this cross as hex strings (JSON's decimal form stops at 4300 digits).
MAX_PLAIN_INT_BITS = 64
#: Standard-library modules the check process never imports for the candidate: they act
#: on import (run a program, open a window or a browser, print).
NO_IMPORT = frozenset(
    {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "ensurepip", "venv",
     "lib2to3", "pydoc", "webbrowser", "unittest", "test"}
)  # fmt: skip


def _limit(which, value):
    try:
        resource.setrlimit(which, (value, value))
    except (ValueError, OSError) as exc:
        sys.stderr.write(f"moelab sandbox: could not set limit {which!r}: {exc}\n")


def set_limits(job):
    _limit(resource.RLIMIT_CORE, 0)
    _limit(resource.RLIMIT_CPU, job["cpu_s"])
    _limit(resource.RLIMIT_AS, job["memory_bytes"])
    _limit(resource.RLIMIT_FSIZE, job["file_size_bytes"])
    _limit(resource.RLIMIT_NOFILE, 256)
    if job["nproc"] is not None:
        _limit(resource.RLIMIT_NPROC, job["nproc"])


def drop_privileges(job):
    if job.get("drop_to") is not None and os.getuid() == 0:
        os.setgroups([])
        os.setgid(job["drop_to"])
        os.setuid(job["drop_to"])


def install_audit_hook(root):
    """The interpreter-level guard of the ``rlimits`` level (no kernel confinement there).

    Hostile code can switch it off from inside its process; it stops mistakes, not attacks.
    """
    root = os.path.realpath(root)
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    path_events = {
        "os.remove": (0,), "os.rmdir": (0,), "os.rename": (0, 1), "os.mkdir": (0,),
        "os.chmod": (0,), "os.chown": (0,), "os.link": (0, 1), "os.symlink": (0, 1),
        "os.truncate": (0,), "os.utime": (0,), "shutil.rmtree": (0,), "shutil.copyfile": (1,),
        "shutil.move": (0, 1), "os.mkfifo": (0,), "os.mknod": (0,), "os.setxattr": (0,),
    }  # fmt: skip
    blocked = (
        "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
        "subprocess.Popen", "pty.spawn", "os.kill", "os.killpg", "signal.pthread_kill",
        "socket.", "ctypes.", "resource.setrlimit", "resource.prlimit", "sys.addaudithook",
        "os.setuid", "os.setgid", "os.chroot", "sqlite3.connect", "_posixsubprocess",
    )  # fmt: skip

    def inside(path):
        if isinstance(path, int):
            return False  # dir_fd / fd-relative operations: refuse
        try:
            real = os.path.realpath(os.fsdecode(path))
        except Exception:
            return False
        return real == root or real.startswith(root + os.sep)

    def hook(event, args):
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None, 0))[:3]
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool(
                (flags or 0) & write_flags
            )
            if writes and not inside(path):
                raise PermissionError(f"moelab sandbox: writing {path!r} is not allowed")
        elif event in path_events:
            for i in path_events[event]:
                if i < len(args) and args[i] is not None and not inside(args[i]):
                    raise PermissionError(f"moelab sandbox: {event} of {args[i]!r} is not allowed")
        elif event.startswith(blocked):
            raise PermissionError(f"moelab sandbox: {event} is not allowed")

    sys.addaudithook(hook)


# --- plain-data codec ------------------------------------------------------------------


class Uncheckable(TypeError):
    """A value that cannot cross between the candidate and the check process."""


def encode(value, fn_names, depth=0):
    """``value`` as JSON-ready data; ``fn_names`` maps id() of shareable functions to names."""
    if depth > MAX_DEPTH:
        raise Uncheckable(f"value nested more than {MAX_DEPTH} levels deep")
    if value is None or type(value) in (bool, str):
        return value
    if isinstance(value, str):
        return str(value)
    if isinstance(value, int):
        return _int(int(value))
    if isinstance(value, float):
        return float(value)
    if isinstance(value, complex):
        return {"t": "complex", "v": [value.real, value.imag]}
    if isinstance(value, (bytes, bytearray)):
        tag = "bytearray" if isinstance(value, bytearray) else "bytes"
        return {"t": tag, "v": bytes(value).decode("latin-1")}
    d = depth + 1
    if isinstance(value, list):
        return [encode(x, fn_names, d) for x in value]
    if isinstance(value, tuple):
        return {"t": "tuple", "v": [encode(x, fn_names, d) for x in value]}
    if isinstance(value, dict):
        return {
            "t": "dict",
            "v": [[encode(k, fn_names, d), encode(x, fn_names, d)] for k, x in value.items()],
        }
    if isinstance(value, (set, frozenset)):
        tag = "frozenset" if isinstance(value, frozenset) else "set"
        return {"t": tag, "v": [encode(x, fn_names, d) for x in value]}
    if id(value) in fn_names:
        return {"t": "fn", "v": fn_names[id(value)]}
    if isinstance(value, numbers.Integral):
        return _int(int(value))
    if isinstance(value, numbers.Real):
        return float(value)
    raise Uncheckable(
        f"a value of type {type(value).__name__} cannot be checked outside the candidate's process"
    )


def _int(value):
    if value.bit_length() <= MAX_PLAIN_INT_BITS:
        return value
    return {"t": "int", "v": hex(value)}


def decode(data, make_fn, depth=0):
    """The inverse of :func:`encode` (accepts nothing but plain data); functions via ``make_fn``."""
    if depth > MAX_DEPTH:
        raise Uncheckable(f"value nested more than {MAX_DEPTH} levels deep")
    if data is None or type(data) in (bool, int, float, str):
        return data
    d = depth + 1
    if type(data) is list:
        return [decode(x, make_fn, d) for x in data]
    if type(data) is not dict or type(data.get("t")) is not str:
        raise Uncheckable("malformed value")
    tag, v = data["t"], data.get("v")
    if (
        tag == "complex"
        and type(v) is list
        and len(v) == 2
        and all(type(x) in (int, float) for x in v)
    ):
        return complex(v[0], v[1])
    if tag in ("bytes", "bytearray") and type(v) is str:
        return v.encode("latin-1") if tag == "bytes" else bytearray(v.encode("latin-1"))
    if tag == "int" and type(v) is str and v.lstrip("-").startswith("0x"):
        try:
            return int(v, 16)
        except ValueError:
            raise Uncheckable("malformed value") from None
    if type(v) is not list:
        raise Uncheckable("malformed value")
    if tag == "tuple":
        return tuple(decode(x, make_fn, d) for x in v)
    if tag == "set":
        return {decode(x, make_fn, d) for x in v}
    if tag == "frozenset":
        return frozenset(decode(x, make_fn, d) for x in v)
    if tag == "dict":
        out = {}
        for pair in v:
            if type(pair) is not list or len(pair) != 2:
                raise Uncheckable("malformed value")
            out[decode(pair[0], make_fn, d)] = decode(pair[1], make_fn, d)
        return out
    raise Uncheckable("malformed value")


def _fn_ref(data):
    if type(data) is dict and data.get("t") == "fn" and type(data.get("v")) is str:
        return data["v"]
    return None


class Channel:
    """Newline-delimited JSON messages over a pair of pipe fds."""

    def __init__(self, fd_in, fd_out):
        self.rfile = os.fdopen(fd_in, "rb")
        self.fd_out = fd_out

    def send(self, message):
        data = json.dumps(message, ensure_ascii=True).encode() + b"\n"
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd_out, view) :]

    def recv(self):
        line = self.rfile.readline(MAX_LINE)
        if not line.endswith(b"\n"):
            raise EOFError("the candidate process stopped answering")
        return json.loads(line)


# --- roles -----------------------------------------------------------------------------


def _run_to_the_end(code, filename, g, nonce):
    """Run ``code`` (source, or a compiled code object); exit 1 on any exception, else print
    ``nonce`` (the verdict: the marker after the code's end, an exit status 0 alone is not
    enough) and exit 0."""
    try:
        exec(code if not isinstance(code, str) else compile(code, filename, "exec"), g)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os.write(1, b"\n" + nonce + b"\n")
    os._exit(0)


def run_whole_program(job):
    nonce = job.pop("nonce").encode()
    program = job.pop("program")
    _run_to_the_end(program, "<candidate>", {"__name__": "__candidate__", "__builtins__": builtins}, nonce)


def serve_candidate(job):
    chan = Channel(job["fd_in"], job["fd_out"])
    g = {"__name__": "__candidate__", "__builtins__": builtins}
    try:
        exec(compile(job.pop("program"), "<candidate>", "exec"), g)
    except BaseException as exc:
        traceback.print_exc()
        chan.send({"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:500]}"})
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    fn_names = {id(v): k for k, v in g.items() if callable(v) and not isinstance(v, type(sys))}
    names = {}
    for name, value in g.items():
        if name.startswith("__"):
            continue
        if isinstance(value, type(sys)):
            names[name] = {"kind": "module", "module": value.__name__}
        elif callable(value):
            names[name] = {"kind": "function"}
        else:
            # a value the tests could read; skipped when it cannot cross or is large
            with contextlib.suppress(Exception):
                data = encode(value, fn_names)
                if len(json.dumps(data)) <= MAX_VALUE_CHARS:
                    names[name] = {"kind": "value", "value": data}
    chan.send({"ok": True, "names": names})

    def resolve(name):
        if name not in fn_names.values():
            raise Uncheckable(f"no function {name!r} in the candidate")
        return g[name]

    while True:
        try:
            request = chan.recv()
        except EOFError:
            os._exit(0)
        try:
            fn = resolve(request["name"])
            args = [resolve(_fn_ref(a)) if _fn_ref(a) else decode(a, None) for a in request["args"]]
            kwargs = {
                k: resolve(_fn_ref(a)) if _fn_ref(a) else decode(a, None)
                for k, a in request["kwargs"].items()
            }
            reply = {"value": encode(fn(*args, **kwargs), fn_names)}
            reply["mutated"] = _mutated(request, args, kwargs, fn_names)
        except BaseException as exc:  # the candidate's own exception, or SystemExit
            reply = _exception_reply(exc, fn_names)
        sys.stdout.flush()
        chan.send(reply)


MUTABLE = (list, dict, set, bytearray)


def _mutated(request, args, kwargs, fn_names):
    """The new contents of the list, dict, set and bytearray arguments the call changed."""
    out = {}
    for key, value in [*enumerate(args), *kwargs.items()]:
        sent = request["args"][key] if type(key) is int else request["kwargs"][key]
        if isinstance(value, MUTABLE) and (now := encode(value, fn_names)) != sent:
            out[str(key)] = now
    return out


def _copy_back(mutated, args, kwargs, fn_from_name):
    """Apply the candidate's in-place changes of arguments to the tests' own objects."""
    if type(mutated) is not dict:
        return
    for key, data in mutated.items():
        index = int(key) if key.isascii() and key.isdigit() else len(args)
        target = args[index] if index < len(args) else kwargs.get(key)
        if type(target) not in MUTABLE:
            continue
        new = decode(data, fn_from_name)
        if type(new) is type(target) and type(target) in (list, bytearray):
            target[:] = new
        elif type(new) is type(target) and type(target) in (dict, set):
            target.clear()
            target.update(new)


def _exception_reply(exc, fn_names):
    reply = {"raise": type(exc).__name__}
    try:
        reply["message"] = str(exc)[:500]
        args = encode(exc.args, fn_names)
        if len(json.dumps(args)) <= MAX_VALUE_CHARS:
            reply["args"] = args
    except Exception:  # noqa: BLE001 - the candidate's exception may not even print
        reply.setdefault("message", "")
    return reply


class CandidateError(Exception):
    """An exception raised in the candidate process (its type is not a built-in one)."""


def _candidate_exception(reply, fn_from_name):
    """The candidate's exception rebuilt in the check process: the built-in type of that
    name with the same arguments (so tests that catch it or read its message behave as in
    one process); :class:`CandidateError` for any other type."""
    message = str(reply.get("message"))[:500]
    kind = getattr(builtins, str(reply["raise"]), None)
    if isinstance(kind, type) and issubclass(kind, Exception):
        try:
            args = decode(reply["args"], fn_from_name)
            exc = kind(*args) if type(args) is tuple else kind(message)
        except Exception:  # noqa: BLE001 - no args, or args this type does not take
            exc = kind(message)
    else:
        exc = CandidateError(f"{str(reply['raise'])[:100]}: {message}")
    exc.add_note("(raised in the candidate's process)")
    return exc


def _importable(module):
    """Whether the check process imports ``module`` for a name of the candidate's module:
    only the standard library's public modules that do nothing but define things."""
    parts = module.split(".")
    return (
        all(p.isidentifier() and not p.startswith("_") for p in parts)
        and parts[0] in sys.stdlib_module_names
        and parts[0] not in NO_IMPORT
    )


def run_check(job):
    nonce = job.pop("nonce").encode()
    chan = Channel(job["fd_in"], job["fd_out"])
    hello = chan.recv()
    if (
        type(hello) is not dict
        or hello.get("ok") is not True
        or type(hello.get("names")) is not dict
    ):
        error = hello.get("error") if type(hello) is dict else None
        sys.stderr.write(f"the candidate's code did not run: {str(error)[:500]}\n")
        os._exit(1)

    def make_proxy(name):
        def proxy(*args, **kwargs):
            chan.send(
                {
                    "name": name,
                    "args": [encode(a, proxies) for a in args],
                    "kwargs": {str(k): encode(v, proxies) for k, v in kwargs.items()},
                }
            )
            reply = chan.recv()
            if type(reply) is not dict:
                raise Uncheckable("malformed reply")
            if "raise" in reply:
                raise _candidate_exception(reply, fn_from_name)
            _copy_back(reply.get("mutated"), args, kwargs, fn_from_name)
            return decode(reply.get("value"), fn_from_name)

        proxy.__name__ = proxy.__qualname__ = name
        return proxy

    fns = {}
    proxies = {}  # id(proxy) -> name, so proxies passed back as arguments are references

    def fn_from_name(name):
        if name not in fns:
            raise Uncheckable(f"no function {name!r} in the candidate")
        return fns[name]

    g = {"__name__": "__main__", "__builtins__": builtins}
    for name, desc in hello["names"].items():
        # The candidate never supplies dunders or shadows a built-in the tests rely on: a
        # function named like a built-in reaches the tests only where they hand it over
        # (_bind_top_level): as the argument of a top-level call, ``check(abs)``.
        if type(name) is not str or not name.isidentifier() or name.startswith("__"):
            continue
        if type(desc) is not dict or desc.get("kind") != "function":
            continue
        fns[name] = make_proxy(name)
        proxies[id(fns[name])] = name
        if not hasattr(builtins, name):
            g[name] = fns[name]
    for name, desc in hello["names"].items():
        if name in g or type(name) is not str or not name.isidentifier() or name.startswith("__"):
            continue
        if hasattr(builtins, name) or type(desc) is not dict:
            continue
        if desc.get("kind") == "module":
            module = desc.get("module")
            if type(module) is str and _importable(module):
                # BaseException: an import that exits (``unittest.__main__`` would exit 0)
                with contextlib.suppress(BaseException):
                    g[name] = __import__(module, fromlist=["_"])
        elif desc.get("kind") == "value":
            with contextlib.suppress(Uncheckable, RecursionError):
                g[name] = decode(desc.get("value"), fn_from_name)
    code = job.pop("program")
    shadowing = {n for n in fns if hasattr(builtins, n)}
    if shadowing:  # e.g. ``def abs(x)`` checked by ``check(abs)``
        # a syntax error is compiled again below and reported as the tests' failure
        with contextlib.suppress(SyntaxError):
            code = _bind_top_level(code, shadowing, g, fns)
    _run_to_the_end(code, "<tests>", g, nonce)


PRIVATE_PREFIX = "_moelab_candidate_"


def _bind_top_level(code, names, g, fns):
    """The tests compiled so that a candidate function whose name is also a built-in reaches
    them where they hand it over, as one process would: passed as an argument of a call at
    the tests' top level (``check(abs)`` gives ``check`` the candidate's ``abs``). Everywhere
    else — called by name, or inside the tests' own functions — such a name stays the
    built-in, so a candidate cannot replace what the tests use to check it
    (``assert len(candidate(1)) == 3``)."""
    import ast

    tree = ast.parse(code, "<tests>")

    def swap(node):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in names:
            return ast.copy_location(ast.Name(id=PRIVATE_PREFIX + node.id, ctx=ast.Load()), node)
        return node

    class TopLevel(ast.NodeTransformer):
        def visit_FunctionDef(self, node):
            return node  # a new scope: built-ins stay built-ins

        visit_AsyncFunctionDef = visit_ClassDef = visit_Lambda = visit_FunctionDef

        def visit_Call(self, node):
            self.generic_visit(node)
            node.args = [swap(a) for a in node.args]
            for kw in node.keywords:
                kw.value = swap(kw.value)
            return node

    tree = ast.fix_missing_locations(TopLevel().visit(tree))
    for name in names:
        g[PRIVATE_PREFIX + name] = fns[name]
    return compile(tree, "<tests>", "exec")


def main():
    job = json.loads(sys.stdin.read())
    # fd 0 (the job file, nonce included) stays open under sys.stdin: replace it, so the
    # code run here cannot read the job back
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    if job.get("pdeathsig"):
        try:
            import ctypes

            ctypes.CDLL(None).prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL
        except Exception:
            pass
    set_limits(job)
    drop_privileges(job)
    if job.get("audit_root"):
        install_audit_hook(job["audit_root"])
    role = job["role"]
    if role == "program":
        run_whole_program(job)
    elif role == "candidate":
        serve_candidate(job)
    elif role == "check":
        run_check(job)
    raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    main()
