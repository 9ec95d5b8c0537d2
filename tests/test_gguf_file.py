"""qlib.gguf: parsing, every error path, writing, and agreement with gguf-py / llama.cpp."""

from __future__ import annotations

import io
import random
import struct

import numpy as np
import pytest
import torch
from synthetic import tiny_llama_weights, write_tiny_llama

from qlib.gguf import Content, GGUFError, GGUFValueType, TensorNotFoundError, Typed, write
from qlib.quants.qtensor import QTensor

VT = GGUFValueType
gguf = pytest.importorskip("gguf")


# ----------------------------------------------------------------------------- raw builders


def s(x: str | bytes) -> bytes:
    b = x.encode() if isinstance(x, str) else x
    return struct.pack("<Q", len(b)) + b


def kv(key: str, vt: int, payload: bytes) -> bytes:
    return s(key) + struct.pack("<I", vt) + payload


def kv_u32(key: str, v: int) -> bytes:
    return kv(key, VT.UINT32, struct.pack("<I", v))


def kv_str(key: str, v: str) -> bytes:
    return kv(key, VT.STRING, s(v))


def tinfo(name: str, ggml_dims: list[int], type_id: int = 0, offset: int = 0) -> bytes:
    return (
        s(name)
        + struct.pack("<I", len(ggml_dims))
        + struct.pack(f"<{len(ggml_dims)}Q", *ggml_dims)
        + struct.pack("<IQ", type_id, offset)
    )


def gguf_bytes(
    kvs=(),
    tinfos=(),
    data=b"",
    *,
    version=3,
    n_tensors=None,
    n_kv=None,
    magic=b"GGUF",
    alignment=32,
) -> bytes:
    head = magic + struct.pack(
        "<IQQ",
        version,
        len(tinfos) if n_tensors is None else n_tensors,
        len(kvs) if n_kv is None else n_kv,
    )
    head += b"".join(kvs) + b"".join(tinfos)
    head += bytes(-len(head) % alignment)
    return head + data


def valid_bytes() -> bytes:
    """A small valid file: two keys, one 2x4 F32 tensor."""
    data = np.arange(8, dtype=np.float32).tobytes()
    return gguf_bytes(
        [kv_str("general.architecture", "llama"), kv_u32("llama.block_count", 2)],
        [tinfo("w", [4, 2])],
        data,
    )


def read_bytes(tmp_path, raw: bytes, buffering: int = -1) -> Content:
    p = tmp_path / "t.gguf"
    p.write_bytes(raw)
    return Content.read_path(p, buffering=buffering)


def error_of(tmp_path, raw: bytes) -> str:
    with pytest.raises(GGUFError) as e:
        read_bytes(tmp_path, raw)
    return str(e.value)


# ----------------------------------------------------------------------------- error paths


class NoEndSeek(io.BytesIO):
    """A stream whose size cannot be learned (no fileno, no seek to the end)."""

    def seek(self, pos, whence=io.SEEK_SET):
        if whence == io.SEEK_END:
            raise io.UnsupportedOperation("no seek to end")
        return super().seek(pos, whence)


def test_bad_magic(tmp_path):
    msg = error_of(tmp_path, gguf_bytes(magic=b"GGUX"))
    assert "bad magic b'GGUX' (47 47 55 58)" in msg


def test_empty_file_is_truncated_header(tmp_path):
    assert "truncated header (magic): needs 4 bytes at offset 0, but the file ends at offset 0" in (
        error_of(tmp_path, b"")
    )


def test_truncated_header(tmp_path):
    msg = error_of(tmp_path, valid_bytes()[:14])
    assert "truncated header (tensor count)" in msg and "offset 8" in msg and "offset 14" in msg


@pytest.mark.parametrize("version", [1, 0, 4])
def test_unsupported_version(tmp_path, version):
    assert f"unsupported GGUF version {version}" in error_of(tmp_path, gguf_bytes(version=version))


def test_big_endian_refused(tmp_path):
    raw = b"GGUF" + struct.pack(">IQQ", 3, 0, 0)
    assert "big-endian" in error_of(tmp_path, raw)


def test_truncated_metadata(tmp_path):
    raw = gguf_bytes([kv_str("general.name", "x"), kv_u32("llama.block_count", 30)])
    msg = error_of(tmp_path, raw[: raw.index(b"\x1e\0\0\0") + 2])
    assert (
        "truncated metadata (value of key 'llama.block_count'): needs 4 bytes at offset 86" in msg
    )
    assert "the file ends at offset 88" in msg


def test_truncated_metadata_unknown_size():
    raw = gguf_bytes([kv_str("general.name", "a long enough name")])
    with pytest.raises(GGUFError) as e:
        Content.read(NoEndSeek(raw[: 24 + 8 + 12 + 4 + 8 + 5]))
    assert (
        "truncated metadata (value of key 'general.name') (string of 18 bytes): needs 18 bytes "
        "at offset 56, but the file ends at offset 61" in str(e.value)
    )


def test_truncated_metadata_string_array(tmp_path):
    items = b"".join(s(t) for t in ["a", "bb", "ccc"])
    raw = gguf_bytes(
        [kv("tokenizer.ggml.tokens", VT.ARRAY, struct.pack("<IQ", VT.STRING, 3) + items)]
    )
    cut = raw.index(b"ccc") + 1
    msg = error_of(tmp_path, raw[:cut])
    assert (
        "metadata key 'tokenizer.ggml.tokens' item 2: string length 3 at offset 88 is larger than "
        "the 1 bytes left in the file" in msg
    )
    with pytest.raises(GGUFError) as e:
        Content.read(NoEndSeek(raw[:cut]))
    assert (
        "truncated metadata (key 'tokenizer.ggml.tokens' item 2): needs 3 bytes at offset 96"
        in str(e.value)
    )


def test_truncated_tensor_directory(tmp_path):
    raw = valid_bytes()
    cut = raw.index(b"w") + 1 + 4 + 3  # inside the dims of 'w'
    msg = error_of(tmp_path, raw[:cut])
    assert "truncated tensor directory (entry 'w')" in msg and "offset" in msg


def test_truncated_tensor_data(tmp_path):
    raw = valid_bytes()
    content = Content.read(io.BytesIO(raw))
    with pytest.raises(
        GGUFError,
        match=r"truncated tensor data of 'w': needs 32 bytes at offset \d+, "
        r"but the file ends at offset \d+",
    ):
        content.tensor(NoEndSeek(raw[:-5]), "w")


def test_unknown_metadata_value_type(tmp_path):
    msg = error_of(tmp_path, gguf_bytes([kv("odd.key", 13, b"\0" * 8)]))
    assert "unknown metadata value type 13 for key 'odd.key' at offset 39" in msg


def test_unknown_array_item_type(tmp_path):
    msg = error_of(
        tmp_path, gguf_bytes([kv("odd.arr", VT.ARRAY, struct.pack("<IQ", 99, 1) + b"\0")])
    )
    assert "unknown metadata value type 99 for the items of array key 'odd.arr'" in msg


def test_unknown_ggml_type(tmp_path):
    msg = error_of(tmp_path, gguf_bytes([], [tinfo("w", [32], type_id=4)], bytes(32)))
    assert "unknown ggml type id 4 for tensor 'w'" in msg


def test_tensor_data_outside_file_at_read(tmp_path):
    msg = error_of(tmp_path, gguf_bytes([], [tinfo("w", [4, 2], offset=64)], bytes(32)))
    assert "tensor 'w' data lies outside the file: offset 64" in msg
    assert "size 32 bytes" in msg and "(absolute 160)" in msg and "file size 128" in msg


def test_misaligned_tensor_offset(tmp_path):
    msg = error_of(tmp_path, gguf_bytes([], [tinfo("w", [4, 2], offset=4)], bytes(64)))
    assert msg == "tensor 'w': data offset 4 is not a multiple of the alignment 32"


def test_overlapping_tensors(tmp_path):
    """Two entries on the same bytes: refused, so tensors never hold more than the file."""
    tinfos = [tinfo("a", [4, 2], offset=0), tinfo("b", [8], offset=64), tinfo("c", [4], offset=0)]
    msg = error_of(tmp_path, gguf_bytes([], tinfos, bytes(96)))
    assert msg == (
        "tensors 'a' and 'c' overlap: 'a' holds bytes 0..32 of the data section, 'c' starts at 0"
    )
    tinfos = [tinfo("a", [16], offset=0), tinfo("b", [8], offset=32)]  # a: 64 bytes
    msg = error_of(tmp_path, gguf_bytes([], tinfos, bytes(96)))
    assert "tensors 'a' and 'b' overlap: 'a' holds bytes 0..64" in msg
    # adjacent (after padding) and out of order is fine
    tinfos = [tinfo("a", [8], offset=32), tinfo("b", [8], offset=0)]
    c = read_bytes(tmp_path, gguf_bytes([], tinfos, bytes(64)))
    assert [c.tensor_infos[n].offset for n in "ab"] == [32, 0]


def test_tensor_data_outside_file_in_tensor(tmp_path):
    p = tmp_path / "t.gguf"
    p.write_bytes(valid_bytes())
    content = Content.read_path(p)
    with open(p, "r+b") as f:
        f.truncate(p.stat().st_size - 4)
    with (
        open(p, "rb") as f,
        pytest.raises(
            GGUFError, match="tensor 'w' data lies outside the file.*size 32 bytes.*file size"
        ),
    ):
        content.tensor(f, "w")


@pytest.mark.parametrize("n_dims", [0, 5])
def test_bad_dims_count(tmp_path, n_dims):
    msg = error_of(tmp_path, gguf_bytes([], [tinfo("w", [1] * n_dims)], bytes(4)))
    assert f"tensor 'w' has {n_dims} dimensions" in msg and "1 to 4" in msg


@pytest.mark.parametrize("dim", [0, 2**64 - 1, 2**63])
def test_dim_not_positive(tmp_path, dim):
    msg = error_of(tmp_path, gguf_bytes([], [tinfo("w", [4, dim])], bytes(32)))
    assert "tensor 'w' has a dimension <= 0" in msg


def test_implausibly_large_tensor(tmp_path):
    msg = error_of(tmp_path, gguf_bytes([], [tinfo("w", [2**40, 2**40])], bytes(32)))
    assert "tensor 'w' is implausibly large" in msg


def test_last_dim_not_divisible_by_block(tmp_path):
    msg = error_of(tmp_path, gguf_bytes([], [tinfo("w", [16, 2], type_id=2)], bytes(64)))
    assert (
        "tensor 'w' of type Q4_0: last dim 16 (shape [2, 16]) is not divisible by the block size 32"
        in msg
    )


def test_implausible_tensor_count(tmp_path):
    msg = error_of(tmp_path, gguf_bytes(n_tensors=(1 << 20) + 1))
    assert "implausible tensor count 1048577" in msg


def test_implausible_kv_count(tmp_path):
    assert "implausible metadata count 1048577" in error_of(
        tmp_path, gguf_bytes(n_kv=(1 << 20) + 1)
    )


def test_counts_larger_than_file(tmp_path):
    msg = error_of(tmp_path, gguf_bytes(n_tensors=1000, n_kv=1000))
    assert "1000 tensors and 1000 metadata entries need at least 45000 bytes" in msg


def test_string_length_implausible(tmp_path):
    raw = gguf_bytes([kv("k", VT.STRING, struct.pack("<Q", (1 << 26) + 1))])
    assert "implausible string length 67108865" in error_of(tmp_path, raw)


def test_string_longer_than_file(tmp_path):
    raw = gguf_bytes([kv("k", VT.STRING, struct.pack("<Q", 5000))])
    msg = error_of(tmp_path, raw)
    assert (
        "metadata (value of key 'k'): string length 5000 at offset" in msg
        and "left in the file" in msg
    )


def test_key_length_implausible(tmp_path):
    raw = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 2**64 - 1) + bytes(40)
    assert "metadata (key #0): implausible string length 18446744073709551615" in error_of(
        tmp_path, raw
    )


def test_string_array_item_longer_than_file(tmp_path):
    raw = gguf_bytes(
        [kv("toks", VT.ARRAY, struct.pack("<IQ", VT.STRING, 2) + s("a") + struct.pack("<Q", 999))]
    )
    assert "metadata key 'toks' item 1: string length 999" in error_of(tmp_path, raw)


@pytest.mark.parametrize("item", [VT.UINT32, VT.STRING, VT.ARRAY])
def test_array_longer_than_file(tmp_path, item):
    raw = gguf_bytes([kv("arr", VT.ARRAY, struct.pack("<IQ", item, 10**9))])
    msg = error_of(tmp_path, raw)
    assert (
        "metadata key 'arr': array length 1000000000 at offset" in msg and "left in the file" in msg
    )


def test_array_length_implausible(tmp_path):
    raw = gguf_bytes([kv("arr", VT.ARRAY, struct.pack("<IQ", VT.UINT8, 2**62))])
    assert "implausible array length 4611686018427387904" in error_of(tmp_path, raw)


def test_bad_bool(tmp_path):
    assert "metadata key 'b': bad bool value 2" in error_of(
        tmp_path, gguf_bytes([kv("b", VT.BOOL, b"\x02")])
    )
    arr = struct.pack("<IQ", VT.BOOL, 3) + b"\x01\x00\x07"
    assert "bad bool value 7 at item 2" in error_of(tmp_path, gguf_bytes([kv("b", VT.ARRAY, arr)]))


def test_nesting_too_deep(tmp_path):
    payload = struct.pack("<IQ", VT.ARRAY, 1) * 70 + struct.pack("<IQ", VT.UINT8, 0)
    assert "arrays nested deeper than 64" in error_of(
        tmp_path, gguf_bytes([kv("deep", VT.ARRAY, payload)])
    )


def test_duplicates(tmp_path):
    assert "duplicate metadata key 'a'" in error_of(
        tmp_path, gguf_bytes([kv_u32("a", 1), kv_u32("a", 2)])
    )
    raw = gguf_bytes([], [tinfo("w", [8]), tinfo("w", [8], offset=32)], bytes(64))
    assert "duplicate tensor name 'w'" in error_of(tmp_path, raw)


@pytest.mark.parametrize(
    "value,expect",
    [(0, "= 0 is not a positive power of two"), (48, "= 48 is not a positive power of two")],
)
def test_bad_alignment(tmp_path, value, expect):
    assert expect in error_of(tmp_path, gguf_bytes([kv_u32("general.alignment", value)]))


def test_alignment_wrong_type(tmp_path):
    msg = error_of(tmp_path, gguf_bytes([kv_str("general.alignment", "32")]))
    assert "general.alignment has type STRING" in msg


def test_unknown_tensor_name(tmp_path):
    content = Content.read(io.BytesIO(valid_bytes()))
    with pytest.raises(TensorNotFoundError) as e:
        content.tensor(io.BytesIO(valid_bytes()), "nope")
    assert str(e.value) == "cannot find tensor info for nope"
    assert isinstance(e.value, KeyError) and isinstance(e.value, GGUFError)


def test_every_truncation_is_a_gguf_error(tmp_path):
    raw = valid_bytes()
    header_end = len(raw) - 32
    for cut in range(header_end - 8):  # the last bytes before the data are padding
        with pytest.raises(GGUFError):
            Content.read(io.BytesIO(raw[:cut]))


def test_random_corruption_never_escapes(tmp_path):
    """Corrupt header bytes: reading (size known or not) and loading give a GGUFError or work."""
    path = write_tiny_llama(
        tmp_path / "tiny.gguf",
        n_layer=1,
        n_embd=32,
        n_ff=32,
        vocab=32,
        extra_metadata={"toks": ["x", "yy"], "nested": [[1, 2], ["a"]], "flag": True},
    )
    raw = path.read_bytes()
    header_end = Content.read_path(path).tensor_data_offset
    rng = random.Random(0)
    outcomes = {"ok": 0, "error": 0}
    for trial in range(1500):
        bad = bytearray(raw)
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(header_end)
            bad[i] = rng.choice([0, 1, 0xFF, 0x7F, 0x40, rng.randrange(256)])
        stream = (io.BytesIO if trial % 2 else NoEndSeek)(bytes(bad))
        try:
            c = Content.read(stream)
            for name in c.tensor_infos:
                c.tensor(stream, name)
            outcomes["ok"] += 1
        except GGUFError:
            outcomes["error"] += 1
    assert outcomes["error"] > 100 and outcomes["ok"] > 10


def test_invalid_utf8_survives_a_round_trip(tmp_path):
    raw = gguf_bytes([kv("s", VT.STRING, s(b"ok\xff\xfe\0"))])
    c = read_bytes(tmp_path, raw)
    assert c.get("s") == "ok\udcff\udcfe\0"
    out = io.BytesIO()
    write(out, c.metadata, {}, types=c.metadata_types)
    assert out.getvalue() == raw


# ----------------------------------------------------------------------------- reading


class Trickle(io.RawIOBase):
    """A raw file that returns at most 3 bytes per read."""

    def __init__(self, raw: bytes):
        self.b = io.BytesIO(raw)

    def readable(self):
        return True

    def readinto(self, buf):
        chunk = self.b.read(min(3, len(buf)))
        buf[: len(chunk)] = chunk
        return len(chunk)

    def seekable(self):
        return True

    def seek(self, pos, whence=0):
        return self.b.seek(pos, whence)

    def tell(self):
        return self.b.tell()


def same_content(a: Content, b: Content) -> None:
    assert a.metadata == b.metadata and a.metadata_types == b.metadata_types
    assert a.tensor_infos == b.tensor_infos
    assert (a.version, a.tensor_data_offset, a.alignment) == (
        b.version,
        b.tensor_data_offset,
        b.alignment,
    )


def test_unbuffered_buffered_and_short_reads_agree(tmp_path):
    path = write_tiny_llama(tmp_path / "tiny.gguf", extra_metadata={"toks": ["a", "bc", ""] * 5})
    buffered = Content.read_path(path)
    same_content(buffered, Content.read_path(path, buffering=0))
    raw = path.read_bytes()
    trickle = Content.read(Trickle(raw))
    same_content(buffered, trickle)
    with open(path, "rb", buffering=0) as f:
        q = buffered.tensor(f, "blk.0.attn_q.weight")
    q2 = trickle.tensor(Trickle(raw), "blk.0.attn_q.weight")
    assert torch.equal(q.data, q2.data)


def test_synthetic_tiny_llama(tmp_path):
    path, w = write_tiny_llama(tmp_path / "t.gguf", return_weights=True)
    c = Content.read_path(path)
    assert c.get("general.architecture") == "llama" and c.get("missing", 7) == 7
    for key in ["head_count", "head_count_kv", "layer_norm_rms_epsilon"]:
        assert f"llama.attention.{key}" in c.metadata
    assert c.metadata_types["llama.block_count"] == VT.UINT32
    assert c.metadata_types["llama.rope.freq_base"] == VT.FLOAT32
    assert "output.weight" not in c.tensor_infos and len(c.tensor_infos) == 2 + 2 * 9
    assert c.tensor_infos["blk.1.attn_k.weight"].shape == (32, 64)
    assert c.tensor_infos["blk.1.ffn_down.weight"].shape == (64, 128)
    assert c.tensor_infos["token_embd.weight"].shape == (256, 64)
    with open(path, "rb") as f:
        for name, info in c.tensor_infos.items():
            got = np.frombuffer(c.tensor_bytes(f, name), np.float32).reshape(info.shape)
            np.testing.assert_array_equal(got, w[name])
    assert set(w) == set(tiny_llama_weights())


def test_synthetic_options(tmp_path):
    path, w = write_tiny_llama(
        tmp_path / "t.gguf",
        weight_type="F16",
        tie_output=False,
        arch="qwen2",
        drop_keys=["llama.rope.freq_base"],
        extra_metadata={"llama.context_length": Typed(VT.UINT32, 4096)},
        return_weights=True,
    )
    c = Content.read_path(path)
    assert c.get("general.architecture") == "qwen2" and "llama.rope.freq_base" not in c.metadata
    assert c.get("llama.context_length") == 4096
    assert c.tensor_infos["output.weight"].dtype.name == "F16"
    assert c.tensor_infos["output_norm.weight"].dtype.name == "F32"
    with open(path, "rb") as f:
        raw = np.frombuffer(c.tensor_bytes(f, "output.weight"), np.float16).astype(np.float32)
    np.testing.assert_array_equal(raw.reshape(256, 64), w["output.weight"])


def test_synthetic_quantized(tmp_path):
    from qlib import quants

    if not hasattr(quants, "quantize") or not hasattr(quants, "dequantize_torch"):
        pytest.skip("qlib.quants.quantize is not there yet")
    path, w = write_tiny_llama(tmp_path / "t.gguf", weight_type="Q8_0", return_weights=True)
    c = Content.read_path(path)
    assert c.tensor_infos["blk.0.attn_q.weight"].dtype.name == "Q8_0"
    with open(path, "rb") as f:
        q = c.tensor(f, "blk.0.attn_q.weight")
    np.testing.assert_array_equal(q.dequantize().numpy(), w["blk.0.attn_q.weight"])


# ----------------------------------------------------------------------------- writing

ALL_TYPES_META = {
    "general.architecture": "llama",
    "u8": Typed(VT.UINT8, 255),
    "i8": Typed(VT.INT8, -128),
    "u16": Typed(VT.UINT16, 65535),
    "i16": Typed(VT.INT16, -32768),
    "u32": Typed(VT.UINT32, 2**32 - 1),
    "i32": -(2**31),
    "u64": Typed(VT.UINT64, 2**64 - 1),
    "i64": -(2**63),
    "f32": 0.5,
    "f64": Typed(VT.FLOAT64, 0.1),
    "t": True,
    "f": False,
    "s": "héllo \u2581world",
    "empty": "",
    "np_u16": np.uint16(7),
    "np_f64": np.float64(1.25),
    "tokens": ["<s>", "</s>", "a", "\u0120b"],
    "scores": Typed(VT.FLOAT32, [0.0, -1.5, 2.25]),
    "token_type": Typed(VT.INT32, [1, 3, 1]),
    "bools": [True, False, True],
    "big_ints": [1, 2**40],
    "np_arr": np.array([1, 2, 3], dtype=np.uint8),
    "nested": [[1, 2, 3], ["x", "y"], [[True], []]],
    "empty_arr": [],
}
PLAIN = {
    "u8": 255,
    "i8": -128,
    "u16": 65535,
    "i16": -32768,
    "u32": 2**32 - 1,
    "u64": 2**64 - 1,
    "f64": 0.1,
    "np_u16": 7,
    "np_f64": 1.25,
    "scores": [0.0, -1.5, 2.25],
    "token_type": [1, 3, 1],
    "np_arr": [1, 2, 3],
}


def sample_tensors():
    rng = np.random.default_rng(0)
    q8 = rng.integers(0, 256, size=2 * 34, dtype=np.uint8)
    return {
        "f32": rng.standard_normal((3, 5)).astype(np.float32),
        "f16": rng.standard_normal((2, 3, 4)).astype(np.float16),
        "q8": (q8, (2, 32), "Q8_0"),
        "qt": QTensor.from_bytes(q8.tobytes(), (64,), "Q8_0"),
        "bf16": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
    }


def test_round_trip_all_types(tmp_path):
    p = tmp_path / "rt.gguf"
    with open(p, "wb") as f:
        write(f, ALL_TYPES_META, sample_tensors())
    c = Content.read_path(p)
    expect = {k: PLAIN.get(k, v) for k, v in ALL_TYPES_META.items()}
    assert c.metadata == expect
    assert c.metadata_types["u8"] == VT.UINT8 and c.metadata_types["i32"] == VT.INT32
    assert c.metadata_types["f32"] == VT.FLOAT32 and c.metadata_types["np_f64"] == VT.FLOAT64
    assert c.metadata_types["tokens"] == (VT.ARRAY, VT.STRING)
    assert c.metadata_types["big_ints"] == (VT.ARRAY, VT.INT64)
    assert c.metadata_types["nested"] == (
        VT.ARRAY,
        [
            (VT.ARRAY, VT.INT32),
            (VT.ARRAY, VT.STRING),
            (VT.ARRAY, [(VT.ARRAY, VT.BOOL), (VT.ARRAY, VT.INT32)]),
        ],
    )
    infos = c.tensor_infos
    assert [(i.dtype.name, i.shape) for i in infos.values()] == [
        ("F32", (3, 5)),
        ("F16", (2, 3, 4)),
        ("Q8_0", (2, 32)),
        ("Q8_0", (64,)),
        ("BF16", (2, 3)),
    ]
    assert all(i.offset % 32 == 0 for i in infos.values()) and c.tensor_data_offset % 32 == 0
    t = sample_tensors()
    with open(p, "rb", buffering=0) as f:
        np.testing.assert_array_equal(
            np.frombuffer(c.tensor_bytes(f, "f16"), np.float16).reshape(2, 3, 4), t["f16"]
        )
        assert bytes(c.tensor_bytes(f, "q8")) == t["q8"][0].tobytes()
        qt = c.tensor(f, "qt")
        assert (
            qt.shape == (64,)
            and qt.dtype.name == "Q8_0"
            and torch.equal(qt.data.reshape(-1), t["qt"].data.reshape(-1))
        )
    # write(read(x)) reproduces x byte for byte
    out = io.BytesIO()
    with open(p, "rb") as f:
        tensors = {n: (c.tensor_bytes(f, n), i.shape, i.dtype) for n, i in infos.items()}
    write(out, c.metadata, tensors, types=c.metadata_types, version=c.version)
    assert out.getvalue() == p.read_bytes()


def test_v2_and_alignment(tmp_path):
    p = tmp_path / "v2.gguf"
    with open(p, "wb", buffering=0) as f:  # raw writes
        write(
            f,
            {"general.architecture": "llama"},
            {"w": np.ones((3, 7), np.float32)},
            version=2,
            alignment=64,
        )
    c = Content.read_path(p)
    assert c.version == 2 and c.alignment == 64 and c.get("general.alignment") == 64
    assert c.metadata_types["general.alignment"] == VT.UINT32 and c.tensor_data_offset % 64 == 0
    assert p.stat().st_size == c.tensor_data_offset + 128
    r = gguf.GGUFReader(p)
    assert r.alignment == 64 and r.data_offset == c.tensor_data_offset


def test_writer_errors():
    def err(meta=None, tensors=None, **kw):
        with pytest.raises(GGUFError) as e:
            write(io.BytesIO(), meta or {}, tensors or {}, **kw)
        return str(e.value)

    assert "cannot write 300 as UINT8" in err({"k": Typed(VT.UINT8, 300)})
    assert "values 0..300 do not fit UINT8" in err({"k": Typed(VT.UINT8, [0, 300])})
    assert "array mixes item types ['int', 'str']" in err({"k": [1, "a"]})
    assert "cannot store a value of type dict" in err({"k": {}})
    assert "is not an integer for INT32" in err({"k": Typed(VT.INT32, 1.5)})
    assert "needs 32 bytes, got 31" in err(tensors={"w": (bytes(31), (8,), "F32")})
    assert "last dim 16 is not divisible by the block size 32" in err(
        tensors={"w": (bytes(9), (16,), "Q4_0")}
    )
    assert "shape [] needs 1 to 4 dims" in err(tensors={"w": (b"", (), "F32")})
    assert "alignment 48 is not a positive power of two" in err(alignment=48)
    assert "disagrees with general.alignment = 64" in err(
        {"general.alignment": Typed(VT.UINT32, 64)}, alignment=32
    )
    assert "cannot write GGUF version 1" in err(version=1)
    assert "cannot write numpy int8" not in err(tensors={"w": np.ones(3, np.uint8)})


def test_our_file_read_by_gguf_py(tmp_path):
    p = tmp_path / "ours.gguf"
    meta = {k: v for k, v in ALL_TYPES_META.items() if k not in ("nested", "empty_arr")}
    with open(p, "wb") as f:
        write(f, meta, sample_tensors())
    c = Content.read_path(p)
    r = gguf.GGUFReader(p)
    fields = {k: f for k, f in r.fields.items() if not k.startswith("GGUF.")}
    assert list(fields) == list(c.metadata)
    for key, field in fields.items():
        spec = c.metadata_types[key]
        want = [int(spec[0]), int(spec[1])] if isinstance(spec, tuple) else [int(spec)]
        assert field.types == want, key
        got = field.contents()
        if isinstance(got, float) or (isinstance(got, list) and got and isinstance(got[0], float)):
            np.testing.assert_allclose(got, c.metadata[key], rtol=1e-7)
        else:
            assert got == c.metadata[key], key
    assert r.data_offset == c.tensor_data_offset
    with open(p, "rb") as f:
        for t in r.tensors:
            info = c.tensor_infos[t.name]
            assert tuple(int(d) for d in t.shape[::-1]) == info.shape
            assert (
                int(t.tensor_type) == info.dtype.id
                and t.data_offset == c.tensor_data_offset + info.offset
            )
            assert np.asarray(t.data).tobytes() == bytes(c.tensor_bytes(f, t.name))


def test_gguf_py_file_read_by_us(tmp_path):
    p = tmp_path / "theirs.gguf"
    w = gguf.GGUFWriter(p, "llama")
    w.add_uint8("u8", 200)
    w.add_int8("i8", -5)
    w.add_uint16("u16", 60000)
    w.add_int16("i16", -300)
    w.add_uint32("u32", 123456)
    w.add_int32("i32", -123456)
    w.add_uint64("u64", 2**60)
    w.add_int64("i64", -(2**60))
    w.add_float32("f32", 0.25)
    w.add_float64("f64", 1e-300)
    w.add_bool("b", True)
    w.add_string("s", "hi \u2581 there")
    w.add_array("strs", ["a", "bb", ""])
    w.add_array("ints", [1, 2, 3])
    w.add_array("floats", [0.5, 1.5])
    rng = np.random.default_rng(1)
    f32 = rng.standard_normal((4, 8)).astype(np.float32)
    f16 = rng.standard_normal((2, 16)).astype(np.float16)
    q8 = rng.integers(0, 256, size=(3, 34), dtype=np.uint8)
    w.add_tensor("f32", f32)
    w.add_tensor("f16", f16)
    w.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    c = Content.read_path(p)
    assert c.version == 3
    expect = {
        "general.architecture": "llama",
        "u8": 200,
        "i8": -5,
        "u16": 60000,
        "i16": -300,
        "u32": 123456,
        "i32": -123456,
        "u64": 2**60,
        "i64": -(2**60),
        "f32": 0.25,
        "f64": 1e-300,
        "b": True,
        "s": "hi \u2581 there",
        "strs": ["a", "bb", ""],
        "ints": [1, 2, 3],
        "floats": [0.5, 1.5],
    }
    assert c.metadata == expect
    assert c.metadata_types["u16"] == VT.UINT16 and c.metadata_types["ints"] == (VT.ARRAY, VT.INT32)
    assert c.tensor_infos["q8"].shape == (3, 32) and c.tensor_infos["q8"].dtype.name == "Q8_0"
    with open(p, "rb", buffering=0) as f:
        np.testing.assert_array_equal(
            np.frombuffer(c.tensor_bytes(f, "f32"), np.float32).reshape(4, 8), f32
        )
        np.testing.assert_array_equal(
            np.frombuffer(c.tensor_bytes(f, "f16"), np.float16).reshape(2, 16), f16
        )
        assert bytes(c.tensor_bytes(f, "q8")) == q8.tobytes()
    # and our writer reproduces gguf-py's file exactly
    out = io.BytesIO()
    with open(p, "rb") as f:
        write(
            out,
            c.metadata,
            {n: (c.tensor_bytes(f, n), i.shape, i.dtype) for n, i in c.tensor_infos.items()},
            types=c.metadata_types,
        )
    assert out.getvalue() == p.read_bytes()


# ----------------------------------------------------------------------------- the real model


@pytest.fixture(scope="module")
def smollm2():
    from qlib import models

    try:
        return models.path()
    except models.ModelNotFoundError as e:
        pytest.skip(str(e))


def test_read_smollm2(smollm2):
    c = Content.read_path(smollm2, buffering=0)
    same_content(c, Content.read_path(smollm2))
    assert c.version == 3 and len(c.tensor_infos) == 272
    counts = {}
    for info in c.tensor_infos.values():
        counts[info.dtype.name] = counts.get(info.dtype.name, 0) + 1
    assert counts == {"Q4_1": 210, "Q8_0": 1, "F32": 61}
    emb = c.tensor_infos["token_embd.weight"]
    assert emb.dtype.name == "Q8_0" and emb.shape == (49152, 576)
    assert c.get("llama.block_count") == 30 and c.get("llama.embedding_length") == 576
    assert c.get("llama.attention.head_count") == 9 and c.get("llama.attention.head_count_kv") == 3
    assert (
        c.get("llama.rope.freq_base") == 100000.0 and len(c.get("tokenizer.ggml.tokens")) == 49152
    )
    assert c.metadata_types["tokenizer.ggml.token_type"] == (VT.ARRAY, VT.INT32)
    with open(smollm2, "rb") as f:
        q = c.tensor(f, "blk.0.attn_q.weight")
    assert q.shape == (576, 576) and q.dtype.name == "Q4_1" and q.data.numel() == 576 * 18 * 20


def copy_through_writer(content: Content, src, dst, **kw) -> None:
    with open(src, "rb") as f:
        tensors = {
            n: (content.tensor_bytes(f, n), i.shape, i.dtype)
            for n, i in content.tensor_infos.items()
        }
    with open(dst, "wb") as f:
        write(
            f,
            content.metadata,
            tensors,
            types=content.metadata_types,
            version=content.version,
            **kw,
        )


def test_smollm2_byte_exact_round_trip(smollm2, tmp_path):
    c = Content.read_path(smollm2)
    copy_through_writer(c, smollm2, tmp_path / "copy.gguf")
    assert (tmp_path / "copy.gguf").read_bytes() == smollm2.read_bytes()


@pytest.mark.slow
@pytest.mark.peers
def test_llama_cpp_loads_our_file(smollm2, tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    c = Content.read_path(smollm2)
    ours = tmp_path / "realigned.gguf"
    copy_through_writer(c, smollm2, ours, alignment=64)  # a different layout than the original
    assert ours.read_bytes() != smollm2.read_bytes()

    def last_logits(path):
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_threads=2, verbose=False)
        toks = llm.tokenize(b"The capital of France is", add_bos=False)
        llm.eval(toks)
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).copy()

    a, b = last_logits(smollm2), last_logits(ours)
    assert np.isfinite(a).all() and a.shape == (49152,)
    np.testing.assert_array_equal(a, b)


# --------------------------------------------------------------------------- mapped files


def test_mapped_tensor_is_a_view_equal_to_the_read_one(tmp_path):
    from qlib.gguf import MappedFile

    p = tmp_path / "t.gguf"
    p.write_bytes(valid_bytes())
    content = Content.read_path(p)
    with open(p, "rb") as raw:
        read = content.tensor(raw, "w")
        mapped_file = MappedFile.open(raw)
        assert isinstance(mapped_file, MappedFile)
        mapped = content.tensor(mapped_file, "w")
    assert torch.equal(read.data, mapped.data) and read.shape == mapped.shape
    mapped_file.release()  # the pages go; the view reads them again from the file
    assert torch.equal(read.data, mapped.data)


def test_mapped_tensor_outside_the_file(tmp_path):
    from qlib.gguf import MappedFile

    p = tmp_path / "t.gguf"
    p.write_bytes(valid_bytes())
    content = Content.read_path(p)
    with open(p, "r+b") as f:
        f.truncate(p.stat().st_size - 4)
    with open(p, "rb") as raw, pytest.raises(GGUFError, match="tensor 'w' data lies outside"):
        content.tensor(MappedFile.open(raw), "w")


def test_unmappable_files_are_read():
    from qlib.gguf import MappedFile

    stream = io.BytesIO(valid_bytes())
    assert MappedFile.open(stream) is stream  # no file descriptor: read as before


def test_load_mapped_equals_load_read(tmp_path):
    from qlib.llama.engine import load

    p = tmp_path / "tiny.gguf"
    write_tiny_llama(p)
    ids = torch.tensor([[1, 5, 7, 3]])
    for engine in ("faithful", "fast"):
        a, _ = load(p, engine=engine)
        b, _ = load(p, engine=engine, mmap=False)
        assert torch.equal(a.forward(ids, 0), b.forward(ids, 0)), engine
