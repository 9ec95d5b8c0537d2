"""Corrupt GGUF files: every case loads (and then runs) or raises ``GGUFError``.

Each case is a whole file (bytes). It goes to a worker process, which reads it
with ``Content.read``, loads every tensor with ``Content.tensor``, builds
``ModelWeights.from_gguf`` and the fast CPU engine (``FastModel.from_gguf``, its C kernels
where the shapes allow) and, when that succeeds, runs two forward calls on each (the fast
engine within the file's context: a corrupt ``llama.context_length`` of 1 is a model of one
position, not a failure). The
outcome is "ok" (loaded and ran), "error" (a ``GGUFError`` with a message) or
a failure: any other exception, an empty message, a forward call that fails
on a model that loaded, a crash of the worker, a case running longer than
``CASE_TIMEOUT_S``, an allocation refused by the worker's address-space limit
(``RLIMIT_AS``: ``AS_BUDGET_MB`` above what the warmed-up worker maps) or a
peak RSS (``VmHWM``, reset before each case) more than ``RSS_BUDGET_MB`` above
the RSS before the case. The files
are at most a few KB, so either budget is far more than a file justifies. A
dead or hung worker is replaced; the failure names the case, so hypothesis
shrinks it like any other.

The cases, on a tiny Q4_1 llama with tokenizer-like arrays (``base_file``):

* truncation at every offset of the file (deterministic, all of them);
* random byte flips in the header, metadata and tensor directory;
* structural fields (counts, string and array lengths, value and ggml type ids,
  n_dims, dims, data offsets, metadata numbers) set to huge or edge values;
* data offsets made misaligned, overlapping, shifted or past the end;
* valid GGUF files whose tensors do not fit the llama architecture (wrong
  shapes, types, missing or extra tensors);
* valid GGUF files with missing, mistyped or out-of-range llama metadata.

``QLIB_FUZZ_CASES=N`` sets the number of generated (hypothesis) cases, split
over the strategies as in ``WEIGHTS`` (default ``CI_CASES``); with it set, the
generation is random rather than derandomized. The truncations always run
all offsets. ``QLIB_FUZZ_REPORT=path`` appends a JSON line of counts and time.
"""

from __future__ import annotations

import json
import os
import pickle
import select
import struct
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from qlib.gguf import GGUFValueType, Typed, write  # noqa: E402
from qlib.quants.types import ggml_type  # noqa: E402

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS and /proc: Linux")

CI_CASES = 3000
WEIGHTS = {"flips": 0.3, "fields": 0.25, "offsets": 0.1, "shapes": 0.15, "metadata": 0.2}
CASE_TIMEOUT_S = 30.0
AS_BUDGET_MB = 256
RSS_BUDGET_MB = 24
STREAMS = ("bytesio", "noend", "file")

_env_cases = os.environ.get("QLIB_FUZZ_CASES")
TOTAL_CASES = int(_env_cases) if _env_cases else CI_CASES
LONG_RUN = _env_cases is not None

VT = GGUFValueType
U32, I32, U64, I64, F32, F64 = VT.UINT32, VT.INT32, VT.UINT64, VT.INT64, VT.FLOAT32, VT.FLOAT64


def n_examples(strategy: str) -> int:
    return max(1, round(TOTAL_CASES * WEIGHTS[strategy]))


def fuzz_settings(strategy: str):
    return settings(
        max_examples=n_examples(strategy),
        deadline=None,
        database=None,
        derandomize=not LONG_RUN,
        print_blob=False,
        suppress_health_check=list(HealthCheck),
    )


# ----------------------------------------------------------------------------- the worker


def _worker_main() -> None:  # pragma: no cover - runs in the child
    """Serve cases from stdin: 4-byte length + pickle((bytes, stream)) -> pickle(result)."""
    import io
    import resource
    import tempfile
    import traceback

    import torch

    from qlib.gguf import Content, GGUFError
    from qlib.llama.faithful import ModelWeights
    from qlib.llama.fast_cpu import FastModel

    torch.set_num_threads(1)

    class NoEndSeek(io.BytesIO):
        def seek(self, pos, whence=io.SEEK_SET):
            if whence == io.SEEK_END:
                raise io.UnsupportedOperation("no seek to end")
            return super().seek(pos, whence)

    tmp = Path(tempfile.mkdtemp(prefix="qlib-fuzz-"))
    inp, out = sys.stdin.buffer, sys.stdout.buffer

    def selftest(kind: str) -> None:
        """Misbehaviours the harness must report (tests of the harness itself)."""
        if kind == "raise":
            raise TypeError("selftest: not a GGUFError")
        if kind == "alloc":
            bytearray((AS_BUDGET_MB + 64) << 20)
        if kind == "rss":
            np.ones((RSS_BUDGET_MB + 16) << 17)  # touched float64s
        if kind == "crash":
            os.abort()
        if kind == "hang":
            time.sleep(3600)

    def run(data: bytes, stream: str) -> tuple[str, str]:
        if stream == "file":
            p = tmp / "case.gguf"
            p.write_bytes(data)
            f = open(p, "rb")  # noqa: SIM115
        else:
            f = (NoEndSeek if stream == "noend" else io.BytesIO)(data)
        try:
            try:
                if stream.startswith("selftest:"):
                    selftest(stream.split(":", 1)[1])
                content = Content.read(f)
                for name in content.tensor_infos:
                    content.tensor(f, name)
                model = ModelWeights.from_gguf(content, f, "cpu")
                fast = FastModel.from_gguf(content, f, "cpu")
            except GGUFError as e:
                msg = str(e)
                if len(msg.strip()) < 10:
                    return (
                        "fail",
                        f"{type(e).__name__} without a message naming the problem: {msg!r}",
                    )
                return "error", f"{type(e).__name__}: {msg}"
            except BaseException as e:
                tb = "".join(traceback.format_exception(type(e), e, e.__traceback__)[-6:])
                return "fail", f"{type(e).__name__} (not a GGUFError): {e}\n{tb}"
            try:
                vocab = model.tok_embeddings.shape[0]
                ids = torch.tensor([[0, vocab - 1, 0]])
                for m in (model, fast):  # (the fast engine holds the file's context)
                    limit = getattr(m, "max_seq_len", None) or 4
                    n = min(3, limit)
                    with torch.inference_mode():
                        logits = m.forward(ids[:, :n], 0)
                        step = m.forward(ids[:, :1], n) if n < limit else logits
                    if logits.shape != (1, vocab) or step.shape != logits.shape:
                        return "fail", f"loaded, but logits have shape {list(logits.shape)}"
            except BaseException as e:
                tb = "".join(traceback.format_exception(type(e), e, e.__traceback__)[-6:])
                return "fail", f"loaded, but forward raised {type(e).__name__}: {e}\n{tb}"
            return "ok", ""
        finally:
            f.close()

    def vm_size_bytes() -> int:
        with open("/proc/self/status") as st_:
            for line in st_:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmSize")

    def status_mb(key: str) -> float:
        with open("/proc/self/status") as st_:
            for line in st_:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 1024
        raise RuntimeError(f"no {key}")

    def reset_peak() -> bool:
        """Reset VmHWM to the current RSS (Linux >= 4.0), so each case has its own peak."""
        try:
            with open("/proc/self/clear_refs", "w") as cr:
                cr.write("5")
            return True
        except OSError:
            return False

    def recv():
        head = inp.read(4)
        if len(head) < 4:
            return None
        (n,) = struct.unpack("<I", head)
        return pickle.loads(inp.read(n))

    def send(obj) -> None:
        b = pickle.dumps(obj)
        out.write(struct.pack("<I", len(b)) + b)
        out.flush()

    first = recv()  # the valid base file: warm up (imports, kernels, allocator), then limit
    if first is not None:
        send(run(*first))
    limit = vm_size_bytes() + AS_BUDGET_MB * (1 << 20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    send({"as_limit_mb": limit >> 20, "rss_mb": round(status_mb("VmRSS"), 1)})
    while (msg := recv()) is not None:
        # not ru_maxrss: it keeps the parent's high-water mark across fork + exec
        before = status_mb("VmRSS") if reset_peak() else status_mb("VmHWM")
        try:
            status, text = run(*msg)
        except MemoryError:
            status, text = "fail", "MemoryError outside the loader"
        grew = status_mb("VmHWM") - before
        if status != "fail" and grew > RSS_BUDGET_MB:
            status, text = "fail", f"peak RSS grew by {grew:.1f} MB during the case ({text})"
        send((status, text))


class Worker:
    """The parent's handle: one case at a time, with a timeout; restarts after a failure."""

    def __init__(self, base: bytes):
        self.base = base
        self.proc: subprocess.Popen | None = None
        self.info: dict = {}
        self.restarts = 0
        self.timeout = CASE_TIMEOUT_S
        self.stats: Counter = Counter()

    def start(self) -> None:
        tests_dir = str(Path(__file__).parent)
        code = (
            f"import sys; sys.path.insert(0, {tests_dir!r}); "
            "import test_fuzz_gguf as t; t._worker_main()"
        )
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self._send((self.base, "bytesio"))
        warm = self._recv(300.0)
        if warm != ("ok", ""):
            raise RuntimeError(f"fuzz worker cannot load the valid base file: {warm!r}")
        self.info = self._recv(60.0)

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            self.proc = None

    def _send(self, obj) -> None:
        b = pickle.dumps(obj)
        self.proc.stdin.write(struct.pack("<I", len(b)) + b)
        self.proc.stdin.flush()

    def _read_exact(self, n: int, deadline: float) -> bytes:
        fd = self.proc.stdout.fileno()
        buf = b""
        while len(buf) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                raise TimeoutError
            chunk = os.read(fd, n - len(buf))
            if not chunk:
                raise EOFError
            buf += chunk
        return buf

    def _recv(self, timeout: float):
        deadline = time.monotonic() + timeout
        (n,) = struct.unpack("<I", self._read_exact(4, deadline))
        return pickle.loads(self._read_exact(n, deadline))

    def case(self, data: bytes, stream: str = "bytesio") -> tuple[str, str]:
        if self.proc is None or self.proc.poll() is not None:
            self.stop()
            self.start()
        t0 = time.monotonic()
        try:
            self._send((data, stream))
            result = self._recv(self.timeout)
        except TimeoutError:
            result = ("fail", f"hang: no answer within {self.timeout:.0f} s")
        except (EOFError, BrokenPipeError):
            code = self.proc.wait()
            result = ("fail", f"the worker died (exit status {code}): crash or killed")
        self.stats[result[0]] += 1
        self.stats["seconds"] += time.monotonic() - t0
        if result[0] == "fail":
            self.stop()  # fresh process and baseline for the next case
            self.restarts += 1
        return result


def check(worker: Worker, data: bytes, stream: str = "bytesio", what: str = "") -> str:
    status, text = worker.case(data, stream)
    assert status != "fail", f"{what} (stream {stream}, {len(data)} bytes): {text}"
    return status


# ----------------------------------------------------------------------------- the files

N_EMBD, N_HEAD, N_KV, N_FF, VOCAB = 32, 2, 1, 32, 16


def base_metadata() -> dict:
    from synthetic import tiny_llama_metadata

    md = tiny_llama_metadata(n_layer=1, n_embd=N_EMBD, n_head=N_HEAD, n_kv_head=N_KV, n_ff=N_FF)
    md["general.alignment"] = Typed(U32, 32)
    md["tokenizer.ggml.model"] = "gpt2"
    md["tokenizer.ggml.tokens"] = [f"t{i}" for i in range(VOCAB)]
    md["tokenizer.ggml.scores"] = Typed(F32, [float(-i) for i in range(VOCAB)])
    md["tokenizer.ggml.token_type"] = Typed(I32, [1] * VOCAB)
    md["tokenizer.ggml.merges"] = ["t 1", "t 2"]
    md["tokenizer.ggml.add_bos_token"] = True
    md["test.nested"] = [[1, 2], ["a", "bc"]]
    md["test.f64"] = Typed(F64, 0.5)
    return md


def base_tensors(weight_type: str = "Q4_1") -> dict:
    from synthetic import _encode, tiny_llama_float_weights

    floats = tiny_llama_float_weights(
        n_layer=1, n_embd=N_EMBD, n_head=N_HEAD, n_kv_head=N_KV, n_ff=N_FF, vocab=VOCAB
    )
    return {name: _encode(name, w, weight_type)[0] for name, w in floats.items()}


def to_bytes(metadata: dict, tensors: dict) -> bytes:
    import io

    buf = io.BytesIO()
    write(buf, metadata, tensors)
    return buf.getvalue()


BASE_TENSORS = base_tensors()
BASE = to_bytes(base_metadata(), BASE_TENSORS)


def layout(raw: bytes) -> tuple[list[tuple[str, int, int, int]], int]:
    """Every structural field of a valid file: (kind, offset, width, value); and the data start.

    Written from the GGUF spec, independently of qlib's reader.
    """
    fields: list[tuple[str, int, int, int]] = []
    pos = 0

    def take(kind: str, fmt: str) -> int:
        nonlocal pos
        size = struct.calcsize(fmt)
        (v,) = struct.unpack_from(fmt, raw, pos)
        if kind:
            fields.append((kind, pos, size, v))
        pos += size
        return v

    def string(kind: str) -> None:
        nonlocal pos
        n = take(kind, "<Q")
        pos += n

    def value(vt: int, kind: str) -> None:
        nonlocal pos
        fmt = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B"}
        fmt |= {10: "<Q", 11: "<q", 12: "<d"}
        if vt == 8:
            string("string length")
        elif vt == 9:
            it = take("array item type", "<I")
            n = take("array length", "<Q")
            for _ in range(n):
                value(it, "")
        elif vt in (4, 5, 10, 11):
            take(kind or "", fmt[vt])  # metadata integers: counts of the model
        else:
            pos += struct.calcsize(fmt[vt])

    take("magic", "<I")
    take("version", "<I")
    n_tensors = take("tensor count", "<Q")
    n_kv = take("metadata count", "<Q")
    for _ in range(n_kv):
        string("key length")
        vt = take("value type", "<I")
        value(vt, "metadata integer")
    for _ in range(n_tensors):
        string("tensor name length")
        n_dims = take("n_dims", "<I")
        for _ in range(n_dims):
            take("dim", "<Q")
        take("ggml type", "<I")
        take("data offset", "<Q")
    return fields, -(-pos // 32) * 32


FIELDS, DATA_START = layout(BASE)
OFFSET_FIELDS = [f for f in FIELDS if f[0] == "data offset"]


def patch(raw: bytes, edits) -> bytes:
    b = bytearray(raw)
    for pos, value in edits:
        b[pos : pos + len(value)] = value
    return bytes(b)


def put(raw: bytes, field: tuple[str, int, int, int], value: int) -> bytes:
    _, pos, width, _ = field
    return patch(raw, [(pos, (value % (1 << (8 * width))).to_bytes(width, "little"))])


# ----------------------------------------------------------------------------- the worker fixture


@pytest.fixture(scope="module")
def worker():
    w = Worker(BASE)
    w.start()
    started = time.monotonic()
    yield w
    w.stop()
    stats = w.stats
    summary = {
        "total_cases_setting": TOTAL_CASES,
        "cases": sum(stats[k] for k in ("ok", "error", "fail")),
        **{k: stats[k] for k in ("ok", "error", "fail")},
        "case_seconds": round(stats["seconds"], 1),
        "wall_seconds": round(time.monotonic() - started, 1),
        "worker_restarts": w.restarts,
        "file_bytes": len(BASE),
        **w.info,
    }
    print("\nfuzz summary:", json.dumps(summary))
    report = os.environ.get("QLIB_FUZZ_REPORT")
    if report:
        with open(report, "a") as f:
            f.write(json.dumps(summary) + "\n")


# ----------------------------------------------------------------------------- the tests


def test_base_file_is_small_and_loads(worker):
    assert 4000 < len(BASE) < 8000, len(BASE)
    kinds = Counter(f[0] for f in FIELDS)
    assert kinds["data offset"] == len(BASE_TENSORS) == 11
    for stream in STREAMS:
        assert check(worker, BASE, stream, "the valid file") == "ok"


def test_truncation_at_every_offset(worker):
    """Every prefix of the file: an error before the data end, never anything else."""
    data_end = DATA_START + max(v for _, _, _, v in OFFSET_FIELDS)  # inside the last tensor
    outcomes = Counter()
    for cut in range(len(BASE)):
        stream = STREAMS[cut % 3]
        status = check(worker, BASE[:cut], stream, f"truncated at {cut}")
        outcomes[status] += 1
        if cut <= data_end:
            assert status == "error", f"a file truncated at {cut} loaded"
    assert outcomes["error"] >= data_end


@fuzz_settings("flips")
@given(
    edits=st.lists(
        st.tuples(st.integers(0, DATA_START - 1), st.integers(0, 255)), min_size=1, max_size=8
    ),
    stream=st.sampled_from(STREAMS),
)
def test_random_byte_flips_in_header_and_directory(worker, edits, stream):
    data = patch(BASE, [(pos, bytes([v])) for pos, v in edits])
    check(worker, data, stream, f"bytes set {edits}")


def _edge_values(width: int, original: int) -> list[int]:
    top = 1 << (8 * width)
    vals = {0, 1, 2, 3, 4, 7, 8, 9, 13, 16, 31, 32, 33, 64, 255, 256, 4096, 65535}
    vals |= {(1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32, 1 << 62, (1 << 63) - 1, 1 << 63}
    vals |= {top - 1, top - 2, len(BASE), len(BASE) + 1, len(BASE) - 1, DATA_START}
    vals |= {original + d for d in (-2, -1, 1, 2, 32, -32)}
    return sorted(v % top for v in vals)


@st.composite
def field_edit(draw):
    field = draw(st.sampled_from([f for f in FIELDS if f[0] not in ("magic", "version")]))
    _, _, width, original = field
    value = draw(
        st.one_of(
            st.sampled_from(_edge_values(width, original)),
            st.integers(0, (1 << (8 * width)) - 1),
        )
    )
    return field, value


@fuzz_settings("fields")
@given(edits=st.lists(field_edit(), min_size=1, max_size=3), stream=st.sampled_from(STREAMS))
def test_huge_or_edge_counts_lengths_types_and_dims(worker, edits, stream):
    data = BASE
    for field, value in edits:
        data = put(data, field, value)
    desc = [(f[0], f[1], v) for f, v in edits]
    check(worker, data, stream, f"fields set {desc}")


@st.composite
def offset_edit(draw):
    i = draw(st.integers(0, len(OFFSET_FIELDS) - 1))
    field = OFFSET_FIELDS[i]
    other = draw(st.sampled_from(OFFSET_FIELDS))[3]
    kind = draw(st.sampled_from(["overlap", "misalign", "shift", "aligned", "past-end", "swap"]))
    if kind == "overlap":
        value = other + draw(st.sampled_from([0, 32, 64]))
    elif kind == "misalign":
        value = field[3] + draw(st.integers(1, 31))
    elif kind == "shift":
        value = field[3] + 32 * draw(st.integers(-4, 4))
    elif kind == "aligned":
        value = 32 * draw(st.integers(0, (len(BASE) - DATA_START) // 32 + 2))
    elif kind == "past-end":
        value = len(BASE) - DATA_START + draw(st.integers(-64, 1 << 20))
    else:
        j = draw(st.integers(0, len(OFFSET_FIELDS) - 1))
        return [(field, OFFSET_FIELDS[j][3]), (OFFSET_FIELDS[j], field[3])]
    return [(field, value)]


@fuzz_settings("offsets")
@given(edits=st.lists(offset_edit(), min_size=1, max_size=2), stream=st.sampled_from(STREAMS))
def test_misaligned_overlapping_and_moved_tensor_offsets(worker, edits, stream):
    data = BASE
    flat = [e for group in edits for e in group]
    for field, value in flat:
        data = put(data, field, value)
    check(worker, data, stream, f"offsets set {[(f[1], v) for f, v in flat]}")


def _raw_tensor(rng: np.random.Generator, shape: tuple[int, ...], type_name: str):
    t = ggml_type(type_name)
    nbytes = t.nbytes(shape)
    return (rng.integers(0, 256, nbytes, dtype=np.uint8), shape, t)


TYPES_FOR_SHAPES = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0", "Q8_1", "Q5_1", "IQ4_NL", "I8",
                    "MXFP4", "NVFP4", "Q1_0"]  # fmt: skip


@st.composite
def wrong_tensors(draw):
    """(tensors, description): valid GGUF tensors that may not fit the architecture."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    tensors = dict(BASE_TENSORS)
    names = sorted(tensors)
    desc = []
    for _ in range(draw(st.integers(1, 3))):
        name = draw(st.sampled_from(names + ["output.weight", "blk.1.attn_q.weight"]))
        action = draw(st.sampled_from(["reshape", "retype", "drop", "rename"]))
        if action == "drop":
            tensors.pop(name, None)
        elif action == "rename":
            if name in tensors:
                tensors[name + ".x"] = tensors.pop(name)
        else:
            type_name = draw(st.sampled_from(TYPES_FOR_SHAPES))
            block = ggml_type(type_name).block_size
            dims = draw(st.lists(st.sampled_from([1, 2, 16, 32, 64, 96]), min_size=1, max_size=3))
            if action == "retype":
                shape = getattr(tensors.get(name), "shape", (N_EMBD,))
                shape = tuple(shape)
            else:
                shape = tuple(dims)
            if shape[-1] % block:
                shape = (*shape[:-1], block)
            tensors[name] = _raw_tensor(rng, shape, type_name)
            desc.append((action, name, type_name, list(shape)))
            continue
        desc.append((action, name))
    return tensors, desc


@fuzz_settings("shapes")
@given(case=wrong_tensors(), stream=st.sampled_from(STREAMS))
def test_tensors_that_do_not_fit_the_architecture(worker, case, stream):
    tensors, desc = case
    check(worker, to_bytes(base_metadata(), tensors), stream, f"tensors {desc}")


LLAMA_KEYS = [
    "llama.attention.head_count",
    "llama.attention.head_count_kv",
    "llama.block_count",
    "llama.embedding_length",
    "llama.rope.dimension_count",
    "llama.attention.layer_norm_rms_epsilon",
    "llama.rope.freq_base",
    "general.architecture",
]


def metadata_value():
    small = [0, 1, 2, 3, 4, 15, 16, 17, 31, 32, 64]
    ints = {
        U32: small + [2**31, 2**32 - 1],
        U64: small + [2**32, 2**63, 2**64 - 1],
        I32: small + [-1, -(2**31), 2**31 - 1],
        I64: small + [-1, -(2**63), 2**63 - 1],
    }
    return st.one_of(
        *[st.builds(Typed, st.just(t), st.sampled_from(v)) for t, v in ints.items()],
        st.builds(Typed, st.just(F32), st.sampled_from([0.0, -1.0, 1e-5, 1e30, float("nan")])),
        st.builds(Typed, st.just(F64), st.floats(allow_nan=True, allow_infinity=True)),
        st.builds(Typed, st.just(VT.BOOL), st.booleans()),
        st.sampled_from(["llama", "qwen2", "", "gpt2", "x" * 300]),
        st.lists(st.integers(0, 100), max_size=3),
        st.lists(st.text(max_size=3), max_size=2),
    )


@st.composite
def bad_metadata(draw):
    md = base_metadata()
    desc = []
    if draw(st.booleans()):  # a consistent but wrong configuration (RoPE tables, head_dim)
        e = draw(st.sampled_from([2, 6, 16, 32, 64, 96, 1 << 12, 1 << 16, 1 << 20, (1 << 31) - 2]))
        h = draw(st.sampled_from([d for d in (1, 2, 3, 4, 32) if e % d == 0]))
        kv = draw(st.sampled_from([d for d in (1, 2, h) if h % d == 0]))
        md["llama.embedding_length"] = Typed(U32, e)
        md["llama.attention.head_count"] = Typed(U32, h)
        md["llama.attention.head_count_kv"] = Typed(U32, kv)
        md["llama.rope.dimension_count"] = Typed(U32, e // h)
        desc.append(("config", e, h, kv))
    for _ in range(draw(st.integers(0 if desc else 1, 3))):
        key = draw(st.sampled_from(LLAMA_KEYS))
        if draw(st.booleans()):
            md.pop(key, None)
            desc.append(("drop", key))
        else:
            md[key] = draw(metadata_value())
            desc.append(("set", key, md[key]))
    return md, desc


@fuzz_settings("metadata")
@given(case=bad_metadata(), stream=st.sampled_from(STREAMS))
def test_missing_mistyped_or_out_of_range_metadata(worker, case, stream):
    md, desc = case
    check(worker, to_bytes(md, BASE_TENSORS), stream, f"metadata {desc}")


def test_configuration_is_checked_before_the_rope_tables(worker):
    """A 6 KB file claiming head_dim 2**20 must not build 4096 x 2**19 RoPE tables (8 GB)."""
    md = base_metadata()
    for key, value in [
        ("llama.embedding_length", 1 << 20),
        ("llama.attention.head_count", 1),
        ("llama.attention.head_count_kv", 1),
        ("llama.rope.dimension_count", 1 << 20),
    ]:
        md[key] = Typed(U32, value)
    assert check(worker, to_bytes(md, BASE_TENSORS), "bytesio", "head_dim 2**20") == "error"


# ----------------------------------------------------------------------------- the harness itself


@pytest.mark.parametrize(
    "kind, expect",
    [
        ("raise", "TypeError (not a GGUFError): selftest"),
        ("alloc", "MemoryError (not a GGUFError)"),
        ("rss", "peak RSS grew by"),
        ("crash", "the worker died"),
        ("hang", "hang: no answer within 2 s"),
    ],
)
def test_harness_reports_misbehaviour(kind, expect):
    """A foreign exception, a huge allocation, a big RSS, a crash and a hang all fail a case."""
    w = Worker(BASE)
    try:
        w.start()
        w.timeout = 2.0
        status, text = w.case(BASE, f"selftest:{kind}")
        assert status == "fail" and expect in text, text
        assert w.case(BASE) == ("ok", "")  # a fresh worker takes the next case
    finally:
        w.stop()
