# Warm interpreter driver for tine-agent. Protocol on the original stdin/stdout
# (which are moved to private fds so user code printing cannot corrupt it):
#   request:  op (1 byte: b'E' eval, b'R' reseed, b'P' prepare for a snapshot)
#             + u32 BE length + UTF-8 payload
#   response: status (b'V' value, b'N' no value, b'X' exception)
#             + 4 x (u32 BE length + UTF-8): repr, stdout, stderr, traceback
import ast, contextlib, io, os, struct, sys, traceback

_tine_in = os.fdopen(os.dup(0), "rb", buffering=0)
_tine_out = os.fdopen(os.dup(1), "wb", buffering=0)
_null = os.open(os.devnull, os.O_RDONLY)
os.dup2(_null, 0)
os.close(_null)
os.dup2(2, 1)


def _tine_read(n):
    buf = bytearray()
    while len(buf) < n:
        chunk = _tine_in.read(n - len(buf))
        if not chunk:
            os._exit(0)
        buf += chunk
    return bytes(buf)


def _tine_send(status, *fields):
    parts = [status]
    for f in fields:
        b = f.encode("utf-8", "replace")
        parts.append(struct.pack(">I", len(b)))
        parts.append(b)
    _tine_out.write(b"".join(parts))


def _tine_traceback():
    exc = traceback.TracebackException(*sys.exc_info())
    # Drop this driver's own frames; keep the user's.
    exc.stack = traceback.StackSummary.from_list(
        [f for f in exc.stack if f.filename != "<string>"])
    return "".join(exc.format())


_tine_globals = {"__name__": "__main__", "__builtins__": __builtins__}


def _tine_eval(src):
    out, err = io.StringIO(), io.StringIO()
    status, value, tb = b"N", "", ""
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            tree = ast.parse(src, "<eval>", "exec")
            last = None
            if tree.body and isinstance(tree.body[-1], ast.Expr):
                last = ast.Expression(tree.body.pop().value)
            exec(compile(tree, "<eval>", "exec"), _tine_globals)
            if last is not None:
                v = eval(compile(last, "<eval>", "eval"), _tine_globals)
                _tine_globals["_"] = v
                if v is not None:
                    status, value = b"V", repr(v)
    except BaseException:  # SystemExit too: the interpreter must survive
        status, tb = b"X", _tine_traceback()
    _tine_send(status, value, out.getvalue(), err.getvalue(), tb)


def _tine_reseed():
    done = []
    if "random" in sys.modules:
        sys.modules["random"].seed()
        done.append("random")
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()
        done.append("numpy")
    _tine_send(b"N", ",".join(done), "", "", "")


def _tine_prepare():
    # Before a snapshot: collect, then move every object into the permanent generation, so
    # a clone's collections never walk (and so write, page by page) the parent's heap.
    import gc
    gc.collect()
    gc.freeze()
    _tine_send(b"N", str(gc.get_freeze_count()), "", "", "")


while True:
    op = _tine_read(1)
    (n,) = struct.unpack(">I", _tine_read(4))
    payload = _tine_read(n).decode("utf-8", "replace")
    if op == b"E":
        _tine_eval(payload)
    elif op == b"R":
        _tine_reseed()
    elif op == b"P":
        _tine_prepare()
    else:
        _tine_send(b"X", "", "", "", "tine driver: unknown op %r\n" % op)
