"""RoPE scaling (Llama 3.1+ ``rope_freqs.weight``; linear and YaRN ``llama.rope.scaling.*``):
the fast engine applies it as llama.cpp does (teacher-forced logits against llama-cpp-python's
on the same file); the faithful engine ignores it, as candle, and refuses it under
``strict=True``.

The file: the synthetic ``tiny`` shape (random seeded weights, F32, 2 layers, head_dim 64),
rewritten with the scaling added. Positions up to 96 so that rotations differ visibly.
Tolerance: 1e-5 x max |logit| (measured 5.9e-7 for the first two kinds, 1.7e-6 / 1.3e-6 for
YaRN): llama.cpp's F32 matmuls and
its RoPE (theta raised by repeated multiplication) round differently from ours; without the
scaling the logits differ by about 0.5 x max |logit| (checked below).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qlib import models
from qlib.gguf import Content, Typed, write
from qlib.gguf.constants import GGUFValueType
from qlib.llama.config import LlamaConfig, rope_tables
from qlib.llama.engine import load
from qlib.llama.errors import ModelError

N = 96
TOL = 1e-5


@pytest.fixture(scope="module")
def tiny() -> str:
    try:
        return str(models.synthetic("tiny", "F32"))
    except Exception as e:  # no tokenizer source here
        pytest.skip(f"cannot make the synthetic model: {e}")


def with_scaling(src: str, dst, *, freqs: np.ndarray | None = None, linear: float | None = None,
                 yarn: tuple[float, int] | None = None):  # fmt: skip
    """``src`` rewritten with ``rope_freqs.weight`` and/or linear scaling metadata, or YaRN's
    (``yarn``: the factor and the original context length)."""
    content = Content.read_path(src)
    metadata = {k: Typed(content.metadata_types[k], v) for k, v in content.metadata.items()}
    with open(src, "rb") as f:
        tensors = {n: content.tensor(f, n) for n in content.tensor_infos}
    if freqs is not None:
        from qlib.quants.qtensor import QTensor
        from qlib.quants.types import ggml_type

        data = torch.from_numpy(freqs.astype(np.float32).view(np.uint8).copy())
        tensors["rope_freqs.weight"] = QTensor(data, (freqs.size,), ggml_type("F32"))
    if linear is not None:
        metadata["llama.rope.scaling.type"] = Typed(GGUFValueType.STRING, "linear")
        metadata["llama.rope.scaling.factor"] = Typed(GGUFValueType.FLOAT32, linear)
    if yarn is not None:
        metadata["llama.rope.scaling.type"] = Typed(GGUFValueType.STRING, "yarn")
        metadata["llama.rope.scaling.factor"] = Typed(GGUFValueType.FLOAT32, yarn[0])
        metadata["llama.rope.scaling.original_context_length"] = Typed(GGUFValueType.UINT32,
                                                                       yarn[1])  # fmt: skip
    with open(dst, "wb") as f:
        write(f, metadata, tensors)
    return str(dst)


def scaled(tiny: str, tmp_path, kind: str) -> str:
    """``tiny`` with ``kind`` of scaling (``freqs``, ``linear``, ``yarn``, ``yarn+freqs``):
    seeded random ``rope_freqs``, linear x4, YaRN x4 over an original context of 48."""
    rng = np.random.default_rng(0)
    half = Content.read_path(tiny).metadata["llama.rope.dimension_count"] // 2
    freqs = rng.uniform(1.0, 32.0, half) if "freqs" in kind else None
    return with_scaling(tiny, tmp_path / "scaled.gguf", freqs=freqs,
                        linear=4.0 if kind == "linear" else None,
                        yarn=(4.0, 48) if "yarn" in kind else None)  # fmt: skip


def ids() -> list[int]:
    gen = torch.Generator().manual_seed(1)
    return [int(i) for i in torch.randint(10, 40000, (N,), generator=gen)]


def fast_logits(path: str) -> np.ndarray:
    model, _ = load(path, engine="fast", prefill="int8")
    with torch.inference_mode():
        return model.forward(torch.tensor([ids()]), 0, all_logits=True)[0].numpy()


def llama_cpp_logits(path: str) -> np.ndarray:
    pytest.importorskip("llama_cpp")
    from qlib.suite.experiments.drift import LlamaCppSource

    return LlamaCppSource(path, n_ctx=128).teacher_forced(ids())


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("kind", ["freqs", "linear", "yarn", "yarn+freqs"])
def test_fast_engine_scales_rope_as_llama_cpp(tiny, tmp_path, kind):
    """YaRN: factor 4 over an original context of 48 positions, so that the ramp between
    interpolated and original frequencies runs over pairs 0..8 of the 32 (and the cos / sin
    magnitude 1 + 0.1 ln 4)."""
    path = scaled(tiny, tmp_path, kind)
    ref = llama_cpp_logits(path)
    got = fast_logits(path)
    assert rel(got, ref) <= TOL
    assert rel(fast_logits(tiny), ref) > 50 * TOL  # the scaling matters at these positions


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("decode", ["fused", "persistent"])
@pytest.mark.parametrize("kind", ["freqs", "linear", "yarn", "yarn+freqs"])
def test_cuda_engine_scales_rope_as_the_cpu_engine(tiny, tmp_path, kind, decode):
    """The fast CUDA engine (its prefill, then each decode path one token at a time) against
    the fast CPU engine, which the test above holds to llama.cpp's logits: both read the same
    RoPE tables (``rope_tables``), so they differ by float32 sums in another order. Tolerance
    1e-5 x max |logit| as above."""
    path = scaled(tiny, tmp_path, kind)
    ref = fast_logits(path)
    model, _ = load(path, "cuda", engine="fast", decode=decode)
    x, prompt = torch.tensor([ids()]), 64
    with torch.inference_mode():
        got = model.forward(x[:, :prompt], 0, all_logits=True)[0].float().cpu().numpy()
        assert rel(got, ref[:prompt]) <= TOL
        for p in range(prompt, N):
            row = model.forward(x[:, p : p + 1], p)[0].float().cpu().numpy()
            assert rel(row, ref[p]) <= TOL, p


def test_faithful_ignores_scaling_and_strict_says_so(tiny, tmp_path):
    path = with_scaling(tiny, tmp_path / "scaled.gguf", linear=4.0)
    plain, _ = load(tiny, form="f32")
    scaled, _ = load(path, form="f32")
    x = torch.tensor([ids()[:8]])
    assert torch.equal(plain.forward(x, 0), scaled.forward(x, 0))  # candle: ignored
    with pytest.raises(ModelError, match="strict=True: this file asks for RoPE linear scaling"):
        load(path, form="f32", strict=True)


def test_tables():
    md = {"llama.attention.head_count": 2, "llama.attention.head_count_kv": 2,
          "llama.block_count": 1, "llama.embedding_length": 16, "llama.rope.dimension_count": 8,
          "llama.attention.layer_norm_rms_epsilon": 1e-5, "general.architecture": "llama",
          "llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0}  # fmt: skip
    c = LlamaConfig.from_metadata(md)
    cos, sin = rope_tables(c, torch.device("cpu"), 10)
    plain = LlamaConfig.from_metadata({**md, "llama.rope.scaling.type": "none"})
    cos2, _ = rope_tables(plain, torch.device("cpu"), 5)
    torch.testing.assert_close(cos[0:10:2], cos2, rtol=0, atol=1e-6)  # position 2k -> k
    ff = torch.full((4,), 2.0)
    cos3, _ = rope_tables(plain, torch.device("cpu"), 10, ff)
    torch.testing.assert_close(cos3, cos, rtol=0, atol=1e-6)  # factors 2 == positions / 2
    with pytest.warns(UserWarning, match="longrope"):
        rope_tables(LlamaConfig.from_metadata({**md, "llama.rope.scaling.type": "longrope"}),
                    torch.device("cpu"), 4)  # fmt: skip


def test_partial_rope_is_refused_as_llama_cpp_refuses_it(tiny, tmp_path):
    """``llama.rope.dimension_count`` < head_dim: llama.cpp's loader rejects a llama-architecture
    file whose n_rot differs from the head size ("invalid n_rot"), so such a file is not a valid
    llama GGUF: qlib refuses it too, at load, naming the key (every engine reads one config)."""
    content = Content.read_path(tiny)
    metadata = {k: Typed(content.metadata_types[k], v) for k, v in content.metadata.items()}
    head_dim = metadata["llama.rope.dimension_count"].value
    metadata["llama.rope.dimension_count"] = Typed(GGUFValueType.UINT32, head_dim // 2)
    with open(tiny, "rb") as f:
        tensors = {n: content.tensor(f, n) for n in content.tensor_infos}
    path = tmp_path / "partial.gguf"
    with open(path, "wb") as f:
        write(f, metadata, tensors)
    for engine in ("faithful", "fast"):
        with pytest.raises(ModelError, match=f"dimension_count {head_dim // 2} differs from head"):
            load(str(path), engine=engine)
    llama_cpp = pytest.importorskip("llama_cpp")
    with pytest.raises(Exception):  # noqa: B017 (its loader raises a plain ValueError)
        llama_cpp.Llama(model_path=str(path), n_ctx=64, verbose=False)


@pytest.mark.parametrize("kind", ["llama3", "linear"])
def test_converted_scaling_matches_transformers(tiny, tmp_path, kind):
    """A transformers folder with Llama 3.1's ``llama3`` RoPE scaling (original context 32
    positions, so that the factors reach the ramp and the long wavelengths here) or linear
    scaling, converted by ``hf_to_gguf`` (llama3: ``rope_freqs.weight`` as llama.cpp's
    converter writes it; linear: the scaling keys): the fast engine's logits over 96 positions
    are transformers' on the folder to 1e-4 of their scale (float32 both sides; measured
    1.3e-6 / 1.0e-6), and far from them without the scaling (0.49 / 0.52)."""
    transformers = pytest.importorskip("transformers")
    import json

    from qlib.convert import gguf_to_hf, hf_to_gguf

    hf = gguf_to_hf(tiny, tmp_path / "hf").path
    cfg = json.loads((hf / "config.json").read_text())
    scaling = {"rope_type": kind, "factor": 4.0, "rope_theta": cfg["rope_theta"]}
    if kind == "llama3":
        scaling.update(low_freq_factor=1.0, high_freq_factor=4.0,
                       original_max_position_embeddings=32)  # fmt: skip
    cfg["rope_scaling"] = cfg["rope_parameters"] = scaling
    (hf / "config.json").write_text(json.dumps(cfg))
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = model(torch.tensor([ids()])).logits[0].numpy()
    path = hf_to_gguf(hf, tmp_path / "scaled.gguf", "F32").path
    assert ("rope_freqs.weight" in Content.read_path(path).tensor_infos) == (kind == "llama3")
    assert rel(fast_logits(str(path)), ref) <= 1e-4
    assert rel(fast_logits(tiny), ref) > 1e-2
